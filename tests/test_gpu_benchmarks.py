"""The GPU rows of benchmarks/ run here, on the stand-in CuPy (tests/fakes/cupy.py), at tiny
sizes: a lease of a GPU machine is short, so anything in them that needs no GPU must fail
here, not there (benchmarks/gpu_session.sh runs them there). Each table prints both sides'
precision settings (benchmarks/precision.py), and a row that cannot run says why."""
import os
import pathlib
import shutil
import subprocess
import sys
import time
import types

import pytest

import d2lperf as d2l

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / 'benchmarks'
sys.path.insert(0, str(BENCHMARKS))

import engine as engine_benchmark            # noqa: E402 - benchmarks/ is on the path now
import hybridize as hybridize_benchmark      # noqa: E402
import precision                             # noqa: E402
import training                              # noqa: E402

SETTINGS = ('CUPY_TF32=', 'NVIDIA_TF32_OVERRIDE=', 'cuDNN', 'PyTorch')


def assert_settings_printed(output):
    assert 'precision: ' in output
    for name in SETTINGS:
        assert name in output, f'{name} missing from the settings:\n{output}'


def cells(line):
    """A Markdown table row's cells, stripped."""
    return [cell.strip() for cell in line.strip().strip('|').split('|')]


def torch_on_cuda():
    return precision.torch_on_cuda()[0] is not None


# -- precision: the modes, their processes and PyTorch's switches ----------------------------

def test_each_mode_starts_with_its_variables_whatever_the_parent_set():
    parent = {'CUPY_TF32': '1', 'NVIDIA_TF32_OVERRIDE': '0', 'HOME': '/root'}
    strict = precision.mode_environment('strict', parent)
    tf32 = precision.mode_environment('tf32', parent)
    assert 'CUPY_TF32' not in strict and strict['NVIDIA_TF32_OVERRIDE'] == '0'
    assert tf32['CUPY_TF32'] == '1' and 'NVIDIA_TF32_OVERRIDE' not in tf32
    assert strict[precision.BENCH_PRECISION] == 'strict' and tf32['HOME'] == '/root'


def test_a_child_per_mode_sees_the_mode(capfd):
    code = ('import os; print("child", os.environ.get("D2LPERF_BENCH_PRECISION"), '
            'os.environ.get("CUPY_TF32"), os.environ.get("NVIDIA_TF32_OVERRIDE"))')
    statuses = precision.run_in_each_mode(['strict', 'tf32'], ['-c', code])
    printed = capfd.readouterr().out
    assert statuses == {'strict': 0, 'tf32': 0}
    assert 'child strict None 0' in printed and 'child tf32 1 None' in printed
    with pytest.raises(ValueError, match='unknown precision'):
        precision.run_in_each_mode(['fp64'], ['-c', 'pass'])


def test_an_unknown_mode_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(precision.BENCH_PRECISION, 'fp16')
    with pytest.raises(ValueError, match='choose one of'):
        precision.current_mode()


class Switches:
    """Stands in for one of PyTorch's backend objects: `fp32_precision` (2.9 on) or not."""
    allow_tf32 = True

    def __init__(self, new_api):
        if new_api:
            self.fp32_precision = 'tf32'


class RefusedFlag(Switches):
    """A backend whose legacy flag PyTorch refuses, to read or to set."""

    @property
    def allow_tf32(self):
        raise RuntimeError('you have used mix of the legacy and new APIs')

    @allow_tf32.setter
    def allow_tf32(self, value):
        raise RuntimeError('you have used mix of the legacy and new APIs')


def fake_torch(new_api, kind=Switches):
    cudnn = kind(new_api)
    cudnn.conv, cudnn.rnn = Switches(new_api), Switches(new_api)
    backends = types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=kind(new_api)),
                                     cudnn=cudnn, fp32_precision='none')
    return types.SimpleNamespace(backends=backends, __version__='2.11.0',
                                 cuda=types.SimpleNamespace(is_available=lambda: True))


