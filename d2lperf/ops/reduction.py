"""Reductions over some axes (or all): sum, mean, max and argmax.

A reduction's gradient gives the reduced axes back (`rules.expand_reduced`) and broadcasts
over them: every input value that fed a sum gets its gradient, ties of a max share it.
"""
import math

import numpy

from .registry import defop
from .rules import expand_reduced, reduced_shape, result_type, sum_dtype


def tuple_axis(axis):
    """Axes as NumPy takes them: a list (from a JSON file) becomes a tuple."""
    return tuple(axis) if isinstance(axis, list) else axis


def sum_vjp(xp, g, out, a, axis=None, keepdims=False):
    return (xp.broadcast_to(expand_reduced(g, a.shape, axis, keepdims), a.shape).astype(a.dtype),)


def mean_vjp(xp, g, out, a, axis=None, keepdims=False):
    count = math.prod(a.shape) // max(math.prod(out.shape), 1)
    return (xp.broadcast_to(expand_reduced(g, a.shape, axis, keepdims) / count, a.shape),)


def max_vjp(xp, g, out, a, axis=None, keepdims=False):
    """Ties share the gradient equally."""
    top = a == expand_reduced(out, a.shape, axis, keepdims)
    share = top / top.sum(axis=tuple_axis(axis), keepdims=True)
    return (expand_reduced(g, a.shape, axis, keepdims) * share,)


def reduce_infer(dtype_rule):
    """The infer rule of a reduction whose result dtype is `dtype_rule(input dtype)`."""
    return lambda a, axis=None, keepdims=False: (reduced_shape(a.shape, axis, keepdims),
                                                 dtype_rule(a.dtype))


defop('sum', lambda xp, a, axis=None, keepdims=False: xp.sum(a, tuple_axis(axis),
                                                             keepdims=keepdims),
      reduce_infer(sum_dtype), sum_vjp, kind='reduction')
defop('mean', lambda xp, a, axis=None, keepdims=False: xp.mean(a, tuple_axis(axis),
                                                               keepdims=keepdims),
      reduce_infer(lambda dtype: result_type(dtype, 1.0)), mean_vjp, kind='reduction')
defop('max', lambda xp, a, axis=None, keepdims=False: xp.max(a, tuple_axis(axis),
                                                             keepdims=keepdims),
      reduce_infer(numpy.dtype), max_vjp, kind='reduction')
defop('argmax', lambda xp, a, axis=None: xp.argmax(a, axis),
      lambda a, axis=None: (reduced_shape(a.shape, axis, False), numpy.dtype(numpy.int64)),
      kind='reduction')
