"""The operations a Transformer adds to a dense network: looking up embeddings, adding
learnt positions, layer normalization, GELU and a causal softmax over attention scores.
Taught in "Model Parallelism", whose small GPT is built from them (`d2lperf.nn.transformer`).

Each is one operation with its own gradient, rather than a chain of smaller ones, so that
the tape keeps one node (and one saved input) per layer instead of five.
"""
import functools
import math

import numpy

from ..engine import pieces
from .nn import ids_in_range, integer_ids
from .registry import defop
from .rules import floating, result_type, same

FLOAT32 = numpy.dtype(numpy.float32)

# How much sooner than a copy each pass gains from being cut (`pieces.count`'s weight), measured
# on the course's 2-core VM (RESULTS.md, "Pieces for the GPT's passes"): cut in two, GELU, its
# gradient and the softmax ran faster from 1 MB, layer norm and its gradient from 2 MB, the
# softmax's gradient from 4 MB, where a copy needs 8. Not their time per byte: a pass of many
# short NumPy calls gains late, each call taking the interpreter lock in turn with the others.
WEIGHTS = {'gelu': 8, 'causal_softmax': 8, 'causal_softmax_vjp': 2, 'layer_norm': 4,
           'layer_norm_vjp': 4}


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


def working_dtype(*dtypes):
    """The dtype of arithmetic between arrays of `dtypes`, each in working precision."""
    return result_type(*(FLOAT32 if numpy.dtype(d).itemsize < 4 else numpy.dtype(d)
                         for d in dtypes))


def row_sums(xp, a):
    """Sums along the last axis (kept, as size 1) as one einsum, each row summed alone: NumPy's
    own reduction along short rows pays a loop per row (0.125 ms for 2,048 rows of 128, the
    einsum 0.048); a product with ones is as fast, but BLAS sums a row by kernels that depend
    on the rows around it (and a lone row is a dot product), so the values would change with
    the rows a piece holds (`pieces`)."""
    rows = working_precision(a.reshape(-1, a.shape[-1]))
    return xp.einsum('ij->i', rows).reshape(a.shape[:-1] + (1,))


def row_dots(xp, a, b):
    """sum(a * b) along the last axis (kept, as size 1), without making a * b."""
    width = a.shape[-1]
    rows_a, rows_b = (working_precision(v.reshape(-1, width)) for v in (a, b))
    return xp.einsum('ij,ij->i', rows_a, rows_b).reshape(a.shape[:-1] + (1,))


def normalized(xp, x, eps, out=None):
    """(x - mean) / std along the last axis (into `out` if given: it has x's working
    precision), and 1 / std (which the gradient needs), in x's working precision: one new
    array, the other passes in place."""
    width = x.shape[-1]
    mean = row_sums(xp, x) / width           # in working precision: float32 for half
    centred = xp.subtract(x, mean, dtype=mean.dtype, out=out)
    inverse_std = 1 / xp.sqrt(row_dots(xp, centred, centred) / width + eps)
    centred *= inverse_std
    return centred, inverse_std


def by_rows(xp, x, kernel, *outs, weight):
    """Run `kernel(start, stop)` over the rows of `x` (its last axis the row), in pieces where
    large; `outs` are (rows, width) arrays it fills, given back shaped as `x`."""
    rows = math.prod(x.shape[:-1])
    pieces.over_axis(xp, rows, x.nbytes, kernel, weight)
    return tuple(out.reshape(x.shape) for out in outs)


def layer_norm(xp, x, gamma, beta, eps=1e-5):
    """Row by row, in pieces where large. In half precision the whole normalization runs in
    float32 and rounds once at the end: ml_dtypes cannot subtract float32 statistics into a
    bfloat16 result, and a float16 x - mean would round before the scaling that brings it
    back to order 1."""
    dtype = result_type(x.dtype, gamma.dtype, beta.dtype)
    rows = x.reshape(-1, x.shape[-1])
    out = xp.empty(rows.shape, dtype)

    def block(start, stop):
        into = out[start:stop] if out.dtype == working_dtype(x.dtype) else None
        normal, _ = normalized(xp, rows[start:stop], eps, into)
        normal = normal.astype(result_type(normal.dtype, dtype), copy=False)
        normal *= gamma
        normal += beta
        if into is None:
            out[start:stop] = normal.astype(dtype, copy=False)
    return by_rows(xp, x, block, out, weight=WEIGHTS['layer_norm'])[0]


def layer_norm_vjp(xp, g, out, x, gamma, beta, eps=1e-5):
    """The statistics are recomputed rather than saved: one more pass over x costs less
    memory than keeping two arrays per layer until backward. Half precision works in
    float32, as the forward does, and rounds each gradient once. Rows apart, in pieces where
    large; gamma's and beta's gradients are sums over every row, taken whole after."""
    width = x.shape[-1]
    rows_x, rows_g = x.reshape(-1, width), g.reshape(-1, width)
    d_x = xp.empty(rows_x.shape, result_type(g.dtype, x.dtype))
    scaled = xp.empty(rows_x.shape, working_dtype(g.dtype, x.dtype))  # g x_hat, for d_gamma
    in_place = d_x.dtype == working_dtype(g.dtype, gamma.dtype)

    def block(start, stop):
        x_hat, inverse_std = normalized(xp, rows_x[start:stop], eps)
        g_wide = working_precision(rows_g[start:stop])
        xp.multiply(g_wide, x_hat, out=scaled[start:stop])
        d_hat = xp.multiply(g_wide, working_precision(gamma),
                            out=d_x[start:stop] if in_place else None)
        x_hat *= row_dots(xp, d_hat, x_hat) / width
        d_hat -= row_sums(xp, d_hat) / width
        d_hat -= x_hat
        d_hat *= inverse_std
        if not in_place:
            d_x[start:stop] = d_hat.astype(d_x.dtype, copy=False)
    d_x, scaled = by_rows(xp, x, block, d_x, scaled, weight=WEIGHTS['layer_norm_vjp'])
    sums = tuple(range(g.ndim - 1))
    d_gamma, d_beta = scaled.sum(axis=sums), working_precision(g).sum(axis=sums)
    return (d_x,) + tuple(d.astype(result_type(g.dtype, like.dtype), copy=False)
                          for d, like in ((d_gamma, gamma), (d_beta, beta)))


