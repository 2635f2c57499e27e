"""Microbenchmarks of the reader's own machine: memory, caches, CPU, storage and network.

The chapter "Hardware" (chapters/hardware.md) runs each function beside a figure from the
literature. Every function returns plain rows (a list of dicts) whose numeric columns name
their unit (`_bytes`, `_seconds`, `_ns`, `_gb_per_s`, ...). A timing is the median of
several repeats after one warm-up run; sizes come from `workload`, so `D2LPERF_QUICK=1`
shrinks them. The GPU measurements live in `d2lperf.hardware_gpu`.
"""
import collections
import gc
import glob
import itertools
import operator
import os
import platform
import subprocess

import numpy as np
import psutil
import threadpoolctl

from . import hardware_gpu
from .utils import median_seconds, workload

CACHE_LINE_BYTES = 64


def print_table(rows, digits=3):
    """Print rows (dicts with the same keys) as aligned columns."""
    if not rows:
        print('(empty table)')
        return
    def cell(value):
        return f'{value:.{digits}g}' if isinstance(value, float) else str(value)
    columns = list(rows[0])
    cells = [columns] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print('  '.join(text.rjust(width) for text, width in zip(line, widths)))


# --- What is in the box ------------------------------------------------------------------

def system_summary():
    """CPU model, cores, cache and memory sizes, BLAS library, and GPUs (empty without one)."""
    blas = [{'library': pool['internal_api'], 'threads': pool['num_threads'],
             'architecture': pool.get('architecture')}
            for pool in threadpoolctl.threadpool_info() if pool['user_api'] == 'blas']
    return {'cpu_model': _cpu_model(), 'physical_cores': psutil.cpu_count(logical=False),
            'logical_cpus': psutil.cpu_count(), 'caches_bytes': cache_sizes(),
            'memory_bytes': psutil.virtual_memory().total, 'blas': blas,
            'numpy': np.__version__, 'python': platform.python_version(),
            'gpus': hardware_gpu.gpu_summary()}


def _cpu_model():
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    return _sysctl('machdep.cpu.brand_string') or platform.processor() or platform.machine()


