"""Array operations as the engine, autograd and the compiler all see them.

Each `Op` is a name plus three small functions, micrograd-style: `compute` runs it with the
device's array module (NumPy or CuPy), `infer` gives the result's shape and dtype from the
inputs' shapes and dtypes alone (so pushing never waits), and `vjp` turns the gradient of
the output into gradients of the inputs. Inputs are arrays or Python scalars; `attrs` are
plain, JSON-friendly values, so a graph of ops can be exported and read back.
"""
import math

import numpy


class Op:
    __slots__ = ('name', 'compute', 'infer', 'vjp')

    def __init__(self, name, compute, infer, vjp=None):
        self.name, self.compute, self.infer, self.vjp = name, compute, infer, vjp

    def __repr__(self):
        return f'Op({self.name})'


REGISTRY = {}


def defop(name, compute, infer, vjp=None):
    REGISTRY[name] = Op(name, compute, infer, vjp)
    return REGISTRY[name]


# -- shape and dtype rules -----------------------------------------------------------------

def shape_of(x):
    return getattr(x, 'shape', ())


def dtype_of(x):
    """The dtype of an array; a Python scalar stays itself, weakly typed as NumPy 2 does."""
    return x.dtype if hasattr(x, 'dtype') else x


def promote(*xs):
    return numpy.broadcast_shapes(*map(shape_of, xs)), numpy.result_type(*map(dtype_of, xs))


def floating(*xs):
    shape, dtype = promote(*xs)
    return shape, numpy.result_type(dtype, 1.0)


def compare(*xs):
    return numpy.broadcast_shapes(*map(shape_of, xs)), numpy.dtype(bool)


def same(x, **_):
    return x.shape, numpy.dtype(x.dtype)


def normalize_axes(axis, ndim):
    """`axis` (None, an int or a tuple) as a sorted tuple of non-negative axes."""
    axes = range(ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
    out = tuple(sorted(a + ndim if a < 0 else a for a in axes))
    if any(not 0 <= a < ndim for a in out):
        raise ValueError(f'axis {axis} is out of range for an array with {ndim} dimensions')
    return out


def reduced_shape(shape, axis, keepdims):
    axes = normalize_axes(axis, len(shape))
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def sum_dtype(dtype):
    """NumPy widens small integer and boolean sums to 64 bits."""
    dtype = numpy.dtype(dtype)
    if dtype.kind in 'bi' and dtype.itemsize < 8:
        return numpy.dtype(numpy.int64)
    return numpy.dtype(numpy.uint64) if dtype.kind == 'u' and dtype.itemsize < 8 else dtype


def matmul_shape(a, b):
    """NumPy's matmul rule: vectors are promoted, leading (batch) dimensions broadcast."""
    sa, sb = shape_of(a), shape_of(b)
    if not sa or not sb:
        raise ValueError('matmul needs arrays of at least one dimension, not scalars')
    ma, mb = (sa if len(sa) > 1 else (1,) + sa), (sb if len(sb) > 1 else sb + (1,))
    if ma[-1] != mb[-2]:
        raise ValueError(f'shapes {sa} and {sb} are not aligned: {ma[-1]} (dim {len(sa) - 1}) '
                         f'!= {mb[-2]} (dim {max(len(sb) - 2, 0)})')
    batch = numpy.broadcast_shapes(ma[:-2], mb[:-2])
    return batch + (ma[-2],) * (len(sa) > 1) + (mb[-1],) * (len(sb) > 1)


def dot_shape(a, b):
    """NumPy's dot rule: a scalar scales; else a's last axis meets b's second-to-last, or
    b's only axis when b is a vector (an N-D array times a vector is common)."""
    sa, sb = a.shape, b.shape
    if not sa or not sb:
        return numpy.broadcast_shapes(sa, sb)
    if len(sa) <= 2 and len(sb) <= 2:
        return matmul_shape(a, b)
    axis = 0 if len(sb) == 1 else len(sb) - 2
    if sa[-1] != sb[axis]:
        raise ValueError(f'shapes {sa} and {sb} are not aligned for dot: '
                         f'{sa[-1]} (dim {len(sa) - 1}) != {sb[axis]} (dim {axis})')
    return sa[:-1] + sb[:axis] + sb[axis + 1:]


def reshape_shape(shape, newshape):
    size, new = math.prod(shape), list(newshape)
    if new.count(-1) > 1:
        raise ValueError(f'can only infer one dimension of {tuple(newshape)}')
    if -1 in new:
        known = math.prod(d for d in new if d != -1)
        if known == 0 or size % known:
            raise ValueError(f'cannot reshape an array of size {size} into shape {tuple(newshape)}')
        new[new.index(-1)] = size // known
    if math.prod(new) != size:
        raise ValueError(f'cannot reshape an array of size {size} into shape {tuple(newshape)}')
    return tuple(new)


def index_shape(shape, dtype, key):
    """Shape of `x[key]`, found by indexing a zero-byte broadcast view: no data is touched."""
    return numpy.broadcast_to(numpy.empty((), dtype), shape)[key].shape


# -- gradient helpers ----------------------------------------------------------------------

def unbroadcast(grad, shape):
    """Sum `grad` back down to `shape`: the adjoint of broadcasting."""
    if grad.shape == tuple(shape):
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)


