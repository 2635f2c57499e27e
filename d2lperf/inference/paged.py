"""Paged KV memory, vLLM's PagedAttention (Kwon et al., 2023): the cache's keys and values
live in fixed-size blocks of one pool, and each sequence has a block table, its blocks in
order. A sequence takes a block only when its tokens spill into one and gives all of them back
the moment it finishes, so the memory it wastes is the unfilled end of its last block, not the
rest of a maximum length reserved up front. Taught in "Inference", "Paged memory".

`BlockAllocator` hands out blocks from a free list; `BlockTables` is the bookkeeping of
sequences, tables and lengths, which `utilization` runs alone over a list of requests;
`PagedCache` adds the pool's arrays, one (blocks · block size, h) pair a layer, for
generation: a block is (block size, heads, head width), as vLLM's FlashAttention backend lays
it, and its attention reads them through the tables, a gather.
"""
import math

import numpy

from .. import np
from ..device import label
from ..np import extension as npx
from .cache import KIND, KVCache

BLOCK_SIZE = 16            # tokens a block: vLLM's default


class BlockAllocator:
    """Blocks 0 .. num_blocks - 1, each in use by at most one sequence: a free list."""

    def __init__(self, num_blocks):
        if num_blocks < 1:
            raise ValueError(f'num_blocks={num_blocks}: a pool needs at least one block')
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))     # pop() hands out 0 first

    def allocate(self, count):
        """`count` free blocks, or none at all and a MemoryError."""
        if count > len(self.free_blocks):
            raise MemoryError(f'{count} blocks asked, {len(self.free_blocks)} of all '
                              f'{self.num_blocks} blocks free: free a finished sequence, or '
                              'make the pool larger')
        return [self.free_blocks.pop() for _ in range(count)]

    def free(self, blocks):
        self.free_blocks.extend(reversed(blocks))


