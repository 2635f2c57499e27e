"""The dependency engine's cost per operation, measured side by side in one run.

    python benchmarks/engine.py            # full sizes
    D2LPERF_QUICK=1 python benchmarks/engine.py
    python benchmarks/engine.py --compare /tmp/old . [ROUNDS]  # per-op rows: trees alternating
    python benchmarks/engine.py --gpu      # the rows on gpu(0) alone

Rows: µs per tiny operation (`x + 1` on a 1×2 float32 array) for plain NumPy (the floor:
no engine at all), one Python thread round trip (queue to a worker and back: the floor of
any design that computes on another thread), the naive engine, the threaded engine waiting
after every operation (the waiter runs the operation itself, then the same with helping
waits off, so that a worker thread runs it), the threaded engine asynchronously, and PyTorch
eager when installed.
Then the time to *issue* 10 products of 1000×1000 matrices over the time to finish them.
With a GPU, the same tiny operation on gpu(0), beside an empty kernel's launch (the floor)
and CuPy's and PyTorch's own `x + 1` (both sides' precision settings printed above them),
and the target's ratio. Each figure is the median of several repeats.
"""
import gc
import platform
import queue
import threading
import time

# d2lperf before NumPy, as the chapters: OpenBLAS then loads with its brief spin
# (engine/blas.py, spin_briefly), which the rows measured so far ran with.
import d2lperf as d2l
import numpy

from d2lperf import engine, np, npx
from d2lperf.utils import median_seconds

import precision          # benchmarks/precision.py: both sides' float32 settings on a GPU

OPS = d2l.workload(10_000, 2_000)
REPEATS = 5


def per_op_us(run):
    """Median over repeats of the wall time of `run()` (which does OPS operations), per op."""
    return median_seconds(run, REPEATS, min_seconds=0) / OPS * 1e6


def numpy_floor():
    x = numpy.ones((1, 2), numpy.float32)

    def run():
        for _ in range(OPS):
            x + 1
    return per_op_us(run)


def thread_round_trip():
    requests, replies = queue.SimpleQueue(), queue.SimpleQueue()

    def worker():
        while (item := requests.get()) is not None:
            replies.put(item)
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def run():
        for i in range(OPS):
            requests.put(i)
            replies.get()
    result = per_op_us(run)
    requests.put(None)
    return result


def engine_tiny_ops(kind, wait_each, helping=True, device=None):
    engine.use(kind)
    engine.set_helping(helping)
    x = np.ones((1, 2), device=device)
    (x + 1).wait_to_read()                # on a GPU, the first add compiles its kernel

    def run():
        for _ in range(OPS):
            y = x + 1
            if wait_each:
                y.wait_to_read()
        npx.waitall()
    result = per_op_us(run)
    engine.use('threaded')
    return result


def torch_eager():
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    x = torch.ones((1, 2))

    def run():
        for _ in range(OPS):
            x + 1
    return per_op_us(run)


def cupy_tiny_ops():
    """`x + 1` on gpu(0) by CuPy itself, queued: the library call the engine's worker makes."""
    import cupy
    with cupy.cuda.Device(0):
        x = cupy.ones((1, 2), cupy.float32)
        x + 1

        def run():
            for _ in range(OPS):
                x + 1
            cupy.cuda.get_current_stream().synchronize()
        return per_op_us(run)


def torch_cuda_tiny_ops():
    """(µs per `x + 1` on the GPU by PyTorch eager, queued, None) or (None, why left out)."""
    torch, why = precision.torch_on_cuda()
    if torch is None:
        return None, why
    x = torch.ones((1, 2), device='cuda')
    x + 1

    def run():
        for _ in range(OPS):
            x + 1
        torch.cuda.synchronize()
    return per_op_us(run), None


ASYNCHRONOUS = 'gpu(0): threaded engine, asynchronous'


