"""Randomness: one generator per device, and the operations that draw from it.

A device's generator is only ever drawn from by the thread that runs that device's
operations, so draws never race, and after `seed(n)` every device draws a repeatable stream
of its own. `d2lperf.np.random` draws arrays from it; the random operations here (a
dropout mask) draw from the generator of the device they run on.
"""
import numpy

from ..engine.workers import running_device
from .registry import defop

generators = {}             # device -> its generator, made on first use
_seed = [None]


def generator(device):
    """The generator of `device`: NumPy's on a CPU, CuPy's on a GPU."""
    if device not in generators:
        kind = 0 if device.kind == 'cpu' else 1
        # One integer per device (CuPy's generators take only an int): distinct streams.
        seed = None if _seed[0] is None else (_seed[0] * 2 + kind) * 1024 + device.index
        generators[device] = device.xp.random.default_rng(seed)
    return generators[device]


def seed(value):
    """Make every later draw on every device repeatable (None: unpredictable again).

    Call it only when no operation is running (`d2lperf.np.random.seed` waits for them)."""
    _seed[0] = None if value is None else int(value)
    generators.clear()


def dropout_mask_infer(x, rate):
    if not 0 <= rate < 1:
        raise ValueError(f'dropout rate must be in [0, 1), not {rate}')
    return x.shape, numpy.dtype(x.dtype)


def dropout_mask(xp, x, rate):
    """Zeros with probability `rate`, else 1 / (1 - rate): E[mask * x] = x."""
    keep = generator(running_device()).random(x.shape) >= rate
    return keep.astype(x.dtype) / x.dtype.type(1 - rate)


defop('dropout_mask', dropout_mask, dropout_mask_infer, lambda xp, g, out, x, rate: (None,),
      kind='random')
