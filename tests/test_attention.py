"""Attention in tiles (ops/attention.py, `npx.attention`): equal to the GPT's whole-matrix
attention with the same gradients, what the tape keeps (O(seq) against O(seq²), to the byte),
the bytes the tile loop moves against its formula, and the same results hybridized."""
import gc
import math
import tracemalloc

import ml_dtypes
import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

import d2lperf as d2l
from d2lperf import autograd, hybrid, np, npx, nn, ops
from d2lperf.ops import attention as tiles

from strategies import checks
from strategies.ops import attention_problems

RNG = numpy.random.default_rng(0)


def gpt_attention(q, k, v, causal=True):
    """What the GPT's CausalSelfAttention computes today (nn/transformer.py), full mask too."""
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1 / math.sqrt(q.shape[-1]))
    return (npx.causal_softmax(scores) if causal else npx.softmax(scores)) @ v


def output_and_gradients(f, values, weights):
    """f(q, k, v) and the gradients of sum(f · weights) for q, k and v, as NumPy arrays."""
    xs = [np.array(v) for v in values]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        out = f(*xs)
        loss = (out * np.array(weights)).sum()
    loss.backward()
    return [out.asnumpy()] + [x.grad.asnumpy() for x in xs]


def relative_error(got, want):
    """max |got - want| / max |want| (or / 1 where want is all zeros: dq for one key)."""
    return float(numpy.abs(got.astype(numpy.float64) - want).max()
                 / (numpy.abs(want).max() or 1))


def problem_values(shape, dtype, seed=0):
    """q, k, v and the weights of a loss, normal values."""
    rng = numpy.random.default_rng(seed)
    return [rng.normal(size=shape).astype(dtype) for _ in range(4)]


# -- equal to the GPT's attention, forward and backward -----------------------------------------

@checks(40)
@given(problem=attention_problems(max_seq=20), dtype=st.sampled_from(['float32', 'float64']),
       seed=st.integers(0, 2 ** 16))
def test_tiles_equal_the_gpts_attention_and_its_gradients(problem, dtype, seed):
    """Block sizes that do and do not divide seq, square and not, past seq, causal and full:
    output and the gradients of q, k, v as max |difference| / max |value|. In float64 within
    1e-12 of the GPT's. In float32 within 1e-6 of the GPT's formula computed exactly (in
    float64, on the same inputs), and so of the GPT's float32 result within 1e-6 beside that
    result's own rounding error: a gradient that sums to nearly zero (dk with one feature)
    has the GPT's float32 off by more than 1e-6 of its largest value on its own."""
    shape, block_size, causal = problem
    *values, weights = [a.astype(dtype) for a in problem_values(shape, 'float64', seed)]

    def gpt(*values):
        return output_and_gradients(lambda q, k, v: gpt_attention(q, k, v, causal), values,
                                    weights.astype(values[0].dtype))

    got = output_and_gradients(
        lambda q, k, v: npx.attention(q, k, v, causal=causal, block_size=block_size),
        values, weights)
    want, exact = gpt(*values), gpt(*(a.astype(numpy.float64) for a in values))
    for name, g, w, e in zip(('out', 'dq', 'dk', 'dv'), got, want, exact):
        assert g.dtype == numpy.dtype(dtype) and g.shape == w.shape
        if dtype == 'float64':
            assert relative_error(g, w) <= 1e-12, name
        else:
            assert relative_error(g, e) <= 1e-6, name
            assert relative_error(g, w) <= 1e-6 + relative_error(w, e), name


@pytest.mark.parametrize('causal', [True, False])
def test_block_size_none_is_the_gpts_attention_itself(causal):
    values = problem_values((2, 2, 7, 4), 'float32')[:3]
    got, want = (f(*map(np.array, values)).asnumpy()
                 for f in (lambda q, k, v: npx.attention(q, k, v, causal, None),
                           lambda q, k, v: gpt_attention(q, k, v, causal)))
    numpy.testing.assert_array_equal(got, want)


