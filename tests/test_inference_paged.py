"""Tests of paged KV memory (d2lperf.inference.paged): generation through pages gives the
contiguous cache's tokens; the attention reads through the block tables what a contiguous
cache holds; the allocator never hands one block to two live sequences, and a finished
sequence's blocks are free at once; utilization is tokens held over token slots, and on the
course's corpus paged memory holds at least 90% of its slots with tokens."""
import doctest

import numpy
import pytest
from hypothesis import given, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import d2lperf as d2l
from d2lperf import data, np
from d2lperf.inference import (BlockTables, ContiguousCache, PagedCache, cache_bytes,
                               corpus_requests, generate, paged, utilization)
from strategies import checks
from test_inference_generate import LAYERS, HIDDENS, gpt, hosts, random_prompts
from test_memory import held

pytestmark = [pytest.mark.usefixtures('fresh_engine'), pytest.mark.chapter('inference')]


def test_the_modules_examples_run():
    assert doctest.testmod(paged).failed == 0


@checks(10)
@given(seed=st.integers(0, 2 ** 16), batch=st.integers(1, 4), longest=st.integers(1, 20),
       new=st.integers(1, 20))
def test_paged_generation_gives_the_contiguous_caches_tokens_in_float64(seed, batch, longest,
                                                                        new):
    net, prompts = gpt(seed % 4), random_prompts(seed, batch, longest)
    for options in ({}, {'temperature': 1.0, 'seed': seed}):
        assert hosts(generate(net, prompts, new, cache='paged', **options)) == hosts(
            generate(net, prompts, new, **options))


@checks(25)
@given(seed=st.integers(0, 2 ** 16), batch=st.integers(1, 4), longest=st.integers(1, 9),
       steps=st.lists(st.integers(1, 6), min_size=1, max_size=5),
       block_size=st.integers(1, 5))
def test_the_attention_reads_through_the_tables_what_a_contiguous_cache_holds(
        seed, batch, longest, steps, block_size):
    """Random keys and values through both caches, step by step: every column past a row's
    padding reads back the same (the padding's are hidden from the attention either way)."""
    rng = numpy.random.default_rng(seed)
    pads = longest - rng.integers(1, longest + 1, batch)
    length, heads, size = longest + sum(steps), 2, 3
    sizes = dict(num_layers=2, width=heads * size, dtype='float64', device=d2l.cpu())
    contiguous = ContiguousCache(batch=batch, length=length, heads=heads, **sizes)
    tables = BlockTables(paged.blocks_for(length - pads, block_size), block_size)
    pages = PagedCache(tables, range(batch), pads, **sizes)
    start = 0
    for count in [longest] + steps:
        for cache in (contiguous, pages):
            cache.begin(start, count)
        for layer in range(2):
            new = [np.array(rng.normal(size=(batch, heads, count, size))) for _ in range(2)]
            want, got = ([a.asnumpy() for a in cache.extend(layer, *new)]
                         for cache in (contiguous, pages))
            for row, pad in enumerate(pads):
                for w, g in zip(want, got):
                    numpy.testing.assert_array_equal(g[row, :, pad:], w[row, :, pad:])
        start += count
    assert tables.tokens_held() == sum(length - pads)
    pages.free()
    assert tables.slots_allocated() == 0 and len(tables.allocator.free_blocks) == (
        tables.allocator.num_blocks)


