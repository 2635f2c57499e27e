"""Tests of the serving simulator (d2lperf.inference.batching): exact times by hand for a
cost model that is a plain line, the invariants of both policies on random workloads, and a
case where iteration-level scheduling provably beats static batching."""
import math

import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

import d2lperf as d2l
from d2lperf.data import python_docs
from d2lperf.inference import batching, paged
from d2lperf.inference.batching import LinearCost, Request
from strategies import checks

pytestmark = pytest.mark.chapter('inference')

UNIT = LinearCost(prefill=(1.0, 0.0, 0.0, 0.0), decode=(1.0, 0.0, 0.0))     # every step: 1 s
LINE = LinearCost(prefill=(1.0, 0.0, 0.1, 0.0), decode=(0.5, 0.0, 0.01))


def times(served):
    return [t for s in served for t in (s.first_token, s.done)]


def test_static_batching_by_hand():
    # the batch starts when B arrives at 0.5; prompts padded to 4 tokens: 1 + 0.1 · 8 = 1.8 s;
    # then two decode steps over 2 · 5 and 2 · 6 cached tokens: 0.6 s and 0.62 s
    a, b = Request(0.0, 4, 3), Request(0.5, 2, 1)
    served = batching.static_batching([a, b], LINE, batch_size=2, timeout=10)
    assert times(served) == pytest.approx([2.3, 3.52, 2.3, 2.3])
    assert [s.tokens for s in served] == [3, 1]


def test_iteration_level_by_hand():
    # A's prefill (1.4 s) ends at 1.4; B, waiting since 0.5, is prefilled then (1.2 s, its
    # only token); A decodes over 5 then 6 cached tokens (0.55 s, 0.56 s)
    a, b = Request(0.0, 4, 3), Request(0.5, 2, 1)
    served, pool, preempted = batching.iteration_level([a, b], LINE, blocks=4)
    assert times(served) == pytest.approx([1.4, 3.71, 2.6, 2.6])
    assert (pool.peak, preempted) == (2, 0)


def test_iteration_level_beats_static_when_a_short_request_follows_a_long_one():
    # static (no waiting): A runs alone to t = 10, B waits for it and ends at 11: mean 10.
    # iteration-level: B joins after A's prefill and ends at 2; A ends at 11: mean 6.
    requests = [Request(0.0, 1, 10), Request(1.0, 1, 1)]
    static = batching.static_batching(requests, UNIT, batch_size=2, timeout=0)
    orca, _, _ = batching.iteration_level(requests, UNIT, blocks=2)
    assert [s.latency for s in static] == [10, 10]
    assert [s.latency for s in orca] == [11, 1]
    assert batching.summary(orca)['latency_mean'] < batching.summary(static)['latency_mean']
    # 11 tokens asked within 1 s of arrivals, served from t = 0 to t = 11
    assert batching.summary(orca) == {
        'requests': 2, 'asked_tokens_per_s': 11, 'tokens_per_s': 1, 'ttft_mean': 1,
        'ttft_p50': 1, 'ttft_p99': 1, 'latency_mean': 6, 'latency_p50': 6,
        'latency_p99': pytest.approx(1 + 0.99 * 10)}    # numpy's linear percentile


def test_a_full_cache_preempts_the_latest_and_recomputes_it():
    # two blocks: A (10 + 10 tokens) and B (4 + 12) start in one block each. At its 17th
    # token A needs a second block (t = 6): B, admitted last, gives its block back and waits
    # until A is done (t = 10), then recomputes its 10 tokens in a prefill and goes on.
    a, b = Request(0.0, 10, 10), Request(0.0, 4, 12)
    served, pool, preempted = batching.iteration_level([a, b], UNIT, blocks=2)
    assert (preempted, pool.peak) == (1, 2)
    assert times(served) == [1, 10, 1, 16]
    assert [s.tokens for s in served] == [10, 12]


