"""Tests of generation (d2lperf.inference.generate) and its contiguous KV cache: greedy tokens
with the cache equal recomputation's in float64, for batches of prompts of different lengths;
padding changes no prompt's tokens; sampling is reproducible and top_k=1 is greedy; the cache
holds 2·L·s·b·h·bytes on the ledger; bad input is refused by name. The static cache (each
decode step compiled once) gives the contiguous cache's tokens, greedy and sampled, and
stores the same columns into the cache's own arrays."""
import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import np
from d2lperf.inference import ContiguousCache, agreement, cache_bytes, forward, generate, sampler
from d2lperf.inference.generate import STEPS, compiled_forward
from strategies import checks
from test_memory import held

pytestmark = [pytest.mark.usefixtures('fresh_engine'), pytest.mark.chapter('inference')]

VOCAB, LAYERS, HIDDENS, HEADS, MAX_LEN = 30, 2, 16, 2, 40


def gpt(seed=0, dtype='float64', layers=LAYERS):
    np.random.seed(seed)
    net = d2l.nn.GPT(VOCAB, layers, HIDDENS, HEADS, MAX_LEN).initialize()
    net.cast(dtype)
    return net


def random_prompts(seed, batch, longest):
    rng = numpy.random.default_rng(seed)
    return [rng.integers(0, VOCAB, rng.integers(1, longest + 1)) for _ in range(batch)]


def hosts(out):
    return [row.asnumpy().tolist() for row in out]


def test_a_step_without_padding_is_the_gpts_own_forward():
    net, tokens = gpt(), numpy.random.default_rng(0).integers(0, VOCAB, (3, 7))
    want = net(np.array(tokens)).asnumpy()[:, -1]
    numpy.testing.assert_allclose(forward(net, tokens, 0, numpy.zeros(3, int)), want,
                                  rtol=1e-12, atol=1e-15)


@checks(12)
@given(seed=st.integers(0, 2 ** 16), batch=st.integers(1, 4), longest=st.integers(1, 12),
       new=st.integers(1, 10))
def test_greedy_tokens_with_the_cache_are_recomputations_in_float64(seed, batch, longest, new):
    net, prompts = gpt(seed % 4), random_prompts(seed, batch, longest)
    cached = generate(net, prompts, new)
    assert hosts(cached) == hosts(generate(net, prompts, new, cache=None))
    assert [row[:len(p)] for row, p in zip(hosts(cached), prompts)] == [p.tolist()
                                                                         for p in prompts]
    assert [len(row) for row in hosts(cached)] == [len(p) + new for p in prompts]


def test_padding_changes_no_prompts_tokens():
    """Each prompt of a batch gets the tokens it gets alone: its positions count from its own
    first token, and the padding before it is hidden from every query."""
    for seed in range(4):
        net, prompts = gpt(seed), random_prompts(seed, 4, 10)
        together = hosts(generate(net, prompts, 6))
        alone = [hosts(generate(net, [p], 6))[0] for p in prompts]
        assert together == alone


def test_a_batch_array_gives_an_array_and_a_list_a_list():
    net, tokens = gpt(), numpy.random.default_rng(1).integers(0, VOCAB, (2, 5))
    out = generate(net, np.array(tokens), 3)
    assert isinstance(out, np.ndarray) and out.shape == (2, 8)
    assert hosts(generate(net, list(tokens), 3)) == out.asnumpy().tolist()


def test_float32_agrees_with_recomputation_most_of_the_time():
    """float32 reported, not required: a near-tie may fall either way between the shapes of
    the two products; float64 agrees exactly."""
    prompts = random_prompts(0, 4, 10)
    assert agreement(gpt(dtype='float64'), prompts, 8) == 1.0
    share = agreement(gpt(dtype='float32'), prompts, 8)
    print(f'float32: {share:.0%} of greedy tokens with the cache equal recomputation')
    assert 0.5 <= share <= 1.0


def test_sampling_with_a_seed_is_reproducible_and_top_k_1_is_greedy():
    net, prompts = gpt(), random_prompts(3, 3, 8)
    drawn = hosts(generate(net, prompts, 8, temperature=1.0, seed=7))
    assert drawn == hosts(generate(net, prompts, 8, temperature=1.0, seed=7))
    assert drawn == hosts(generate(net, prompts, 8, temperature=1.0, seed=7, cache=None))
    assert drawn != hosts(generate(net, prompts, 8, temperature=1.0, seed=8))
    greedy = hosts(generate(net, prompts, 8))
    assert drawn != greedy
    for temperature in (0.5, 1.0, 3.0):
        assert hosts(generate(net, prompts, 8, temperature=temperature, top_k=1,
                              seed=1)) == greedy