def test_the_causal_mask_hides_every_later_key():
    """Changing the last key and value changes only the last query's row."""
    q, k, v = problem_values((1, 1, 6, 3), 'float64')[:3]
    before = npx.attention(np.array(q), np.array(k), np.array(v), block_size=4).asnumpy()
    k[..., -1, :] += 5
    v[..., -1, :] -= 5
    after = npx.attention(np.array(q), np.array(k), np.array(v), block_size=4).asnumpy()
    numpy.testing.assert_array_equal(before[..., :-1, :], after[..., :-1, :])
    assert (before[..., -1, :] != after[..., -1, :]).all()


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_half_precision_keeps_its_dtype_and_rounds_once(dtype):
    """Half inputs are computed in float32 tiles and each result rounded once: within a unit
    or two in the dtype's last place of the float64 result on the same (rounded) inputs."""
    half = numpy.dtype(ml_dtypes.bfloat16) if dtype == 'bfloat16' else numpy.dtype(dtype)
    *values, weights = [a.astype(half) for a in problem_values((2, 2, 9, 4), 'float32')]
    got = output_and_gradients(lambda q, k, v: npx.attention(q, k, v, block_size=4),
                               values, weights)
    wide = output_and_gradients(lambda q, k, v: npx.attention(q, k, v, block_size=4),
                                [a.astype(numpy.float64) for a in values],
                                weights.astype(numpy.float64))
    assert all(g.dtype == half for g in got)
    for g, w in zip(got, wide):
        assert relative_error(g, w) <= 2 * float(ml_dtypes.finfo(half).eps)


@pytest.mark.parametrize('call, words', [
    (lambda q: npx.attention(q, q[:, :, :3], q, block_size=2), 'one shape'),
    (lambda q: npx.attention(q[0], q[0], q[0], block_size=2), '(batch, heads, seq, d)'),
    (lambda q: npx.attention(q, q, q, block_size=0), 'positive int'),
    (lambda q: npx.attention(q, q, q, block_size=(2, 3, 4)), 'positive int'),
    (lambda q: npx.attention(q, q, q, block_size=2.5), 'positive int'),
    (lambda q: npx.attention(q.astype('int32'), q.astype('int32'), q.astype('int32'),
                             block_size=2), 'floating'),
])
def test_bad_input_is_refused_by_name(call, words):
    with pytest.raises(ValueError, match=words.replace('(', r'\(').replace(')', r'\)')):
        call(np.ones((1, 2, 4, 3)))


# -- memory: what the tape keeps, and the peak through backward ----------------------------------

def activations_and_peak(seq, block_size, batch=2, heads=3, width=8):
    """Bytes of activations the forward leaves on the tape, and the peak above what was held
    before it, through forward and backward, from the ledger."""
    xs = [np.array(v) for v in problem_values((batch, heads, seq, width), 'float32')[:3]]
    for x in xs:
        x.attach_grad()
    d2l.npx.waitall()
    gc.collect()
    cpu = d2l.cpu()
    before = d2l.device.memory(cpu)
    d2l.device.reset_peak(cpu)
    with autograd.record():
        out = npx.attention(*xs, block_size=block_size)
    d2l.npx.waitall()
    gc.collect()
    kept = d2l.device.memory(cpu).by_kind['activations'] - before.by_kind['activations']
    out.backward()
    d2l.npx.waitall()
    gc.collect()
    return kept, d2l.device.memory(cpu).peak - before.total


@pytest.mark.parametrize('seq', [16, 32, 64])
def test_the_tape_keeps_linear_bytes_in_tiles_and_quadratic_whole(seq):
    """Per (batch, head), with float32 q, k, v of seq·d each (4 bytes a value):
    whole matrix: the tape keeps q, k, v and three (seq, seq) arrays (the scores, the scaled
    scores, the probabilities), and backward's peak holds six (seq, seq) arrays and four of
    seq·d; tiles: the tape keeps q, k, v and the saved out with its log-sum-exp, seq·(d + 1)
    in float64 (8 bytes); backward's peak holds the float32 out, the head's gradient, dq, dk,
    dv (seq·d each), the head's gradient widened to float64 and two of seq·(d + 1) in float64
    (the saved array and its gradient). The tiles themselves are the op's own scratch, which
    the ledger does not count: (rows, cols) per batch and head, whatever seq is."""
    d, heads = 8, 2 * 3
    kept, peak = activations_and_peak(seq, None, width=d)
    assert kept == heads * 4 * (3 * seq * d + 3 * seq * seq)
    assert peak == heads * 4 * (4 * seq * d + 6 * seq * seq)
    kept, peak = activations_and_peak(seq, 8, width=d)
    assert kept == heads * (4 * 3 * seq * d + 8 * seq * (d + 1))
    assert peak == heads * (4 * 5 * seq * d + 8 * seq * d + 8 * 2 * seq * (d + 1))


