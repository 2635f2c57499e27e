"""Speculative decoding (d2lperf.inference.speculative) against the target alone: greedy, the
same tokens (float64 GPTs, where no near-tie can flip between a pass over one token and a pass
over γ + 1); sampling, the same distribution, exactly on explicit tables (every draft and
every accept/reject event summed) and by a seeded chi-square test of the sampler itself."""
import collections
import itertools
import re

import numpy
import pytest
import scipy.stats
from hypothesis import given, settings, strategies as st

import d2lperf as d2l
from d2lperf import np
from d2lperf.inference import speculative as spec

pytestmark = [pytest.mark.usefixtures('fresh_engine'), pytest.mark.chapter('inference')]

VOCAB, MAX_LEN = 11, 24


def gpt(seed, layers=1):
    np.random.seed(seed)
    return d2l.nn.GPT(VOCAB, layers, 8, 2, MAX_LEN).initialize().cast('float64')


def greedy_alone(net, prompt, count):
    """The target's own greedy continuation: argmax of a forward over the whole prefix."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(net(np.array(numpy.array([tokens]))).asnumpy()[0, -1].argmax()))
    return tokens


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), gamma=st.integers(1, 6), new=st.integers(1, 18))
def test_greedy_tokens_equal_the_target_alone_with_a_draft_that_disagrees(seed, gamma, new):
    target, draft = gpt(seed, layers=2), gpt(seed + 1)
    prompts = numpy.random.default_rng(seed).integers(0, VOCAB, (2, 5))
    rounds = []
    got = spec.generate(target, draft, prompts, new, draft_tokens=gamma, rounds=rounds)
    numpy.testing.assert_array_equal(got, [greedy_alone(target, p, new) for p in prompts])
    assert sum(r.accepted + 1 for r in rounds) == 2 * new       # every round emits kept + 1


def test_a_random_draft_is_rejected_often_and_the_tokens_still_agree():
    """The case the rule exists for: most drafted tokens rejected, yet the same tokens."""
    rounds = []
    for seed in range(4):
        target, draft = gpt(seed, layers=2), gpt(100 + seed)
        prompts = [numpy.array([seed, 3, 1]), numpy.array([7, 2, 9, 9, 4, 0])]  # two lengths
        got = spec.generate(target, draft, prompts, 16, draft_tokens=4, rounds=rounds)
        for row, prompt in zip(got, prompts):
            assert list(row) == greedy_alone(target, prompt, 16)
    drafted = sum(r.drafted for r in rounds)
    assert sum(r.accepted for r in rounds) < 0.5 * drafted, 'the draft should disagree often'


@pytest.mark.parametrize('temperature', [0.0, 0.7])
def test_the_target_as_its_own_draft_has_every_token_accepted(temperature):
    target, rounds = gpt(3, layers=2), []
    got = spec.generate(target, target, numpy.array([[1, 2, 3]]), 16, draft_tokens=4,
                        temperature=temperature, seed=0, rounds=rounds)
    assert [r.accepted for r in rounds] == [r.drafted for r in rounds] == [4, 4, 4, 0]
    assert all(numpy.allclose(r.overlaps, 1.0) for r in rounds)
    if temperature == 0:
        assert list(got[0]) == greedy_alone(target, [1, 2, 3], 16)


# -- sampling: explicit tables, every outcome summed -----------------------------------------

TOY = 4
P = numpy.array([[.5, .2, .2, .1], [.1, .6, .3, 0.], [.25, .25, .25, .25], [.7, 0., .1, .2]])
Q = numpy.array([[.1, .3, .3, .3], [.4, .2, .2, .2], [0., .5, .5, 0.], [.7, .1, .1, .1]])


def table(rows):
    """A bigram model as `Distributions`: the next token's distribution given the last one."""
    return lambda tokens, count: rows[numpy.array(tokens[-count:])]


def round_outcomes(context, gamma, p_table=P, q_table=Q):
    """{tokens one round emits: probability}, summed over every γ-token draft (each with its
    probability under Q) and every accept/reject event, by the module's own rule."""
    outcomes = collections.defaultdict(float)
    for drafted in itertools.product(range(TOY), repeat=gamma):
        previous = (context,) + drafted
        q, p = q_table[list(previous[:-1])], p_table[list(previous)]
        reach = numpy.prod([q[i, x] for i, x in enumerate(drafted)])   # drafted, kept so far
        for i, x in enumerate(drafted):
            kept = spec.acceptance(p[i], q[i])[x]
            for y, chance in enumerate(spec.residual(p[i], q[i])):
                outcomes[drafted[:i] + (y,)] += reach * (1 - kept) * chance
            reach *= kept
        for y, chance in enumerate(p[gamma]):
            outcomes[drafted + (y,)] += reach * chance
    return outcomes


