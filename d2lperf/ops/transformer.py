"""The operations a Transformer adds to a dense network: looking up embeddings, adding
learnt positions, layer normalization, GELU and a causal softmax over attention scores.
Taught in "Model Parallelism", whose small GPT is built from them (`d2lperf.nn.transformer`).

Each is one operation with its own gradient, rather than a chain of smaller ones, so that
the tape keeps one node (and one saved input) per layer instead of five.
"""
import math

import numpy

from .nn import ids_in_range, integer_ids
from .registry import defop
from .rules import floating, result_type, same


# -- embedding: rows of a table, picked by integer ids ----------------------------------------

def embedding_infer(index, weight):
    if len(weight.shape) != 2:
        raise ValueError(f'an embedding table is (rows, features), got shape {weight.shape}')
    integer_ids(index, "an embedding's ids")
    return tuple(index.shape) + tuple(weight.shape[1:]), numpy.dtype(weight.dtype)


def embedding_vjp(xp, g, out, index, weight):
    """Scatter-add: a row read by several ids gets the sum of their gradients. NumPy's
    `add.at` adds one row at a time (1.6 ms for 2,048 ids of 128 features); sorting the ids
    and summing each run of equal ones with `add.reduceat` took 0.27 ms. CuPy's `add.at` is
    one atomic kernel already."""
    grad = xp.zeros(weight.shape, dtype=g.dtype)
    ids, rows = index.astype(numpy.int64).ravel(), g.reshape(-1, weight.shape[1])
    if xp.__name__ != 'numpy':
        xp.add.at(grad, ids, rows)
        return None, grad
    order = numpy.argsort(ids, kind='stable')
    ids = ids[order]
    starts = numpy.flatnonzero(numpy.diff(ids, prepend=-1))          # ids are never -1
    grad[ids[starts]] = numpy.add.reduceat(rows[order], starts, axis=0)
    return None, grad


def embedding(xp, index, weight):
    rows = weight.shape[0]
    return weight[ids_in_range(xp, index, rows, 'id', f'an embedding of {rows} rows (its '
                                                       'vocabulary)')]


defop('embedding', embedding, embedding_infer, embedding_vjp)



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


def working_precision(a):
    """Half precision is summed (and scores exponentiated) in float32, where the sum does not
    round away small terms and the shift by the row's max keeps exp in range."""
    return a.astype(numpy.float32) if a.dtype.itemsize < 4 else a


def row_sums(xp, a):
    """Sums along the last axis (kept, as size 1) as one matrix-vector product: NumPy's own
    reduction along short rows pays a loop per row, BLAS runs through them at memory speed."""
    rows = working_precision(a.reshape(-1, a.shape[-1]))
    return (rows @ xp.ones(a.shape[-1], rows.dtype)).reshape(a.shape[:-1] + (1,))


def row_dots(xp, a, b):
    """sum(a * b) along the last axis (kept, as size 1), without making a * b."""
    width = a.shape[-1]
    rows_a, rows_b = (working_precision(v.reshape(-1, width)) for v in (a, b))
    return xp.einsum('ij,ij->i', rows_a, rows_b).reshape(a.shape[:-1] + (1,))


def normalized(xp, x, eps):
    """(x - mean) / std along the last axis, and 1 / std (which the gradient needs), in x's
    working precision: one new array, the other passes in place."""
    width = x.shape[-1]
    mean = row_sums(xp, x) / width           # in working precision: float32 for half
    centred = xp.subtract(x, mean, dtype=mean.dtype)
    inverse_std = 1 / xp.sqrt(row_dots(xp, centred, centred) / width + eps)
    centred *= inverse_std
    return centred, inverse_std


def layer_norm(xp, x, gamma, beta, eps=1e-5):
    """In half precision the whole normalization runs in float32 and rounds once at the
    end: ml_dtypes cannot subtract float32 statistics into a bfloat16 result, and a float16
    x - mean would round before the scaling that brings it back to order 1."""
    dtype = result_type(x.dtype, gamma.dtype, beta.dtype)
    out, _ = normalized(xp, x, eps)
    out = out.astype(result_type(out.dtype, dtype), copy=False)
    out *= gamma
    out += beta
    return out.astype(dtype, copy=False)


