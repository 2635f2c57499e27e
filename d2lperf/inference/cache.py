"""The KV cache: every layer's keys and values of the positions seen so far, so that a decode
step computes the projections of one new position instead of the whole prefix's. Taught in
"Inference", "One token at a time".

Generation runs a batch as one left-padded array of columns (`generate.py`); a step brings
the keys and values of columns start .. start + count, split into heads, (batch, heads,
count, d), and its attention needs every column's up to there, (batch, heads, start + count,
d). A cache is what turns the one into the other. `ContiguousCache` keeps each layer's in
two arrays preallocated for the whole output, as FasterTransformer and Hugging Face's static
cache do: 2·L·s·b·h numbers, which the memory ledger counts as 'kv cache'. The paged cache
(`paged.py`) keeps them in blocks. `Appended` is the contiguous cache as a compiled decode
step reads it (`generate.compiled_forward`): at its whole length, so that every step has the
same shapes and one program serves them all.
"""
from .. import engine, np
from ..device import label

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
    memory is allocated whole at construction, for the GPT's `heads`."""

    def __init__(self, num_layers, batch, length, width, dtype, device, heads):
        shape = (batch, heads, length, width // heads)
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
        self.store(layer, keys, values)
        return self.keys[layer][:, :, :self.stop], self.values[layer][:, :, :self.stop]

    def store(self, layer, keys, values):
        """Write a step's keys and values at its columns, start .. stop."""
        self.keys[layer][:, :, self.start:self.stop] = keys
        self.values[layer][:, :, self.start:self.stop] = values


    def store_step(self, new):
        """Store a decode step's keys and values of every layer (`new`: a layer's keys, then
        its values, each (batch, heads, count, head width)) as ONE engine operation: at decode
        sizes, a push a layer's keys and one its values cost more than the copies they make."""
        held = [array for pair in zip(self.keys, self.values) for array in pair]
        if not held:
            return
        start, stop = self.start, self.stop

        def run():
            for target, column in zip(held, new):
                target.data[:, :, start:stop] = column.data
        engine.push(run, [array.var for array in new], [array.var for array in held],
                    held[0].device, 'store_step')


class Appended(KVCache):
    """A contiguous cache's arrays, `held` (keys, values, for each layer in turn), as a traced
    decode step reads them: every column the cache has room for, then the step's own keys and
    values appended (a copy), which `new` keeps for generation to store into the cache once
    the step has run. A compiled program only makes new values, so the cache is written
    outside it; the attention's bias hides the columns not written yet."""

    def __init__(self, held):
        self.held, self.new = held, []

    def extend(self, layer, keys, values):
        self.new += [keys, values]
        return tuple(np.concatenate([self.held[2 * layer + i], new], axis=2)
                     for i, new in enumerate((keys, values)))


def cache_bytes(num_layers, length, batch, width, itemsize):
    """2·L·s·b·h·bytes: keys and values, for each of L layers, s positions, b sequences and
    h = heads × head width features."""
    return 2 * num_layers * length * batch * width * itemsize
