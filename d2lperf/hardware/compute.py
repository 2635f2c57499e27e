"""Arithmetic on the reader's CPU: vectorization, BLAS matrix multiply, and the roofline.

The same matrix product in Python loops, in NumPy without BLAS and with it; GFLOP/s against
size and precision; BLAS threads, which pay only above a size and cost dearly when a core is
taken; five kernels placed against the roofline of this machine's peak and bandwidth, and a
paper estimate of a kernel from its operations and its bytes. Taught in "Hardware".
"""
import contextlib
import subprocess
import sys
import time

import numpy
import threadpoolctl

from ..utils import median_seconds, workload
from .memory_hierarchy import stream_kernel


# --- Arithmetic: vectorization, matrix multiply, roofline ---------------------------------

def matmul_flops_count(n):
    """Exact operations of an n x n matrix product: n^2 sums of n products (n-1 adds)."""
    return n * n * (2 * n - 1)


def matmul_python(a, b):
    """Matrix product of nested lists, one multiply-add at a time in the interpreter."""
    columns = list(zip(*b))
    return [[sum(x * y for x, y in zip(row, column)) for column in columns] for row in a]


def matmul_broadcast(a, b):
    """Matrix product as NumPy elementwise products and a sum: vectorized, but no BLAS."""
    return (a[:, :, None] * b[None, :, :]).sum(axis=1)


def vectorization(n=None, repeats=3):
    """GFLOP/s of one n x n float64 matrix product done three ways."""
    n = n or workload(128, 48)
    a, b = numpy.random.default_rng(0).random((2, n, n))
    lists = a.tolist(), b.tolist()
    ways = {'Python loops': lambda: matmul_python(*lists),
            'NumPy, no BLAS': lambda: matmul_broadcast(a, b),
            'NumPy @ (BLAS)': lambda: a @ b}
    flops = matmul_flops_count(n)
    rows = []
    for way, run in ways.items():
        seconds = median_seconds(run, repeats)
        rows.append({'method': way, 'n': n, 'flops': flops, 'seconds': seconds,
                     'gflop_per_s': flops / seconds / 1e9})
    return rows


def matmul_flops(sizes=None, dtypes=('float32', 'float64'), repeats=3):
    """GFLOP/s of BLAS matrix multiply (`a @ b`) for square matrices of growing size."""
    sizes = sizes or [2 ** k for k in range(6, workload(12, 10) + 1)]
    rng = numpy.random.default_rng(0)
    rows = []
    for dtype in dtypes:
        for n in sizes:
            a, b = rng.random((2, n, n)).astype(dtype)
            out = numpy.empty((n, n), dtype)
            seconds = median_seconds(lambda: numpy.matmul(a, b, out=out), repeats)
            rows.append({'dtype': dtype, 'n': n, 'flops': matmul_flops_count(n),
                         'seconds': seconds,
                         'gflop_per_s': matmul_flops_count(n) / seconds / 1e9})
    return rows


# --- BLAS threads: when they pay, and what a busy core does to them ----------------------

def blas_threads():
    """The BLAS thread count the process started with (1 where no BLAS library is found): the
    count in force may be lower, where the engine fitted it to the cores others leave free."""
    from .. import engine
    cores = getattr(engine.current(), 'workers', None)
    if cores is not None and cores.cores.limit is not None:
        return cores.cores.limit
    return max([pool['num_threads'] for pool in threadpoolctl.threadpool_info()
                if pool['user_api'] == 'blas'], default=1)


@contextlib.contextmanager
def blas_thread_count(threads):
    """BLAS on `threads` threads meanwhile, set through OpenBLAS itself: a microsecond, where
    threadpoolctl's context takes a millisecond, longer than a small product."""
    from ..engine.blas import openblas_thread_controls
    controls = openblas_thread_controls()
    before = [control.get_num_threads() for control in controls]
    for control in controls:
        control.set_num_threads(threads)
    try:
        yield
    finally:
        for control, count in zip(controls, before):
            control.set_num_threads(count)


def _products(a, count, threads):
    def run():
        with blas_thread_count(threads):
            for _ in range(count):
                a @ a
    return run


def threads_by_size(sizes=None, repeats=5):
    """Seconds of one n x n float32 product on one BLAS thread and on every thread, by size."""
    sizes = sizes or [64, 96, 128, 192, 256, workload(512, 384)]
    threads, rng, rows = blas_threads(), numpy.random.default_rng(0), []
    for n in sizes:
        a = rng.random((n, n), dtype=numpy.float32)
        count = max(1, int(1e8 / n ** 3))             # about 2 ms of work a run
        times = median_seconds({1: _products(a, count, 1),
                                threads: _products(a, count, threads)}, repeats)
        rows.append({'n': n, 'one_thread_seconds': times[1] / count,
                     'every_thread_seconds': times[threads] / count, 'threads': threads})
    return rows