def layer_norm_vjp(xp, g, out, x, gamma, beta, eps=1e-5):
    """The statistics are recomputed rather than saved: one more pass over x costs less
    memory than keeping two arrays per layer until backward. Half precision works in
    float32, as the forward does, and rounds each gradient once."""
    x_hat, inverse_std = normalized(xp, x, eps)
    g_wide = working_precision(g)
    width, rows = x.shape[-1], tuple(range(g.ndim - 1))
    d_gamma, d_beta = (g_wide * x_hat).sum(axis=rows), g_wide.sum(axis=rows)
    d_hat = g_wide * working_precision(gamma)
    x_hat *= row_dots(xp, d_hat, x_hat) / width
    d_hat -= row_sums(xp, d_hat) / width
    d_hat -= x_hat
    d_hat *= inverse_std
    return tuple(d.astype(result_type(g.dtype, like.dtype), copy=False)
                 for d, like in ((d_hat, x), (d_gamma, gamma), (d_beta, beta)))


defop('layer_norm', layer_norm, layer_norm_infer, layer_norm_vjp)


# -- GELU, with GPT-2's tanh approximation ----------------------------------------------------

GELU_SCALE, GELU_CUBIC = math.sqrt(2 / math.pi), 0.044715


def gelu(xp, a):
    """0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), in the dtype `floating` infers
    (integers become float64; ml_dtypes would widen bfloat16 to float32): one new array,
    every other pass in place."""
    a = a.astype(result_type(a.dtype, 1.0), copy=False)
    y = tanh_argument(xp, a)
    xp.tanh(y, out=y)
    y += 1
    y *= a
    y *= 0.5
    return y


def tanh_argument(xp, a):
    """sqrt(2/pi) (a + 0.044715 a^3), written as a (c a² + s): a new array and three passes
    (`out=`, so that a 0-d `a` gives an array, not a NumPy scalar)."""
    y = xp.multiply(a, a, out=xp.empty_like(a))
    y *= GELU_SCALE * GELU_CUBIC
    y += GELU_SCALE
    y *= a
    return y


def gelu_vjp(xp, g, out, a):
    """g · 0.5 (1 + t) (1 + a·slope·(1 - t)), t = tanh(...), slope its argument's derivative
    sqrt(2/pi) (1 + 3·0.044715 a²): the textbook sum of two terms, factored so that two
    arrays suffice (1 + t is 2 - (1 - t)); a new array costs more than a pass in place."""
    a = a.astype(result_type(a.dtype, 1.0), copy=False)
    t = tanh_argument(xp, a)
    xp.tanh(t, out=t)
    xp.subtract(1, t, out=t)                 # 1 - t
    d = xp.multiply(a, a, out=xp.empty_like(a))
    d *= 3 * GELU_SCALE * GELU_CUBIC
    d += GELU_SCALE
    d *= a                                   # a · slope
    d *= t
    d += 1
    xp.subtract(2, t, out=t)                 # 1 + t
    d *= t
    d *= g
    d *= 0.5
    return (d,)


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


def causal_softmax(xp, scores):
    """One new array, every pass after it in place. The mask is added (0 or -inf from a
    small table) rather than chosen with `where`, which costs four times as much."""
    e = working_precision(scores) + future_mask(xp, scores.shape[-2:])
    e -= e.max(axis=-1, keepdims=True)       # the diagonal is never masked: max finite
    xp.exp(e, out=e)
    e *= 1 / row_sums(xp, e)
    return e.astype(scores.dtype, copy=False)


def future_mask(xp, shape):
    """-inf where a key comes after its query (`future`), else 0, as float32."""
    return xp.where(future(xp, *shape), -numpy.inf, 0).astype(numpy.float32)


def causal_softmax_vjp(xp, g, out, scores):
    """Softmax's gradient p (g - sum(g p)); a masked score has probability 0, so it gets
    none. The row sums of g·p are one einsum, which makes no product array."""
    g, p = working_precision(g), working_precision(out)
    d = g - row_dots(xp, g, p)
    d *= p
    return (d.astype(scores.dtype, copy=False),)


defop('causal_softmax', causal_softmax, causal_softmax_infer, causal_softmax_vjp)