def _grads(g, *pairs):
    """For each (input, gradient-maker): the gradient unbroadcast to the input, or None."""
    return tuple(None if not hasattr(x, 'shape') else unbroadcast(make(), x.shape)
                 for x, make in pairs)


def expand_reduced(g, shape, axis, keepdims):
    """Give a reduced gradient its reduced axes back, so that it broadcasts against `shape`."""
    if not keepdims:
        g = g.reshape(reduced_shape(shape, axis, True))
    return g


# -- elementwise ---------------------------------------------------------------------------

defop('add', lambda xp, a, b: xp.add(a, b), promote,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g), (b, lambda: g)))
defop('subtract', lambda xp, a, b: xp.subtract(a, b), promote,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g), (b, lambda: -g)))
defop('multiply', lambda xp, a, b: xp.multiply(a, b), promote,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g * b), (b, lambda: g * a)))
defop('divide', lambda xp, a, b: xp.divide(a, b), floating,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g / b), (b, lambda: -g * out / b)))
defop('power', lambda xp, a, b: xp.power(a, b), promote,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g * b * xp.power(a, b - 1)),
                                      (b, lambda: g * out * xp.log(a))))
defop('maximum', lambda xp, a, b: xp.maximum(a, b), promote,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g * (a >= b)), (b, lambda: g * (a < b))))
defop('minimum', lambda xp, a, b: xp.minimum(a, b), promote,
      lambda xp, g, out, a, b: _grads(g, (a, lambda: g * (a <= b)), (b, lambda: g * (a > b))))
for _name in ('greater', 'less', 'equal', 'greater_equal', 'less_equal', 'not_equal'):
    defop(_name, lambda xp, a, b, _f=_name: getattr(xp, _f)(a, b), compare)

defop('negative', lambda xp, a: xp.negative(a), same, lambda xp, g, out, a: (-g,))
defop('exp', lambda xp, a: xp.exp(a), floating, lambda xp, g, out, a: (g * out,))
defop('log', lambda xp, a: xp.log(a), floating, lambda xp, g, out, a: (g / a,))
defop('sqrt', lambda xp, a: xp.sqrt(a), floating, lambda xp, g, out, a: (g / (2 * out),))
defop('abs', lambda xp, a: xp.abs(a), same, lambda xp, g, out, a: (g * xp.sign(a),))
defop('tanh', lambda xp, a: xp.tanh(a), floating, lambda xp, g, out, a: (g * (1 - out * out),))
defop('sigmoid', lambda xp, a: 1 / (1 + xp.exp(-a)), floating,
      lambda xp, g, out, a: (g * out * (1 - out),))
defop('relu', lambda xp, a: xp.maximum(a, 0), same, lambda xp, g, out, a: (g * (out > 0),))


# -- linear algebra ------------------------------------------------------------------------

def _matmul_vjp(xp, g, out, a, b):
    """Gradients of a @ b for any batch shape: treat vectors as 1-row / 1-column matrices."""
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g.reshape(matmul_shape(a2, b2))
    grad_a = unbroadcast(xp.matmul(g2, xp.swapaxes(b2, -1, -2)), a2.shape).reshape(a.shape)
    grad_b = unbroadcast(xp.matmul(xp.swapaxes(a2, -1, -2), g2), b2.shape).reshape(b.shape)
    return grad_a, grad_b


def _dot_vjp(xp, g, out, a, b):
    if a.ndim > 2 or b.ndim > 2 or not a.ndim or not b.ndim:
        raise NotImplementedError('the gradient of dot is defined here for 1-D and 2-D arrays; '
                                  'use matmul for batched products')
    return _matmul_vjp(xp, g, out, a, b)


defop('dot', lambda xp, a, b: xp.dot(a, b),
      lambda a, b: (dot_shape(a, b), numpy.result_type(a.dtype, b.dtype)), _dot_vjp)
