"""Operation cases: inputs and attributes for every op in `ops.REGISTRY`, with NumPy arrays
and Python scalars as inputs, for the tests that check each op against NumPy."""
import math

import numpy
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

DTYPES = ('float32', 'float64', 'int32')


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
    return (a, index.astype(draw(st.sampled_from(['int32', 'int64', 'uint8'])))), {}


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


@st.composite
def embedding_cases(draw):
    rows, features = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    ids = numpy.arange(math.prod(draw(shapes(0, 2)))) % rows
    index = ids.reshape(draw(st.sampled_from([ids.shape, (1,) + ids.shape])))
    return (index.astype(draw(st.sampled_from(['int32', 'int64']))),
            host((rows, features), draw(floats))), {}



@st.composite
def add_position_embedding_cases(draw):
    x = host(draw(shapes(min_dims=2)), draw(floats))
    rows = x.shape[-2] + draw(st.integers(0, 2))
    return (x, host((rows, x.shape[-1]), draw(floats))), {}

@st.composite
def layer_norm_cases(draw):
    x = host(draw(shapes(min_dims=1)), draw(floats))
    gamma, beta = (host(x.shape[-1:], draw(floats)) for _ in range(2))
    return (x, gamma, beta), {'eps': draw(st.sampled_from([1e-5, 1e-3]))}


@st.composite
def causal_softmax_cases(draw):
    batch, queries = draw(shapes(0, 2)), draw(st.integers(1, 3))
    keys = queries + draw(st.integers(0, 2))
    return (host(batch + (queries, keys), draw(floats)),), {}

@st.composite
def attention_problems(draw, max_seq=12):
    """(shape (batch, heads, seq, d), block_size, causal): block sizes from one row to past
    the sequence, that do and do not divide it, square (an int) or not (a pair)."""
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, max_seq)),
             draw(st.integers(1, 6)))
    rows = st.integers(1, shape[2] + 2)
    block_size = draw(st.one_of(rows, st.tuples(rows, rows)))
    return shape, block_size, draw(st.booleans())


@st.composite
def attention_cases(draw):
    shape, block_size, causal = draw(attention_problems(max_seq=5))
    block_size = (block_size, block_size) if isinstance(block_size, int) else block_size
    q, k, v = (host(shape, draw(floats)) for _ in range(3))
    return (q, k, v), {'causal': causal, 'block_size': block_size}


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
    'batch_norm_predict': batch_norm_cases(), 'embedding': embedding_cases(),
    'add_position_embedding': add_position_embedding_cases(), 'layer_norm': layer_norm_cases(),
    'gelu': unary_cases(), 'causal_softmax': causal_softmax_cases(),
    'attention': attention_cases(),
})