def first_tokens(context, count, gamma):
    """{the first `count` emitted tokens: probability}, round after round."""
    if count == 0:
        return {(): 1.0}
    result = collections.defaultdict(float)
    for emitted, chance in round_outcomes(context, gamma).items():
        if len(emitted) >= count:
            result[emitted[:count]] += chance
        else:
            for rest, more in first_tokens(emitted[-1], count - len(emitted), gamma).items():
                result[emitted + rest] += chance * more
    return result


def target_alone(context, count):
    return {seq: numpy.prod(P[list((context,) + seq[:-1]), list(seq)])
            for seq in itertools.product(range(TOY), repeat=count)}


@pytest.mark.parametrize('gamma', [1, 2, 3])
@pytest.mark.parametrize('context', range(TOY))
def test_the_first_three_tokens_are_distributed_exactly_as_the_target_alone(context, gamma):
    got, want = first_tokens(context, 3, gamma), target_alone(context, 3)
    for seq, chance in want.items():
        assert abs(got.get(seq, 0.0) - chance) < 1e-12, (seq, got.get(seq), chance)
    assert set(got) <= set(want)


def test_the_chance_to_keep_a_drafted_token_is_the_overlap():
    """Σ_x q(x) min(1, p(x)/q(x)) = Σ_x min(p(x), q(x)): the β that α averages."""
    for p, q in itertools.product(P, Q):
        assert abs((q * spec.acceptance(p, q)).sum() - spec.overlap(p, q)) < 1e-15


@pytest.mark.parametrize('gamma', [1, 3, 5])
def test_tokens_a_round_emits_follow_the_formula_where_beta_is_the_same_everywhere(gamma):
    """With p and q the same at every position, β is one number α and the kept tokens are
    i.i.d. trials: E[emitted] = (1 − α^(γ+1)) / (1 − α) exactly (Leviathan et al., eq. 1)."""
    same_p, same_q = numpy.tile(P[0], (TOY, 1)), numpy.tile(Q[0], (TOY, 1))
    alpha = spec.overlap(P[0], Q[0])
    outcomes = round_outcomes(0, gamma, same_p, same_q)
    mean = sum(len(emitted) * chance for emitted, chance in outcomes.items())
    assert abs(mean - (1 - alpha ** (gamma + 1)) / (1 - alpha)) < 1e-12
    assert abs(mean - spec.expected_tokens(alpha, gamma)) < 1e-12


def test_the_sampler_draws_the_targets_distribution_chi_square():
    """The sampler itself (speculate and verify, not the sums above): 20,000 seeded runs, the
    first three tokens (the 50 sequences of the 64 the target can emit) against the target's
    probabilities; a p-value under 1e-3 fails (with this seed it is 0.23)."""
    runs, counts = 20_000, collections.Counter()
    rng = numpy.random.default_rng(0)
    for _ in range(runs):
        counts[tuple(spec.speculate(table(P), table(Q), [2], 4, 3, rng)[1:4])] += 1
    want = target_alone(2, 3)
    cells = [seq for seq, chance in want.items() if chance > 0]
    assert sum(counts[seq] for seq in cells) == runs                # nothing impossible drawn
    _, p_value = scipy.stats.chisquare([counts[s] for s in cells],
                                       [runs * want[s] for s in cells])
    assert p_value > 1e-3, p_value


def test_a_sampler_without_the_residual_fails_the_same_chi_square(monkeypatch):
    """The test has power: drawing from p, not norm(max(0, p − q)), after a rejection
    over-weights what the draft proposes, and the chi-square sees it."""
    monkeypatch.setattr(spec, 'residual', lambda p, q: p)
    rng, counts = numpy.random.default_rng(0), collections.Counter()
    for _ in range(5_000):
        counts[spec.speculate(table(P), table(Q), [2], 4, 3, rng)[1]] += 1
    _, p_value = scipy.stats.chisquare([counts[x] for x in range(TOY)], 5_000 * P[2])
    assert p_value < 1e-6, p_value


# -- the distributions and bad input -----------------------------------------------------------

