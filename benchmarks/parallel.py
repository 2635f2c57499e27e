"""Automatic parallelism, measured side by side in one run: one table.

    python benchmarks/parallel.py            # full sizes
    D2LPERF_QUICK=1 python benchmarks/parallel.py

Two independent workloads on two devices, each alone and both together (no barrier between
them): `together / slower alone` is 1.0 when the devices really run side by side, 2.0 when
they take turns. Then computation on one device whose results are copied to another:
compute alone, copy alone, both; `both / max` is 1.0 when the copies hide behind the
computation. Every figure is the median of several interleaved repeats, so that a burst of
load from another process hurts all rows alike rather than one.

Rows (pairs `cpu(0)` + `cpu(1)` always; `cpu(0)` + `gpu(0)` and `gpu(0)` → `cpu(0)` with a GPU):
* matmul: 10 products of n × n float32 matrices; BLAS uses every core for one product, so
  two virtual CPU devices on the same cores can at best take turns. Run twice: each device's
  products with every BLAS thread (the default), and with the engine dividing the threads
  among the busy CPU devices (`engine.set_blas_division(True)`).
* elementwise: 10 `tanh` of a large vector; NumPy runs these on one core, so a second
  virtual CPU device has a core of its own to use.
* small elementwise: 300 `tanh` of a 300 × 300 and of a 600 × 600 matrix (about 25 and 100 µs
  each), where the engine's own Python work per operation, which holds the interpreter lock,
  is no longer small beside the operation; beside them, the same `tanh` loop on two plain
  Python threads (no engine), the floor of any design written in Python.

A second table: a strided copy of 1 to 40 MB, whole and cut in two pieces run at once
(`engine.pieces`): where cutting an operation starts to pay on this machine.

A third table: the same 300 × 300 float32 product repeated, as plain NumPy on one BLAS thread
and on every thread, and through the package, whose BLAS threads fit the cores other programs
leave free (`engine.blas.threads_that_fit`), first on an idle machine, then while another
process keeps one core busy.
"""
import os
import platform
import threading

# d2lperf before NumPy, as the chapters: OpenBLAS then loads with its brief spin
# (engine/blas.py, spin_briefly), which the rows measured so far ran with.
import d2lperf as d2l
import numpy

from d2lperf import engine, hardware, np, npx
from d2lperf.engine import pieces
from d2lperf.utils import median_seconds

REPEATS = d2l.workload(7, 5)
N = d2l.workload(1000, 500)
GPU_N = 4000
VECTOR = d2l.workload(4_000_000, 1_000_000)


def matmuls(x):
    return [np.dot(x, x) for _ in range(10)]


def elementwise(x):
    return [np.tanh(x) for _ in range(10)]


def small_elementwise(x, count=300):
    """Results dropped as they come, as in a loop that keeps only the last one: 300 kept
    would measure the allocator more than the engine."""
    for _ in range(count):
        np.tanh(x)