@pytest.mark.parametrize('new_api', [True, False])
def test_torch_switches_follow_the_mode(new_api):
    torch = fake_torch(new_api)
    precision.set_torch_precision(torch, 'strict')
    line = precision.torch_settings(torch)
    assert line.startswith('PyTorch 2.11.0: cuda.matmul.allow_tf32=False; cudnn.allow_tf32=False')
    assert ('fp32_precision backends=none, cuda.matmul=tf32' in line) == new_api
    precision.set_torch_precision(torch, 'tf32')
    assert 'cuda.matmul.allow_tf32=True; cudnn.allow_tf32=True' in precision.torch_settings(torch)
    precision.set_torch_precision(torch, None)             # the defaults: left as they are
    assert torch.backends.cudnn.allow_tf32


def test_where_the_flags_are_refused_the_newer_names_are_set_and_printed_as_such():
    torch = fake_torch(True, RefusedFlag)
    precision.set_torch_precision(torch, 'strict')
    backends = torch.backends
    assert [owner.fp32_precision for owner in (backends.cuda.matmul, backends.cudnn.conv,
                                               backends.cudnn.rnn)] == ['ieee'] * 3
    line = precision.torch_settings(torch)
    assert 'cudnn.allow_tf32=unreadable (RuntimeError)' in line
    assert 'cuda.matmul=ieee' in line and 'cudnn.conv=ieee' in line


def test_settings_name_both_sides_and_say_where_pytorch_is_left_out(monkeypatch):
    monkeypatch.setenv(precision.BENCH_PRECISION, 'strict')
    monkeypatch.setenv('NVIDIA_TF32_OVERRIDE', '0')
    text = precision.settings()
    assert_settings_printed(text)
    assert text.startswith('precision: strict, strict FP32') and 'NVIDIA_TF32_OVERRIDE=0' in text
    if precision.cudnn is None:
        assert 'cuDNN path: not built in this tree' in text
    if not torch_on_cuda():
        assert 'PyTorch' in text and 'left out: ' in text


# -- without a GPU: every GPU section says its rows are left out -----------------------------

def test_without_a_gpu_each_gpu_section_says_it_left_its_rows_out(capsys):
    if d2l.num_gpus():
        pytest.skip('a GPU is here: the sections run for real')
    for name, section in training.GPU_SECTIONS.items():
        section(2)
        assert 'No GPU' in capsys.readouterr().out, name
    engine_benchmark.print_gpu_rows()
    assert 'No GPU' in capsys.readouterr().out
    hybridize_benchmark.print_gpu_rows([1], 1, 1)
    assert 'No GPU' in capsys.readouterr().out


# -- on the stand-in GPU: each row's code path once, at tiny sizes ----------------------------

@pytest.fixture
def tiny(monkeypatch, fake_gpus):
    monkeypatch.setattr(training, 'GPU_RESNET_BATCHES', (1,))
    monkeypatch.setattr(training, 'GPU_ROUNDS', 1)
    monkeypatch.setattr(training, 'GPU_STEPS', 1)
    monkeypatch.setattr(training, 'GPU_GPT_SIZES', dict(vocab_size=16, num_layers=1,
                                                         num_hiddens=16, num_heads=2, max_len=8))
    monkeypatch.setattr(training, 'GPU_GPT_BATCH', 2)
    monkeypatch.setattr(training, 'GPU_MEMORY_BATCH', 1)


