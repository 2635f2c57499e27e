"""Tests of cuDNN's fused attention in d2lperf.ops.cudnn, as the attention op (ops/attention.py)
takes it on a GPU in float16: on fake GPUs (tests/fakes/cupy.py) and a fake cuDNN frontend
(tests/fakes/cudnn.py) whose sdpa and sdpa_backward compute in NumPy from the dims, strides,
scale and causal band they are given.

The packed (out, L) and the gradients of q, k and v equal the NumPy path's within float16's
tolerance, causal or not, with a gradient reaching L too (the ring attention's merge gives
one); through the engine and autograd, gpu(0) equals cpu(0); a graph is built once per key;
float32 and head widths cuDNN does not take stay on the tiles; `off()` gives the tiles; a
refused graph is remembered and said once. The fake's attention is checked against the tiles
in float64, and tests/cudnn_check.py's attention rows run on the fakes."""
import sys
import warnings

import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, nn, np, npx
from d2lperf.ops import attention, cudnn
import cudnn_check
from fakes import cudnn as fake_cudnn, cupy as fake_cupy
from strategies import checks


def problem(shape, dtype='float16', seed=0, strided=False):
    """q, k, v and a gradient of the packed output, L's column included (nonzero)."""
    rng = numpy.random.default_rng(seed)
    q, k, v = (rng.normal(size=shape).astype(dtype) for _ in range(3))
    g = rng.normal(size=shape[:-1] + (shape[-1] + 1,)).astype('float32')
    return q, k, v, g