requests_lists = st.lists(
    st.tuples(st.floats(0, 20), st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=12
).map(lambda rows: [Request(*row) for row in rows])


@checks(60)
@given(requests_lists, st.integers(0, 4), st.integers(1, 4), st.floats(0, 3))
def test_every_request_gets_its_tokens_after_it_arrives(requests, spare, batch_size, timeout):
    blocks = paged.blocks_for([max(r.prompt + r.output for r in requests)]) + spare
    orca, pool, _ = batching.iteration_level(requests, LINE, blocks)
    static = batching.static_batching(requests, LINE, batch_size, timeout)
    for served in (orca, static):
        for s in served:
            assert s.tokens == s.request.output
            assert s.request.arrival < s.first_token <= s.done
    assert pool.peak <= blocks and not pool.tables.tables and pool.free == blocks


def test_seeded_runs_are_the_same_run():
    pairs = paged.corpus_requests(python_docs(), 50, max_len=512, seed=3)
    runs = [batching.poisson_requests(3.0, pairs, seed=7) for _ in range(2)]
    assert runs[0] == runs[1] != batching.poisson_requests(3.0, pairs, seed=8)
    assert [(r.prompt, r.output) for r in runs[0]] == pairs
    assert times(batching.iteration_level(runs[0], LINE, 64)[0]) == \
        times(batching.iteration_level(runs[1], LINE, 64)[0])


def test_the_fit_recovers_a_line_and_keeps_every_cost_positive():
    rows = [(b, t, 0.002 + 1e-4 * b + 1e-6 * t) for b in (1, 4, 16) for t in (16, 256)]
    coefficients, error = batching.fit_line('decode', rows)
    assert coefficients == pytest.approx((0.002, 1e-4, 1e-6)) and error < 1e-9
    # times that fall with the batch: plain least squares would give it a negative cost
    rows = [(1, 16, 0.010), (8, 16, 0.008), (32, 16, 0.007), (1, 512, 0.012)]
    coefficients, _ = batching.fit_line('decode', rows)
    assert min(coefficients) >= 0
    assert numpy.linalg.lstsq(numpy.array([[1, b, t] for b, t, _ in rows], float),
                              numpy.array([s for *_, s in rows]), rcond=None)[0].min() < 0


@pytest.mark.parametrize('call, message', [
    (lambda: batching.iteration_level([Request(0, 30, 10)], UNIT, blocks=2), 'more blocks'),
    (lambda: batching.static_batching([Request(0, 3, 0)], UNIT, 2, 0), 'at least one token'),
    (lambda: batching.static_batching([Request(0, 3, 1)], UNIT, 0, 0), 'batch_size=0'),
    (lambda: batching.poisson_requests(0, [(1, 2)]), 'rate=0'),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_loads_are_counted_in_requests_served_one_at_a_time():
    pairs = [(4, 3), (8, 5)] * 15                   # mean: a prompt of 6, 4 tokens out
    assert batching.solo_rate(UNIT, pairs) == 1 / 4       # a prefill and 3 decode steps
    rows = batching.compare_policies(pairs, UNIT, [0.5, 4], batch_size=2)
    assert [(r['policy'], r['load']) for r in rows] == [
        ('iteration-level', 0.5), ('static', 0.5), ('iteration-level', 4), ('static', 4)]
    assert all(r['requests'] == 30 and r['peak_blocks'] <= 2 for r in rows)
    assert rows[0]['rate'] == rows[1]['rate'] == 0.5 / 4


@pytest.mark.usefixtures('fresh_engine')
def test_the_cost_is_fitted_to_real_steps_of_a_gpt():
    net = d2l.nn.GPT(20, 1, 16, 2, max_len=32)
    net.initialize()
    cost, errors = batching.measure_cost(net, [1, 4], [4, 16], most_tokens=32, repeats=1)
    assert (len(cost.prefill), len(cost.decode)) == (4, 3)
    assert min(cost.prefill + cost.decode) >= 0 and set(errors) == {'prefill', 'decode'}
    assert cost.step_seconds('decode', 4, 64) >= cost.step_seconds('decode', 1, 4) > 0
