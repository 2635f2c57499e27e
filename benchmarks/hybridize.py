"""Hybridization: the 512 -> 256 -> 128 -> 2 MLP, called 1000 times, every way we have.

One table from one run, ratios to the floor (NumPy written by hand with preallocated
buffers) measured side by side: imperative d2lperf, hybridized d2lperf (the calls pushed and
waited for once, or each call waited for with `asnumpy()` as an inference loop does, with the
engine's helping waits on and off), and PyTorch eager,
torch.jit.trace and torch.compile when PyTorch is installed. On a GPU, also hybridized with
CUDA-graph replay against eager CuPy and PyTorch eager on the same GPU.

`hybridize(static_alloc=True, static_shape=True)` gets a row beside the compiled one, and a
table of its own on a forward where it changes the plan (a slice, a cast and reductions after
the dense layer, which a plain plan leaves to NumPy to allocate on every call), with ratios to
the un-hybridized forward from the same run. On a GPU a last table times a forward replayed
as a CUDA graph: its wall time against the GPU's busy time (CUDA events), and its launches per
call, counted by PyTorch's profiler where it is installed. Every GPU table is headed by both
sides' precision settings (benchmarks/precision.py). Without a GPU, the GPU rows say they were
left out.

    python benchmarks/hybridize.py [--calls 1000] [--repeats 7] [--batches 1 256] [--breakdown]
    python benchmarks/hybridize.py --gpu      # the rows on gpu(0) alone, and the replay table

`--breakdown` adds where the time of one waited call at batch 1 goes, each piece timed alone.

Every mode is timed `repeats` times, round-robin, and the median is reported; PyTorch runs
after the others (see `main_rows`).
"""
import argparse
import collections
import gc
import os
import platform
import re

# d2lperf before NumPy, as the chapters: OpenBLAS then loads with its brief spin
# (engine/blas.py, spin_briefly), which the rows measured so far ran with.
import d2lperf as d2l
import numpy

from d2lperf import engine, np, npx, nn
from d2lperf.engine import engines
from d2lperf.engine.workers import ctrl_c
from d2lperf.hybrid import runtime
from d2lperf.np.multiarray import HeldVar, NDArray
from d2lperf.utils import median_seconds

import precision          # benchmarks/precision.py: both sides' float32 settings on a GPU

WIDTHS, FEATURES = (256, 128, 2), 512


def get_net(device):
    net = nn.HybridSequential()
    net.add(nn.Dense(256, activation='relu'), nn.Dense(128, activation='relu'), nn.Dense(2))
    net.initialize(device=device)
    return net