defop('matmul', lambda xp, a, b: xp.matmul(a, b),
      lambda a, b: (matmul_shape(a, b), numpy.result_type(dtype_of(a), dtype_of(b))),
      _matmul_vjp)


# -- reductions ----------------------------------------------------------------------------

def _tuple_axis(axis):
    return tuple(axis) if isinstance(axis, list) else axis


def _sum_vjp(xp, g, out, a, axis=None, keepdims=False):
    return (xp.broadcast_to(expand_reduced(g, a.shape, axis, keepdims), a.shape).astype(a.dtype),)


def _mean_vjp(xp, g, out, a, axis=None, keepdims=False):
    count = math.prod(a.shape) // max(math.prod(out.shape), 1)
    return (xp.broadcast_to(expand_reduced(g, a.shape, axis, keepdims) / count, a.shape),)


def _max_vjp(xp, g, out, a, axis=None, keepdims=False):
    """Ties share the gradient equally."""
    top = a == expand_reduced(out, a.shape, axis, keepdims)
    share = top / top.sum(axis=_tuple_axis(axis), keepdims=True)
    return (expand_reduced(g, a.shape, axis, keepdims) * share,)


defop('sum', lambda xp, a, axis=None, keepdims=False: xp.sum(a, _tuple_axis(axis),
                                                             keepdims=keepdims),
      lambda a, axis=None, keepdims=False: (reduced_shape(a.shape, axis, keepdims),
                                            sum_dtype(a.dtype)), _sum_vjp)
defop('mean', lambda xp, a, axis=None, keepdims=False: xp.mean(a, _tuple_axis(axis),
                                                               keepdims=keepdims),
      lambda a, axis=None, keepdims=False: (reduced_shape(a.shape, axis, keepdims),
                                            numpy.result_type(a.dtype, 1.0)), _mean_vjp)
defop('max', lambda xp, a, axis=None, keepdims=False: xp.max(a, _tuple_axis(axis),
                                                             keepdims=keepdims),
      lambda a, axis=None, keepdims=False: (reduced_shape(a.shape, axis, keepdims),
                                            numpy.dtype(a.dtype)), _max_vjp)
defop('argmax', lambda xp, a, axis=None: xp.argmax(a, axis),
      lambda a, axis=None: (reduced_shape(a.shape, axis, False), numpy.dtype(numpy.int64)))


# -- shapes, copies and selection -----------------------------------------------------------

def _inverse(axes):
    return tuple(numpy.argsort(axes))


def _transpose_axes(ndim, axes):
    """The permutation `axes` names, negative axes counted from the end: the gradient
    inverts it, so it must be checked and normalized here, at push time."""
    if axes is None:
        return tuple(reversed(range(ndim)))
    normalized = tuple(a + ndim if a < 0 else a for a in axes)
    if sorted(normalized) != list(range(ndim)):
        raise ValueError(f'axes {tuple(axes)} are not a permutation of the {ndim} axes')
    return normalized


defop('reshape', lambda xp, a, shape: xp.reshape(a, shape),
      lambda a, shape: (reshape_shape(a.shape, shape), numpy.dtype(a.dtype)),
      lambda xp, g, out, a, shape: (g.reshape(a.shape),))
defop('transpose', lambda xp, a, axes=None: xp.transpose(a, axes),
      lambda a, axes=None: (tuple(a.shape[i] for i in _transpose_axes(len(a.shape), axes)),
                            numpy.dtype(a.dtype)),
      lambda xp, g, out, a, axes=None: (xp.transpose(g, _inverse(_transpose_axes(a.ndim, axes))),))
def _broadcast_to_infer(a, shape):
    if numpy.broadcast_shapes(a.shape, tuple(shape)) != tuple(shape):
        raise ValueError(f'cannot broadcast shape {a.shape} to {tuple(shape)}')
    return tuple(shape), numpy.dtype(a.dtype)


defop('broadcast_to', lambda xp, a, shape: xp.array(xp.broadcast_to(a, shape)), _broadcast_to_infer,
      lambda xp, g, out, a, shape: (unbroadcast(g, a.shape),))
defop('astype', lambda xp, a, dtype: a.astype(dtype),
      lambda a, dtype: (a.shape, numpy.dtype(dtype)),
      lambda xp, g, out, a, dtype: (g.astype(a.dtype),))
defop('copy', lambda xp, a: a.copy(), same, lambda xp, g, out, a: (g,))


def _getitem_vjp(xp, g, out, a, key):
    grad = xp.zeros(a.shape, dtype=g.dtype)
    grad[key] = g
    return (grad,)


defop('getitem', lambda xp, a, key: a[key].copy(),
      lambda a, key: (index_shape(a.shape, a.dtype, key), numpy.dtype(a.dtype)), _getitem_vjp)