def numpy_threads(n, count=300):
    """The same tanh loop on one and on two plain Python threads: (one, one, both, ratio)."""
    a = numpy.random.default_rng(0).uniform(size=(n, n)).astype(numpy.float32)

    def loop():
        for _ in range(count):
            numpy.tanh(a)

    def two_threads():
        threads = [threading.Thread(target=loop) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    times = median_seconds({'one': loop, 'both': two_threads}, REPEATS, min_seconds=0)
    return times['one'], times['one'], times['both'], times['both'] / times['one']


def copy_all(ys, device):
    return [y.copyto(device) for y in ys]


def until_done(fn):
    return lambda: (fn(), npx.waitall())


def median_times(cases, repeats=REPEATS):
    """{name: median wall time} of each `fn()`, run until done, interleaved over repeats."""
    return median_seconds({name: until_done(fn) for name, fn in cases.items()}, repeats,
                          min_seconds=0)


def side_by_side(work, x, y):
    """Alone on x's device, alone on y's, and both pushed without a barrier between."""
    times = median_times({'a': lambda: work(x), 'b': lambda: work(y),
                          'both': lambda: (work(x), work(y))})
    return times['a'], times['b'], times['both'], times['both'] / max(times['a'], times['b'])


def compute_and_copy(x, target):
    """Compute on x's device, copy the results to `target`: apart and together."""
    ys = matmuls(x)
    npx.waitall()
    times = median_times({'compute': lambda: matmuls(x), 'copy': lambda: copy_all(ys, target),
                          'both': lambda: copy_all(matmuls(x), target)})
    return times['compute'], times['copy'], times['both'], times['both'] / max(
        times['compute'], times['copy'])


def rows():
    cpu0, cpu1 = d2l.cpu(0), d2l.cpu(1)
    a = np.random.uniform(size=(N, N), device=cpu0)
    b = np.random.uniform(size=(N, N), device=cpu1)
    u = np.random.uniform(size=(VECTOR,), device=cpu0)
    v = np.random.uniform(size=(VECTOR,), device=cpu1)
    yield ('two devices', f'matmul {N}², cpu(0) + cpu(1), all BLAS threads each (default)',
           *side_by_side(matmuls, a, b))
    old = engine.set_blas_division(True)
    yield ('two devices', f'matmul {N}², cpu(0) + cpu(1), BLAS threads divided',
           *side_by_side(matmuls, a, b))
    engine.set_blas_division(old)
    yield ('two devices', f'tanh {VECTOR:,}, cpu(0) + cpu(1)', *side_by_side(elementwise, u, v))
    for n in (300, 600):
        x, y = (np.random.uniform(size=(n, n), device=d) for d in (cpu0, cpu1))
        yield ('two devices', f'tanh {n}² × 300, cpu(0) + cpu(1)',
               *side_by_side(small_elementwise, x, y))
        yield ('two NumPy threads', f'tanh {n}² × 300, no engine', *numpy_threads(n))
    yield ('compute + copy', f'matmul {N}² on cpu(0), copy to cpu(1)', *compute_and_copy(a, cpu1))
    if d2l.num_gpus():
        g = np.random.uniform(size=(GPU_N, GPU_N), device=d2l.gpu(0))
        yield ('two devices', f'matmul {N}² on cpu(0) + {GPU_N}² on gpu(0)',
               *side_by_side(matmuls, a, g))
        yield ('compute + copy', f'matmul {GPU_N}² on gpu(0), copy to cpu(0)',
               *compute_and_copy(g, cpu0))


def pieces_rows(sizes_mb=(1, 2, 4, 8, 16, 40)):
    """A strided copy (im2col's kind: every other float of a wider array) whole and cut in two
    pieces (`engine.pieces`), by size: where cutting starts to pay on this machine."""
    for mb in sizes_mb:
        count = int(mb * 2**20 / 4)
        wide = numpy.random.default_rng(0).uniform(size=(64, 2 * count // 64)).astype(
            numpy.float32)
        source = wide[:, ::2]
        target = numpy.empty(source.shape, numpy.float32)

        def copy(start, stop):
            target[start:stop] = source[start:stop]
        times = median_seconds({'whole': lambda: pieces.run(copy, 64, 1),
                                'two': lambda: pieces.run(copy, 64, 2)}, 15, min_seconds=0)
        yield mb, times['whole'], times['two']


def report_other_load(run, prefix=''):
    """Run `run()`, then print how many cores other processes kept busy meanwhile."""
    before = hardware.cpu_times()
    result = run()
    after = hardware.cpu_times()
    print(f'{prefix}other processes kept {hardware.load_by_others(before, after):.2f} cores busy '
          f'on average during the {after.wall_seconds - before.wall_seconds:.0f} s of this run '
          '(0.00: an idle machine)')
    return result


def main():
    print(f'# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
          f'{d2l.num_gpus()} GPUs; median of {REPEATS} interleaved repeats, seconds')
    print('| experiment | workload | first alone | second alone | together | ratio |')
    print('|---|---|--:|--:|--:|--:|')
    def table():
        for kind, workload, first, second, both, ratio in rows():
            print(f'| {kind} | {workload} | {first:.4f} | {second:.4f} | {both:.4f} | '
                  f'{ratio:.2f} |')
        print('\nratio: two devices = together / slower alone; compute + copy = both / '
              'max(compute, copy) (first alone = compute, second alone = copy)')
    report_other_load(table)

    print('\n# Pieces: a strided copy whole and cut in two (`engine.pieces`), median of 15; '
          f'operations from {pieces.SPLIT_BYTES >> 20} MB are cut')
    print('| MB | whole, µs | two pieces, µs | two ÷ whole |\n|--:|--:|--:|--:|')
    for mb, whole, two in pieces_rows():
        print(f'| {mb} | {whole * 1e6:.0f} | {two * 1e6:.0f} | {two / whole:.2f} |')

    print('\n# BLAS threads that fit the free cores: the same products as plain NumPy and '
          'through d2lperf, idle and while another process keeps one core busy; seconds')
    print('| load | products | NumPy, 1 thread | NumPy, every thread | d2lperf (fitted) | '
          'd2lperf ÷ 1 thread | d2lperf ÷ every thread |')
    print('|---|---|--:|--:|--:|--:|--:|')
    for row in hardware.compute.products_under_load(repeats=REPEATS):
        one, every, fitted = (row[k] for k in ('one_thread_seconds', 'every_thread_seconds',
                                               'd2lperf_seconds'))
        print(f"| {row['load']} | {row['products']} × {row['n']}² float32 | {one:.4f} | "
              f"{every:.4f} ({row['threads']}) | {fitted:.4f} | {fitted / one:.2f} | "
              f"{fitted / every:.2f} |")


if __name__ == '__main__':
    main()
