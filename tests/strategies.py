"""Hypothesis strategies shared by the tests of d2lperf's core.

Two families: *operation cases* (inputs and attributes for every op in `ops.REGISTRY`,
with NumPy arrays and Python scalars as inputs) and *programs* (lists of instructions over a
few named arrays spread over devices, run once by d2lperf and once by NumPy, to check the
engine's ordering on one device and across several).
"""
import math

import numpy
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.extra import numpy as hnp

from d2lperf import np

DTYPES = ('float32', 'float64', 'int32')


def checks(max_examples):
    """Settings for a property test: few examples (the suite runs on 2 cores), no deadline
    (the engine's threads make timings noisy), and fixtures that switch engines allowed."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
SCALARS = st.sampled_from([2, 3, 0.5, 2.5])          # Python int and float, weakly typed


def host(shape, dtype):
    """Small positive values (1, 2, 3, ...): every op is defined on them, int powers included."""
    return ((numpy.arange(math.prod(shape)) % 3) + 1).reshape(shape).astype(dtype)


def shapes(min_dims=0, max_dims=3, min_side=1, max_side=3):
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side,
                            max_side=max_side)


dtypes = st.sampled_from(DTYPES)


@st.composite
def operands(draw, shape, allow_scalar=True):
    """An array of `shape` in one of DTYPES, or sometimes a Python scalar instead."""
    if allow_scalar and draw(st.integers(0, 3)) == 0:
        return draw(SCALARS)
    return host(shape, draw(dtypes))


# -- one strategy of (inputs, attrs) per operation ------------------------------------------

@st.composite
def binary_cases(draw):
    pair = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3))
    a, b = (draw(operands(s)) for s in pair.input_shapes)
    if not hasattr(a, 'shape') and not hasattr(b, 'shape'):
        a = host(pair.input_shapes[0], draw(dtypes))
    return (a, b), {}


@st.composite
def unary_cases(draw, min_dims=0):
    return (host(draw(shapes(min_dims=min_dims)), draw(dtypes)),), {}


@st.composite
def axes(draw, ndim, allow_tuple=True):
    """None, one axis or (if allowed) a tuple of distinct axes, each maybe negative."""
    choices = [st.none()]
    if ndim:
        choices.append(st.integers(-ndim, ndim - 1))
        if allow_tuple:
            picked = st.lists(st.integers(0, ndim - 1), unique=True, min_size=1, max_size=ndim)
            choices.append(picked.map(lambda axs: tuple(a - ndim if a % 2 else a for a in axs)))
    return draw(st.one_of(choices))


@st.composite
def reduction_cases(draw, keepdims=True, allow_tuple=True):
    a = host(draw(shapes()), draw(dtypes))
    attrs = {'axis': draw(axes(a.ndim, allow_tuple))}
    if keepdims:
        attrs['keepdims'] = draw(st.booleans())
    return (a,), attrs


@st.composite
def reshape_cases(draw):
    shape = draw(shapes())
    size = math.prod(shape)
    new = draw(st.sampled_from([(size,), (-1,), shape[::-1], (1, size), (size, 1, -1)]))
    return (host(shape, draw(dtypes)),), {'shape': new}


@st.composite
def transpose_cases(draw):
    a = host(draw(shapes()), draw(dtypes))
    perm = draw(st.none() | st.permutations(range(a.ndim)).map(
        lambda p: tuple(x - a.ndim if i % 2 else x for i, x in enumerate(p))))
    return (a,), {'axes': perm}


@st.composite
def broadcast_to_cases(draw):
    target = draw(shapes(min_side=1))
    lead = draw(st.integers(0, len(target)))             # dropped leading axes, some sides 1
    shape = tuple(1 if draw(st.booleans()) else n for n in target[lead:])
    return (host(shape, draw(dtypes)),), {'shape': target}


@st.composite
def astype_cases(draw):
    return (host(draw(shapes()), draw(dtypes)),), {'dtype': draw(st.sampled_from(DTYPES))}


@st.composite
def getitem_cases(draw):
    a = host(draw(shapes(min_dims=1)), draw(dtypes))
    key = draw(hnp.basic_indices(a.shape, allow_newaxis=True, allow_ellipsis=True))
    return (a,), {'key': key}


@st.composite
def concatenate_cases(draw):
    base = draw(shapes(min_dims=1))
    axis = draw(st.integers(-len(base), len(base) - 1))
    count = draw(st.integers(1, 3))
    xs = []
    for _ in range(count):
        shape = list(base)
        shape[axis] = draw(st.integers(0, 3))
        xs.append(host(tuple(shape), draw(dtypes)))
    return tuple(xs), {'axis': axis}


@st.composite
def dot_cases(draw):
    """Every case of NumPy's dot: scalars (0-d), vectors, matrices and N-D arrays."""
    na, nb = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    m = draw(st.integers(1, 3))
    if not na or not nb:
        sa, sb = draw(shapes(na, na)), draw(shapes(nb, nb))
    else:
        sa = draw(shapes(na - 1, na - 1)) + (m,)
        sb = (m,) if nb == 1 else draw(shapes(nb - 2, nb - 2)) + (m, draw(st.integers(1, 3)))
    return (host(sa, draw(dtypes)), host(sb, draw(dtypes))), {}