def test_resnet_rows_in_a_mode_time_each_road_against_pytorch(tiny, monkeypatch, capsys):
    monkeypatch.setenv(precision.BENCH_PRECISION, 'strict')
    monkeypatch.setattr(training, 'gpu_peak_flops', lambda mode: (
        (1e12, f'floor: {mode} at 1.0 TFLOP/s') if mode == 'float32' else (None, 'wrong mode')))
    training.gpu_resnet_section(2)
    output = capsys.readouterr().out
    assert_settings_printed(output)
    road = 'cuDNN' if len(training.convolution_roads()) == 2 else 'im2col'
    rows = {cells(line)[0]: cells(line) for line in output.splitlines()
            if line.startswith('| d2lperf')}
    assert set(rows) >= {f'd2lperf, imperative, {road}', f'd2lperf, hybridized, {road}',
                         'd2lperf, hybridized static_alloc, im2col'}
    floor_ms = 1e3 * training.resnet_flops(1) / 1e12
    for row in rows.values():
        assert row[1] == '1' and float(row[6]) == pytest.approx(floor_ms, abs=0.01)
        assert float(row[7]) == pytest.approx(float(row[2]) / floor_ms, rel=0.06)
    if not torch_on_cuda():
        assert '| PyTorch eager, batch 1 | | left out: ' in output


def test_resnet_rows_run_in_a_child_per_mode_and_a_failed_child_fails_the_run(tiny,
                                                                              monkeypatch):
    monkeypatch.delenv(precision.BENCH_PRECISION, raising=False)
    started, statuses = [], {'tf32': 0, 'strict': 0}

    def run_in_each_mode(modes, argv):
        started.append((tuple(modes), argv[1:]))
        return statuses
    monkeypatch.setattr(precision, 'run_in_each_mode', run_in_each_mode)
    monkeypatch.setattr(training, 'gpu_resnet_rows', lambda *args: pytest.fail('ran here'))
    training.main(['gpu_resnet', '--precision', 'tf32', 'strict'])
    assert started == [(('tf32', 'strict'), ['gpu_resnet'])]
    statuses['strict'] = 1
    with pytest.raises(SystemExit, match=r"\['gpu_resnet'\] failed in a child process"):
        training.main(['gpu_resnet'])


def test_rows_are_timed_in_rounds_or_say_why_not(monkeypatch, capsys):
    """A row that fails says why; a row slower than SLOW_STEP is timed by its second step
    alone; the others in rounds, in turns."""
    calls = []

    def make(name, seconds=0.0, fails=False):
        def step():
            calls.append(name)
            if fails:
                raise RuntimeError('no bfloat16 kernel')
            time.sleep(seconds)
        return lambda: step
    monkeypatch.setattr(training, 'SLOW_STEP', 0.05)
    notes = {}
    rows = training.timed_rows({'fast': make('fast'), 'slow': make('slow', 0.06),
                                'broken': make('broken', fails=True)}, 4, 2, 3, notes)
    assert [(name, batch, len(seconds)) for name, batch, seconds in rows] == [
        ('fast', 4, 3), ('slow', 4, 1)]
    assert rows[1][2][0] >= 0.06
    assert calls.count('fast') == 2 + 1 + 3 * 2 and calls.count('slow') == 2
    assert notes == {'broken, batch 4': 'left out: RuntimeError: no bfloat16 kernel',
                     'slow, batch 4': 'timed by one step: slower than 0 s a step'}
    assert 'fast, batch 4: built and first step in ' in capsys.readouterr().out
    monkeypatch.setattr(training, 'SLOW_FIRST_STEP', -1.0)
    assert training.timed_rows({'fast': make('fast')}, 1, 1, 1, notes) == []
    assert notes['fast, batch 1'].startswith('left out: its first step took ')


def test_resnet_flops_count_every_product_of_a_step():
    """Batch 1: the first layer (1→64, 28², 3×3) forward and weight gradient, and the dense
    layer's three products, by hand."""
    first = 2 * 64 * 28 * 28 * 1 * 9
    assert training.resnet_flops(2) == 2 * training.resnet_flops(1)
    assert training.resnet_flops(1) > 2 * first + 3 * 2 * 512 * 10
    sizes = dict(vocab_size=10, num_layers=1, num_hiddens=4, num_heads=1, max_len=3)
    dense = 2 * 3 * (12 * 16 + 40)
    assert training.gpt_flops(sizes, 1) == 3 * (dense + 2 * 9 * 4)