def weights(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def numpy_by_hand(ws, batch):
    """The floor: what a person writes with preallocated buffers and no framework."""
    (w1, b1, w2, b2, w3, b3), x = ws, numpy.random.normal(size=(batch, FEATURES))
    x = x.astype(numpy.float32)
    h1, h2 = numpy.empty((batch, 256), numpy.float32), numpy.empty((batch, 128), numpy.float32)
    w1t, w2t, w3t = w1.T, w2.T, w3.T

    def call():
        numpy.matmul(x, w1t, out=h1)
        numpy.add(h1, b1, out=h1)
        numpy.maximum(h1, 0, out=h1)
        numpy.matmul(h1, w2t, out=h2)
        numpy.add(h2, b2, out=h2)
        numpy.maximum(h2, 0, out=h2)
        out = numpy.matmul(h2, w3t)
        numpy.add(out, b3, out=out)
        return out
    return call, noop


def d2lperf_modes(batch, device):
    x = np.random.normal(size=(batch, FEATURES), device=device)
    imperative = get_net(device)
    imperative(x).wait_to_read()
    hybridized = get_net(device)
    hybridized.hybridize()
    hybridized(x).wait_to_read()
    static = get_net(device)
    static.hybridize(static_alloc=True, static_shape=True)
    static(x).wait_to_read()
    return {'d2lperf imperative': (lambda: imperative(x), npx.waitall),
            'd2lperf hybridized': (lambda: hybridized(x), npx.waitall),
            'd2lperf hybridized, static_alloc': (lambda: static(x), npx.waitall),
            'd2lperf hybridized, each call waited for': (lambda: hybridized(x).asnumpy(), noop),
            'd2lperf hybridized, each call waited for, helping off':
                (without_helping(lambda: hybridized(x).asnumpy()), noop)}, imperative


def noop():
    pass


def without_helping(fn):
    """`fn` run while a waiting thread sleeps until a worker has done the work."""
    def call():
        engine.set_helping(False)
        try:
            return fn()
        finally:
            engine.set_helping(True)
    return call


def torch_modes(ws, batch, device='cpu'):
    try:
        import torch
    except ImportError:
        return {}
    if device == 'cuda' and not torch.cuda.is_available():
        return {}
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    with torch.no_grad():
        for layer, (w, b) in zip([model[0], model[2], model[4]], zip(ws[::2], ws[1::2])):
            layer.weight.copy_(torch.from_numpy(w))
            layer.bias.copy_(torch.from_numpy(b))
    model = model.to(device).eval()
    x = torch.randn(batch, FEATURES, device=device)
    sync = torch.cuda.synchronize if device == 'cuda' else noop
    modes = {}
    with torch.no_grad():
        modes[f'PyTorch eager ({device})'] = model
        if device == 'cpu':
            modes['torch.jit.trace'] = torch.jit.trace(model, x)
            try:
                compiled = torch.compile(model)
                compiled(x)
                modes['torch.compile'] = compiled
            except Exception as err:                     # noqa: BLE001 - report, do not crash
                print(f'torch.compile unavailable: {type(err).__name__}: {err}'[:200])
    return {name: (no_grad(torch, fn, x), sync) for name, fn in modes.items()}


def no_grad(torch, fn, x):
    def call():
        with torch.no_grad():
            return fn(x)
    return call


def cupy_by_hand(ws, batch):
    import cupy
    (w1, b1, w2, b2, w3, b3) = [cupy.asarray(w) for w in ws]
    x = cupy.asarray(numpy.random.standard_normal((batch, FEATURES)).astype(numpy.float32))

    def call():
        h = cupy.maximum(x @ w1.T + b1, 0)
        h = cupy.maximum(h @ w2.T + b2, 0)
        return h @ w3.T + b3
    return call, cupy.cuda.get_current_stream().synchronize


def calls_then_sync(fn, sync, calls):
    def run():
        for _ in range(calls):
            fn()
        sync()
    return run


def time_modes(modes, calls, repeats):
    """Median seconds per call of each mode, timed round-robin so that drift hits all alike.

    The heap is frozen first: PyTorch's import leaves a million objects that every full
    garbage collection would walk again, a cost that belongs to neither side."""
    gc.collect()
    gc.freeze()
    runs = {name: calls_then_sync(fn, sync, calls) for name, (fn, sync) in modes.items()}
    return {name: seconds / calls
            for name, seconds in median_seconds(runs, repeats, min_seconds=0).items()}


def table(rows):
    lines = ['| device | batch | mode | µs per call | × floor |', '|---|---:|---|---:|---:|']
    for device, batch, name, seconds, floor in rows:
        lines.append(f'| {device} | {batch} | {name} | {seconds * 1e6:.1f} | '
                     f'{seconds / floor:.2f} |')
    return '\n'.join(lines)


def rows_for(device_name, floor_name, modes, batch, calls, repeats, floors):
    results = time_modes(modes, calls, repeats)
    floors.update({(device_name, batch): results[floor_name]} if floor_name in results else {})
    floor = floors[(device_name, batch)]
    return [(device_name, batch, name, seconds, floor) for name, seconds in results.items()]


def main_rows(batches, calls, repeats, gpu_only=False):
    """d2lperf and the floor first, PyTorch after: its OpenMP threads keep spinning on the
    cores for a while after each call, which would slow down whatever runs next."""
    rows, floors, weights_of = [], {}, {}
    devices = [] if gpu_only else [('cpu', d2l.cpu(), 'NumPy by hand (floor)', numpy_by_hand)]
    if d2l.num_gpus():
        devices.append(('gpu', d2l.gpu(0), 'CuPy eager by hand (floor)', cupy_by_hand))
    for name, device, floor_name, by_hand in devices:
        for batch in batches:
            modes, net = d2lperf_modes(batch, device)
            weights_of[name, batch] = ws = weights(net)
            modes = {floor_name: by_hand(ws, batch), **modes}
            rows += rows_for(name, floor_name, modes, batch, calls, repeats, floors)
    for name, device, floor_name, _ in devices:
        for batch in batches:
            modes = torch_modes(weights_of[name, batch], batch, 'cuda' if name == 'gpu' else 'cpu')
            if modes:
                rows += rows_for(name, floor_name, modes, batch, calls, repeats, floors)
    return sorted(rows, key=lambda row: (row[0], row[1]))     # stable: keeps the mode order


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--calls', type=int, default=d2l.workload(1000, 200))
    parser.add_argument('--repeats', type=int, default=d2l.workload(7, 3))
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 256])
    parser.add_argument('--breakdown', action='store_true')
    parser.add_argument('--gpu', action='store_true',
                        help='the rows on gpu(0) alone, and the CUDA graph replay table')
    args = parser.parse_args()
    if args.gpu:
        print_gpu_rows(args.batches, args.calls, args.repeats)
        return
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = 'not installed'
    print(f'# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
          f'NumPy {numpy.__version__}, PyTorch {torch_version}, engine '
          f'{os.environ.get("D2LPERF_ENGINE", "threaded")}; {args.calls} calls, median of '
          f'{args.repeats}\n')
    if d2l.num_gpus():
        print(precision.settings() + '\n')
    print(table(main_rows(args.batches, args.calls, args.repeats)))
    print(static_alloc_table(args.batches, args.calls, args.repeats))
    if d2l.num_gpus():
        print(torch_left_out())
        print(replay_table(args.calls, args.repeats))
    print(naive_engine_line(args.calls, args.repeats))
    if args.breakdown:
        print(breakdown(args.calls, args.repeats))