class Allocations(RuleBasedStateMachine):
    """Sequences grow and finish at random in a pool of 12 blocks of 4 tokens."""

    def __init__(self):
        super().__init__()
        self.tables, self.next_id = BlockTables(num_blocks=12, block_size=4), 0

    @rule(count=st.integers(1, 9))
    def start_a_sequence(self, count):
        self.grow(self.next_id, count)
        self.next_id += 1

    @precondition(lambda self: self.tables.tables)
    @rule(data=st.data(), count=st.integers(1, 6))
    def grow_one(self, data, count):
        self.grow(data.draw(st.sampled_from(sorted(self.tables.tables))), count)

    @precondition(lambda self: self.tables.tables)
    @rule(data=st.data())
    def finish_one(self, data):
        sequence = data.draw(st.sampled_from(sorted(self.tables.tables)))
        free_before, blocks = len(self.tables.allocator.free_blocks), self.tables.tables[sequence]
        self.tables.free(sequence)
        assert len(self.tables.allocator.free_blocks) == free_before + len(blocks)

    def grow(self, sequence, count):
        needed = -(-(self.tables.lengths.get(sequence, 0) + count) // 4) - len(
            self.tables.tables.get(sequence, []))
        before = {s: list(t) for s, t in self.tables.tables.items()}, dict(self.tables.lengths)
        if needed > len(self.tables.allocator.free_blocks):
            with pytest.raises(MemoryError, match=f'{needed} blocks asked'):
                self.tables.grow(sequence, count)
            assert (self.tables.tables, self.tables.lengths) == before    # nothing taken
        else:
            self.tables.grow(sequence, count)
            assert self.tables.tables[sequence][:len(before[0].get(sequence, []))] == (
                before[0].get(sequence, []))                              # blocks stay put

    @invariant()
    def no_block_is_in_two_places(self):
        used = [block for table in self.tables.tables.values() for block in table]
        free = self.tables.allocator.free_blocks
        assert sorted(used + free) == list(range(12))

    @invariant()
    def each_sequence_holds_the_fewest_blocks_its_tokens_need(self):
        for sequence, table in self.tables.tables.items():
            assert len(table) * 4 - 4 < self.tables.lengths[sequence] <= len(table) * 4


TestAllocations = Allocations.TestCase
TestAllocations.settings = checks(30)


def test_utilization_counts_tokens_over_slots_at_every_step():
    """Two requests, blocks of 4, max_len 8. Step 1: 3 + 2 tokens in 1 + 1 blocks (8 slots)
    against 16 reserved; step 2: 4 + 3 in 2 (8); step 3, the second gone: 5 in 2 blocks (8)
    against 8."""
    assert utilization([(2, 3), (1, 2)], block_size=4, max_len=8) == (
        (5 + 7 + 5) / (8 + 8 + 8), (5 + 7 + 5) / (16 + 16 + 8))
    with pytest.raises(ValueError, match='max_len=4'):
        utilization([(2, 3)], max_len=4)


def test_on_the_corpus_paged_memory_holds_90_percent_while_preallocation_holds_far_less():
    requests = corpus_requests(data.python_docs(), count=200, max_len=1024, seed=0)
    assert len(requests) == 200 and max(p + o for p, o in requests) <= 1024
    in_pages, preallocated = utilization(requests, block_size=16, max_len=1024)
    print(f'paged {in_pages:.1%}, preallocated to 1024 tokens {preallocated:.1%}')
    assert in_pages >= 0.9 and preallocated < 0.5


def test_a_gpt_of_no_layers_generates_through_pages_what_recomputation_gives():
    """A bigram GPT has no keys or values: the pages hold none, and give every block back."""
    net, prompts = gpt(1, layers=0), random_prompts(3, 3, 7)
    for options in ({}, {'temperature': 1.0, 'seed': 3}):
        assert hosts(generate(net, prompts, 9, cache='paged', **options)) == hosts(
            generate(net, prompts, 9, cache=None, **options))


def test_the_pool_holds_its_blocks_bytes_on_the_ledger_as_kv_cache():
    device = d2l.cpu()
    before = held(device).by_kind['kv cache']
    tables = BlockTables(num_blocks=5, block_size=16)
    pages = PagedCache(tables, [0], [0], num_layers=LAYERS, width=HIDDENS, dtype='float64',
                       device=device)
    assert held(device).by_kind['kv cache'] - before == cache_bytes(LAYERS, 5 * 16, 1,
                                                                    HIDDENS, 8)
    del pages
    assert held(device).by_kind['kv cache'] == before
