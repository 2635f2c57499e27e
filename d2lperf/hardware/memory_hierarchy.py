"""The memory hierarchy of the reader's machine: bandwidth, latency, and the order of reads.

Streams over growing working sets show each cache level and main memory; a dependent pointer
chase shows the latency a prefetcher cannot hide; sequential against scattered reads show why
a cache line arrives whole. Taught in "Hardware".
"""
import collections
import gc
import itertools
import operator

import numpy

from ..utils import median_seconds, workload


CACHE_LINE_BYTES = 64


# --- Memory bandwidth --------------------------------------------------------------------

STREAM_BYTES_PER_ELEMENT = {'copy': 16, 'triad': 24}   # counted as STREAM counts them


STREAM_ARRAYS = {'copy': 2, 'triad': 3}


TRIAD_BLOCK = 2 ** 15   # elements: the block's scratch array stays in L2


def stream_kernel(name, n):
    """`(run, a)`: one STREAM kernel over float64 arrays of n elements, and its output a.

    copy is `a = b`; triad is `a = b + 3 c`, run block by block so that the intermediate
    `3 c` lives in a cache-sized scratch array and never travels to memory."""
    a, b, c = numpy.zeros(n), numpy.ones(n), numpy.full(n, 2.0)
    if name == 'copy':
        return (lambda: numpy.copyto(a, b)), a
    scratch = numpy.empty(min(n, TRIAD_BLOCK))

    def triad():
        for start in range(0, n, TRIAD_BLOCK):
            stop = min(start + TRIAD_BLOCK, n)
            part = scratch[:stop - start]
            numpy.multiply(c[start:stop], 3.0, out=part)
            numpy.add(b[start:stop], part, out=a[start:stop])
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
        visit = [nodes[i] for i in numpy.random.default_rng(seed).permutation(n)]
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
    addresses = numpy.sort(numpy.array([id(node) for node in nodes[:4096]], dtype=numpy.int64))
    return int(numpy.median(numpy.diff(addresses))) if len(nodes) > 1 else 64


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
    return {'sequential': numpy.arange(n), 'random': numpy.random.default_rng(seed).permutation(n)}


def read_patterns(working_sets_bytes=None, repeats=3):
    """ns per float64 read by `numpy.take`, in sequential and in random order.

    The same C loop runs for both orders; only the addresses differ. The index and output
    arrays stream sequentially in both cases (16 bytes per read, not counted)."""
    if working_sets_bytes is None:
        working_sets_bytes = [2 ** k for k in range(16, workload(30, 27), 2)]
    rows = []
    for size in working_sets_bytes:
        data = numpy.arange(size // 8, dtype=numpy.float64)
        for order, index in read_orders(len(data)).items():
            out = numpy.empty(len(index))
            seconds = median_seconds(lambda: numpy.take(data, index, out=out), repeats)
            rows.append({'order': order, 'working_set_bytes': data.nbytes,
                         'reads': len(index), 'ns_per_read': seconds / len(index) * 1e9,
                         'useful_gb_per_s': 8 * len(index) / seconds / 1e9})
    return rows
