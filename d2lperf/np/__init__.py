"""`d2lperf.np`: NumPy's names for asynchronous arrays (`from d2lperf import np`).

Each function pushes one engine operation and returns at once; `device=` says where the
result lives (default `cpu(0)`). The default floating dtype is float32, as on accelerators.
"""
import builtins
import math

import numpy

from ..device import cpu
from .multiarray import NDArray, apply, create, from_host
from . import random  # noqa: F401  (np.random.normal, np.random.uniform, np.random.seed)

float32, float64, int32, int64, bool_ = (numpy.float32, numpy.float64, numpy.int32,
                                         numpy.int64, numpy.bool_)
ndarray = NDArray


def ones(shape, dtype=numpy.float32, device=None):
    return create(shape, dtype, device, lambda xp, s, d: xp.ones(s, d), 'ones')


def zeros(shape, dtype=numpy.float32, device=None):
    return create(shape, dtype, device, lambda xp, s, d: xp.zeros(s, d), 'zeros')


def full(shape, fill_value, dtype=numpy.float32, device=None):
    return create(shape, dtype, device, lambda xp, s, d: xp.full(s, fill_value, d), 'full')


def ones_like(x):
    return ones(x.shape, x.dtype, x.device)


def zeros_like(x):
    return zeros(x.shape, x.dtype, x.device)


def arange(start, stop=None, step=1, dtype=numpy.float32, device=None):
    if stop is None:
        start, stop = 0, start
    size = builtins.max(0, math.ceil((stop - start) / step))
    return create((size,), dtype, device,
                  lambda xp, s, d: xp.arange(start, stop, step, dtype=d), 'arange')


def array(obj, dtype=None, device=None):
    """Copy `obj` (an NDArray, a NumPy array or nested lists) into a new NDArray.

    Lists of Python floats become float32; NumPy arrays keep their dtype unless `dtype` says.
    """
    device = device or cpu()
    if isinstance(obj, NDArray):
        out = obj.copyto(device) if obj.device != device else obj.copy()
        return out if dtype is None else out.astype(dtype)
    host = numpy.array(obj, dtype=dtype)
    if dtype is None and not isinstance(obj, numpy.ndarray) and host.dtype == numpy.float64:
        host = host.astype(numpy.float32)
    return from_host(host, device)


def _binary(name):
    def op(a, b):
        return apply(name, a, b)
    op.__name__ = name
    op.__doc__ = f'Elementwise {name}, with broadcasting.'
    return op


def _unary(name):
    def op(a):
        return apply(name, a)
    op.__name__ = name
    op.__doc__ = f'Elementwise {name}.'
    return op


add, subtract, multiply, divide, power, maximum, minimum = map(
    _binary, ('add', 'subtract', 'multiply', 'divide', 'power', 'maximum', 'minimum'))
greater, less, equal = map(_binary, ('greater', 'less', 'equal'))
exp, log, sqrt, abs, tanh, negative = map(_unary, ('exp', 'log', 'sqrt', 'abs', 'tanh',
                                                   'negative'))
true_divide = divide


def dot(a, b):
    return apply('dot', a, b)


def matmul(a, b):
    return apply('matmul', a, b)


def sum(a, axis=None, keepdims=False):
    return apply('sum', a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims=False):
    return apply('mean', a, axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False):
    return apply('max', a, axis=axis, keepdims=keepdims)


def argmax(a, axis=None):
    return apply('argmax', a, axis=axis)


def reshape(a, shape):
    return apply('reshape', a, shape=tuple(shape))


def transpose(a, axes=None):
    return apply('transpose', a, axes=None if axes is None else tuple(axes))


def broadcast_to(a, shape):
    return apply('broadcast_to', a, shape=tuple(shape))


def concatenate(arrays, axis=0):
    return apply('concatenate', *arrays, axis=axis)


def where(condition, x, y):
    """x where condition is true, else y: elementwise choice, the traceable form of `if`."""
    return apply('where', condition, x, y)
