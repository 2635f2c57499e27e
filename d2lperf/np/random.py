"""Random arrays, drawn on the device that holds them, one generator per device."""
import numpy

from .. import engine
from ..device import cpu
from ..ndarray import create

_generators = {}
_seed = [None]


def _generator(device):
    """The generator of one device; only that device's worker thread draws from it."""
    if device not in _generators:
        kind = 0 if device.kind == 'cpu' else 1
        # One integer per device (CuPy's generators take only an int): distinct streams.
        seed = None if _seed[0] is None else (_seed[0] * 2 + kind) * 1024 + device.index
        _generators[device] = device.xp.random.default_rng(seed)
    return _generators[device]


def seed(value):
    """Make every later draw on every device repeatable."""
    engine.wait_all()
    _seed[0] = int(value)
    _generators.clear()


def normal(loc=0.0, scale=1.0, size=(), dtype=numpy.float32, device=None):
    device = device or cpu()

    def draw(xp, shape, dtype):
        values = _generator(device).standard_normal(shape, dtype=dtype)
        return values * dtype.type(scale) + dtype.type(loc)
    return create(size, dtype, device, draw, 'random_normal')


def uniform(low=0.0, high=1.0, size=(), dtype=numpy.float32, device=None):
    device = device or cpu()

    def draw(xp, shape, dtype):
        values = _generator(device).random(shape, dtype=dtype)
        return values * dtype.type(high - low) + dtype.type(low)
    return create(size, dtype, device, draw, 'random_uniform')