def test_the_peak_grows_linearly_in_tiles_and_quadratically_whole():
    """Doubling seq doubles the tiles' peak; the whole matrix's is a·seq² + b·seq with a > 0,
    so its excess over doubling, 2a·seq², quadruples with each doubling."""
    tiled = [activations_and_peak(seq, 16)[1] for seq in (64, 128, 256)]
    whole = [activations_and_peak(seq, None)[1] for seq in (64, 128, 256)]
    assert tiled[1] == 2 * tiled[0] and tiled[2] == 2 * tiled[1]
    assert whole[2] - 2 * whole[1] == 4 * (whole[1] - 2 * whole[0]) > 0


def scratch_bytes(seq, heads=2, width=16, block_size=(32, 32)):
    """What the op's compute and vjp allocate beyond their results, at their peak, traced by
    tracemalloc (NumPy reports its buffers to it): the ledger sees arrays, not this."""
    q = problem_values((1, heads, seq, width), 'float32')[0]
    tracemalloc.start()
    try:
        packed = tiles.attention(numpy, q, q, q, True, block_size)
        forward = tracemalloc.get_traced_memory()[1] - packed.nbytes
        g = numpy.ones_like(packed)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        grads = tiles.attention_vjp(numpy, g, packed, q, q, q, True, block_size)
        backward = tracemalloc.get_traced_memory()[1] - held - sum(d.nbytes for d in grads)
    finally:
        tracemalloc.stop()
    return forward, backward


def test_the_ops_own_scratch_never_holds_a_seq_by_seq_matrix():
    """Forward: the tiles' scratch is the same whatever seq is (within 4 KiB of Python's own
    objects). Backward: what grows with seq is O(seq · d) (dq, dk, dv in float64 before they
    are rounded, the rows' D), so each doubling of seq doubles its growth; a (seq, seq) array
    would quadruple it, and at seq = 1024 one would be 16 MiB."""
    seqs = (128, 256, 512, 1024)
    forward, backward = zip(*(scratch_bytes(seq) for seq in seqs))
    assert max(forward) - min(forward) < 4096
    growth = [b - a for a, b in zip(backward, backward[1:])]
    assert all(1.8 < later / earlier < 2.2 for earlier, later in zip(growth, growth[1:]))
    assert backward[-1] < 2 ** 20


# -- traffic: the bytes the tile loop moves ------------------------------------------------------

@checks(60)
@given(seq=st.integers(1, 40), width=st.integers(1, 16), rows=st.integers(1, 45),
       cols=st.integers(1, 45), causal=st.booleans(),
       dtype=st.sampled_from(['float32', 'float64', 'float16']))
def test_counted_traffic_equals_the_formula(seq, width, rows, cols, causal, dtype):
    assert (tiles.counted_traffic(seq, width, (rows, cols), causal, dtype)
            == tiles.tiled_traffic(seq, width, (rows, cols), causal, dtype))


