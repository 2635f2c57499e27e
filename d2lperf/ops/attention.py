"""Attention in tiles, FlashAttention's idea: softmax(q kᵀ / √d) v computed one block of
queries against one block of keys at a time, so that the (seq, seq) matrix of scores is never
made. Taught in "Long Sequences and Many Experts"; `npx.attention` is its front end.

Forward (FlashAttention-2's): for each block of query rows, walk the key/value blocks with an
online softmax, a running max m and sum l per row; a new block that raises the max scales
what was summed before by exp(m_old - m_new). Backward recomputes each block's probabilities
from the saved log-sum-exp L = m + log l, as exp(scores - L), rather than keeping them.

An operation here has one output, so the rows' log-sum-exps ride along as one more column:
the op returns (..., seq, d + 1), out then L, and `npx.attention` hands back the view of the
first d columns. What the tape keeps is then q, k, v and that array: O(seq) per row.

The loop counts the bytes it moves between the full arrays and its tiles (`Traffic`), which
Dao et al. (2022, Theorem 2) call HBM accesses: `counted_traffic` runs it, `tiled_traffic`
is the same number as a formula. The tiles and the saved out and L are one precision wider
than the inputs (`saved_dtype`): the output is rounded to the inputs' dtype once.

On a GPU in float16 (bfloat16 too, where the arrays have it: CuPy has no bfloat16 dtype
today), with NVIDIA's cuDNN frontend installed, cuDNN's fused attention (`sdpa` and
`sdpa_backward`, cudnn.py) computes both passes: the same packed (out, L), so the tape keeps
what it keeps here. float32 stays on these tiles of cuBLAS products: cuDNN has no float32
attention.
"""
import math

import numpy

from . import cudnn
from .registry import defop
from .rules import differentiable, result_type


# -- what moves between the full arrays and the tiles -----------------------------------------

class Traffic:
    """Bytes read from full arrays into tiles and written from tiles back: what on a GPU
    moves between HBM and on-chip SRAM. NumPy has no SRAM; counting shows the algorithm's."""

    def __init__(self):
        self.bytes = 0

    def load(self, full, start, stop, dtype):
        """Rows start:stop of `full` (..., seq, width) as a tile in `dtype`."""
        tile = full[..., start:stop, :]
        self.bytes += tile.nbytes
        return tile.astype(dtype, copy=False)

    def store(self, full, start, tile):
        """Write `tile` into `full` from row `start` and column 0 on."""
        target = full[..., start:start + tile.shape[-2], :tile.shape[-1]]
        target[...] = tile
        self.bytes += target.nbytes


