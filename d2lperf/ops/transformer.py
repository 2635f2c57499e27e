"""The operations a Transformer adds to a dense network: looking up embeddings, adding
learnt positions, layer normalization, GELU and a causal softmax over attention scores.
Taught in "Model Parallelism", whose small GPT is built from them (`d2lperf.nn.transformer`).

Each is one operation with its own gradient, rather than a chain of smaller ones, so that
the tape keeps one node (and one saved input) per layer instead of five.
"""
import math

import numpy

from .registry import defop
from .rules import floating, result_type, same


# -- embedding: rows of a table, picked by integer ids ----------------------------------------

def embedding_infer(index, weight):
    if len(weight.shape) != 2:
        raise ValueError(f'an embedding table is (rows, features), got shape {weight.shape}')
    return tuple(index.shape) + tuple(weight.shape[1:]), numpy.dtype(weight.dtype)


def embedding_vjp(xp, g, out, index, weight):
    """Scatter-add: a row read by several ids gets the sum of their gradients."""
    grad = xp.zeros(weight.shape, dtype=g.dtype)
    xp.add.at(grad, index.astype(numpy.int64).ravel(), g.reshape(-1, weight.shape[1]))
    return None, grad


defop('embedding', lambda xp, index, weight: weight[index.astype(numpy.int64)],
      embedding_infer, embedding_vjp)



# -- learnt positions: the first rows of a table, added to every sequence ---------------------

def add_position_embedding_infer(x, table):
    if len(x.shape) < 2 or x.shape[-2] > table.shape[0] or x.shape[-1:] != table.shape[1:]:
        raise ValueError(f'inputs (..., seq, features) of shape {x.shape} need a position '
                         f'table of at least seq rows of the same features, got {table.shape}')
    return tuple(x.shape), numpy.result_type(x.dtype, table.dtype)


def add_position_embedding_vjp(xp, g, out, x, table):
    grad = xp.zeros(table.shape, dtype=g.dtype)
    grad[:g.shape[-2]] = g.reshape(-1, *g.shape[-2:]).sum(axis=0)
    return g, grad


# One op with x, not `x + table[:seq]`: the slice reads the parameter alone, so a hybridized
# block would compute it once while tracing and keep it as a constant, never learning it.
defop('add_position_embedding', lambda xp, x, table: x + table[:x.shape[-2]],
      add_position_embedding_infer, add_position_embedding_vjp)

# -- layer normalization over the last axis ---------------------------------------------------

def layer_norm_infer(x, gamma, beta, eps=1e-5):
    if tuple(gamma.shape) != tuple(x.shape[-1:]) or tuple(beta.shape) != tuple(x.shape[-1:]):
        raise ValueError(f'layer_norm of shape {x.shape} needs gamma and beta of shape '
                         f'{x.shape[-1:]}, got {gamma.shape} and {beta.shape}')
    return tuple(x.shape), numpy.result_type(x.dtype, gamma.dtype, beta.dtype)


def normalized(xp, x, eps):
    """(x - mean) / std along the last axis, and 1 / std (which the gradient needs)."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    inverse_std = 1 / xp.sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps)
    return centred * inverse_std, inverse_std


def layer_norm(xp, x, gamma, beta, eps=1e-5):
    return normalized(xp, x, eps)[0] * gamma + beta


def layer_norm_vjp(xp, g, out, x, gamma, beta, eps=1e-5):
    """The statistics are recomputed rather than saved: one more pass over x costs less
    memory than keeping two arrays per layer until backward."""
    x_hat, inverse_std = normalized(xp, x, eps)
    rows = tuple(range(g.ndim - 1))
    d_hat = g * gamma
    d_x = inverse_std * (d_hat - d_hat.mean(axis=-1, keepdims=True)
                         - x_hat * (d_hat * x_hat).mean(axis=-1, keepdims=True))
    return d_x, (g * x_hat).sum(axis=rows), g.sum(axis=rows)


defop('layer_norm', layer_norm, layer_norm_infer, layer_norm_vjp)


# -- GELU, with GPT-2's tanh approximation ----------------------------------------------------

GELU_SCALE, GELU_CUBIC = math.sqrt(2 / math.pi), 0.044715


def gelu(xp, a):
    """0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), in the dtype `floating` infers
    (integers become float64; ml_dtypes would widen bfloat16 to float32)."""
    y = 0.5 * a * (1 + xp.tanh(GELU_SCALE * (a + GELU_CUBIC * a * a * a)))
    return y.astype(result_type(a.dtype, 1.0), copy=False)


def gelu_vjp(xp, g, out, a):
    t = xp.tanh(GELU_SCALE * (a + GELU_CUBIC * a * a * a))
    slope = GELU_SCALE * (1 + 3 * GELU_CUBIC * a * a)
    return (g * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * slope),)


defop('gelu', gelu, floating, gelu_vjp, kind='elementwise',
      c_expr=f'({{t}})0.5 * {{a}} * (({{t}})1 + tanh(({{t}}){GELU_SCALE!r} * ({{a}} + '
             f'({{t}}){GELU_CUBIC!r} * {{a}} * {{a}} * {{a}})))')


# -- causal softmax over attention scores (..., queries, keys) --------------------------------

def causal_softmax_infer(scores):
    if len(scores.shape) < 2 or scores.shape[-2] > scores.shape[-1]:
        raise ValueError('causal_softmax needs scores (..., queries, keys) with no more '
                         f'queries than keys, got shape {scores.shape}')
    return same(scores)


def future(xp, queries, keys):
    """True where key j comes after query i: the last query is the last key, so with a
    cache of earlier keys (keys > queries) query i sits at position i + keys - queries."""
    return xp.arange(keys)[None, :] > xp.arange(queries)[:, None] + (keys - queries)


def working_precision(a):
    """Half-precision scores are exponentiated in float32, where the shift by the row's max
    keeps exp in range and the sum does not round away small terms."""
    return a.astype(numpy.float32) if a.dtype.itemsize < 4 else a


def causal_softmax(xp, scores):
    a = working_precision(scores)
    a = xp.where(future(xp, *a.shape[-2:]), -xp.inf, a)
    e = xp.exp(a - a.max(axis=-1, keepdims=True))    # the diagonal is never masked: max finite
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def causal_softmax_vjp(xp, g, out, scores):
    """Softmax's gradient; a masked score has probability 0, so it gets none."""
    g, p = working_precision(g), working_precision(out)
    return ((p * (g - (g * p).sum(axis=-1, keepdims=True))).astype(scores.dtype),)


defop('causal_softmax', causal_softmax, causal_softmax_infer, causal_softmax_vjp)