def gpu_rows():
    """µs per tiny operation on gpu(0), beside an empty kernel's launch, queued (the floor:
    what the host pays CUDA for one kernel) and waited for, from the same run; and the
    PyTorch row's note where it is left out."""
    from d2lperf.hardware import gpu
    launch = {row['mode']: row['us_per_launch'] for row in gpu.kernel_launch_latency(OPS)}
    rows = [('gpu(0): empty kernel launch, queued (floor)', launch['queued']),
            ('gpu(0): empty kernel launch, waited for', launch['launch and wait']),
            ('gpu(0): CuPy x + 1, queued', cupy_tiny_ops()),
            ('gpu(0): naive engine', engine_tiny_ops('naive', False, device=d2l.gpu(0))),
            ('gpu(0): threaded engine, wait after every op',
             engine_tiny_ops('threaded', True, device=d2l.gpu(0))),
            (ASYNCHRONOUS, engine_tiny_ops('threaded', False, device=d2l.gpu(0)))]
    theirs, why = torch_cuda_tiny_ops()
    if theirs is not None:
        rows.append(('gpu(0): PyTorch eager x + 1, queued', theirs))
    return rows, why


def print_gpu_rows():
    if not d2l.num_gpus():
        print('\nNo GPU: the rows on gpu(0) are left out')
        return
    rows, torch_left_out = gpu_rows()
    floor = rows[0][1]
    print(f'\non gpu(0): x + 1 on a 1x2 array, {OPS} ops, median of {REPEATS}\n'
          f'{precision.settings()}')
    print(f'| {"what":46s} | µs/op | × launch |')
    print(f'|{"-" * 48}|------:|---------:|')
    for name, us in rows:
        print(f'| {name:46s} | {us:5.1f} | {us / floor:8.1f} |')
    if torch_left_out:
        print(f'| {"gpu(0): PyTorch eager x + 1, queued":46s} | {torch_left_out} | |')
    print(f'target: tiny eager x + 1, asynchronous: {dict(rows)[ASYNCHRONOUS] / floor:.1f}× an '
          'empty kernel launch, queued (target ≤ 5×, aim 4×)')


def bookkeeping_us(count=OPS):
    """µs of the threaded engine's own Python per operation (1 read, 1 write, nothing to
    compute), on this thread alone: the push, with its hand-over to the lane's queue, then the
    lane's part (execute and complete). This thread holds the lane's `runner` meanwhile, so the
    lane's thread is never woken and never runs one of them; the garbage collector is off,
    since the pushed operations pile up here as they never would in a program, and each
    collection would walk them all."""
    eng = engine.use('threaded')
    x = np.ones((1, 2))
    x.wait_to_read()
    worker = eng.workers.start(d2l.cpu(), engine.COMPUTE)
    gc.disable()
    worker.runner.acquire()
    try:
        start = time.perf_counter()
        for _ in range(count):
            eng.push(lambda: None, [x.var], [engine.Var()], d2l.cpu(), 'nothing')
        push = time.perf_counter() - start
        pushed = list(worker.queued)
        worker.queued.clear()
        start = time.perf_counter()
        for op in pushed:
            eng.run(op, worker)
        complete = time.perf_counter() - start
    finally:
        worker.runner.release()
        gc.enable()
    return push / count * 1e6, complete / count * 1e6


def calls_per_operation():
    """Python calls (of Python and C functions, as `sys.setprofile` sees them) of one `x + 1`:
    its push, then its run and completion by the thread that waits for it, which the lane's
    thread leaves to it here (its wake-ups are kept from it). Unlike time, exact: the same in
    every run. tests/test_engine_calls.py bounds the same counts."""
    import sys
    import types
    eng = engine.use('threaded')
    x = np.ones((1, 2))
    x.wait_to_read()
    worker = eng.workers.start(d2l.cpu(), engine.COMPUTE)
    held, calls = [], []

    def note(frame, event, arg):
        if event in ('call', 'c_call'):
            calls.append(event)
    real, worker.wakeups = worker.wakeups, types.SimpleNamespace(put=held.append)
    try:
        for _ in range(3):                  # the third of three in a row
            calls.clear()
            sys.setprofile(note)
            y = x + 1
            sys.setprofile(None)
            push = len(calls) - 1           # setprofile(None) itself
            calls.clear()
            sys.setprofile(note)
            y.wait_to_read()
            sys.setprofile(None)
    finally:
        worker.wakeups = real
        for item in held:
            real.put(item)
    return push, len(calls) - 1


def memory_counter_us(count=OPS):
    """µs an array's memory counter adds (`device.Held`: its bytes on the ledger when made,
    off when freed, and the ledger's adding up), as the variable of an array made and freed
    against a plain engine variable."""
    from d2lperf.np.multiarray import HeldVar
    device = d2l.cpu()

    def made_and_freed(make):
        def run():
            for _ in range(count):
                make()
        return median_seconds(run, REPEATS, min_seconds=0) / count * 1e6
    return made_and_freed(lambda: HeldVar(device, 8)) - made_and_freed(engine.Var)