defop('layer_norm', layer_norm, layer_norm_infer, layer_norm_vjp)


# -- GELU, with GPT-2's tanh approximation ----------------------------------------------------

GELU_SCALE, GELU_CUBIC = math.sqrt(2 / math.pi), 0.044715


def gelu(xp, a):
    """0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))), in the dtype `floating` infers
    (integers become float64; ml_dtypes would widen bfloat16 to float32): one new array,
    every other pass in place, in pieces on the device's cores where large (`pieces`)."""
    a = a.astype(result_type(a.dtype, 1.0), copy=False)
    return pieces.elementwise(xp, functools.partial(gelu_into, xp), a, a,
                              weight=WEIGHTS['gelu'])


def gelu_into(xp, y, a):
    tanh_argument(xp, a, y)
    xp.tanh(y, out=y)
    y += 1
    y *= a
    y *= 0.5


def tanh_argument(xp, a, y):
    """sqrt(2/pi) (a + 0.044715 a^3) into `y`, written as a (c a² + s): three passes after
    the square (`out=`, so that a 0-d `a` gives an array, not a NumPy scalar)."""
    xp.multiply(a, a, out=y)
    y *= GELU_SCALE * GELU_CUBIC
    y += GELU_SCALE
    y *= a
    return y


def gelu_vjp(xp, g, out, a):
    """g · 0.5 (1 + t) (1 + a·slope·(1 - t)), t = tanh(...), slope its argument's derivative
    sqrt(2/pi) (1 + 3·0.044715 a²): the textbook sum of two terms, factored so that two
    arrays suffice (1 + t is 2 - (1 - t)); a new array costs more than a pass in place."""
    a = a.astype(result_type(a.dtype, 1.0), copy=False)
    return (pieces.elementwise(xp, functools.partial(gelu_gradient_into, xp), a, g, a,
                               weight=WEIGHTS['gelu']),)


def gelu_gradient_into(xp, d, g, a):
    t = tanh_argument(xp, a, xp.empty_like(a))
    xp.tanh(t, out=t)
    xp.subtract(1, t, out=t)                 # 1 - t
    xp.multiply(a, a, out=d)
    d *= 3 * GELU_SCALE * GELU_CUBIC
    d += GELU_SCALE
    d *= a                                   # a · slope
    d *= t
    d += 1
    xp.subtract(2, t, out=t)                 # 1 + t
    d *= t
    d *= g
    d *= 0.5


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
    """Each attention matrix on its own (a query's row reads only its own scores), so the
    matrices are cut into pieces for the device's cores where large (`pieces`)."""
    matrices = scores.reshape(-1, *scores.shape[-2:])
    out = xp.empty(matrices.shape, working_dtype(scores.dtype, FLOAT32))
    mask = future_mask(xp, scores.shape[-2:])

    def block(start, stop):
        softmax_into(xp, out[start:stop], matrices[start:stop], mask)
    pieces.over_axis(xp, len(matrices), out.nbytes, block, WEIGHTS['causal_softmax'])
    return out.reshape(scores.shape).astype(scores.dtype, copy=False)


def softmax_into(xp, e, scores, mask):
    """Into `e`, every pass in place. The mask is added (0 or -inf from a small table) rather
    than chosen with `where`, which costs four times as much."""
    xp.add(working_precision(scores), mask, out=e)
    e -= e.max(axis=-1, keepdims=True)       # the diagonal is never masked: max finite
    xp.exp(e, out=e)
    e *= 1 / row_sums(xp, e)


def future_mask(xp, shape):
    """-inf where a key comes after its query (`future`), else 0, as float32."""
    return xp.where(future(xp, *shape), -numpy.inf, 0).astype(numpy.float32)


def causal_softmax_vjp(xp, g, out, scores):
    """Softmax's gradient p (g - sum(g p)); a masked score has probability 0, so it gets
    none. The row sums of g·p are one einsum, which makes no product array. Rows apart, in
    pieces where large."""
    width = scores.shape[-1]
    rows_g, rows_p = g.reshape(-1, width), out.reshape(-1, width)
    d = xp.empty(rows_g.shape, working_dtype(g.dtype, out.dtype))

    def block(start, stop):
        g, p = working_precision(rows_g[start:stop]), working_precision(rows_p[start:stop])
        rows = xp.subtract(g, row_dots(xp, g, p), out=d[start:stop])
        rows *= p                            # on a name: `d[a:b] *= p` would copy back
    pieces.over_axis(xp, len(d), d.nbytes, block, WEIGHTS['causal_softmax_vjp'])
    return (d.reshape(scores.shape).astype(scores.dtype, copy=False),)


defop('causal_softmax', causal_softmax, causal_softmax_infer, causal_softmax_vjp)