@st.composite
def matmul_cases(draw):
    pair = draw(hnp.mutually_broadcastable_shapes(signature=numpy.matmul.signature,
                                                  max_dims=3, max_side=3))
    return tuple(host(s, draw(dtypes)) for s in pair.input_shapes), {}


@st.composite
def pick_cases(draw):
    a = host(draw(shapes(min_dims=1)), draw(dtypes))
    index = numpy.arange(math.prod(a.shape[:-1])).reshape(a.shape[:-1]) % a.shape[-1]
    return (a, index.astype(draw(st.sampled_from(['int32', 'int64', 'float32'])))), {}


@st.composite
def fully_connected_cases(draw):
    batch, features, units = draw(shapes(0, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    x = host(batch + (features,), draw(dtypes))
    return (x, host((units, features), draw(dtypes)), host((units,), draw(dtypes))), {}


@st.composite
def where_cases(draw):
    triple = draw(hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3))
    cond_shape, a_shape, b_shape = triple.input_shapes
    cond = numpy.asarray(host(cond_shape, 'int32') % 2 == 0)
    return (cond, draw(operands(a_shape)), draw(operands(b_shape))), {}


floats = st.sampled_from(['float32', 'float64'])


@st.composite
def window_attrs(draw, height, width):
    kernel = (draw(st.integers(1, height)), draw(st.integers(1, width)))
    pad = (draw(st.integers(0, kernel[0] - 1)), draw(st.integers(0, kernel[1] - 1)))
    return {'kernel': kernel, 'stride': (draw(st.integers(1, 2)), draw(st.integers(1, 2))),
            'pad': pad}


@st.composite
def convolution_cases(draw):
    (n, c, h, w), dtype = draw(shapes(4, 4)), draw(floats)
    attrs, filters = draw(window_attrs(h, w)), draw(st.integers(1, 3))
    weight = host((filters, c) + attrs['kernel'], dtype)
    bias = host((filters,), dtype) if draw(st.booleans()) else 0
    return (host((n, c, h, w), dtype), weight, bias), dict(attrs, num_filter=filters)


@st.composite
def pooling_cases(draw):
    shape = draw(shapes(4, 4))
    attrs = draw(window_attrs(*shape[2:]))
    return (host(shape, draw(floats)),), dict(attrs, pool_type=draw(st.sampled_from(['max', 'avg'])))


@st.composite
def batch_norm_cases(draw):
    shape, dtype = draw(st.one_of(shapes(2, 2), shapes(4, 4))), draw(floats)
    channel = (shape[1],)
    running_var = numpy.abs(host(channel, dtype)) + 0.5
    return (host(shape, dtype), host(channel, dtype), host(channel, dtype), host(channel, dtype),
            running_var), {'eps': 1e-5, 'momentum': 0.9}


@st.composite
def dropout_mask_cases(draw):
    x = host(draw(shapes()), draw(st.sampled_from(['float32', 'float64'])))
    return (x, draw(st.sampled_from([0.0, 0.25, 0.5]))), {}


OP_CASES = {name: binary_cases() for name in (
    'add', 'subtract', 'multiply', 'divide', 'power', 'maximum', 'minimum', 'greater', 'less',
    'equal', 'greater_equal', 'less_equal', 'not_equal')}
OP_CASES.update({name: unary_cases() for name in (
    'negative', 'exp', 'log', 'sqrt', 'abs', 'tanh', 'sigmoid', 'relu', 'copy')})
OP_CASES.update({
    'log_softmax': unary_cases(min_dims=1), 'softmax': unary_cases(min_dims=1),
    'sum': reduction_cases(), 'mean': reduction_cases(), 'max': reduction_cases(),
    'argmax': reduction_cases(keepdims=False, allow_tuple=False),
    'reshape': reshape_cases(), 'transpose': transpose_cases(),
    'broadcast_to': broadcast_to_cases(), 'astype': astype_cases(), 'getitem': getitem_cases(),
    'concatenate': concatenate_cases(), 'dot': dot_cases(), 'matmul': matmul_cases(),
    'pick': pick_cases(), 'fully_connected': fully_connected_cases(), 'where': where_cases(),
    'dropout_mask': dropout_mask_cases(), 'convolution': convolution_cases(),
    'pooling': pooling_cases(), 'batch_norm_train': batch_norm_cases(),
    'batch_norm_predict': batch_norm_cases(),
})


# -- programs: instructions over a pool of named arrays, spread over devices ------------------

NAMES = ('a', 'b', 'c', 'd')
SHAPE = (4, 4)
VIEW_SLOTS = 3

_name = st.sampled_from(NAMES)
_slot = st.integers(0, VIEW_SLOTS - 1)
_row = st.integers(0, SHAPE[0] - 1)
_span = st.tuples(st.integers(0, SHAPE[0] - 1), st.integers(1, SHAPE[0])).map(
    lambda t: (min(t), max(t)) if t[0] != t[1] else (t[0] - 1, t[1]) if t[0] else (0, 1))
_scalar = st.sampled_from([-1.0, 0.5, 2.0, 3.0])
_update_op = st.sampled_from(['+=', '-=', '*='])
_view_shape = st.sampled_from([(16,), (2, 8), (8, 2), (2, 2, 4), (4, 4)])
_view_of_view = st.sampled_from(['T', 'flat', 'head', 'reversed'])


def programs(device_count=2):
    """(a device index per named array, instructions): arithmetic, in-place updates, slice
    assignments, views (indexing, reshape, transpose, views of views) and updates and
    assignments through them, updates that read their own target through a view, products,
    and copies between devices."""
    device = st.integers(0, device_count - 1)
    instructions = st.one_of(
        st.tuples(st.just('binary'), _name, _name, _name,
                  st.sampled_from(['add', 'subtract', 'multiply', 'maximum'])),
        st.tuples(st.just('affine'), _name, _name, _scalar, _scalar),
        st.tuples(st.just('matmul'), _name, _name, _name),
        st.tuples(st.just('tanh'), _name, _name),
        st.tuples(st.just('update'), _name, _update_op, _name),
        st.tuples(st.just('update_scalar'), _name, _update_op, _scalar),
        st.tuples(st.just('set_slice'), _name, _span, _name),
        st.tuples(st.just('set_row'), _name, _row, _scalar),
        st.tuples(st.just('set_row_from'), _name, _row, _name, _row),
        st.tuples(st.just('view'), _slot, _name, _span),
        st.tuples(st.just('row_view'), _slot, _name, _row),
        st.tuples(st.just('view_update'), _slot, _update_op, _scalar),
        st.tuples(st.just('view_update_row'), _slot, _name, _row),
        st.tuples(st.just('view_fill'), _slot, _scalar),
        st.tuples(st.just('reshape_view'), _slot, _name, _view_shape),
        st.tuples(st.just('transpose_view'), _slot, _name),
        st.tuples(st.just('view_of_view'), _slot, _slot, _view_of_view),
        st.tuples(st.just('view_update_from'), _slot, _update_op, _name),
        st.tuples(st.just('view_set_from'), _slot, _name),
        st.tuples(st.just('update_from_own_view'), _name, _update_op,
                  st.sampled_from(['T', 'reversed'])),
        st.tuples(st.just('move'), _name, _name, device),
        st.tuples(st.just('snapshot'), _name, device),
        st.tuples(st.just('snapshot_sum'), _name, st.sampled_from([None, 0, 1])),
        st.tuples(st.just('snapshot_view'), _slot),
    )
    return st.tuples(st.lists(device, min_size=len(NAMES), max_size=len(NAMES)),
                     st.lists(instructions, min_size=1, max_size=30))


def initial_values(i):
    return numpy.arange(math.prod(SHAPE), dtype=numpy.float64).reshape(SHAPE) * 0.5 + 10 * i


class NumpyBackend:
    """Run a program sequentially on NumPy: the reference (devices are ignored)."""

    maximum, tanh = staticmethod(numpy.maximum), staticmethod(numpy.tanh)

    @staticmethod
    def make(values, device):
        return values.copy()

    @staticmethod
    def on(x, like):
        return x

    @staticmethod
    def move(x, device):
        return x.copy()

    @staticmethod
    def host(x):
        return numpy.asarray(x)


class D2LBackend:
    """Run a program on d2lperf: asynchronous arrays, device index i meaning `devices[i]`.

    An operation whose inputs live on different devices first copies the second one to the
    first one's device, as a program must (the engine never moves data by itself)."""

    maximum, tanh = staticmethod(np.maximum), staticmethod(np.tanh)

    def __init__(self, devices):
        self.devices = devices

    def make(self, values, device):
        return np.array(values, device=self.devices[device])

    @staticmethod
    def on(x, like):
        return x if x.device == like.device else x.copyto(like.device)

    def move(self, x, device):
        return x.copyto(self.devices[device])

    @staticmethod
    def host(x):
        return x.asnumpy()


class Interpreter:
    """Run one program on a backend; returns every array, view and snapshot it made."""

    def __init__(self, backend):
        self.be = backend
        self.arrays, self.views, self.snapshots = {}, {}, []

    def run(self, program):
        devices, body = program
        for i, (name, device) in enumerate(zip(NAMES, devices)):
            self.arrays[name] = self.be.make(initial_values(i), device)
        for instruction in body:
            getattr(self, 'do_' + instruction[0])(*instruction[1:])
        return self.results()

    def results(self):
        out = [self.be.host(self.arrays[n]) for n in NAMES]
        out += [self.be.host(v) for v in self.views.values()]
        return out + [self.be.host(s) for s in self.snapshots]

    # -- instructions ---------------------------------------------------------------------
    def do_binary(self, dst, x, y, op):
        a, b = self.arrays[x], self.be.on(self.arrays[y], self.arrays[x])
        result = {'add': lambda: a + b, 'subtract': lambda: a - b,
                  'multiply': lambda: a * b, 'maximum': lambda: self.be.maximum(a, b)}[op]()
        self.arrays[dst] = result

    def do_affine(self, dst, src, scale, shift):
        self.arrays[dst] = self.arrays[src] * scale + shift

    def do_matmul(self, dst, x, y):
        a = self.arrays[x]
        self.arrays[dst] = self.be.tanh(a @ self.be.on(self.arrays[y], a))

    def do_tanh(self, dst, src):
        self.arrays[dst] = self.be.tanh(self.arrays[src])

    def do_update(self, dst, op, src):
        target = self.arrays[dst]
        update_in_place(target, op, self.be.on(self.arrays[src], target))

    def do_update_scalar(self, dst, op, scalar):
        update_in_place(self.arrays[dst], op, scalar)

    def do_set_slice(self, dst, span, src):
        target = self.arrays[dst]
        start, stop = span
        target[start:stop] = self.be.on(self.arrays[src][start:stop], target)

    def do_set_row(self, dst, i, scalar):
        self.arrays[dst][i] = scalar

    def do_set_row_from(self, dst, i, src, j):
        target = self.arrays[dst]
        target[i] = self.be.on(self.arrays[src][j], target)

    def do_view(self, slot, base, span):
        self.views[slot] = self.arrays[base][span[0]:span[1]]

    def do_row_view(self, slot, base, i):
        self.views[slot] = self.arrays[base][i]

    def do_view_update(self, slot, op, scalar):
        if slot in self.views:
            update_in_place(self.views[slot], op, scalar)

    def do_view_update_row(self, slot, src, j):
        """`view += a row`, for views whose rows are as long (a row broadcasts over them)."""
        view = self.views.get(slot)
        if view is not None and view.shape[-1:] == SHAPE[1:]:
            view += self.be.on(self.arrays[src][j], view)

    def do_view_fill(self, slot, scalar):
        if slot in self.views:
            self.views[slot][:] = scalar

    def do_reshape_view(self, slot, base, shape):
        self.views[slot] = self.arrays[base].reshape(shape)

    def do_transpose_view(self, slot, base):
        self.views[slot] = self.arrays[base].T

    def do_view_of_view(self, slot, source, how):
        if source in self.views:
            self.views[slot] = view_of(self.views[source], how)

    def do_view_update_from(self, slot, op, src):
        if slot in self.views:
            view = self.views[slot]
            update_in_place(view, op, self.shaped_like(view, src))

    def do_view_set_from(self, slot, src):
        if slot in self.views:
            view = self.views[slot]
            view[...] = self.shaped_like(view, src)

    def do_update_from_own_view(self, name, op, how):
        """`x op= x.T` and the like: an update that reads memory it writes."""
        target = self.arrays[name]
        update_in_place(target, op, view_of(target, how).reshape(target.shape))

    def shaped_like(self, view, src):
        """The first values of `src`, through views of it, shaped like `view`."""
        flat = self.be.on(self.arrays[src], view).reshape(-1)
        return flat[:view.size].reshape(view.shape)

    def do_move(self, dst, src, device):
        self.arrays[dst] = self.be.move(self.arrays[src], device)

    def do_snapshot(self, src, device):
        self.snapshots.append(self.be.move(self.arrays[src], device))

    def do_snapshot_sum(self, src, axis):
        self.snapshots.append(self.arrays[src].sum(axis=axis))

    def do_snapshot_view(self, slot):
        if slot in self.views:
            self.snapshots.append(self.views[slot].copy())


def view_of(x, how):
    """A view of a view (or, where NumPy's layout rules say so, a copy), the same way on
    NumPy and on d2lperf."""
    if how == 'T':
        return x.T
    if how == 'flat':
        return x.reshape(-1)
    if how == 'head':
        return x[:1]
    return x.reshape(-1)[::-1]


def update_in_place(target, op, value):
    """`target op= value` in place (the augmented assignment on a local name rebinds only it)."""
    if op == '+=':
        target += value
    elif op == '-=':
        target -= value
    else:
        target *= value