def garbage_collector_us():
    """µs per operation that Python's garbage collector takes in the asynchronous loop, and
    the objects one operation in flight keeps: the collector walks every object that survives
    a collection, and thousands of operations are in flight when the caller pushes faster than
    the lane runs them. The heap is frozen first: PyTorch's import (the row before) leaves a
    million objects that a full collection would walk, a cost that is not the engine's."""
    engine.use('threaded')
    x = np.ones((1, 2))
    x.wait_to_read()
    gc.collect()
    gc.freeze()
    spent, started = [0.0], [0.0]

    def note(phase, info):
        if phase == 'start':
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
    gc.callbacks.append(note)
    try:
        for _ in range(OPS):
            x + 1
        npx.waitall()
    finally:
        gc.callbacks.remove(note)
    return spent[0] / OPS * 1e6, objects_per_operation(x)


def objects_per_operation(x, count=100):
    """Objects the garbage collector tracks that one pushed operation keeps until it has run."""
    keep = []
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        with engine_paused():
            for _ in range(count):
                keep.append(x + 1)
            kept = (gc.get_count()[0] - before) / count
    finally:
        gc.enable()
    return kept


class engine_paused:
    """cpu(0)'s lane runs nothing inside (this thread holds its `runner`, so pushes queue there
    and wake nobody); on the way out the lane's thread is woken to run them."""

    def __enter__(self):
        self.worker = engine.current().workers.start(d2l.cpu(), engine.COMPUTE)
        self.worker.runner.acquire()

    def __exit__(self, *exc):
        self.worker.runner.release()
        self.worker.wake()
        npx.waitall()


def issue_over_finish(n=d2l.workload(1000, 400)):
    a = np.random.normal(size=(n, n))
    npx.waitall()
    ratios = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(10):
            b = np.dot(a, a)
        issued = time.perf_counter() - start
        b.wait_to_read()
        finished = time.perf_counter() - start
        ratios.append((issued, finished))
    issued, finished = min(ratios, key=lambda r: r[0] / r[1])
    return n, issued, finished


# Run in a fresh interpreter on another tree of d2lperf (an older commit's): only the calls
# every version has, so that a change in the per-op cost is measured side by side. One line:
# µs per op for NumPy's own x + 1 (the floor, from the same process), the naive engine, the
# threaded engine waiting after every op, asynchronously; then a decode step of the small GPT
# at batch 1 (many small operations, one wait), in ms, and the thread switches it caused.
PER_OP_ROWS = """
import statistics, time
import numpy
import d2lperf as d2l
from d2lperf import engine, np, npx
def numpy_floor():
    x = numpy.ones((1, 2), numpy.float32)
    times = []
    for _ in range({repeats}):
        start = time.perf_counter()
        for _ in range({ops}):
            x + 1
        times.append(time.perf_counter() - start)
    return statistics.median(times) / {ops} * 1e6
def per_op(kind, wait_each):
    engine.use(kind)
    x = np.ones((1, 2)); x.wait_to_read()
    def run():
        for _ in range({ops}):
            y = x + 1
            if wait_each:
                y.wait_to_read()
        npx.waitall()
    run()
    times = []
    for _ in range({repeats}):
        start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
    return statistics.median(times) / {ops} * 1e6
def decode_step(steps=200):
    try:
        from d2lperf.inference import roofline
    except ImportError:                 # a tree from before generation
        return float('nan'), float('nan')
    import resource
    engine.use('threaded')
    numpy.random.seed(0)
    step = roofline.decode_step(d2l.nn.GPT(96, 2, 128, 4, 1024).initialize(), 1, 32)
    for _ in range(10):
        step()
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    times = []
    for _ in range(steps):
        start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches
    return statistics.median(times) * 1e3, switches / steps
print(numpy_floor(), per_op('naive', False), per_op('threaded', True), per_op('threaded', False),
      *decode_step())
"""
ROWS = ('NumPy x + 1 (floor), µs', 'naive engine, µs', 'threaded, wait after every op, µs',
        'threaded, asynchronous, µs', 'decode step (2 x 128 GPT, batch 1), ms',
        'voluntary context switches a decode step')