def test_temperature_and_top_k_shape_both_distributions():
    logits = numpy.array([2.0, 1.0, 0.5, 2.0, -1.0])
    numpy.testing.assert_array_equal(spec.distribution(logits), [1, 0, 0, 0, 0])  # first max
    hot = spec.distribution(logits, temperature=0.5, top_k=2)
    numpy.testing.assert_allclose(hot, [0.5, 0, 0, 0.5, 0], atol=1e-15)
    three = spec.distribution(logits, temperature=2.0, top_k=3)
    weights = numpy.exp(numpy.array([2.0, 1.0, 0, 2.0, 0]) / 2) * [1, 1, 0, 1, 0]
    numpy.testing.assert_allclose(three, weights / weights.sum(), rtol=1e-14)
    numpy.testing.assert_array_equal(spec.distribution(logits, 1.0, top_k=1), [1, 0, 0, 0, 0])
    rows = spec.distribution(numpy.stack([logits, -logits]), 1.0, top_k=2)   # row by row
    numpy.testing.assert_allclose(rows[1], spec.distribution(-logits, 1.0, top_k=2))


def test_sampling_is_reproducible_with_a_seed():
    target, draft = gpt(0, layers=2), gpt(1)
    runs = [spec.generate(target, draft, numpy.array([[1, 2]]), 10, temperature=1.0, top_k=5,
                          seed=7) for _ in range(2)]
    numpy.testing.assert_array_equal(*runs)


@pytest.mark.parametrize('change, words', [
    ({'draft_tokens': 0}, 'draft_tokens=0'),
    ({'max_new_tokens': MAX_LEN}, 'larger max_len'),
    ({'temperature': -1.0}, 'temperature=-1.0'),
    ({'top_k': VOCAB + 1}, 'top_k=12'),
    ({'prompts': numpy.array([1, 2])}, 'shape (2,)'),
    ({'prompts': [numpy.array([1]), numpy.array([], int)]}, 'lengths [1, 0]'),
])
def test_bad_input_is_refused_with_the_fix(change, words):
    arguments = dict(target=gpt(0), draft=gpt(1), prompts=numpy.array([[1, 2]]),
                     max_new_tokens=4)
    arguments.update(change)
    with pytest.raises(ValueError, match=re.escape(words)):
        spec.generate(**arguments)


def test_a_draft_over_another_vocabulary_is_refused():
    np.random.seed(0)
    other = d2l.nn.GPT(VOCAB + 1, 1, 8, 2, MAX_LEN).initialize()
    with pytest.raises(ValueError, match='one vocabulary'):
        spec.generate(gpt(0), other, numpy.array([[1]]), 2)


def test_the_speedup_formula_helps_for_some_gamma_exactly_when_alpha_exceeds_c():
    """At γ = 1 it is (1 + α) / (1 + c); for α ≤ c every α^i ≤ c, so no γ beats 1."""
    grid = numpy.linspace(0.02, 0.98, 25)
    for alpha, cost in itertools.product(grid, grid):
        best = max(spec.predicted_speedup(alpha, g, cost) for g in range(1, 40))
        assert (best > 1 + 1e-12) == (alpha > cost), (alpha, cost, best)
    assert spec.expected_tokens(1.0, 4) == 5 and spec.predicted_speedup(0.5, 0, 0.3) == 1


def test_the_acceptance_rate_is_the_mean_overlap_of_the_tried_positions():
    rounds = [spec.Round(3, 1, [1.0, 0.25]), spec.Round(3, 3, [0.5] * 3), spec.Round(0, 0, [])]
    assert spec.acceptance_rate(rounds) == (1.0 + 0.25 + 1.5) / 5


def test_a_draft_of_no_layers_runs_through_the_kv_cache():
    """A bigram draft (a GPT of 0 layers) has no keys or values to cache: generation through
    the cache gives what recomputation gives, greedy and sampled."""
    target, draft = gpt(0, layers=2), gpt(1, layers=0)
    prompts = [numpy.array([0, 3, 1]), numpy.array([7, 2, 9, 9, 4, 0])]
    for temperature in (0.0, 1.0):
        runs = [d2l.inference.generate(target, prompts, 12, temperature, seed=0, cache=cache,
                                       draft=draft, draft_tokens=3)
                for cache in (None, 'contiguous')]
        for recomputed_row, cached_row in zip(*runs):
            numpy.testing.assert_array_equal(cached_row.asnumpy(), recomputed_row.asnumpy())
