"""Arithmetic on the reader's CPU: vectorization, BLAS matrix multiply, and the roofline.

The same matrix product in Python loops, in NumPy without BLAS and with it; GFLOP/s against
size and precision; five kernels placed against the roofline of this machine's peak and
bandwidth, and a paper estimate of a kernel from its operations and its bytes. Taught in
"Hardware".
"""
import numpy

from ..utils import median_seconds, workload
from .memory import stream_kernel


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
