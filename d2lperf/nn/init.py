"""Initializers: how a parameter's first values are drawn."""
import math

from .. import np


class Initializer:
    def __call__(self, shape, device):
        raise NotImplementedError


class Uniform(Initializer):
    """U(-scale, scale); MXNet's default with scale 0.07."""

    def __init__(self, scale=0.07):
        self.scale = scale

    def __call__(self, shape, device):
        return np.random.uniform(-self.scale, self.scale, size=shape, device=device)


class Normal(Initializer):
    def __init__(self, sigma=0.01):
        self.sigma = sigma

    def __call__(self, shape, device):
        return np.random.normal(0.0, self.sigma, size=shape, device=device)


class Xavier(Initializer):
    """Uniform with the variance that keeps activations' scale through a layer (Glorot, 2010)."""

    def __call__(self, shape, device):
        fan_out, fan_in = shape[0], math.prod(shape[1:])
        scale = math.sqrt(6.0 / (fan_in + fan_out))
        return np.random.uniform(-scale, scale, size=shape, device=device)


class Constant(Initializer):
    def __init__(self, value):
        self.value = value

    def __call__(self, shape, device):
        return np.full(shape, self.value, device=device)


class Zeros(Constant):
    """All zeros: biases, and whatever must start with no effect (a residual branch's last
    scale).

    Named `Zeros` so that `Zero` alone means ZeRO, `d2l.data_parallel.Zero(net, stage, ...)`,
    the design's name for sharded training. MXNet calls this initializer `mx.init.Zero`, so
    `init.Zero` stays, an alias, for readers who know Gluon.
    """

    def __init__(self):
        super().__init__(0.0)


Zero = Zeros      # MXNet's name (mx.init.Zero); not ZeRO, which is d2l.data_parallel.Zero