def compare_trees(trees, rounds=3):
    """µs per `x + 1` for each row of ROWS (the median of REPEATS), for each source tree in
    turn (PYTHONPATH=tree), `rounds` times alternating: {tree: {row: [figures]}}."""
    import os
    import subprocess
    import sys
    code = PER_OP_ROWS.format(ops=OPS, repeats=REPEATS)
    figures = {tree: {row: [] for row in ROWS} for tree in trees}
    for turn in range(rounds):
        for tree in trees if turn % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=tree)
            done = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                                  text=True, check=True, cwd=tree)
            for row, value in zip(ROWS, done.stdout.split()[-len(ROWS):]):
                figures[tree][row].append(float(value))
    return figures


def print_comparison(trees, rounds):
    import os
    load = os.getloadavg()[0]
    figures = compare_trees(trees, rounds)
    print(f'load average (1 min): {load:.2f} before, {os.getloadavg()[0]:.2f} after')
    first = figures[trees[0]]
    print(f'x + 1 ({OPS} ops, median of {REPEATS} loops) and a decode step of speculative '
          f'decoding\'s target (median of 200), {rounds} alternations; ratio to {trees[0]} in '
          'the same alternation')
    for row in ROWS:
        print(f'{row}:')
        for tree, rows in figures.items():
            values = rows[row]
            ratios = sorted(v / base for v, base in zip(values, first[row]))
            print(f'  {tree}: ' + ', '.join(f'{v:.2f}' for v in values) +
                  f'; × first: median {ratios[len(ratios) // 2]:.3f} '
                  f'(range {ratios[0]:.3f}-{ratios[-1]:.3f})')


def main():
    import sys
    if sys.argv[1:2] == ['--compare']:       # python benchmarks/engine.py --compare OLD NEW [7]
        trees = [arg for arg in sys.argv[2:] if not arg.isdigit()]
        rounds = [int(arg) for arg in sys.argv[2:] if arg.isdigit()]
        print_comparison(trees, rounds=rounds[0] if rounds else 7)
        return
    if sys.argv[1:2] == ['--gpu']:           # python benchmarks/engine.py --gpu: its rows alone
        print_gpu_rows()
        return
    floor = numpy_floor()
    rows = [('NumPy, no engine (floor)', floor),
            ('thread round trip, queue to worker and back', thread_round_trip()),
            ('naive engine (synchronous, caller thread)', engine_tiny_ops('naive', False)),
            ('threaded engine, wait after every op', engine_tiny_ops('threaded', True)),
            ('  the same, helping waits off', engine_tiny_ops('threaded', True, False)),
            ('threaded engine, asynchronous', engine_tiny_ops('threaded', False)),
            ('PyTorch eager (1 thread)', torch_eager())]
    print(f'# {platform.processor() or platform.machine()}, {OPS} ops of x + 1 on a 1x2 array, '
          f'median of {REPEATS}')
    print(f'| {"what":46s} | µs/op | × NumPy |')
    print(f'|{"-" * 48}|------:|--------:|')
    for name, us in rows:
        if us is not None:
            print(f'| {name:46s} | {us:5.1f} | {us / floor:7.1f} |')
    per_op = dict(rows)
    naive, helped = per_op['naive engine (synchronous, caller thread)'], per_op[
        'threaded engine, wait after every op']
    print(f'\nwaiting after every op: {helped / naive:.1f}× the naive engine with helping '
          f'waits, {per_op["  the same, helping waits off"] / naive:.1f}× without')
    push, complete = bookkeeping_us()
    print(f'the threaded engine\'s own Python per operation, on one thread: push {push:.2f} µs, '
          f'execute + complete {complete:.2f} µs')
    push, run = calls_per_operation()
    print(f'Python calls per x + 1: push {push}, run, complete and wait {run}')
    collector, kept = garbage_collector_us()
    print(f'the memory counter per array: {memory_counter_us():.2f} µs; the garbage collector '
          f'in the asynchronous loop: {collector:.2f} µs per operation, {kept:.0f} objects '
          'kept per operation in flight')
    n, issued, finished = issue_over_finish()
    print(f'\nissuing 10 products of {n}x{n}: {issued * 1e3:.3f} ms; finishing them: '
          f'{finished * 1e3:.1f} ms; issue / finish = {100 * issued / finished:.2f}%')
    print_gpu_rows()


if __name__ == '__main__':
    main()