def keys_seen(stop, seq, cols, causal):
    """How many keys a block of queries ending at row `stop` reads: all of them, or under a
    causal mask the key blocks that start before `stop` (a block is read whole or not)."""
    return min(seq, -(-stop // cols) * cols) if causal else seq


def query_blocks(seq, rows):
    return [(start, min(start + rows, seq)) for start in range(0, seq, rows)]


def future(xp, query_start, query_stop, key_start, key_stop):
    """True where a key comes after its query, for one tile."""
    return xp.arange(key_start, key_stop)[None, :] > xp.arange(query_start, query_stop)[:, None]


def tile_scores(xp, q_tile, k_tile, query_rows, key_rows, causal):
    """q kᵀ / √d for one tile, -inf where the causal mask hides a key."""
    scores = q_tile @ xp.swapaxes(k_tile, -1, -2)
    scores *= 1 / math.sqrt(q_tile.shape[-1])
    if causal and key_rows[1] - 1 > query_rows[0]:          # the tile crosses the diagonal
        scores = xp.where(future(xp, *query_rows, *key_rows), -numpy.inf, scores)
    return scores


# -- forward: one block of queries against every block of keys --------------------------------

def attend(xp, q_tile, k, v, query_rows, causal, cols, traffic):
    """Out and log-sum-exp for one block of query rows, walking the key/value blocks with an
    online softmax. The first key block holds key 0, which every query sees, so the running
    max is finite after it and exp(old max - new max) is never nan."""
    seq, dtype = k.shape[-2], q_tile.dtype
    maximum = xp.full(q_tile.shape[:-1] + (1,), -numpy.inf, dtype)
    total = xp.zeros_like(maximum)
    out = xp.zeros_like(q_tile)
    for key_start in range(0, keys_seen(query_rows[1], seq, cols, causal), cols):
        key_rows = key_start, min(key_start + cols, seq)
        k_tile, v_tile = (traffic.load(a, *key_rows, dtype) for a in (k, v))
        scores = tile_scores(xp, q_tile, k_tile, query_rows, key_rows, causal)
        new_maximum = xp.maximum(maximum, scores.max(axis=-1, keepdims=True))
        p = xp.exp(scores - new_maximum)
        shrink = xp.exp(maximum - new_maximum)
        total = total * shrink + p.sum(axis=-1, keepdims=True)
        out = out * shrink + p @ v_tile
        maximum = new_maximum
    return out / total, maximum + xp.log(total)


def tiled_forward(xp, q, k, v, causal, block_size, traffic):
    """(..., seq, d + 1): each row's output, then its log-sum-exp."""
    rows, cols = block_size
    dtype = saved_dtype(q.dtype, k.dtype, v.dtype)
    packed = xp.empty(q.shape[:-1] + (q.shape[-1] + 1,), dtype)
    for query_rows in query_blocks(q.shape[-2], rows):
        q_tile = traffic.load(q, *query_rows, dtype)
        out, log_sum_exp = attend(xp, q_tile, k, v, query_rows, causal, cols, traffic)
        traffic.store(packed, query_rows[0], xp.concatenate([out, log_sum_exp], axis=-1))
    return packed


def attention(xp, q, k, v, causal=True, block_size=(64, 64)):
    """The packed (out, L). On a GPU in half precision, cuDNN's fused attention computes it
    (cudnn.py; it has no float32 path): the same tiles and online softmax in one kernel,
    whose softmax stats are this L. Elsewhere, the tiles above."""
    fused = None if xp is numpy else cudnn.attention_forward(xp, q, k, v, causal)
    if fused is None:
        return tiled_forward(xp, q, k, v, causal, block_size, Traffic())
    out, log_sum_exp = fused
    packed = xp.empty(q.shape[:-1] + (q.shape[-1] + 1,), saved_dtype(q.dtype))
    packed[..., :-1], packed[..., -1:] = out, log_sum_exp
    return packed


# -- backward: recompute each tile's probabilities from L ---------------------------------------

def attention_vjp(xp, g, packed, q, k, v, causal=True, block_size=(64, 64)):
    """FlashAttention-2's backward: the outer loop over key blocks keeps dk and dv of one
    block in tiles; the inner loop over query blocks adds into dq. With D = rowsum(dO ∘ O),
    dS = P ∘ (dO vᵀ - D); a gradient reaching L itself (dL/dS = P) joins as D - dL."""
    width = q.shape[-1]
    fused = None if xp is numpy else cudnn.attention_backward(
        xp, g, packed[..., :width], packed[..., width:], q, k, v, causal)
    if fused is not None:                   # cuDNN's, from the same out and L
        return fused
    rows, cols = block_size
    seq, dtype = q.shape[-2], packed.dtype
    g = g.astype(dtype, copy=False)
    g_out, out, log_sum_exp = g[..., :width], packed[..., :width], packed[..., width:]
    row_term = (g_out * out).sum(axis=-1, keepdims=True) - g[..., width:]
    scale = 1 / math.sqrt(width)
    dq, dk, dv = (xp.zeros(a.shape, dtype) for a in (q, k, v))
    for key_rows in query_blocks(seq, cols):
        k_tile, v_tile = (a[..., slice(*key_rows), :].astype(dtype, copy=False) for a in (k, v))
        for query_rows in query_blocks(seq, rows):
            if causal and query_rows[1] <= key_rows[0]:      # every key here is in the future
                continue
            at = slice(*query_rows)
            q_tile = q[..., at, :].astype(dtype, copy=False)
            p = xp.exp(tile_scores(xp, q_tile, k_tile, query_rows, key_rows, causal)
                       - log_sum_exp[..., at, :])
            dv[..., slice(*key_rows), :] += xp.swapaxes(p, -1, -2) @ g_out[..., at, :]
            d_scores = p * (g_out[..., at, :] @ xp.swapaxes(v_tile, -1, -2) - row_term[..., at, :])
            d_scores *= scale
            dq[..., at, :] += d_scores @ k_tile
            dk[..., slice(*key_rows), :] += xp.swapaxes(d_scores, -1, -2) @ q_tile
    return tuple(d.astype(a.dtype, copy=False) for d, a in ((dq, q), (dk, k), (dv, v)))


# -- shapes --------------------------------------------------------------------------------------

def saved_dtype(*dtypes):
    """The tiles' and the saved (out, L)'s dtype: one precision wider than the inputs, float32
    for half, float64 for float32 and float64. The whole matrix's float32 gradients are up to
    8e-7 (of their largest value) from exact, so tiles within 1e-6 of them must be nearly
    exact: float32 tiles came within 1e-6 of exact, but 1.4e-6 of the whole matrix's."""
    dtype = numpy.dtype(result_type(*map(numpy.dtype, dtypes)))
    if not differentiable(dtype):
        raise ValueError(f'attention needs floating q, k and v, got {dtype}: cast them first')
    return numpy.dtype(numpy.float32 if dtype.itemsize < 4 else numpy.float64)


def check_shapes(q, k, v):
    if len(q.shape) != 4 or tuple(k.shape) != tuple(q.shape) or tuple(v.shape) != tuple(q.shape):
        raise ValueError('attention needs q, k and v of one shape (batch, heads, seq, d), got '
                         f'{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}')


def block_pair(block_size):
    """(query rows, key rows) from an int (square tiles) or a pair, or a ValueError."""
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(b, int) and b > 0 for b in pair)):
        raise ValueError('attention in tiles needs block_size = a positive int, or a pair '
                         f'(query rows, key rows) of them, got {block_size!r}')
    return tuple(pair)


