"""Which float32 arithmetic each side of a GPU row computes in, printed beside the row.

The defaults differ. PyTorch's cuDNN convolutions may use TF32
(`torch.backends.cudnn.allow_tf32`, `fp32_precision` from PyTorch 2.9 on); its matrix products
do not. CuPy's products use TF32 only with CUPY_TF32=1, which it reads once, at its first
product. cuDNN graphs take
their own compute settings (`d2lperf.ops.cudnn.settings()`, where that module is built), and
NVIDIA_TF32_OVERRIDE=0 holds cuBLAS and cuDNN to strict float32 in the whole process, on both
sides. The Hardware chapter measures what TF32 buys and costs: `hardware.gpu.gpu_matmul_flops`,
its 'float32' and 'tf32' rows, which the floors here use.

Since CuPy reads its variable once, a precision is set per process: `run_in_each_mode` starts
the same command again with a mode's variables, and the child, which finds its mode in
BENCH_PRECISION, sets PyTorch's switches to match (`set_torch_precision`).

    python benchmarks/precision.py       # both sides' settings in this process
"""
import os
import subprocess
import sys
import warnings

try:
    from d2lperf.ops import cudnn
except ImportError:                 # a tree from before the cuDNN graphs
    cudnn = None

BENCH_PRECISION = 'D2LPERF_BENCH_PRECISION'
# mode: the variables its process starts with (None: unset), and PyTorch's fp32_precision
MODES = {'strict': ({'CUPY_TF32': None, 'NVIDIA_TF32_OVERRIDE': '0'}, 'ieee'),
         'tf32': ({'CUPY_TF32': '1', 'NVIDIA_TF32_OVERRIDE': None}, 'tf32')}
DESCRIBED = {'strict': 'strict FP32 on both sides (no TF32 in products or convolutions)',
             'tf32': 'TF32 on both sides (products and convolutions)'}


def current_mode():
    """The mode this process was started in by `run_in_each_mode`, or None (the defaults)."""
    mode = os.environ.get(BENCH_PRECISION)
    if mode is not None and mode not in MODES:
        raise ValueError(f'{BENCH_PRECISION}={mode!r}: choose one of {list(MODES)}')
    return mode


def mode_environment(mode, environ=None):
    """The environment a child computing in `mode` starts with."""
    env = dict(os.environ if environ is None else environ, **{BENCH_PRECISION: mode})
    for name, value in MODES[mode][0].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_in_each_mode(modes, argv):
    """Run `python argv...` once per mode, each in a fresh process (CuPy reads CUPY_TF32
    once); the children print their own rows. Returns their exit statuses."""
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(f'unknown precision(s) {unknown}: choose from {list(MODES)}')
    statuses = {}
    for mode in modes:
        print(f'\n## Precision: {mode}, {DESCRIBED[mode]}', flush=True)
        statuses[mode] = subprocess.run([sys.executable, *argv],
                                        env=mode_environment(mode)).returncode
        if statuses[mode]:
            print(f'(the {mode} run ended with exit status {statuses[mode]})', flush=True)
    return statuses


def set_torch_precision(torch, mode):
    """PyTorch's TF32 switches for products and cuDNN as `mode` says; None leaves its
    defaults. Through the `allow_tf32` flags, which set both of PyTorch's views (from 2.9 on
    they also set `fp32_precision`, with a deprecation warning), where they can be set: a
    PyTorch that mixed the two APIs refuses to compute ("you have used mix of the legacy and
    new APIs"). Where they cannot, the newer names for products and cuDNN's operations."""
    if mode is None:
        return
    allowed = MODES[mode][1] == 'tf32'
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            torch.backends.cuda.matmul.allow_tf32 = allowed
            torch.backends.cudnn.allow_tf32 = allowed
    except (AttributeError, RuntimeError):
        for owner in (torch.backends.cuda.matmul, torch.backends.cudnn.conv,
                      torch.backends.cudnn.rnn):
            owner.fp32_precision = MODES[mode][1]


def read(owner, name):
    """One switch as text: its value, 'absent', or why it could not be read."""
    try:
        return str(getattr(owner, name))
    except AttributeError:
        return 'absent'
    except Exception as error:          # noqa: BLE001 - PyTorch's getters raise on mixed APIs
        return f'unreadable ({type(error).__name__})'


def torch_settings(torch):
    """PyTorch's side: its version and TF32 switches, or why its rows are left out."""
    if torch is None:
        return 'PyTorch: left out: not installed'
    if not torch.cuda.is_available():
        return f'PyTorch {torch.__version__}: left out: no CUDA'
    backends = torch.backends
    parts = [f'cuda.matmul.allow_tf32={read(backends.cuda.matmul, "allow_tf32")}',
             f'cudnn.allow_tf32={read(backends.cudnn, "allow_tf32")}']
    if hasattr(backends.cuda.matmul, 'fp32_precision'):
        owners = {'backends': backends, 'cuda.matmul': backends.cuda.matmul,
                  'cudnn': backends.cudnn, 'cudnn.conv': getattr(backends.cudnn, 'conv', None),
                  'cudnn.rnn': getattr(backends.cudnn, 'rnn', None)}
        parts.append('fp32_precision ' + ', '.join(
            f'{name}={read(owner, "fp32_precision")}' for name, owner in owners.items()))
    return f'PyTorch {torch.__version__}: ' + '; '.join(parts)


def cudnn_settings():
    """The cuDNN graphs' side: their settings, or that this tree has none."""
    if cudnn is None:
        return 'cuDNN path: not built in this tree'
    try:
        if not cudnn.available():
            return 'cuDNN path: built, not available here (convolutions run by im2col)'
        return 'cuDNN graphs: ' + ', '.join(f'{k}={v}' for k, v in cudnn.settings().items())
    except Exception as error:          # noqa: BLE001 - a settings line must never stop a row
        return f'cuDNN path: settings unreadable ({type(error).__name__}: {error})'


def d2lperf_settings():
    variables = ', '.join(f'{name}={os.environ.get(name, "(unset)")}'
                          for name in ('CUPY_TF32', 'NVIDIA_TF32_OVERRIDE'))
    return f'd2lperf: {variables} (CuPy reads CUPY_TF32 at its first product); {cudnn_settings()}'


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def settings(torch=None):
    """Both sides' precision, two lines to print above a GPU table. `torch` defaults to the
    installed PyTorch, if any."""
    torch = torch_or_none() if torch is None else torch
    mode = current_mode()
    heading = (f'precision: {mode}, {DESCRIBED[mode]}' if mode
               else "precision: each side's defaults")
    return f'{heading}\n  {d2lperf_settings()}\n  {torch_settings(torch)}'


def torch_on_cuda():
    """PyTorch if it is installed and sees a GPU, with this process's precision set; else
    (None, why its rows are left out)."""
    torch = torch_or_none()
    if torch is None:
        return None, 'left out: PyTorch is not installed'
    if not torch.cuda.is_available():
        return None, 'left out: no CUDA'
    set_torch_precision(torch, current_mode())
    return torch, None


if __name__ == '__main__':
    torch = torch_or_none()
    if torch is not None and torch.cuda.is_available():
        set_torch_precision(torch, current_mode())
    print(settings(torch))
