"""`d2lperf.npx`: operators NumPy lacks (activations, softmax, picking, convolution, pooling,
batch normalization, a Transformer's embedding, layer norm, GELU, causal softmax and
attention) and engine controls. Images are NCHW: (batch, channels, height, width)."""
import math

from .. import engine
from .multiarray import apply
from ..ops.attention import block_pair, check_shapes
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


def embedding(index, weight):
    """`weight[index]`: the row of a (rows, features) table for each integer id."""
    return apply('embedding', index, weight)


def add_position_embedding(x, table):
    """`x + table[:seq]` for x of shape (..., seq, features): position i's learnt vector
    added at position i."""
    return apply('add_position_embedding', x, table)


def layer_norm(x, gamma, beta, eps=1e-5):
    """Normalize each vector along the last axis to mean 0 and variance 1, then scale by
    `gamma` and shift by `beta` (one value per feature)."""
    return apply('layer_norm', x, gamma, beta, eps=float(eps))


def gelu(x):
    """GELU with GPT-2's tanh approximation."""
    return apply('gelu', x)


def causal_softmax(scores):
    """Softmax of attention scores (..., queries, keys) along the keys, each query seeing
    only the keys at or before its own position."""
    return apply('causal_softmax', scores)


def attention(q, k, v, causal=True, block_size=None):
    """softmax(q kᵀ / √d) v for q, k, v of shape (batch, heads, seq, d), each query seeing
    only the keys at or before its own position when `causal`. block_size=None makes the
    whole (seq, seq) matrix of scores, which the tape keeps; an int (or a pair: query rows,
    key rows) walks tiles with an online softmax and never makes it (ops/attention.py).
    On a GPU in 16 bits, None means the attention op as one tile: cuDNN's fused attention
    where it runs (ops/cudnn.py), as PyTorch's scaled_dot_product_attention picks a fused
    kernel where one fits."""
    check_shapes(q, k, v)
    if block_size is None and q.device.kind == 'gpu' and q.dtype.itemsize == 2:
        block_size = (q.shape[-2], k.shape[-2])
    if block_size is None:
        scores = (q @ k.transpose(0, 1, 3, 2)) * (1 / math.sqrt(q.shape[-1]))
        return (causal_softmax(scores) if causal else softmax(scores)) @ v
    packed = apply('attention', q, k, v, causal=bool(causal), block_size=block_pair(block_size))
    out = packed[..., :q.shape[-1]]                 # then each row's log-sum-exp, for backward
    return out if out.dtype == q.dtype else out.astype(q.dtype)


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