@pytest.mark.parametrize('seq, width, block', [(64, 8, 8), (128, 16, 32), (96, 4, 96)])
def test_square_blocks_that_divide_seq_read_seq_squared_d_over_b(seq, width, block):
    """q once, k and v seq/B times (full) or (seq/B + 1)/2 times on average (causal), out
    and L once: Theorem 2's Θ(N²d/B), so Θ(N²d²/M) for an on-chip M of Θ(Bd)."""
    full = 4 * (seq * width + 2 * seq * seq * width // block) + 8 * seq * (width + 1)
    causal = 4 * (seq * width + seq * (seq + block) * width // block) + 8 * seq * (width + 1)
    assert tiles.counted_traffic(seq, width, (block, block), causal=False) == full
    assert tiles.counted_traffic(seq, width, (block, block), causal=True) == causal


def test_one_block_moves_less_than_the_whole_matrix():
    """With one block as large as seq, the tiles read q, k, v once and write out and L once
    (in float64), where the whole matrix's four operations move 4·seq·d + 6·seq² values."""
    seq, width = 64, 8
    assert tiles.counted_traffic(seq, width, (seq, seq), causal=False) == (
        4 * 3 * seq * width + 8 * seq * (width + 1))
    assert tiles.whole_matrix_traffic(seq, width) == 4 * (4 * seq * width + 6 * seq * seq)


# -- hybridized --------------------------------------------------------------------------------

def test_a_trace_holds_attention_as_one_op_and_a_view_of_its_output():
    """The compiler sees one opaque op (the registry's default kind), the slice of its
    first d columns and the rounding back to the inputs' dtype: no (seq, seq) node."""
    graph = hybrid.trace(lambda q, k, v: npx.attention(q, k, v, block_size=4),
                         [hybrid.Spec((1, 2, 8, 4))] * 3)
    calls = [(n.op, n.shape) for n in graph.nodes if n.kind == 'call']
    assert calls == [('attention', (1, 2, 8, 5)), ('getitem', (1, 2, 8, 4)),
                     ('astype', (1, 2, 8, 4))]
    assert ops.REGISTRY['attention'].kind == 'opaque'


class SelfAttention(nn.HybridBlock):
    """q, k, v projected from x (batch, seq, 8), two heads of 4, attended in tiles."""

    def __init__(self, block_size, causal):
        super().__init__()
        self.block_size, self.causal = block_size, causal
        self.query, self.key, self.value = (nn.Dense(8, in_units=8, flatten=False)
                                            for _ in range(3))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (f(x).reshape(batch, seq, 2, 4).transpose(0, 2, 1, 3)
                   for f in (self.query, self.key, self.value))
        return npx.attention(q, k, v, causal=self.causal, block_size=self.block_size)


@pytest.mark.parametrize('block_size, causal', [(3, True), ((2, 5), False), (None, True)])
def test_a_hybridized_block_gives_the_imperative_outputs_and_gradients(block_size, causal):
    np.random.seed(3)
    net = SelfAttention(block_size, causal)
    net.initialize()
    x = np.array(RNG.normal(size=(2, 7, 8)).astype('float32'))
    results = []
    for hybrid in (False, True):
        if hybrid:
            net.hybridize()
        with autograd.record():
            out = net(x)
            loss = (out * out).sum()
        loss.backward()
        results.append([out.asnumpy()] + [p.grad().asnumpy().copy()
                                           for p in net.collect_params().values()])
    for got, want in zip(*results):
        assert relative_error(got, want) <= 1e-6


# -- on a GPU: the same code over CuPy -----------------------------------------------------------

def gpu_matches_cpu(causal, block_size):
    """Tiles on gpu(0) against the CPU's, output and gradients, float32."""
    *values, weights = problem_values((2, 2, 9, 4), 'float32')
    results = []
    for device in (d2l.cpu(), d2l.gpu(0)):
        xs = [np.array(v, device=device) for v in values]
        for x in xs:
            x.attach_grad()
        with autograd.record():
            out = npx.attention(*xs, causal=causal, block_size=block_size)
            loss = (out * np.array(weights, device=device)).sum()
        loss.backward()
        assert out.device == device
        results.append([out.asnumpy()] + [x.grad.asnumpy() for x in xs])
    for got, want in zip(*results):
        assert got.dtype == numpy.float32 and relative_error(got, want) <= 1e-6


@pytest.mark.parametrize('causal, block_size', [(True, 4), (False, (2, 5))])
def test_tiles_on_fake_gpus_take_the_cupy_path(fake_gpus, causal, block_size):
    gpu_matches_cpu(causal, block_size)


@pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')
@pytest.mark.parametrize('causal, block_size', [(True, 4), (False, (2, 5))])
def test_tiles_on_a_gpu_match_the_cpu(causal, block_size):
    gpu_matches_cpu(causal, block_size)


def test_an_exported_block_with_tiles_is_imported_with_identical_outputs(tmp_path):
    """The op's attributes (causal, the pair of block sizes) survive the JSON file."""
    np.random.seed(3)
    net = SelfAttention((2, 3), True)
    net.initialize()
    net.hybridize()
    x = np.array(RNG.normal(size=(2, 7, 8)).astype('float32'))
    want = net(x).asnumpy()
    symbol, params = net.export(str(tmp_path / 'attention'))
    block = nn.SymbolBlock.imports(symbol, ['data'], params, device=d2l.cpu())
    numpy.testing.assert_array_equal(block(x).asnumpy(), want)