def test_the_sampler_draws_each_token_with_its_softmax_probability_among_the_top_k():
    """20,000 rows of the same logits, one draw each: each share within 4 standard deviations
    of its probability (at most 0.014)."""
    p = numpy.array([0.1, 0.4, 0.2, 0.3])
    logits = numpy.tile(numpy.log(p), (20_000, 1))
    for temperature, top_k, want in ((1.0, None, p), (1.0, 2, [0, 0.4 / 0.7, 0, 0.3 / 0.7]),
                                     (0.5, None, p ** 2 / (p ** 2).sum())):  # ∝ p^(1/T)
        drawn = sampler(temperature, top_k, seed=0)(logits)
        shares = numpy.bincount(drawn, minlength=4) / len(drawn)
        numpy.testing.assert_allclose(shares, want, atol=0.014)
        assert all(shares[numpy.array(want) == 0] == 0)


def test_the_cache_holds_two_l_s_b_h_bytes_on_the_ledger_as_kv_cache():
    device = d2l.cpu()
    before = held(device).by_kind['kv cache']
    for (dtype, itemsize), heads in zip((('float32', 4), ('float64', 8)) * 2, (1, 1, 4, 4)):
        cache = ContiguousCache(num_layers=3, batch=5, length=11, width=16, dtype=dtype,
                                device=device, heads=heads)
        kept = held(device).by_kind['kv cache'] - before
        assert kept == cache_bytes(3, 11, 5, 16, itemsize) == 2 * 3 * 11 * 5 * 16 * itemsize
        del cache
        assert held(device).by_kind['kv cache'] == before