class BlockTables:
    """Each live sequence's block table and the tokens it holds.

    >>> tables = BlockTables(num_blocks=4, block_size=16)
    >>> tables.grow('a', 20); tables.grow('b', 5); tables.tables
    {'a': [0, 1], 'b': [2]}
    >>> tables.utilization()            # 25 tokens in 3 blocks of 16 slots
    0.5208333333333334
    >>> tables.free('a'); tables.grow('c', 1); tables.tables['c']    # a's first block
    [0]
    """

    def __init__(self, num_blocks, block_size=BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f'block_size={block_size}: a block holds at least one token')
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables, self.lengths = {}, {}

    def grow(self, sequence, count):
        """Room for `count` more tokens of `sequence` (a new one starts empty): a block only
        for the tokens that spill past the last one."""
        table, length = self.tables.get(sequence, []), self.lengths.get(sequence, 0) + count
        spilled = -(-length // self.block_size) - len(table)          # ceil, less held
        self.tables[sequence] = table + self.allocator.allocate(max(spilled, 0))
        self.lengths[sequence] = length

    def free(self, sequence):
        """A finished sequence's blocks go back to the free list at once."""
        self.allocator.free(self.tables.pop(sequence))
        del self.lengths[sequence]

    def slots(self, sequence, positions):
        """Where tokens `positions` (an int array) of `sequence` live in the pool."""
        table = numpy.asarray(self.tables[sequence])
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def tokens_held(self):
        return sum(self.lengths.values())

    def slots_allocated(self):
        return self.block_size * sum(map(len, self.tables.values()))

    def utilization(self):
        """Tokens held over the token slots of the blocks allocated."""
        return self.tokens_held() / max(self.slots_allocated(), 1)


class PagedCache(KVCache):
    """Keys and values of a left-padded batch in pages: row i is sequence `sequences[i]`,
    whose token p sits at column p + pads[i]. Padding takes no slot; a gather hands the
    attention the same (batch, heads, columns, d) layout a `ContiguousCache` holds, its
    padding columns read from slot 0 (finite, and hidden by the attention's bias)."""

    def __init__(self, tables, sequences, pads, num_layers, width, dtype, device):
        slots = tables.allocator.num_blocks * tables.block_size
        self.keys, self.values = ([label(np.zeros((slots, width), dtype, device), KIND)
                                   for _ in range(num_layers)] for _ in range(2))
        self.tables, self.sequences, self.pads = tables, list(sequences), list(pads)
        self.device = device

    def begin(self, start, count):
        """Grow each sequence by its tokens among columns start .. start + count; note where
        they go (`writes`: row, first column of this step, first slot, tokens) and the slot
        of every column so far (`index`)."""
        self.writes, index = [], numpy.zeros((len(self.sequences), start + count), numpy.int64)
        for row, (sequence, pad) in enumerate(zip(self.sequences, self.pads)):
            first = max(start, pad)
            if start + count > first:
                self.tables.grow(sequence, start + count - first)
                slots = self.tables.slots(sequence, numpy.arange(first, start + count) - pad)
                self.writes += [(row, first - start + offset, slots[offset], length)
                                for offset, length in runs(slots)]
            index[row, pad:] = self.tables.slots(sequence, numpy.arange(start + count - pad))
        self.index = np.array(index, device=self.device)

    def extend(self, layer, keys, values):
        """Store a step's keys and values (batch, heads, count, d) in their slots, a token's
        heads side by side; hand back every column's, gathered through the tables and split
        into heads, (batch, heads, columns, d)."""
        batch, heads, count, size = keys.shape
        gathered = []
        for pool, new in ((self.keys[layer], keys), (self.values[layer], values)):
            tokens = new.transpose(0, 2, 1, 3).reshape(batch, count, heads * size)
            for row, column, slot, length in self.writes:
                pool[slot:slot + length] = tokens[row, column:column + length]
            columns = npx.embedding(self.index, pool)
            gathered.append(columns.reshape(batch, -1, heads, size).transpose(0, 2, 1, 3))
        return gathered

    def free(self):
        """The batch is done: every sequence's blocks go back."""
        for sequence in self.sequences:
            self.tables.free(sequence)


def runs(slots):
    """(offset, length) of each run of consecutive slots: one write each (a block's worth)."""
    breaks = numpy.flatnonzero(numpy.diff(slots) != 1) + 1
    starts = numpy.concatenate([[0], breaks])
    return list(zip(starts.tolist(), numpy.diff(numpy.append(starts, len(slots))).tolist()))


def blocks_for(lengths, block_size=BLOCK_SIZE):
    return sum(math.ceil(length / block_size) for length in lengths)


def utilization(requests, block_size=BLOCK_SIZE, max_len=None):
    """(paged, preallocated): tokens held over token slots, summed over the steps of serving
    `requests`, (prompt length, output length) pairs, together from the first step: each step
    every live sequence gains a token, and one that reaches its output length leaves. Paged,
    a sequence holds the blocks its tokens fill, freed as it leaves; preallocated, each live
    sequence reserves `max_len` slots (default: the longest prompt + output among them)."""
    lengths = [prompt + output for prompt, output in requests]
    max_len = max_len or max(lengths)
    if min(output for _, output in requests) < 1 or max(lengths) > max_len:
        raise ValueError(f'each request needs an output of 1 token or more and at most '
                         f'max_len={max_len} tokens in all, got lengths up to {max(lengths)}')
    tables = BlockTables(blocks_for(lengths, block_size), block_size)
    for sequence, (prompt, _) in enumerate(requests):
        tables.grow(sequence, prompt)
    live, held, paged, reserved = set(range(len(requests))), 0, 0, 0
    while live:
        for sequence in live:
            tables.grow(sequence, 1)
        held, paged = held + tables.tokens_held(), paged + tables.slots_allocated()
        reserved += len(live) * max_len
        for sequence in [s for s in live if tables.lengths[s] == lengths[s]]:
            tables.free(sequence)
            live.remove(sequence)
    return held / paged, held / reserved


def corpus_requests(text, count, max_len, seed=0):
    """`count` (prompt length, output length) pairs from a text's paragraphs, in characters
    (the course's GPT reads characters): a paragraph as the prompt, the one after it as the
    output, at random places (seeded), each cut to fit max_len (the prompt to half of it)."""
    paragraphs = [len(p) for p in text.split('\n\n') if p.strip()]
    starts = numpy.random.default_rng(seed).integers(0, len(paragraphs) - 1, count)
    pairs = []
    for start in starts.tolist():
        prompt = min(paragraphs[start], max_len // 2)
        pairs.append((prompt, min(paragraphs[start + 1], max_len - prompt)))
    return pairs
