"""Shapes, copies and selection: reshape, transpose, broadcast, cast, copy, index, join, where.

`reshape` and `transpose` are views, as in NumPy and MXNet: no data moves, and a write
through the result changes the input (`x.reshape(2, 2)[:] = 0` zeroes x). Because the two
arrays share memory, they share one engine variable (`ndarray.alias`), so the engine orders
every write through either with every read of the other. Sharing was chosen over copying
because a view is free (flattening before a Dense layer moves nothing) and keeps NumPy's
meaning; where NumPy must copy instead (reshaping a non-contiguous array), the shared
variable only orders a little more than needed. Indexing is a view too (`ndarray.view`);
`getitem` here is the op the tape and the compiler use for it, and copies. Every other op
in this file makes a new array (`astype` copies even to the same dtype). Each gradient puts
the output's gradient back where its values came from. Taught in "Asynchronous Computation".
"""
import numpy

from .registry import defop
from .rules import dtype_of, index_shape, input_grads, normalize_axes, reshape_shape, same, \
    shape_of, unbroadcast


def inverse_permutation(axes):
    return tuple(numpy.argsort(axes))


def transpose_axes(ndim, axes):
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
      lambda xp, g, out, a, shape: (g.reshape(a.shape),), kind='view')
defop('transpose', lambda xp, a, axes=None: xp.transpose(a, axes),
      lambda a, axes=None: (tuple(a.shape[i] for i in transpose_axes(len(a.shape), axes)),
                            numpy.dtype(a.dtype)),
      lambda xp, g, out, a, axes=None: (
          xp.transpose(g, inverse_permutation(transpose_axes(a.ndim, axes))),),
      kind='view')


def broadcast_to_infer(a, shape):
    if numpy.broadcast_shapes(a.shape, tuple(shape)) != tuple(shape):
        raise ValueError(f'cannot broadcast shape {a.shape} to {tuple(shape)}')
    return tuple(shape), numpy.dtype(a.dtype)


defop('broadcast_to', lambda xp, a, shape: xp.array(xp.broadcast_to(a, shape)),
      broadcast_to_infer, lambda xp, g, out, a, shape: (unbroadcast(g, a.shape),))
defop('astype', lambda xp, a, dtype: a.astype(dtype),
      lambda a, dtype: (a.shape, numpy.dtype(dtype)),
      lambda xp, g, out, a, dtype: (g.astype(a.dtype),))
defop('copy', lambda xp, a: a.copy(), same, lambda xp, g, out, a: (g,))


def getitem_vjp(xp, g, out, a, key):
    grad = xp.zeros(a.shape, dtype=g.dtype)
    grad[key] = g
    return (grad,)


defop('getitem', lambda xp, a, key: a[key].copy(),
      lambda a, key: (index_shape(a.shape, a.dtype, key), numpy.dtype(a.dtype)), getitem_vjp)


def concatenate_infer(*xs, axis=0):
    first = xs[0].shape
    axis = normalize_axes(axis, len(first))[0]
    for x in xs[1:]:
        if len(x.shape) != len(first) or any(m != n for i, (m, n) in enumerate(zip(first, x.shape))
                                             if i != axis):
            raise ValueError(f'concatenate along axis {axis} needs equal other dimensions, '
                             f'got {first} and {x.shape}')
    size = sum(x.shape[axis] for x in xs)
    return first[:axis] + (size,) + first[axis + 1:], numpy.result_type(*(x.dtype for x in xs))


def concatenate_vjp(xp, g, out, *xs, axis=0):
    bounds = numpy.cumsum([x.shape[axis] for x in xs])[:-1].tolist()
    return tuple(xp.split(g, bounds, axis=axis))


defop('concatenate', lambda xp, *xs, axis=0: xp.concatenate(xs, axis=axis),
      concatenate_infer, concatenate_vjp)


def where_infer(cond, a, b):
    return numpy.broadcast_shapes(*map(shape_of, (cond, a, b))), numpy.result_type(
        dtype_of(a), dtype_of(b))


def where_vjp(xp, g, out, cond, a, b):
    picked = cond.astype(bool)
    return (None,) + input_grads((a, lambda: g * picked), (b, lambda: g * ~picked))


defop('where', lambda xp, cond, a, b: xp.where(cond, a, b), where_infer, where_vjp)
