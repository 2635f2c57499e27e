"""The KV cache: every layer's keys and values of the positions seen so far, so that a decode
step computes the projections of one new position instead of the whole prefix's. Taught in
"Inference", "One token at a time".

Generation runs a batch as one left-padded array of columns (`generate.py`); a step brings
the keys and values of columns start .. start + count, split into heads, (batch, heads,
count, d), and its attention needs every column's up to there, (batch, heads, start + count,
d). A cache is what turns the one into the other. `ContiguousCache` keeps each layer's in
two arrays preallocated for the whole output, as FasterTransformer and Hugging Face's static
cache do: 2·L·s·b·h numbers, which the memory ledger counts as 'kv cache'. The paged cache
(`paged.py`) keeps them in blocks. `ColumnWrites` is the contiguous cache as a compiled
decode step sees it (`generate.DecodeStep`): the column to write is an array, not a number,
so that every step has the same shapes and one program serves them all.
"""
from .. import np
from ..device import label
from ..np.multiarray import apply
from ..ops import defop

KIND = 'kv cache'          # the ledger's kind for the bytes of every cache


class KVCache:
    """What generation asks of a cache: room for a step's columns, once a step before the
    layers (`begin`), then, layer by layer, to store the step's keys and values and hand back
    every column's (`extend`)."""

    def begin(self, start, count):
        raise NotImplementedError

    def extend(self, layer, keys, values):
        raise NotImplementedError


class ContiguousCache(KVCache):
    """Per layer, keys and values (batch, heads, length, head width), the layout the attention
    reads (as vLLM's and Hugging Face's caches keep them): a step writes only its own columns,
    split into heads once, and the attention reads columns 0 .. stop in place, a view. The
    memory is allocated whole at construction; `heads` (generation passes the GPT's) shapes
    it there, else the first keys a layer stores do (a reshape of the same bytes, pushed in
    that step)."""

    def __init__(self, num_layers, batch, length, width, dtype, device, heads=None):
        shape = (batch, length, width) if heads is None else (
            batch, heads, length, width // heads)
        self.keys, self.values = ([label(np.zeros(shape, dtype, device), KIND)
                                   for _ in range(num_layers)] for _ in range(2))
        self.length, self.start, self.stop = length, 0, 0      # length: also with 0 layers

    def begin(self, start, count):
        if start + count > self.length:
            raise ValueError(f'columns up to {start + count} do not fit a cache made for '
                             f'{self.length}: make it for the whole output')
        self.start, self.stop = start, start + count

    def extend(self, layer, keys, values):
        """Store a step's keys and values (batch, heads, count, head width); every column's."""
        batch, heads, _, size = keys.shape
        for held, new in ((self.keys, keys), (self.values, values)):
            if len(held[layer].shape) == 3:
                held[layer] = held[layer].reshape(batch, heads, self.length, size)
            held[layer][:, :, self.start:self.stop] = new
        return self.keys[layer][:, :, :self.stop], self.values[layer][:, :, :self.stop]


class ColumnWrites(KVCache):
    """The arrays of a `ContiguousCache` inside a traced decode step: `extend` writes a step's
    keys and values at `column`, a (1,) integer array, in place (the op `write_column`, the
    cache's arrays being parameters of the program), and hands back every column the cache
    has room for: the attention's bias hides those past `column`, so that the shapes, and
    the program, are the same at every step (Hugging Face's StaticCache does the same with
    `index_copy_`). Only inside a trace: imperatively, the op's result would be a second
    array counting the cache's bytes again."""

    def __init__(self, keys, values, column):
        self.keys, self.values, self.column = keys, values, column

    def extend(self, layer, keys, values):
        return (apply('write_column', self.keys[layer], keys, self.column),
                apply('write_column', self.values[layer], values, self.column))


def write_column(xp, held, new, column):
    """held[:, :, column] = new, in place; returns `held`, which the attention then reads."""
    held[:, :, column] = new
    return held


def write_column_infer(held, new, column):
    if tuple(new.shape) != (*held.shape[:2], 1, *held.shape[3:]) or column.shape != (1,):
        raise ValueError(f'write_column stores one column (batch, heads, 1, d) at a (1,) '
                         f'index into {tuple(held.shape)}, got {tuple(new.shape)} at '
                         f'{tuple(column.shape)}')
    return tuple(held.shape), held.dtype


defop('write_column', write_column, write_column_infer, writes=(0,))


def cache_bytes(num_layers, length, batch, width, itemsize):
    """2·L·s·b·h·bytes: keys and values, for each of L layers, s positions, b sequences and
    h = heads × head width features."""
    return 2 * num_layers * length * batch * width * itemsize
