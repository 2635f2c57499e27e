"""Hypothesis strategies for communication: batches to split, arrays to allreduce."""
import math

import numpy
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import d2lperf as d2l

DEVICES = [d2l.cpu(i) for i in range(4)]

device_counts = st.integers(1, len(DEVICES))
weight_lists = st.lists(st.integers(1, 5), min_size=1, max_size=len(DEVICES))


@st.composite
def batches_to_split(draw):
    """(number of examples, devices): at least one example a device."""
    devices = DEVICES[:draw(device_counts)]
    return draw(st.integers(len(devices), 4 * len(devices) + 3)), devices


@st.composite
def work_loads(draw):
    """(number of examples, weights): every share at least 3, so rounding empties no device."""
    weights = draw(weight_lists)
    return draw(st.integers(math.ceil(3 * sum(weights) / min(weights)), 90)), weights


@st.composite
def exact_work_loads(draw):
    """(number of examples, weights) whose proportional shares are whole numbers."""
    weights = draw(weight_lists)
    return draw(st.integers(1, 6)) * sum(weights), weights


@st.composite
def arrays_to_reduce(draw):
    """Float32 host arrays of one shape, one a device (2 to 4 devices)."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=4))
    elements = st.floats(-100, 100, width=32)
    return [draw(hnp.arrays(numpy.float32, shape, elements=elements))
            for _ in range(draw(st.integers(2, len(DEVICES))))]


ALGORITHMS = ('naive', 'cpu', 'split', 'tree', 'ring', 'ring2')
REDUCTION_OPS = ('sum', 'max', 'min', 'prod')
MAX_DEVICES = 8


@st.composite
def allreduce_cases(draw):
    """(host arrays, one a device, 1 to 8 of them; algorithm; op): sizes that do not divide by
    the device count, and empty ones, included. Products stay near 1 so that nothing overflows."""
    count = draw(st.integers(1, MAX_DEVICES))
    op = draw(st.sampled_from(REDUCTION_OPS))
    dtype = numpy.dtype(draw(st.sampled_from(['float32', 'float64'])))
    shape = draw(st.one_of(st.tuples(st.integers(0, 3 * MAX_DEVICES + 1)),
                           hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
    low, high = (0.5, 2.0) if op == 'prod' else (-100.0, 100.0)
    elements = st.floats(low, high, width=dtype.itemsize * 8)
    arrays = [draw(hnp.arrays(dtype, shape, elements=elements)) for _ in range(count)]
    return arrays, draw(st.sampled_from(ALGORITHMS)), op


@st.composite
def gradient_groups(draw):
    """Groups of float32 host arrays to sum over 2 to 4 devices: `groups[i][d][k]` is device
    d's array k of group i; array k has one shape on every device, and a group one array or
    several."""
    count = draw(st.integers(2, len(DEVICES)))
    elements = st.floats(-100, 100, width=32)
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        shapes = draw(st.lists(hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
                               min_size=1, max_size=4))
        groups.append([[draw(hnp.arrays(numpy.float32, shape, elements=elements))
                        for shape in shapes] for _ in range(count)])
    return groups


@st.composite
def context_parallel_problems(draw):
    """(shape (batch, heads, seq, d), devices, layout, algorithm, causal) for attention with
    the sequence split over 2, 4 or 8 devices: seq a multiple of its chunks (2c for the
    zig-zag)."""
    devices = draw(st.sampled_from([2, 4, 8]))
    layout = draw(st.sampled_from(['zigzag', 'contiguous']))
    chunks = 2 * devices if layout == 'zigzag' else devices
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)),
             chunks * draw(st.integers(1, 3)), draw(st.integers(1, 6)))
    return (shape, [d2l.cpu(i) for i in range(devices)], layout,
            draw(st.sampled_from(['ring', 'all_gather'])), draw(st.booleans()))