def _sysctl(name):
    """A macOS `sysctl` value as text, or None elsewhere."""
    try:
        return subprocess.run(['sysctl', '-n', name], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cache_sizes():
    """Cache sizes in bytes of the first CPU, e.g. {'L1d': 32768, 'L2': 524288, ...}."""
    sizes = {}
    root = '/sys/devices/system/cpu/cpu0/cache'
    for index in sorted(glob.glob(os.path.join(root, 'index[0-9]*'))):
        def read(name):
            with open(os.path.join(index, name)) as f:
                return f.read().strip()
        kind = {'Data': 'd', 'Instruction': 'i'}.get(read('type'), '')
        size = read('size')   # '32K', '1024K', '32M'
        scale = 1024 ** ('KMG'.index(size[-1]) + 1) if size[-1] in 'KMG' else 1
        sizes[f'L{read("level")}{kind}'] = int(size.rstrip('KMG')) * scale
    if not sizes:   # macOS
        for name, key in (('L1d', 'hw.l1dcachesize'), ('L2', 'hw.l2cachesize'),
                          ('L3', 'hw.l3cachesize')):
            value = _sysctl(key)
            if value and value.isdigit() and int(value) > 0:
                sizes[name] = int(value)
    return sizes


# --- Memory bandwidth --------------------------------------------------------------------

STREAM_BYTES_PER_ELEMENT = {'copy': 16, 'triad': 24}   # counted as STREAM counts them
STREAM_ARRAYS = {'copy': 2, 'triad': 3}
TRIAD_BLOCK = 2 ** 15   # elements: the block's scratch array stays in L2


def stream_kernel(name, n):
    """`(run, a)`: one STREAM kernel over float64 arrays of n elements, and its output a.

    copy is `a = b`; triad is `a = b + 3 c`, run block by block so that the intermediate
    `3 c` lives in a cache-sized scratch array and never travels to memory."""
    a, b, c = np.zeros(n), np.ones(n), np.full(n, 2.0)
    if name == 'copy':
        return (lambda: np.copyto(a, b)), a
    scratch = np.empty(min(n, TRIAD_BLOCK))

    def triad():
        for start in range(0, n, TRIAD_BLOCK):
            stop = min(start + TRIAD_BLOCK, n)
            part = scratch[:stop - start]
            np.multiply(c[start:stop], 3.0, out=part)
            np.add(b[start:stop], part, out=a[start:stop])
    return triad, a


def memory_bandwidth(working_sets_bytes=None, repeats=5):
    """GB/s of copy and triad for each working set (all arrays together), in bytes read +
    written; the extra read that a cached store may cost (write-allocate) is not counted."""
    if working_sets_bytes is None:
        working_sets_bytes = [2 ** k for k in range(16, workload(31, 27), 2)]
    rows = []
    for size in working_sets_bytes:
        for name, arrays in STREAM_ARRAYS.items():
            n = max(size // (8 * arrays), 1)
            run, _ = stream_kernel(name, n)
            seconds = median_seconds(run, repeats)
            moved = STREAM_BYTES_PER_ELEMENT[name] * n
            rows.append({'kernel': name, 'working_set_bytes': 8 * arrays * n,
                         'bytes_counted': moved, 'seconds': seconds,
                         'gb_per_s': moved / seconds / 1e9})
    return rows


# --- Latency: a dependent pointer chase ----------------------------------------------------

class ChaseNode:
    """One element of the chase: all it holds is a reference to the next element."""
    __slots__ = ('next',)


def chase_cycle(n, seed=0):
    """n nodes, allocated side by side, linked into one cycle in random order."""
    was_enabled = gc.isenabled()
    gc.disable()   # millions of new objects would otherwise trigger needless collections
    try:
        nodes = [ChaseNode() for _ in range(n)]
        visit = [nodes[i] for i in np.random.default_rng(seed).permutation(n)]
        collections.deque(map(setattr, visit, itertools.repeat('next'),
                              visit[1:] + visit[:1]), maxlen=0)
    finally:
        if was_enabled:
            gc.enable()
    return nodes


HOP = 1024
_follow_hop = operator.attrgetter('.'.join(['next'] * HOP))   # 'next.next. ... .next'


def walk(node, steps):
    """Follow `.next` `steps` times; returns the node reached.

    Each step reads the address of the next node from the node just loaded, so no load can
    start before the previous one has finished: the time per step is a latency. A dotted
    `operator.attrgetter` follows HOP links per call inside C, keeping the interpreter's
    share of each step small."""
    for _ in range(steps // HOP):
        node = _follow_hop(node)
    for _ in range(steps % HOP):
        node = node.next
    return node


def unlink(nodes):
    """Break the cycle so that the nodes are freed at once, without the cycle collector."""
    collections.deque(map(setattr, nodes, itertools.repeat('next'),
                          itertools.repeat(None)), maxlen=0)


def bytes_per_node(nodes):
    """The allocator's stride between consecutive nodes (CPython's id is an address)."""
    addresses = np.sort(np.array([id(node) for node in nodes[:4096]], dtype=np.int64))
    return int(np.median(np.diff(addresses))) if len(nodes) > 1 else 64


def pointer_chase(working_sets_bytes=None, steps=None, repeats=3):
    """Nanoseconds per step of a random dependent walk over working sets of growing size.

    A step costs one load's latency plus roughly 15 ns of CPython work (the attribute
    lookup), part of which overlaps with the load. Hits in L1 and L2 (a few ns) hide under
    that floor; the rise past L2 and the step to main memory stand out above it."""
    if working_sets_bytes is None:
        working_sets_bytes = [2 ** k for k in range(12, workload(30, 27), workload(1, 2))]
    steps = steps or workload(2 ** 18, 2 ** 16)
    probe = chase_cycle(1024)
    stride = bytes_per_node(probe)
    unlink(probe)
    rows = []
    for size in working_sets_bytes:
        nodes = chase_cycle(max(size // stride, 2))
        where = [nodes[0]]   # each call walks on from where the last one stopped

        def walk_on():
            where[0] = walk(where[0], steps)
        seconds = median_seconds(walk_on, repeats)
        rows.append({'working_set_bytes': len(nodes) * stride, 'nodes': len(nodes),
                     'steps': steps, 'ns_per_access': seconds / steps * 1e9})
        unlink(nodes)
    return rows


# --- Burst reads versus scattered reads -----------------------------------------------------

def read_orders(n, seed=0):
    """Index arrays that read each of n elements once: in order, and in a random order."""
    return {'sequential': np.arange(n), 'random': np.random.default_rng(seed).permutation(n)}


def read_patterns(working_sets_bytes=None, repeats=3):
    """ns per float64 read by `np.take`, in sequential and in random order.

    The same C loop runs for both orders; only the addresses differ. The index and output
    arrays stream sequentially in both cases (16 bytes per read, not counted)."""
    if working_sets_bytes is None:
        working_sets_bytes = [2 ** k for k in range(16, workload(30, 27), 2)]
    rows = []
    for size in working_sets_bytes:
        data = np.arange(size // 8, dtype=np.float64)
        for order, index in read_orders(len(data)).items():
            out = np.empty(len(index))
            seconds = median_seconds(lambda: np.take(data, index, out=out), repeats)
            rows.append({'order': order, 'working_set_bytes': data.nbytes,
                         'reads': len(index), 'ns_per_read': seconds / len(index) * 1e9,
                         'useful_gb_per_s': 8 * len(index) / seconds / 1e9})
    return rows


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
    a, b = np.random.default_rng(0).random((2, n, n))
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
    rng = np.random.default_rng(0)
    rows = []
    for dtype in dtypes:
        for n in sizes:
            a, b = rng.random((2, n, n)).astype(dtype)
            out = np.empty((n, n), dtype)
            seconds = median_seconds(lambda: np.matmul(a, b, out=out), repeats)
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
        a, b, c = np.full(n, 1.5), np.full(n, 2.5), np.empty(n)
        return (lambda: np.add(a, b, out=c)) if kernel == 'vector add' else (lambda: a @ b)
    matrix = rng.random((n, n))
    other = rng.random(n) if kernel == 'matvec' else rng.random((n, n))
    out = np.empty(other.shape)
    return lambda: np.matmul(matrix, other, out=out)


def roofline_kernels(sizes=None, repeats=3):
    """Measured GFLOP/s and arithmetic intensity (FLOP per byte) of five float64 kernels,
    at sizes whose data (but for matmul's) are far larger than the caches."""
    vector = workload(2 ** 25, 2 ** 23)
    sizes = sizes or {'vector add': vector, 'triad': vector, 'dot': vector,
                      'matvec': workload(8192, 4096), 'matmul': workload(2048, 512)}
    rng = np.random.default_rng(0)
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
    return np.minimum(peak_gflop_per_s, bandwidth_gb_per_s * np.asarray(flop_per_byte))


def predict_seconds(flops, moved_bytes, peak_gflop_per_s, bandwidth_gb_per_s):
    """Paper estimate of one kernel: its arithmetic or its memory traffic, whichever is slower."""
    return max(flops / (peak_gflop_per_s * 1e9), moved_bytes / (bandwidth_gb_per_s * 1e9))