def test_the_gpt_rows_say_why_they_are_left_out_rather_than_fail(tiny, capsys):
    training.gpu_gpt_section(2)
    output = capsys.readouterr().out
    assert_settings_printed(output)
    lines = [line for line in output.splitlines() if line.startswith('| d2lperf')]
    assert len(lines) == 4           # imperative and hybridized, each dtype, timed or left out
    for line, dtype in zip(lines, ['float16'] * 2 + ['bfloat16'] * 2):
        assert f'{dtype}, multi_precision' in line
        timed = cells(line)[2].replace('.', '', 1).isdigit()
        assert timed or 'left out: ' in line, line
    targets = [line for line in output.splitlines() if line.startswith('target: GPT step')]
    assert [t.split(':')[1] for t in targets] == [' GPT step in float16', ' GPT step in bfloat16']


def test_peak_memory_rows_put_the_ledger_beside_pytorch(tiny, capsys):
    training.gpu_memory_section(2)
    output = capsys.readouterr().out
    assert_settings_printed(output)
    rows = [cells(line) for line in output.splitlines() if line.startswith('| d2lperf')]
    assert len(rows) == 2 * len(training.convolution_roads())
    for row in rows:
        before, peak, above = (float(row[i]) for i in (1, 2, 3))
        assert before > 40 and peak >= before and above == pytest.approx(peak - before, abs=0.2)
    if not torch_on_cuda():
        assert '| PyTorch eager: torch.cuda.max_memory_allocated | left out: ' in output
    assert 'target: peak memory of a step' in output


def test_lenet_and_winograd_tables_print_the_settings(tiny, monkeypatch, capsys):
    monkeypatch.setattr(training, 'best_seconds', lambda step, **kw: (step(), 0.5)[1])
    monkeypatch.setattr(training, 'gpu_winograd_rows', lambda: [('64→64, 28×28', 16, 2e-3, 1e-3)])
    training.gpu_lenet_section(2)
    training.gpu_winograd_section(2)
    output = capsys.readouterr().out
    assert output.count('NVIDIA_TF32_OVERRIDE=') == 2
    assert '| d2lperf on gpu(0), imperative | GPU | 512 |' in output
    assert '| 64→64, 28×28 (gpu) | 16 | 2.000 | 1.000 | 2.00 |' in output


def test_dispatch_prints_the_ratio_the_target_names(fake_gpus, monkeypatch, capsys):
    from d2lperf.hardware import gpu
    monkeypatch.setattr(engine_benchmark, 'OPS', 20)
    monkeypatch.setattr(gpu, 'kernel_launch_latency', lambda launches: [
        {'mode': 'queued', 'us_per_launch': 4.0}, {'mode': 'launch and wait', 'us_per_launch': 9.0}])
    engine_benchmark.print_gpu_rows()
    output = capsys.readouterr().out
    assert_settings_printed(output)
    asynchronous = [line for line in output.splitlines()
                    if line.startswith(f'| {engine_benchmark.ASYNCHRONOUS}')][0]
    ratio = float(cells(asynchronous)[2])
    assert (f'target: tiny eager x + 1, asynchronous: {ratio:.1f}× an empty kernel launch'
            in output)
    if not torch_on_cuda():
        assert 'PyTorch eager x + 1, queued' in output and 'left out: ' in output


def test_a_replayed_forward_shows_wall_against_gpu_time(fake_gpus, monkeypatch, capsys):
    # The script freezes the heap before timing; frozen here, this test's arrays would stay
    # on the ledger for the tests after it.
    monkeypatch.setattr(hybridize_benchmark.gc, 'freeze', lambda: None)
    wide_net = hybridize_benchmark.wide_net
    monkeypatch.setattr(hybridize_benchmark, 'wide_net',
                        lambda device: wide_net(device, width=32, layers=2))
    monkeypatch.setattr(hybridize_benchmark, 'REPLAY_BATCHES', (1,))
    hybridize_benchmark.print_gpu_rows([1], 3, 1)
    output = capsys.readouterr().out
    assert_settings_printed(output)
    rows = [cells(line) for line in output.splitlines()
            if line.startswith('| gpu | MLP 6 × 2048, ReLU | 1 |')]
    assert [row[3] for row in rows] == ['imperative', 'hybridized', 'hybridized, static_alloc']
    assert rows[2][4] == 'CUDA graph'              # every product is a kernel of its own
    waited, gpu_us, ratio = float(rows[2][5]), float(rows[2][7]), float(rows[2][8])
    assert ratio == pytest.approx(waited / gpu_us, rel=0.02)
    if not torch_on_cuda():
        assert 'not counted: ' in rows[2][10]
        assert '| gpu | | PyTorch eager (cuda) | left out: ' in output
    assert 'target: a replayed forward' in output and '(CUDA graph)' in output


