"""The layers of convolutional networks, as in Gluon: Conv2D, pooling, BatchNorm, Flatten.

Each is a HybridBlock around one npx operation, so a network of them can be hybridized and
exported like a stack of Dense layers. Input channels are learnt from the first batch, as
Dense learns its input width. Taught in "Training on Multiple GPUs".
"""
from ..np import extension as npx
from ..ops.rules import pair
from .block import HybridBlock, activation_function
from .init import Constant, Zero
from .parameter import Parameter


class Conv2D(HybridBlock):
    """`channels` filters of `kernel_size`, on NCHW images."""

    def __init__(self, channels, kernel_size, strides=1, padding=0, activation=None,
                 use_bias=True, in_channels=0):
        super().__init__()
        self.channels, self.kernel = channels, pair(kernel_size)
        self.strides, self.padding = pair(strides), pair(padding)
        self.activation, self.act = activation, activation_function(activation)
        self.weight = Parameter('weight', (channels, in_channels) + self.kernel)
        self.bias = Parameter('bias', (channels,), init=Zero()) if use_bias else None

    def forward(self, x):
        if 0 in self.weight.shape:
            self.weight.infer_shape((self.channels, x.shape[1]) + self.kernel)
        device = x.device
        y = npx.convolution(x, self.weight.data(device),
                            None if self.bias is None else self.bias.data(device),
                            kernel=self.kernel, stride=self.strides, pad=self.padding,
                            num_filter=self.channels)
        return self.act(y) if self.act else y

    def __repr__(self):
        return (f'Conv2D({self.weight.shape[1] or None} -> {self.channels}, '
                f'kernel_size={self.kernel}, stride={self.strides}, padding={self.padding})')


class _Pool2D(HybridBlock):
    pool_type = 'max'

    def __init__(self, pool_size=2, strides=None, padding=0):
        super().__init__()
        self.pool_size, self.padding = pair(pool_size), pair(padding)
        self.strides = pair(strides) if strides is not None else self.pool_size

    def forward(self, x):
        return npx.pooling(x, kernel=self.pool_size, stride=self.strides, pad=self.padding,
                           pool_type=self.pool_type)

    def __repr__(self):
        return (f'{type(self).__name__}(size={self.pool_size}, stride={self.strides}, '
                f'padding={self.padding})')


class MaxPool2D(_Pool2D):
    """The largest value of each window."""
    pool_type = 'max'


class AvgPool2D(_Pool2D):
    """The mean of each window (padding counts as zeros)."""
    pool_type = 'avg'


class GlobalAvgPool2D(HybridBlock):
    """Each channel's mean over the whole image: (N, C, H, W) -> (N, C, 1, 1)."""

    def forward(self, x):
        return npx.pooling(x, pool_type='avg', global_pool=True)

    def __repr__(self):
        return 'GlobalAvgPool2D()'


class BatchNorm(HybridBlock):
    """Normalize each channel over the batch while training, with running statistics in
    prediction. The running statistics are parameters without gradients: the layer updates
    them, the Trainer does not, and each device keeps its own."""

    def __init__(self, momentum=0.9, epsilon=1e-5, in_channels=0):
        super().__init__()
        self.momentum, self.epsilon = momentum, epsilon
        self.gamma = Parameter('gamma', (in_channels,), init=Constant(1.0))
        self.beta = Parameter('beta', (in_channels,), init=Zero())
        self.running_mean = Parameter('running_mean', (in_channels,), init=Zero(),
                                      grad_req='null')
        self.running_var = Parameter('running_var', (in_channels,), init=Constant(1.0),
                                     grad_req='null')

    def forward(self, x):
        params = (self.gamma, self.beta, self.running_mean, self.running_var)
        if 0 in self.gamma.shape:
            for param in params:
                param.infer_shape((x.shape[1],))
        device = x.device
        return npx.batch_norm(x, *(p.data(device) for p in params), eps=self.epsilon,
                              momentum=self.momentum)

    def __repr__(self):
        return f'BatchNorm({self.gamma.shape[0] or None} channels)'


class Flatten(HybridBlock):
    """(N, ...) -> (N, everything else), between convolutions and dense layers."""

    def forward(self, x):
        return npx.flatten(x)

    def __repr__(self):
        return 'Flatten()'
