"""The operations neural networks are made of: activations, softmax, picking labels, and a
dense layer as one operation (as MXNet's FullyConnected).

Softmax and its log work along the last axis, as classifiers use them. `fully_connected` is
a contraction: the compiler runs it as a product followed by a fused bias and activation.
"""
import numpy

from ..engine import pieces
from .registry import defop
from .rules import floating, rounded, same

def relu(xp, a):
    """max(a, 0), in pieces on every core the device has where `a` is large (`pieces`)."""
    return pieces.elementwise(xp, lambda out, a: xp.maximum(a, 0, out=out), a, a)


def relu_vjp(xp, g, out, a):
    def block(d_a, g, out):
        xp.multiply(g, out > 0, out=d_a)
    return (pieces.elementwise(xp, block, g, g, out),)


defop('relu', relu, same, relu_vjp, kind='elementwise', c_expr='max({a}, ({t})0)')
defop('sigmoid', lambda xp, a: 1 / (1 + xp.exp(-a)), floating,
      lambda xp, g, out, a: (g * out * (1 - out),),
      kind='elementwise', c_expr='({t})1 / (({t})1 + exp(-{a}))')


def log_softmax(xp, a):
    shifted = a - a.max(axis=-1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))


def softmax(xp, a):
    e = xp.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


defop('log_softmax', log_softmax, floating,
      lambda xp, g, out, a: (g - xp.exp(out) * g.sum(axis=-1, keepdims=True),))
defop('softmax', softmax, floating,
      lambda xp, g, out, a: (out * (g - (g * out).sum(axis=-1, keepdims=True)),))


def integer_ids(index, what):
    """Refuse ids that are not integers when the op is pushed, as PyTorch does: NumPy would
    read 2.7 as 2, and True as 1, with no error."""
    dtype = numpy.dtype(index.dtype)
    if dtype.kind not in 'iu':
        raise TypeError(f'{what} must be integers, not {dtype}: convert them with '
                        f".astype('int64') (a float id would be truncated: 2.7 read as 2)")


def ids_in_range(xp, index, count, what, among):
    """`index` as int64, once its ids are checked to lie in [0, count) (`among` names the
    count): NumPy reads -1 as the last row and names no vocabulary. One min and max a call,
    one transfer on a GPU."""
    ids = index.astype(numpy.int64, copy=False)
    if ids.size:
        low, high = bounds(xp, ids)
        if low < 0 or high >= count:
            bad = low if low < 0 else high
            raise IndexError(f'{what} {bad} is out of range for {among}: each must lie in '
                             f'0 to {count - 1}')
    return ids


def bounds(xp, ids):
    """(min, max) of `ids` as Python ints: on a GPU both in one transfer (each `int()` of a
    CuPy scalar waits for the device); on NumPy, where stacking costs more than the two
    reductions, directly."""
    if xp is numpy:
        return int(ids.min()), int(ids.max())
    return tuple(int(v) for v in xp.stack([ids.min(), ids.max()]).tolist())


def pick_infer(a, index):
    if tuple(index.shape) != tuple(a.shape[:-1]):
        raise ValueError(f'pick needs one index per row: index shape {index.shape} '
                         f'!= {a.shape[:-1]}')
    integer_ids(index, 'pick\'s indices (labels)')
    return a.shape[:-1], numpy.dtype(a.dtype)


def pick(xp, a, index):
    count = a.shape[-1]
    ids = ids_in_range(xp, index, count, 'label', f'{count} classes (the last axis)')
    return xp.take_along_axis(a, ids[..., None], axis=-1)[..., 0]


def pick_vjp(xp, g, out, a, index):
    onehot = xp.arange(a.shape[-1]) == index.astype(numpy.int64)[..., None]
    return (onehot * g[..., None], None)


defop('pick', pick, pick_infer, pick_vjp)


def fully_connected_infer(x, weight, bias):
    if x.shape[-1:] != weight.shape[1:]:
        raise ValueError(f'a Dense layer with weight {weight.shape} expects inputs of '
                         f'{weight.shape[1]} features, got shape {x.shape}')
    if tuple(bias.shape) != tuple(weight.shape[:1]):
        raise ValueError(f'a Dense layer with weight {weight.shape} needs a bias of shape '
                         f'{weight.shape[:1]}, got {bias.shape}')
    # The bias is added last, so its dtype promotes the result too.
    return x.shape[:-1] + weight.shape[:1], numpy.result_type(x.dtype, weight.dtype, bias.dtype)


def fully_connected(xp, x, weight, bias):
    """x @ weight.T + bias, every leading axis of x as rows of one product: NumPy's matmul of
    a (batch, seq, features) array makes one small product a batch entry instead."""
    rows = x.reshape(-1, x.shape[-1])
    out = rounded(xp.matmul(rows, weight.T), x, weight)
    if out.dtype == xp.result_type(out, bias):
        out += bias                   # in place: no second array of the product's size
    else:
        out = out + bias
    return out.reshape(x.shape[:-1] + weight.shape[:1])


def fully_connected_vjp(xp, g, out, x, weight, bias):
    """The bias's gradient, a sum over rows, as a product with ones: BLAS runs at memory speed
    where NumPy's column sum does not."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    return (xp.matmul(g2, weight).reshape(x.shape), xp.matmul(g2.T, x2),
            xp.ones(len(g2), g2.dtype) @ g2)


defop('fully_connected', fully_connected, fully_connected_infer, fully_connected_vjp,
      kind='contraction')
