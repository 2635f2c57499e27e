"""Random arrays, drawn on the device that holds them, one generator per device
(`d2lperf.ops.random`)."""
import numpy

from .. import engine
from ..device import cpu
from .multiarray import create
from ..ops.random import generator, seed as reseed


def seed(value):
    """Make every later draw on every device repeatable (dropout masks included)."""
    engine.wait_all()
    reseed(value)


def normal(loc=0.0, scale=1.0, size=(), dtype=numpy.float32, device=None):
    device = device or cpu()

    def draw(xp, shape, dtype):
        values = generator(device).standard_normal(shape, dtype=dtype)
        return values * dtype.type(scale) + dtype.type(loc)
    return create(size, dtype, device, draw, 'random_normal')


def uniform(low=0.0, high=1.0, size=(), dtype=numpy.float32, device=None):
    device = device or cpu()

    def draw(xp, shape, dtype):
        values = generator(device).random(shape, dtype=dtype)
        return values * dtype.type(high - low) + dtype.type(low)
    return create(size, dtype, device, draw, 'random_uniform')