def test_the_cache_keeps_heads_as_the_attention_reads_them_and_a_step_writes_its_column():
    """(batch, heads, length, head width), in the bytes allocated at construction: a decode
    step writes only its own column and reads the earlier ones where they lie."""
    net, tokens = gpt(), numpy.random.default_rng(1).integers(0, VOCAB, (3, 6))
    pads = numpy.zeros(3, int)
    cache = ContiguousCache(LAYERS, 3, 8, HIDDENS, 'float64', d2l.cpu(), HEADS)
    forward(net, tokens, 0, pads, cache)
    before = [held.asnumpy() for held in cache.keys + cache.values]
    assert all(held.shape == (3, HEADS, 8, HIDDENS // HEADS) for held in before)
    step = forward(net, tokens[:, -1:], 6, pads, cache)
    after = [held.asnumpy() for held in cache.keys + cache.values]
    for old, new in zip(before, after):
        numpy.testing.assert_array_equal(new[:, :, :6], old[:, :, :6])
        assert (new[:, :, 6] != 0).all() and (new[:, :, 7] == 0).all()
    whole = numpy.concatenate([tokens, tokens[:, -1:]], axis=1)
    numpy.testing.assert_allclose(step, forward(net, whole, 0, pads), rtol=1e-12, atol=1e-15)


def test_a_decode_step_pushes_the_operations_of_the_prefill():
    """With its heads given, the cache is laid out when it is made: a prefill through it and
    each decode step after it push the same operations, each on one column a row."""
    net, tokens = gpt(), numpy.random.default_rng(2).integers(0, VOCAB, (2, 5))
    pads = numpy.array([2, 0])
    cache = ContiguousCache(LAYERS, 2, 8, HIDDENS, 'float64', d2l.cpu(), heads=HEADS)
    with d2l.profiler.profile() as prefill:
        forward(net, tokens, 0, pads, cache)
    for start in (5, 6):
        with d2l.profiler.profile() as step:
            forward(net, tokens[:, -1:], start, pads, cache)
        assert [r.name for r in step] == [r.name for r in prefill]


def test_generation_holds_the_formulas_bytes_at_its_peak_and_none_after():
    """s is the longest prompt plus the new tokens: the cache has room for the whole output."""
    device, net, prompts = d2l.cpu(), gpt(), random_prompts(5, 3, 9)
    before = held(device).by_kind['kv cache']
    d2l.device.reset_peak(device)
    generate(net, prompts, 7)
    memory = held(device)
    length = max(map(len, prompts)) + 7
    assert memory.peak_by_kind['kv cache'] - before == cache_bytes(LAYERS, length, 3, HIDDENS, 8)
    assert memory.by_kind['kv cache'] == before


def test_bad_input_is_refused_by_name():
    net = gpt()
    with pytest.raises(ValueError, match=r'30 tokens and max_new_tokens=11 .* max_len=40'):
        generate(net, numpy.zeros((1, 30), int), 11)
    with pytest.raises(ValueError, match='cache='):
        generate(net, numpy.zeros((1, 3), int), 2, cache='dense')
    with pytest.raises(ValueError, match='temperature='):
        generate(net, numpy.zeros((1, 3), int), 2, temperature=-1)
    with pytest.raises(ValueError, match='top_k='):
        generate(net, numpy.zeros((1, 3), int), 2, temperature=1, top_k=VOCAB + 1)
    with pytest.raises(ValueError, match='prompt ids'):
        generate(net, numpy.full((1, 3), VOCAB), 2)
    with pytest.raises(ValueError, match='1-D prompts'):
        generate(net, [numpy.zeros(3, int), numpy.zeros(0, int)], 2)
    with pytest.raises(ValueError, match='different lengths go in a list'):
        generate(net, numpy.zeros(3, int), 2)
    with pytest.raises(TypeError, match='GPT'):
        generate(d2l.nn.Dense(3), numpy.zeros((1, 3), int), 2)


def test_a_gpt_with_experts_is_refused_with_the_reason():
    np.random.seed(0)
    moe = d2l.nn.GPT(VOCAB, 2, HIDDENS, HEADS, MAX_LEN, num_experts=2).initialize()
    with pytest.raises(ValueError, match='mixtures of experts: an expert takes a capacity'):
        generate(moe, numpy.zeros((1, 3), int), 2)


def test_with_a_draft_greedy_tokens_are_the_targets_alone_in_float64():
    """`draft=` hands generation to speculative decoding (speculative.py, tested there): the
    draft's guesses change how many passes the target makes, never its greedy tokens."""
    target, draft, prompts = gpt(0), gpt(1, layers=1), random_prompts(2, 3, 8)
    alone = hosts(generate(target, prompts, 9))
    for draft_tokens in (1, 3):
        assert hosts(generate(target, prompts, 9, draft=draft, draft_tokens=draft_tokens)) == alone
    tokens = numpy.random.default_rng(3).integers(0, VOCAB, (2, 4))
    out = generate(target, tokens, 5, temperature=1.0, seed=4, draft=draft)
    assert isinstance(out, np.ndarray) and out.shape == (2, 9)
    assert (out.asnumpy() == generate(target, tokens, 5, temperature=1.0, seed=4,
                                      draft=draft).asnumpy()).all()


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_with_a_draft_the_cache_rolls_back_to_recomputations_tokens(temperature):
    """Both GPTs run through a contiguous cache, which a round rolls back past the drafted
    tokens the target rejects (an untrained draft has many rejected): the same tokens as
    recomputing both prefixes, greedy and, from one seed, sampled (float64)."""
    for seed in range(3):
        target, draft, prompts = gpt(seed), gpt(50 + seed, layers=1), random_prompts(seed, 2, 7)
        runs = [hosts(generate(target, prompts, 15, temperature, seed=seed, cache=cache,
                               draft=draft, draft_tokens=3)) for cache in ('contiguous', None)]
        assert runs[0] == runs[1]
    np.random.seed(0)
    moe = d2l.nn.GPT(VOCAB, 2, HIDDENS, HEADS, MAX_LEN, num_experts=2).initialize()
    with pytest.raises(ValueError, match='mixtures of experts'):
        generate(target, prompts, 2, draft=moe)


def test_a_gpt_of_no_layers_runs_through_every_cache():
    """A bigram model (0 layers) has no keys or values to keep: every cache gives what
    recomputation gives, alone and as a draft."""
    bigram, target, prompts = gpt(1, layers=0), gpt(0), random_prompts(4, 2, 6)
    want = hosts(generate(bigram, prompts, 6, cache=None))
    assert all(hosts(generate(bigram, prompts, 6, cache=c)) == want
               for c in ('contiguous', 'static', 'paged'))
    runs = [hosts(generate(target, prompts, 8, 1.0, seed=0, cache=cache, draft=bigram,
                           draft_tokens=3)) for cache in (None, 'contiguous')]
    assert runs[0] == runs[1]


@checks(12)
@given(seed=st.integers(0, 2 ** 16), batch=st.integers(1, 4), longest=st.integers(1, 12),
       new=st.integers(1, 10))
def test_greedy_tokens_of_the_compiled_step_are_the_contiguous_caches_in_float64(
        seed, batch, longest, new):
    net, prompts = gpt(seed % 4), random_prompts(seed, batch, longest)
    assert hosts(generate(net, prompts, new, cache='static')) == hosts(generate(net, prompts, new))


def test_sampled_tokens_of_the_compiled_step_are_the_contiguous_caches_from_one_seed():
    for seed in range(3):
        net, prompts = gpt(seed), random_prompts(seed, 3, 9)
        for temperature, top_k in ((1.0, None), (0.7, 5)):
            runs = [hosts(generate(net, prompts, 12, temperature, top_k, seed=seed, cache=c))
                    for c in ('contiguous', 'static')]
            assert runs[0] == runs[1]


def test_a_compiled_step_is_one_push_and_stores_its_column_into_the_cache():
    """The step's inputs (ids, positions, bias) are three arrays made on the host; the whole
    step is one engine operation, which reads the cache's own arrays (the ledger's 'kv cache'
    bytes); then one operation stores every layer's new keys and values at the step's
    column, as the imperative step does, and no other."""
    net, tokens = gpt(), numpy.random.default_rng(1).integers(0, VOCAB, (3, 6))
    pads = numpy.array([0, 2, 1])
    caches = [ContiguousCache(LAYERS, 3, 9, HIDDENS, 'float64', d2l.cpu(), heads=HEADS)
              for _ in range(2)]
    for cache in caches:
        forward(net, tokens, 0, pads, cache)
    arrays = [id(held) for held in caches[1].keys + caches[1].values]
    want = forward(net, tokens[:, -1:], 6, pads, caches[0])
    with d2l.profiler.profile() as step:
        got = compiled_forward(net, tokens[:, -1:], 6, pads, caches[1])
    assert [r.name for r in step] == ['array'] * 3 + ['decode_step', 'store_step']
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert [id(held) for held in caches[1].keys + caches[1].values] == arrays
    for imperative, compiled in zip(caches[0].keys + caches[0].values,
                                    caches[1].keys + caches[1].values):
        numpy.testing.assert_allclose(compiled.asnumpy()[:, :, :7], imperative.asnumpy()[:, :, :7],
                                      rtol=1e-12, atol=1e-15)
        assert (compiled.asnumpy()[:, :, 6] != 0).all() and (compiled.asnumpy()[:, :, 7:] == 0).all()


def test_the_step_is_compiled_once_for_a_batch_and_length_and_the_cache_is_on_the_ledger():
    """A second generation of the same shapes reuses the program with its own, new cache; the
    ledger holds that cache's 2·L·s·b·h bytes at the peak and none after, as with the
    contiguous cache."""
    device, net, prompts = d2l.cpu(), gpt(), random_prompts(5, 3, 9)
    before = held(device).by_kind['kv cache']
    d2l.device.reset_peak(device)
    first = hosts(generate(net, prompts, 7, cache='static'))
    memory = held(device)
    length = max(map(len, prompts)) + 7
    assert memory.peak_by_kind['kv cache'] - before == cache_bytes(LAYERS, length, 3, HIDDENS, 8)
    assert memory.by_kind['kv cache'] == before
    assert hosts(generate(net, prompts[::-1], 7, cache='static')) == first[::-1]
    assert STEPS[net].compiles == 1
    generate(net, prompts, 8, cache='static')                   # a longer cache: a new shape
    assert STEPS[net].compiles == 2


def test_the_compiled_step_reads_the_gpts_parameters_anew_and_runs_a_hybridized_gpt():
    """Parameters given new arrays (a cast there and back) are read again by the program
    compiled before; one of another dtype compiles a new one; a hybridized GPT's blocks are
    traced into the step as the plain GPT's are."""
    net, prompts = gpt(), random_prompts(6, 2, 7)
    want = hosts(generate(net, prompts, 6, cache='static'))
    net.cast('float32').cast('float64')
    assert hosts(generate(net, prompts, 6, cache='static')) == want
    net.cast('float32')                 # float32 tokens may part at a near-tie: not compared
    assert [len(row) for row in hosts(generate(net, prompts, 6, cache='static'))] == [
        len(p) + 6 for p in prompts]
    assert STEPS[net].compiles == 2
    net.cast('float64').hybridize()
    assert hosts(generate(net, prompts, 6, cache='static')) == want