def heads_view(x):
    """x (batch, heads, seq, d) on the fake GPU as the GPT's split heads are: a transposed
    view of (batch, seq, heads, d) memory, so the graphs read it through its strides."""
    return fake_cupy.on_device(numpy.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(
        0, 2, 1, 3)


def both_roads(values, causal, strided=False):
    """(packed, dq, dk, dv) on the fake GPU and by NumPy's tiles."""
    q, k, v, g = values
    want = attention.attention(numpy, q, k, v, causal)
    want = (want,) + attention.attention_vjp(numpy, g, want, q, k, v, causal)
    cupy = sys.modules['cupy']
    on_gpu = heads_view if strided else fake_cupy.on_device
    q_d, k_d, v_d = (on_gpu(a) for a in (q, k, v))
    packed = attention.attention(cupy, q_d, k_d, v_d, causal)
    got = (packed,) + attention.attention_vjp(cupy, fake_cupy.on_device(g), packed, q_d, k_d,
                                              v_d, causal)
    return [numpy.asarray(a) for a in got], want


def relative_error(got, want):
    return float(numpy.abs(got.astype('float64') - want).max() / (numpy.abs(want).max() or 1))


HALF = 1e-2          # float16 inputs, dO and o rounded to float16: a few units of 2⁻¹¹


@checks(30)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 20),
                       st.sampled_from([8, 16])),
       causal=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_cudnns_attention_equals_the_tiles_forward_and_backward(frontend, shape, causal,
                                                                strided, seed):
    before = len(frontend.executions)
    got, want = both_roads(problem(shape, seed=seed), causal, strided)
    for name, g, w in zip(('packed', 'dq', 'dk', 'dv'), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert relative_error(g, w) <= HALF, name
    assert [e.graph.kind for e in frontend.executions[before:]] == ['sdpa', 'sdpa_backward']
    if strided and min(shape[1:3]) > 1:             # read through the view's strides
        q = frontend.executions[-1].graph.inputs[0]
        assert q.stride == [shape[1] * shape[2] * shape[3], shape[3], shape[1] * shape[3], 1]


def test_the_gradient_of_l_is_in_the_gradients(frontend):
    """The ring attention's merge differentiates L: dq and dk change with L's gradient alone,
    as the tiles' do, and dv does not."""
    q, k, v, g = problem((1, 2, 12, 8), seed=3)
    g_out_only = g.copy()
    g_out_only[..., -1] = 0
    got, want = both_roads((q, k, v, g), True)
    got_without, want_without = both_roads((q, k, v, g_out_only), True)
    for i in (1, 2):
        assert relative_error(got[i] - got_without[i], want[i] - want_without[i]) < 3e-2
        assert numpy.abs(want[i] - want_without[i]).max() > 0.1
    assert relative_error(got[3], got_without[3]) < 1e-3


class Attend(nn.HybridBlock):
    def forward(self, q, k, v):
        return npx.attention(q, k, v, causal=True, block_size=8)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_through_the_engine_gpu0_equals_cpu0(frontend, hybridize):
    """npx.attention with tiles, in float16 on gpu(0), through autograd (and compiled): the
    output and gradients equal cpu(0)'s, and the graphs run on gpu(0)'s lane stream."""
    q, k, v, _ = problem((2, 2, 16, 8), seed=4)
    weights = numpy.random.default_rng(5).normal(size=q.shape).astype('float16')

    f = Attend()
    f.hybridize(hybridize)
    results = []
    for device in (d2l.cpu(0), d2l.gpu(0)):
        xs = [np.array(a, device=device) for a in (q, k, v)]
        for x in xs:
            x.attach_grad()
        with autograd.record():
            loss = (f(*xs).astype('float32') * np.array(weights, device=device)).sum()
        loss.backward()
        results.append([loss.asnumpy()] + [x.grad.asnumpy() for x in xs])
    for cpu, gpu in zip(*results):
        assert relative_error(gpu, cpu.astype('float64')) <= HALF
    assert sorted(e.graph.kind for e in frontend.executions) == ['sdpa', 'sdpa_backward']
    assert len({e.stream for e in frontend.executions}) == 1
    assert frontend.executions[0].stream not in (0, None)


def test_a_graph_is_built_once_per_key_and_reused(frontend):
    values = problem((2, 2, 8, 8))
    for _ in range(3):
        both_roads(values, True)
    assert [g.kind for g in frontend.built] == ['sdpa', 'sdpa_backward']
    assert len(frontend.executions) == 6
    both_roads(values, False)                                   # the mask is in the key
    both_roads(problem((2, 2, 9, 8)), True)                     # a new sequence length
    both_roads(values, True, strided=True)                      # new strides
    assert len(frontend.built) == len(frontend.attempts) == 8
    causal, full = frontend.built[0], frontend.built[2]
    assert causal.attention == (full.attention[0], True) and full.attention[1] is False
    assert causal.attention[0] == pytest.approx(1 / numpy.sqrt(8))


def test_float32_and_head_widths_cudnn_does_not_take_stay_on_the_tiles(frontend):
    with warnings.catch_warnings():
        warnings.simplefilter('error')                          # and nothing is said
        for values in (problem((1, 2, 8, 8), 'float32'), problem((1, 2, 8, 6))):
            got, want = both_roads(values, True)
            for g, w in zip(got, want):
                numpy.testing.assert_array_equal(g, w)
    assert frontend.attempts == []


def test_off_gives_the_tiles_for_the_work_pushed_inside_it(frontend):
    q, k, v, _ = problem((1, 2, 8, 8), seed=6)

    def attend():
        return npx.attention(*(np.array(a, device=d2l.gpu(0)) for a in (q, k, v)),
                             block_size=4)
    fused = attend()
    with cudnn.off():
        tiles = attend()
    tiles.wait_to_read()
    assert len(frontend.executions) == 1
    want = attention.attention(numpy, q, k, v)[..., :8].astype('float16')
    numpy.testing.assert_array_equal(tiles.asnumpy(), want)
    assert relative_error(fused.asnumpy(), want.astype('float64')) <= HALF


def test_a_refused_backward_is_remembered_and_runs_on_the_tiles(frontend):
    frontend.refuse = lambda graph: 'no engine' if graph.kind == 'sdpa_backward' else None
    values = problem((1, 1, 8, 8), seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(3):
            got, want = both_roads(values, True)
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(said) == 1 and 'sdpa_backward' in said[0] and 'no engine' in said[0]
    for g, w in zip(got, want):
        assert relative_error(g, w) <= HALF
    # the backward tried with v wider than q and k, then all three wide; never again
    assert [g.kind for g in frontend.attempts] == ['sdpa', 'sdpa_backward', 'sdpa_backward']
    assert [e.graph.kind for e in frontend.executions] == ['sdpa'] * 3


def test_without_the_frontend_the_tiles_give_the_values_and_it_is_said_once(frontend,
                                                                            monkeypatch):
    monkeypatch.setitem(sys.modules, 'cudnn', None)
    values = problem((1, 1, 8, 8), seed=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(2):
            got, want = both_roads(values, False)
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(said) == 1 and 'attention' in said[0] and 'does not import' in said[0]
    for g, w in zip(got, want):
        numpy.testing.assert_array_equal(g, w)


# -- the fake itself: cuDNN's attention, so that the tests above mean something ---------------

@checks(20)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 12),
                       st.integers(1, 5)),
       causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_the_fakes_attention_is_the_tiles_in_float64(shape, causal, seed):
    """The fake's forward gives the tiles' out and L; its backward, given o, dO and the
    stats, gives the tiles' gradients (with no gradient for L, which cuDNN does not take)."""
    q, k, v, g = problem(shape, 'float64', seed)
    g[..., -1] = 0
    scale = 1 / numpy.sqrt(shape[-1])
    packed = attention.attention(numpy, q, k, v, causal, (4, 4))
    want = attention.attention_vjp(numpy, g, packed, q, k, v, causal, (4, 4))
    out, stats = fake_cudnn.sdpa_forward(q, k, v, scale, causal)
    numpy.testing.assert_allclose(numpy.concatenate([out, stats], -1), packed, atol=1e-12)
    got = fake_cudnn.sdpa_backward(q, k, v, out, g[..., :-1], stats, scale, causal)
    for a, b in zip(got, want):
        numpy.testing.assert_allclose(a, b, atol=1e-12)


def test_the_gpu_check_compares_attention_and_fails_where_cudnn_is_not_used(frontend):
    """tests/cudnn_check.py's attention rows, as a GPU lease runs them, on the fakes."""
    rows = cudnn_check.compare_attention(d2l.gpu(0), cudnn_check.ODD_ATTENTION, repeats=2)
    assert all(r['ok'] for r in rows), cudnn_check.attention_table(rows)
    assert max(rows[0]['errors']) < 5e-3 and max(rows[0]['tiles_errors']) < 5e-3
    # the op's two graphs, then the backward without L's column, timed beside it
    assert [g.kind for g in frontend.built] == ['sdpa', 'sdpa_backward', 'sdpa_backward']
    assert [g.inputs[2].dim[3] for g in frontend.built[1:]] == [24, 16]
    assert all(len(r['backward_ms']) == 2 for r in rows)
    with cudnn.off():
        rows = cudnn_check.compare_attention(d2l.gpu(0), cudnn_check.ODD_ATTENTION, repeats=1)
    assert not rows[0]['ok'] and 'FAILED' in cudnn_check.attention_table(rows)


def test_where_cudnn_refuses_a_wider_v_q_and_k_are_widened_too(frontend):
    """The backward's first try reads q and k of width d and v of d + 8; where cuDNN has no
    engine for unequal widths, all three are d + 8 wide, the scale still 1/√d."""
    frontend.refuse = lambda graph: ('d_qk != d_v' if graph.kind == 'sdpa_backward'
                                     and graph.inputs[0].dim[3] != graph.inputs[2].dim[3]
                                     else None)
    with pytest.warns(RuntimeWarning, match='refused'):
        got, want = both_roads(problem((1, 2, 10, 8), seed=9), True)
    for name, g, w in zip(('packed', 'dq', 'dk', 'dv'), got, want):
        assert relative_error(g, w) <= HALF, name
    backward = frontend.built[-1]
    assert [t.dim[3] for t in backward.inputs[:3]] == [16, 16, 16]
    assert backward.attention[0] == pytest.approx(1 / numpy.sqrt(8))


@pytest.mark.skipif(not d2l.num_gpus() or not cudnn.available(),
                    reason='runs where a GPU is here and the cuDNN frontend imports')
def test_on_a_real_gpu_cudnns_attention_agrees_with_the_whole_matrix():
    rows = cudnn_check.compare_attention(d2l.gpu(0), cudnn_check.ODD_ATTENTION, repeats=1)
    assert all(r['ok'] for r in rows), cudnn_check.attention_table(rows)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_a_float16_gpt_on_a_gpu_takes_cudnns_attention_without_asking(frontend, hybridize):
    """npx.attention with no block size, as the GPT's layers call it: in float16 on a GPU it
    is the fused op, cuDNN's graphs forward and backward, and the loss is the CPU's."""
    losses, runs, start = [], [], None
    for device in (d2l.cpu(0), d2l.gpu(0)):
        net = nn.GPT(16, 1, 16, 2, 8)
        net.initialize(device=device)
        net.cast('float16')
        params = net.collect_params().values()
        start = start or [p.data().asnumpy() for p in params]         # the same weights
        for param, value in zip(params, start):
            param.set_data(np.array(value, device=device))
        net.hybridize(hybridize)
        tokens = np.array(numpy.arange(16).reshape(2, 8) % 16, device=device)
        before = len(frontend.executions)
        with autograd.record():
            loss = net(tokens).astype('float32').sum()
        loss.backward()
        npx.waitall()
        losses.append(loss.asnumpy())
        runs.append(sorted(e.graph.kind for e in frontend.executions[before:]))
    assert runs == [[], ['sdpa', 'sdpa_backward']]
    assert relative_error(losses[1], losses[0].astype('float64')) <= HALF