class SlicesAndSums(nn.HybridBlock):
    """The dense layer, then a slice, a cast, a sum and a mean: what static_alloc plans."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(256, activation='relu')

    def forward(self, x):
        h = self.dense(x)
        return (h[:, :128] * 2).sum(axis=1) + h.astype('float64').mean()


def static_alloc_modes(batch, device):
    x = np.random.normal(size=(batch, FEATURES), device=device)
    nets = {'d2lperf imperative (floor)': SlicesAndSums().initialize(device=device),
            'd2lperf hybridized': SlicesAndSums().initialize(device=device),
            'd2lperf hybridized, static_alloc': SlicesAndSums().initialize(device=device)}
    nets['d2lperf hybridized'].hybridize()
    nets['d2lperf hybridized, static_alloc'].hybridize(static_alloc=True, static_shape=True)
    for net in nets.values():
        net(x).wait_to_read()
    return {name: (lambda net=net: net(x), npx.waitall) for name, net in nets.items()}


def static_alloc_table(batches, calls, repeats, gpu_only=False):
    """The forward that static_alloc changes, against itself un-hybridized; GPU rows only
    where there is a GPU, and a line saying so where there is none."""
    rows, floors = [], {}
    devices = (([] if gpu_only else [('cpu', d2l.cpu())])
               + ([('gpu', d2l.gpu(0))] if d2l.num_gpus() else []))
    for name, device in devices:
        for batch in batches:
            rows += rows_for(name, 'd2lperf imperative (floor)', static_alloc_modes(batch, device),
                             batch, calls, repeats, floors)
    left_out = '' if d2l.num_gpus() else (
        '\ngpu rows (static_alloc, the forward replayed as a CUDA graph): left out, no GPU '
        'on this machine')
    return ('\nDense(256) -> slice, cast, sum and mean: static_alloc against the un-hybridized '
            'forward\n\n' + table(sorted(rows, key=lambda row: (row[0], row[1]))) + left_out)


# -- On a GPU: the forward replayed as a CUDA graph, its wall time against its GPU time ------

REPLAY_BATCHES = (1, 64)          # up to 64 rows a dense layer is a kernel of our own, which a
                                  # graph can capture (cuBLAS refuses stream capture)


def wide_net(device, width=d2l.workload(2048, 64), layers=6):
    """A forward long enough for the GPU, not the host, to set the pace, and one a graph can
    capture: each dense layer has an activation to fuse with, so up to 64 rows each is one
    kernel of our own (a bare product, like `get_net`'s last layer, calls cuBLAS)."""
    net = nn.HybridSequential()
    for _ in range(layers):
        net.add(nn.Dense(width, activation='relu'))
    net.initialize(device=device)
    return net


def replay_modes(make_net, batch, device):
    """{mode: (net, x)} for the imperative net, hybridized, and hybridized with static_alloc
    (its forward, with fixed shapes, replayed as a CUDA graph), each called once."""
    x = np.random.normal(size=(batch, FEATURES), device=device)
    modes = {}
    for mode, flags in (('imperative', None), ('hybridized', {}),
                        ('hybridized, static_alloc', {'static_alloc': True, 'static_shape': True})):
        net = make_net(device)
        if flags is not None:
            net.hybridize(**flags)
        net(x).wait_to_read()
        modes[mode] = net, x
    return modes


def runner_of(net, mode):
    """Which program a hybridized net's last call ran ('CUDA graph', 'fused kernels', ...),
    and the runner's notes on why not a faster one."""
    if mode == 'imperative':
        return 'CuPy calls, one or more kernels an operation'
    runner = net._compiled.last.runner
    return '; '.join([str(runner.name)] + list(runner.notes))


def gpu_seconds_per_call(net, x, calls):
    """Seconds the GPU was busy per call, from the engine's records (CUDA events around each
    operation: for a hybridized net, the whole program)."""
    npx.waitall()
    with d2l.profiler.profile() as records:
        for _ in range(calls):
            net(x)
        npx.waitall()
    on_gpu = [(r.start, r.end) for r in records if r.device == x.device]
    return d2l.profiler.busy_time(on_gpu) / calls


def launches_per_call(net, x, calls=20):
    """(text, None): the host's launch and copy calls per call, by name, and the GPU's
    activities (kernels, copies) per call, as PyTorch's profiler counts them: it reads CUPTI,
    which sees every library's launches in the process, CuPy's too. (None, why) where they
    were not counted."""
    torch, why = precision.torch_on_cuda()
    if torch is None:
        return None, f'not counted: PyTorch\'s profiler (CUPTI) counts them; PyTorch {why}'
    try:
        from torch.profiler import ProfilerActivity, profile
        npx.waitall()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                net(x)
            npx.waitall()
        host, kernels = collections.Counter(), 0
        for event in prof.events():
            if str(event.device_type).endswith('CUDA'):
                kernels += 1
            elif re.match(r'cu(da)?\w*(Launch|Memcpy|Memset)', event.name):
                host[event.name] += 1
    except Exception as error:              # noqa: BLE001 - a count, never a failed run
        return None, f'not counted: {type(error).__name__}: {error}'[:200]
    counted = ', '.join(f'{name} {count / calls:.1f}' for name, count in sorted(host.items()))
    return f'host: {counted or "none seen"}; GPU: {kernels / calls:.1f} activities', None


def replay_rows(calls, repeats, batches):
    """(net, batch, mode, runner, µs waited, µs queued, GPU µs, launches) per call on gpu(0):
    each call waited for (`asnumpy` would add a copy: `wait_to_read`), and calls queued with
    one wait; the GPU's busy time from the engine's CUDA events, timed in a run of its own
    (the events add to the host's time)."""
    device, rows = d2l.gpu(0), []
    for net_name, make_net in (('MLP 512-256-128-2', get_net), ('MLP 6 × 2048, ReLU', wide_net)):
        for batch in batches:
            modes = replay_modes(make_net, batch, device)
            runs = {}
            for mode, (net, x) in modes.items():
                runs[mode, 'waited'] = (lambda net=net, x=x: net(x).wait_to_read(), noop)
                runs[mode, 'queued'] = (lambda net=net, x=x: net(x), npx.waitall)
            seconds = time_modes(runs, calls, repeats)
            for mode, (net, x) in modes.items():
                launches, why = launches_per_call(net, x)
                rows.append((net_name, batch, mode, runner_of(net, mode), seconds[mode, 'waited'],
                             seconds[mode, 'queued'], gpu_seconds_per_call(net, x, calls),
                             launches or why))
    return rows


def replay_table(calls, repeats):
    lines = ['\nA forward on gpu(0), hybridized with static_alloc (replayed as a CUDA graph '
             'where it can be), against itself hybridized and imperative: wall time per call '
             f'against the GPU\'s busy time (CUDA events), median of {repeats} rounds of '
             f'{calls} calls\n{precision.settings()}',
             '| device | net | batch | mode | runs as | µs waited | µs queued | GPU µs | '
             'waited / GPU | queued / GPU | launches per call |',
             '|---|---|--:|---|---|--:|--:|--:|--:|--:|---|']
    targets = []
    for net_name, batch, mode, runner, waited, queued, gpu_s, launches in replay_rows(
            calls, repeats, REPLAY_BATCHES):
        lines.append(f'| gpu | {net_name} | {batch} | {mode} | {runner} | {waited * 1e6:.1f} | '
                     f'{queued * 1e6:.1f} | {gpu_s * 1e6:.1f} | {waited / gpu_s:.2f} | '
                     f'{queued / gpu_s:.2f} | {launches} |')
        if mode == 'hybridized, static_alloc':
            targets.append(f'{net_name} at batch {batch} ({runner.split(";")[0]}): '
                           f'{waited / gpu_s:.2f} waited, {queued / gpu_s:.2f} queued')
    lines.append('target: a replayed forward\'s wall time against its GPU time (target ≤ '
                 '1.2×, launches per call above): ' + '; '.join(targets))
    return '\n'.join(lines)


def torch_left_out():
    """A line for the GPU table where PyTorch's rows on cuda are missing, else nothing."""
    torch, why = precision.torch_on_cuda()
    return '' if torch is not None else f'| gpu | | PyTorch eager (cuda) | {why} | |'


def print_gpu_rows(batches, calls, repeats):
    """`--gpu`: the rows on gpu(0) alone, each table with both sides' precision settings."""
    if not d2l.num_gpus():
        print('No GPU: the rows on gpu(0) (CuPy by hand, d2lperf, PyTorch on cuda, static_alloc, '
              'the CUDA graph replay) are left out')
        return
    print(precision.settings() + '\n')
    print(table(main_rows(batches, calls, repeats, gpu_only=True)))
    print(torch_left_out())
    print(static_alloc_table(batches, calls, repeats, gpu_only=True))
    print(replay_table(calls, repeats))


def naive_engine_line(calls, repeats):
    """Batch 1, each call waited for, on the naive engine (every operation on the caller's
    thread, no bookkeeping of dependencies): the least any engine could cost at this call
    path, timed against the floor in a round of its own."""
    engine.use('naive')
    try:
        modes, net = d2lperf_modes(1, d2l.cpu())
        waited = modes['d2lperf hybridized, each call waited for']
        times = time_modes({'floor': numpy_by_hand(weights(net), 1), 'naive': waited}, calls,
                           repeats)
    finally:
        engine.use('threaded')
    return (f'\nnaive engine, batch 1, each call waited for: {times["naive"] * 1e6:.1f} µs, '
            f'{times["naive"] / times["floor"]:.2f}× the floor ({times["floor"] * 1e6:.1f} µs) '
            'in the same round')


def breakdown(calls, repeats):
    """Where a waited call at batch 1 goes beyond the floor, timed in one round: the whole
    call with one piece taken out (the engine: `push_short` calls the program; holding
    Ctrl-C back; counting the output's bytes), and pieces alone."""
    net, x = get_net(d2l.cpu()), np.random.normal(size=(1, FEATURES))
    net.hybridize()
    net(x).asnumpy()
    executable = net._compiled.last
    data = [a.data for a in (x,) + executable.params()]
    reads, writes = [x.var] + executable._param_vars, [engine.Var(), engine.Var()]
    waited = lambda: net(x).asnumpy()                   # noqa: E731 - one line per piece

    def engine_alone():
        engine.push_short(noop, reads, writes, x.device, 'noop')
        engine.wait_for(writes[0])
    dtype = numpy.dtype('float32')
    pieces = {'floor': (numpy_by_hand(weights(net), 1)[0], noop),
              'the generated program': (lambda: executable.runner(*data), noop),
              'hybridized, each call waited for': (waited, noop),
              '  without the engine (push_short calls the program)':
                  patched(waited, engine.current(), 'push_short', lambda fn, *_: fn()),
              '  without holding Ctrl-C back': patched(waited, engines, 'ctrl_c', NoCtrlC()),
              "  without counting the output's bytes (a plain engine variable)":
                  patched(waited, runtime, 'HeldVar', lambda device, nbytes: engine.Var()),
              'the engine alone: push_short of a no-op reading 7, writing 2, and its wait':
                  (engine_alone, noop),
              '  of which holding Ctrl-C back': (lambda: ctrl_c.release() if ctrl_c.hold() else 0,
                                                 noop),
              'an output NDArray, made and freed (its bytes counted)':
                  (lambda: NDArray((1, 2), dtype, x.device, HeldVar(x.device, 8)), noop)}
    times = time_modes(pieces, calls, repeats)
    return '\n' + '\n'.join(f'{seconds * 1e6:6.2f} µs  {name}' for name, seconds in times.items())


def patched(fn, owner, name, value):
    """`fn` as a mode timed with `owner.name` set to `value`: set by a round's first call,
    taken off by its sync, so that the calls in between pay nothing for it."""
    old = []

    def call():
        if not old:
            old.append(vars(owner).get(name, noop))      # noop: a method, from the class
            setattr(owner, name, value)
        return fn()

    def sync():
        if old:
            kept = old.pop()
            if kept is noop:
                delattr(owner, name)
            else:
                setattr(owner, name, kept)
    return call, sync


class NoCtrlC:
    """Stands in for `workers.ctrl_c` where its cost is measured: holds nothing back."""

    def hold(self):
        return False

    def release(self):
        pass


if __name__ == '__main__':
    main()