# -- the session's script ---------------------------------------------------------------------

def run_session(tmp_path, seconds, *parts):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable,
               GPU_SESSION_SECONDS=str(seconds))
    return subprocess.run(['bash', str(BENCHMARKS / 'gpu_session.sh'), *parts], env=env,
                          capture_output=True, text=True, timeout=300)


PARTS = ('settings', 'dispatch', 'resnet_strict', 'gpt_16bit', 'replay', 'memory', 'resnet_tf32')


@pytest.mark.skipif(shutil.which('timeout') is None, reason='needs coreutils timeout')
def test_the_session_runs_each_part_here_and_writes_at_most_eight_files(tmp_path):
    if d2l.num_gpus():
        pytest.skip('a GPU is here: the session would take minutes')
    done = run_session(tmp_path, 450)
    assert done.returncode == 0, done.stderr
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == sorted(f'{part}.txt' for part in PARTS + ('summary',))
    for part in PARTS:
        text = (tmp_path / f'{part}.txt').read_text()
        assert text.startswith(f'== {part} (at most ') and 'Traceback' not in text, text
    assert 'No GPU' in (tmp_path / 'resnet_strict.txt').read_text()
    assert_settings_printed((tmp_path / 'settings.txt').read_text())
    summary = (tmp_path / 'summary.txt').read_text()
    assert all(f'{part}: exit 0' in summary for part in PARTS), summary


@pytest.mark.skipif(shutil.which('timeout') is None, reason='needs coreutils timeout')
def test_the_session_starts_no_part_once_its_time_is_spent(tmp_path):
    done = run_session(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / 'summary.txt').read_text()
    assert all(f'{part}: not run (budget spent)' in summary for part in PARTS), summary


@pytest.mark.skipif(shutil.which('timeout') is None, reason='needs coreutils timeout')
def test_the_session_runs_the_parts_it_is_named(tmp_path):
    done = run_session(tmp_path, 450, 'settings', 'memory')
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        'memory.txt', 'settings.txt', 'summary.txt']
    summary = (tmp_path / 'summary.txt').read_text().splitlines()
    assert [line.split(':')[0] for line in summary
            if not line.startswith(('==', 'target'))] == ['settings', 'memory']


def test_through_cudnn_a_resnet_step_makes_fewer_gpu_calls_than_by_im2col():
    """benchmarks/gpu_calls.py counts, on the stand-in GPU, the calls a ResNet-18 step makes
    that each launch GPU work: convolutions and batch norm as cuDNN graphs take under half
    of im2col's, and hybridizing cuts the engine's operations, not the calls."""
    done = subprocess.run([sys.executable, '-W', 'ignore', str(BENCHMARKS / 'gpu_calls.py'),
                           '--batch', '2'], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent)))
    assert done.returncode == 0, done.stderr
    rows = {tuple(cells[:2]): [int(c) for c in cells[2:]] for cells in (
        [c.strip() for c in line.strip('|').split('|')] for line in done.stdout.splitlines()
        if line.startswith(('| im2col', '| cuDNN')))}
    im2col, cudnn = rows['im2col', 'imperative'], rows['cuDNN', 'imperative']
    assert cudnn[-1] < im2col[-1] / 2 and im2col[3] == 0 < cudnn[3]
    assert rows['cuDNN', 'hybridized'][0] < cudnn[0]