def _concatenate_infer(*xs, axis=0):
    first = xs[0].shape
    axis = normalize_axes(axis, len(first))[0]
    for x in xs[1:]:
        if len(x.shape) != len(first) or any(m != n for i, (m, n) in enumerate(zip(first, x.shape))
                                             if i != axis):
            raise ValueError(f'concatenate along axis {axis} needs equal other dimensions, '
                             f'got {first} and {x.shape}')
    size = sum(x.shape[axis] for x in xs)
    return first[:axis] + (size,) + first[axis + 1:], numpy.result_type(*(x.dtype for x in xs))


def _concatenate_vjp(xp, g, out, *xs, axis=0):
    bounds = numpy.cumsum([x.shape[axis] for x in xs])[:-1].tolist()
    return tuple(xp.split(g, bounds, axis=axis))


defop('concatenate', lambda xp, *xs, axis=0: xp.concatenate(xs, axis=axis),
      _concatenate_infer, _concatenate_vjp)


# -- softmax and friends (along the last axis, as classifiers use them) ----------------------

def _log_softmax(xp, a):
    shifted = a - a.max(axis=-1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))


def _softmax(xp, a):
    e = xp.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


defop('log_softmax', _log_softmax, floating,
      lambda xp, g, out, a: (g - xp.exp(out) * g.sum(axis=-1, keepdims=True),))
defop('softmax', _softmax, floating,
      lambda xp, g, out, a: (out * (g - (g * out).sum(axis=-1, keepdims=True)),))


def _pick_infer(a, index):
    if tuple(index.shape) != tuple(a.shape[:-1]):
        raise ValueError(f'pick needs one index per row: index shape {index.shape} '
                         f'!= {a.shape[:-1]}')
    return a.shape[:-1], numpy.dtype(a.dtype)


def _pick(xp, a, index):
    return xp.take_along_axis(a, index.astype(numpy.int64)[..., None], axis=-1)[..., 0]


def _pick_vjp(xp, g, out, a, index):
    onehot = xp.arange(a.shape[-1]) == index.astype(numpy.int64)[..., None]
    return (onehot * g[..., None], None)


defop('pick', _pick, _pick_infer, _pick_vjp)


# -- a dense layer as one operation, as MXNet's FullyConnected ------------------------------

def _fully_connected_infer(x, weight, bias):
    if x.shape[-1:] != weight.shape[1:]:
        raise ValueError(f'a Dense layer with weight {weight.shape} expects inputs of '
                         f'{weight.shape[1]} features, got shape {x.shape}')
    if tuple(bias.shape) != tuple(weight.shape[:1]):
        raise ValueError(f'a Dense layer with weight {weight.shape} needs a bias of shape '
                         f'{weight.shape[:1]}, got {bias.shape}')
    # The bias is added last, so its dtype promotes the result too.
    return x.shape[:-1] + weight.shape[:1], numpy.result_type(x.dtype, weight.dtype, bias.dtype)


def _fully_connected_vjp(xp, g, out, x, weight, bias):
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    return xp.matmul(g, weight), xp.matmul(g2.T, x2), g2.sum(axis=0)


defop('fully_connected', lambda xp, x, weight, bias: xp.matmul(x, weight.T) + bias,
      _fully_connected_infer, _fully_connected_vjp)


# -- for the compiler ("Compilers and Interpreters"): selection and randomness -------------

RANDOM_OPS = {'dropout_mask'}   # results that are not a function of the inputs: never merged


def _where_infer(cond, a, b):
    return numpy.broadcast_shapes(*map(shape_of, (cond, a, b))), numpy.result_type(
        dtype_of(a), dtype_of(b))


def _where_vjp(xp, g, out, cond, a, b):
    picked = cond.astype(bool)
    return (None,) + _grads(g, (a, lambda: g * picked), (b, lambda: g * ~picked))


def _dropout_mask_infer(x, rate):
    if not 0 <= rate < 1:
        raise ValueError(f'dropout rate must be in [0, 1), not {rate}')
    return x.shape, numpy.dtype(x.dtype)


def _dropout_mask(xp, x, rate):
    """Zeros with probability `rate`, else 1 / (1 - rate): E[mask * x] = x."""
    keep = xp.random.random(x.shape) >= rate
    return keep.astype(x.dtype) / x.dtype.type(1 - rate)


defop('where', lambda xp, cond, a, b: xp.where(cond, a, b), _where_infer, _where_vjp)
defop('dropout_mask', _dropout_mask, _dropout_mask_infer, lambda xp, g, out, x, rate: (None,))