@contextlib.contextmanager
def busy_core():
    """Another process keeps one core busy meanwhile, as a browser tab or a build would."""
    busy = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    try:
        yield busy
    finally:
        busy.kill()
        busy.wait()


def products_under_load(n=300, products=None, repeats=5):
    """Seconds of `products` n x n float32 products, with the cores as found and with one more
    kept busy by another process: plain NumPy on one BLAS thread and on every thread, and
    d2lperf's `np.dot`, whose threads fit the cores other programs leave
    (`engine.blas.threads_that_fit`). `others_cores`: the cores other programs kept busy."""
    from .. import np
    from ..np import extension as npx
    from .machine import cpu_times, load_by_others
    products = products or workload(300, 100)
    threads, a = blas_threads(), numpy.random.default_rng(0).random((n, n), dtype=numpy.float32)
    x = np.array(a)
    def fitted():
        for _ in range(products):
            np.dot(x, x)
        npx.waitall()
    rows = []
    for load in ('as found', 'one more core busy'):
        with busy_core() if load != 'as found' else contextlib.nullcontext():
            warm_until = time.perf_counter() + 1.0     # the package reads the load every 0.2 s
            while time.perf_counter() < warm_until:
                fitted()
            before = cpu_times()
            times = median_seconds({'one': _products(a, products, 1), 'd2lperf': fitted},
                                   repeats, min_seconds=0)
            others = load_by_others(before, cpu_times())
            # Every thread last and apart: with a core taken, the scheduler needs a while to
            # settle the threads after such a run, which would slow whatever ran next.
            times['every'] = median_seconds(_products(a, products, threads), repeats,
                                            min_seconds=0)
        rows.append({'load': load, 'others_cores': others, 'n': n, 'products': products,
                     'threads': threads, 'one_thread_seconds': times['one'],
                     'every_thread_seconds': times['every'],
                     'd2lperf_seconds': times['d2lperf']})
    return rows


def kernel_counts(kernel, n, itemsize=8):
    """(FLOPs, bytes) a kernel cannot do without: each input read once, each output written
    once, nothing counted twice. Size n is the vector length or the matrix order."""
    flops, words = {
        'vector add': (n, 3 * n),                           # c = a + b
        'triad': (2 * n, 3 * n),                            # a = b + s c
        'dot': (2 * n - 1, 2 * n),                          # s = a . b
        'matvec': (n * (2 * n - 1), n * n + 2 * n),         # y = A x
        'matmul': (matmul_flops_count(n), 3 * n * n),       # C = A B
    }[kernel]
    return flops, words * itemsize


def _kernel_runner(kernel, n, rng):
    if kernel == 'triad':
        return stream_kernel('triad', n)[0]
    if kernel in ('vector add', 'dot'):
        a, b, c = numpy.full(n, 1.5), numpy.full(n, 2.5), numpy.empty(n)
        return (lambda: numpy.add(a, b, out=c)) if kernel == 'vector add' else (lambda: a @ b)
    matrix = rng.random((n, n))
    other = rng.random(n) if kernel == 'matvec' else rng.random((n, n))
    out = numpy.empty(other.shape)
    return lambda: numpy.matmul(matrix, other, out=out)


def roofline_kernels(sizes=None, repeats=3):
    """Measured GFLOP/s and arithmetic intensity (FLOP per byte) of five float64 kernels,
    at sizes whose data (but for matmul's) are far larger than the caches."""
    vector = workload(2 ** 25, 2 ** 23)
    sizes = sizes or {'vector add': vector, 'triad': vector, 'dot': vector,
                      'matvec': workload(8192, 4096), 'matmul': workload(2048, 512)}
    rng = numpy.random.default_rng(0)
    rows = []
    for kernel, n in sizes.items():
        flops, moved = kernel_counts(kernel, n)
        seconds = median_seconds(_kernel_runner(kernel, n, rng), repeats)
        rows.append({'kernel': kernel, 'n': n, 'flops': flops, 'bytes': moved,
                     'flop_per_byte': flops / moved, 'seconds': seconds,
                     'gflop_per_s': flops / seconds / 1e9})
    return rows


def roofline_bound(flop_per_byte, peak_gflop_per_s, bandwidth_gb_per_s):
    """The roofline: attainable GFLOP/s at a given arithmetic intensity."""
    return numpy.minimum(peak_gflop_per_s, bandwidth_gb_per_s * numpy.asarray(flop_per_byte))


def predict_seconds(flops, moved_bytes, peak_gflop_per_s, bandwidth_gb_per_s):
    """Paper estimate of one kernel: its arithmetic or its memory traffic, whichever is slower."""
    return max(flops / (peak_gflop_per_s * 1e9), moved_bytes / (bandwidth_gb_per_s * 1e9))
