"""`d2lperf.npx`: operators NumPy lacks (activations, softmax, picking, convolution, pooling,
batch normalization) and engine controls. Images are NCHW: (batch, channels, height, width)."""
from .. import engine
from .multiarray import apply
from ..ops.rules import pair
from .tape import TAPE


def relu(x):
    return apply('relu', x)


def sigmoid(x):
    return apply('sigmoid', x)


def softmax(x):
    """Softmax along the last axis."""
    return apply('softmax', x)


def log_softmax(x):
    """Log-softmax along the last axis, computed stably in one operation."""
    return apply('log_softmax', x)


def pick(x, index):
    """`x[i, ..., index[i, ...]]` along the last axis: the score of each example's label."""
    return apply('pick', x, index)


def fully_connected(x, weight, bias):
    """`x @ weight.T + bias`, the whole of a Dense layer as one operation."""
    return apply('fully_connected', x, weight, bias)


def convolution(data, weight, bias=None, kernel=(3, 3), stride=(1, 1), pad=(0, 0),
                num_filter=1):
    """A 2-D convolution of `data` with `num_filter` filters `weight` (F, C, kh, kw)."""
    return apply('convolution', data, weight, 0 if bias is None else bias, kernel=pair(kernel),
                 stride=pair(stride), pad=pair(pad), num_filter=int(num_filter))


def pooling(data, kernel=(2, 2), stride=None, pad=(0, 0), pool_type='max', global_pool=False):
    """Max or average pooling over windows; `stride` defaults to the window (no overlap), and
    `global_pool` pools each channel's whole image to one value."""
    if global_pool:
        kernel, stride, pad = data.shape[2:], (1, 1), (0, 0)
    kernel = pair(kernel)
    return apply('pooling', data, kernel=kernel, stride=pair(stride or kernel), pad=pair(pad),
                 pool_type=pool_type)


def batch_norm(data, gamma, beta, running_mean, running_var, eps=1e-5, momentum=0.9,
               use_global_stats=False):
    """Normalize each channel: with the batch's statistics while training (and update the
    running ones, in place), with the running statistics in prediction."""
    training = TAPE.training and not use_global_stats
    return apply('batch_norm_train' if training else 'batch_norm_predict', data, gamma, beta,
                 running_mean, running_var, eps=float(eps), momentum=float(momentum))


def flatten(data):
    """Keep the first (batch) axis, flatten the rest: (N, C, H, W) -> (N, C·H·W)."""
    return data.reshape(data.shape[0], -1)


def waitall():
    """Block until every pushed operation has finished (a barrier for the whole engine)."""
    engine.wait_all()
