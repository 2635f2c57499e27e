"""Shape, dtype and gradient rules that many operations share.

Shapes and dtypes follow NumPy's rules (broadcasting, type promotion, with Python scalars
weakly typed as in NumPy 2), so `infer` can give an op's result type without computing it.
`unbroadcast` is the gradient's side of broadcasting: it sums a gradient back down to the
shape of the input it belongs to.

bfloat16 on NumPy is `ml_dtypes`' (the dtype JAX uses), which NumPy's promotion does not take
for a float: `result_type` and `weak_scalars` keep a Python float weak beside it, as NumPy 2
does beside float16, and `rounded` brings its products back from float32 (CuPy 14 keeps
bfloat16 as it is; CuPy 13 has no bfloat16).
"""
import math

import ml_dtypes
import numpy

BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)      # importing ml_dtypes names it for numpy.dtype


def differentiable(dtype):
    """Whether arrays of `dtype` take gradients: NumPy's floats, and ml_dtypes' bfloat16, whose
    NumPy kind is 'V' (a void of two bytes), not 'f'."""
    return dtype.kind == 'f' or dtype == BFLOAT16


# -- shape and dtype rules -----------------------------------------------------------------

def pair(value):
    """A window's size, stride or padding as (height, width): `3` means `(3, 3)`."""
    return (value, value) if isinstance(value, int) else tuple(value)


def shape_of(x):
    return getattr(x, 'shape', ())


def dtype_of(x):
    """The dtype of an array; a Python scalar stays itself, weakly typed as NumPy 2 does."""
    return x.dtype if hasattr(x, 'dtype') else x


def result_type(*dtypes):
    """numpy.result_type, but bfloat16 beside Python scalars stays bfloat16 (NumPy would make
    bfloat16 · 0.5 a float64, as if bfloat16 were no float)."""
    arrays = [d for d in dtypes if isinstance(d, numpy.dtype)]
    if arrays and all(d == BFLOAT16 for d in arrays):
        return BFLOAT16
    return numpy.result_type(*dtypes)


def weak_scalars(a, b):
    """The inputs of a binary ufunc, a Python float beside a bfloat16 array made bfloat16, so
    that the ufunc computes what `result_type` says (ml_dtypes would compute float32)."""
    if type(b) is float and a.dtype == BFLOAT16:
        return a, BFLOAT16.type(b)
    if type(a) is float and b.dtype == BFLOAT16:
        return BFLOAT16.type(a), b
    return a, b


def rounded(product, *inputs):
    """A product of bfloat16 arrays rounded to bfloat16: ml_dtypes' matmul accumulates and
    returns float32 (NumPy has no bfloat16 BLAS)."""
    if product.dtype != BFLOAT16 and all(x.dtype == BFLOAT16 for x in inputs):
        return product.astype(BFLOAT16)
    return product


def promote(*xs):
    return numpy.broadcast_shapes(*map(shape_of, xs)), result_type(*map(dtype_of, xs))


def floating(*xs):
    shape, dtype = promote(*xs)
    return shape, result_type(dtype, 1.0)


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
    """Shape of `x[key]`, found by indexing a stand-in for x whose every element is one and
    the same (all strides 0): no data is touched, and NumPy checks the key. Made directly, as
    `numpy.broadcast_to` would make it through ten Python calls (a third of a view's push)."""
    return numpy.ndarray(shape, dtype, bytes(dtype.itemsize), 0, (0,) * len(shape))[key].shape


# -- gradient helpers ----------------------------------------------------------------------

def unbroadcast(grad, shape):
    """Sum `grad` back down to `shape`: the adjoint of broadcasting."""
    if grad.shape == tuple(shape):
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)


def input_grads(*pairs):
    """For each (input, gradient-maker): the gradient unbroadcast to the input, or None."""
    return tuple(None if not hasattr(x, 'shape') else unbroadcast(make(), x.shape)
                 for x, make in pairs)


def expand_reduced(g, shape, axis, keepdims):
    """Give a reduced gradient its reduced axes back, so that it broadcasts against `shape`."""
    if not keepdims:
        g = g.reshape(reduced_shape(shape, axis, True))
    return g