def attention_infer(q, k, v, causal=True, block_size=(64, 64)):
    check_shapes(q, k, v)
    block_pair(block_size)
    return tuple(q.shape[:-1]) + (q.shape[-1] + 1,), saved_dtype(q.dtype, k.dtype, v.dtype)


defop('attention', attention, attention_infer, attention_vjp)


# -- the bytes the forward moves, counted and as a formula --------------------------------------

def counted_traffic(seq, width, block_size, causal=True, dtype='float32'):
    """Bytes the forward's tile loop moves for one (batch, head) of `seq` rows of `width`."""
    q = numpy.zeros((1, 1, seq, width), dtype)
    traffic = Traffic()
    tiled_forward(numpy, q, q, q, causal, block_size, traffic)
    return traffic.bytes


def tiled_traffic(seq, width, block_size, causal=True, dtype='float32'):
    """The same as a formula: q read once, k and v once per block of queries (the keys it
    sees), out and L written once. With square blocks of B rows that divide seq, the keys
    read are seq²/B, or seq(seq + B)/2B under the causal mask: Θ(seq² d / B)."""
    rows, cols = block_size
    keys_read = sum(keys_seen(stop, seq, cols, causal) for _, stop in query_blocks(seq, rows))
    itemsize, saved = numpy.dtype(dtype).itemsize, numpy.dtype(saved_dtype(dtype)).itemsize
    return itemsize * (seq * width + 2 * keys_read * width) + saved * seq * (width + 1)


def whole_matrix_traffic(seq, width, dtype='float32'):
    """Bytes the whole-matrix version's four operations (q kᵀ, the scaling, the softmax,
    the product with v) read and write, each reading its inputs and writing its output once:
    4·seq·d + 6·seq², Theorem 2's Θ(Nd + N²)."""
    return numpy.dtype(dtype).itemsize * (4 * seq * width + 6 * seq * seq)


def on_chip_elements(block_size, width):
    """What one tile step holds on chip, the paper's M: the q tile and the out tile, the k and
    v tiles, the scores."""
    rows, cols = block_size
    return 2 * rows * width + 2 * cols * width + rows * cols
