"""Generation: a GPT's prompt in one pass (prefill), then one token a step (decode), each
step's keys and values kept in a KV cache so that a step computes one position, not the
whole prefix again. Taught in "Inference", "One token at a time".

Prompts of different lengths run as one batch, left-padded to the longest (the new tokens
then share one column in every row, as most servers without paged kernels do). The GPT's
positions are learnt, so each row counts its positions from its own first token, and a bias
on the attention's scores hides the padding. The steps call the GPT's own blocks (its
embedding table, norms, projections, attention and MLP: `forward` below), so that a step with
the cache computes what the GPT computes on the whole prefix (`cache=None`, the reference),
which the tests check token for token in float64.

With `cache='static'` the decode steps run compiled (`decode_step`): the contiguous cache
read at its whole length, so that a step has the same shapes every time and is one compiled
program, then one push that stores every layer's keys and values: 5 pushes a step (its
three inputs, the program, the store) instead of 67 for a 2-layer GPT, one per operation,
whose Python costs more than their arithmetic at batch 1.
"""
import numbers
import weakref

import numpy

from .. import hybrid, np
from ..np import extension as npx
from ..nn import GPT
from ..nn.block import current_arrays
from . import speculative
from .cache import Appended, ContiguousCache
from .paged import BlockTables, PagedCache, blocks_for

CACHES = ('contiguous', 'static', 'paged', None)


def generate(net, tokens, max_new_tokens, temperature=0.0, top_k=None, seed=None,
             cache='contiguous', draft=None, draft_tokens=4):
    """`max_new_tokens` tokens after each prompt: the most likely at temperature 0 (greedy),
    else drawn from softmax(logits / temperature) over the `top_k` most likely, with a numpy
    Generator seeded by `seed`. `tokens`: (batch, len) ids, the result (batch, len + new); or
    a list of 1-D prompts, the result a list. `cache`: 'contiguous', 'static' (the same cache,
    each decode step compiled once: `decode_step`), 'paged' (blocks of 16 tokens) or None
    (recompute the whole prefix every step). `draft`: a smaller GPT that
    proposes `draft_tokens` tokens a round for `net` to check (speculative decoding,
    `speculative.py`; both GPTs through a contiguous cache unless `cache` is None)."""
    prompts, as_list = read_prompts(tokens)
    check(net, prompts, max_new_tokens, cache)
    device = parameter_of(net).device
    if draft is not None:
        check(draft, prompts, max_new_tokens, cache)
        rows = speculative.generate(net, draft, prompts, max_new_tokens, draft_tokens,
                                    temperature, top_k, seed, distributions=(
                                        speculative.recomputed if cache is None else cached))
        return returned(rows, as_list, device)
    choose = sampler(temperature, top_k, seed, vocab_size=net.config[0])
    ids, pads = left_pad(prompts)
    memory = make_cache(cache, net, pads, ids.shape[1] + max_new_tokens)
    decode = compiled_forward if cache == 'static' else forward
    start = 0
    for _ in range(max_new_tokens):
        logits = (decode if start else forward)(net, ids[:, start:], start, pads, memory)
        ids = numpy.concatenate([ids, choose(logits)[:, None]], axis=1)
        start = 0 if memory is None else ids.shape[1] - 1
    if isinstance(memory, PagedCache):
        memory.free()
    return returned([row[pad:] for row, pad in zip(ids, pads)], as_list, device)


def cached(net, temperature=0.0, top_k=None):
    """`net` as speculative decoding's `Distributions` of one sequence, through a contiguous
    KV cache: a call computes only the columns the cache lacks. Where the sequence leaves
    what the cache holds (drafted tokens the target rejected), the cache rolls back by
    starting there: the columns past it are overwritten before they are read again."""
    pads, held = numpy.zeros(1, numpy.int64), []
    memory = make_cache('contiguous', net, pads, net.config[4])

    def next_distributions(tokens, count):
        agreed = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b),
                      min(len(held), len(tokens)))
        start = min(agreed, len(tokens) - count)
        logits = column_logits(net, numpy.array([tokens[start:]]), start, pads, memory, count)
        held[:] = tokens
        return speculative.distribution(logits[0], temperature, top_k)
    return next_distributions


def returned(rows, as_list, device):
    """Host rows as the caller gave the prompts: a list of 1-D arrays, or one 2-D array."""
    if as_list:
        return [np.array(row, device=device) for row in rows]
    return np.array(numpy.stack(rows), device=device)


def forward(net, tokens, start, pads, cache=None):
    """Logits (batch, vocab) of the last column, for host ids `tokens` (batch, count) at
    columns start .. start + count of a left-padded batch whose row i starts at column
    pads[i]. A cache holds the keys and values of the columns before start; without one,
    start is 0 and `tokens` the whole prefix."""
    return column_logits(net, tokens, start, pads, cache, 1)[:, 0]


def column_logits(net, tokens, start, pads, cache, last):
    """`forward`'s logits for each of the `last` columns, (batch, last, vocab): speculative
    decoding's target scores every drafted token in one pass."""
    device, dtype = parameter_of(net).device, parameter_of(net).dtype
    columns = numpy.arange(start + tokens.shape[1])
    x = embed(net, np.array(tokens, device=device),
              np.array(positions_of(columns[start:], pads), device=device))
    bias = np.array(padding_bias(columns, pads, dtype), device=device)
    if cache is not None:
        cache.begin(start, tokens.shape[1])
    return net[-1](layers(net, x, bias, cache)[:, -last:]).asnumpy()


def compiled_forward(net, tokens, start, pads, cache):
    """`forward` of one new column through a `ContiguousCache`, as one compiled program (then
    one push that stores every layer's new keys and values into the cache): the
    step sees the cache at its whole length and its own column after it, and the bias hides,
    besides the padding, the cache's columns from `start` on, not written yet."""
    device, dtype = parameter_of(net).device, parameter_of(net).dtype
    bias = padding_bias(numpy.arange(cache.length + 1), pads, dtype)
    bias[..., start:cache.length] = numpy.finfo(dtype).min
    inputs = [np.array(x, device=device) for x in (tokens, positions_of(
        numpy.array([start]), pads), bias)]
    held = [array for pair in zip(cache.keys, cache.values) for array in pair]
    step = STEPS.get(net) or STEPS.setdefault(net, decode_step(net))
    logits, *new = step.run((*inputs, *held))
    cache.begin(start, 1)
    cache.store_step(new)
    return logits.asnumpy()[:, 0]


STEPS = weakref.WeakKeyDictionary()         # a GPT -> its compiled decode step


def decode_step(net):
    """The GPT's decode step, traced and compiled once per batch, cache length and dtype
    (`hybrid.CompiledFunction`; MXNet's static_shape, Hugging Face's StaticCache): the ids,
    positions and bias, then the cache's arrays, in; the logits and each layer's new keys
    and values out."""
    gpt = weakref.proxy(net)                # STEPS keeps a step only while its GPT lives

    def forward(tokens, positions, bias, *held):
        cache = Appended(held)
        x = layers(gpt, embed(gpt, tokens, positions), bias, cache)
        return (gpt[-1](x), *cache.new)
    return hybrid.CompiledFunction(forward, lambda: gpt.collect_params(), 'decode_step',
                                   current_arrays)


def embed(net, tokens, positions):
    """The GPT's embedding of ids `tokens` at learnt positions `positions`, both (batch, count)."""
    embedding = net[0]
    return (embedding.token(tokens)
            + npx.embedding(positions, embedding.position.data(tokens.device)))


def positions_of(columns, pads):
    """Each row's positions at `columns`, counted from its own first token."""
    return numpy.maximum(columns - pads[:, None], 0)


def padding_bias(columns, pads, dtype):
    """(batch, 1, 1, columns) to add to the attention's scores: the dtype's lowest number
    where a row's padding lies, so that its softmax weight is exactly 0, else 0."""
    hidden = numpy.where(columns < pads[:, None], numpy.finfo(dtype).min, 0).astype(dtype)
    return hidden.reshape(len(pads), 1, 1, -1)


def layers(net, x, bias, cache):
    """The GPT's transformer layers on `x`, each layer's keys and values through `cache`."""
    for number, layer in enumerate(list(net.children())[1:-1]):
        x = transformer_layer(layer, x, bias, cache, number)
    return x


def transformer_layer(layer, x, bias, cache, number):
    """`TransformerLayer.forward`, with keys and values through the cache. They are split
    into heads as they are made, one step's columns, since the cache keeps them so: the
    attention then reads the cached prefix as it lies instead of re-laying it every step."""
    attention, h = layer.attention, layer.attention_norm(x)
    query, keys, values = (attention.split_heads(projection(h)) for projection in
                           (attention.query, attention.key, attention.value))
    if cache is not None:
        keys, values = cache.extend(number, keys, values)
    x = x + attention.output(attention.attend(query, keys, values, bias))
    return x + layer.mlp(layer.mlp_norm(x))


def sampler(temperature=0.0, top_k=None, seed=None, vocab_size=None):
    """A function from logits (batch, vocab) on the host to one token a row."""
    check_sampling(temperature, top_k, vocab_size)
    generator = numpy.random.default_rng(seed)

    def choose(logits):
        if temperature == 0:
            return logits.argmax(axis=1)
        scaled = logits / temperature
        if top_k is not None:        # a stable sort: top_k=1 keeps argmax's own choice
            kept = numpy.zeros(scaled.shape, bool)
            numpy.put_along_axis(kept, numpy.argsort(-scaled, axis=1, kind='stable')[:, :top_k],
                                 True, axis=1)
            scaled = numpy.where(kept, scaled, -numpy.inf)
        cumulative = numpy.exp(scaled - scaled.max(axis=1, keepdims=True)).cumsum(axis=1)
        drawn = generator.random((len(logits), 1)) * cumulative[:, -1:]
        return (cumulative <= drawn).sum(axis=1)         # the first entry past the draw
    return choose


def agreement(net, tokens, max_new_tokens, cache='contiguous'):
    """The share of greedy tokens that `cache` generates equal, position by position, to
    recomputation's: 1.0 in float64; in float32 a near-tie may fall the other way, and the
    rest of that sequence after it too."""
    got, want = (numpy.array([row[-max_new_tokens:] for row in read_prompts(
        generate(net, tokens, max_new_tokens, cache=c))[0]]) for c in (cache, None))
    return float((got == want).mean())


def make_cache(kind, net, pads, length):
    """An empty cache of `kind` for a batch with `pads`, whose rows reach `length` columns."""
    if kind is None:
        return None
    num_layers, width, weight = net.config[1], net.config[2], parameter_of(net)
    sizes = dict(num_layers=num_layers, width=width, dtype=weight.dtype, device=weight.device)
    if kind in ('contiguous', 'static'):
        return ContiguousCache(batch=len(pads), length=length, heads=net.config[3], **sizes)
    tables = BlockTables(blocks_for(length - pads))
    return PagedCache(tables, range(len(pads)), pads, **sizes)


def left_pad(prompts):
    """(ids (batch, longest), pads): each prompt at the end of its row, after pads[i] zeros."""
    longest = max(map(len, prompts))
    pads = numpy.array([longest - len(p) for p in prompts])
    ids = numpy.zeros((len(prompts), longest), numpy.int64)
    for row, (prompt, pad) in enumerate(zip(prompts, pads)):
        ids[row, pad:] = prompt
    return ids, pads


def read_prompts(tokens):
    """([1-D int64 host arrays], whether `tokens` was a list of prompts)."""
    if isinstance(tokens, (list, tuple)):
        prompts = [numpy.asarray(host(p)).astype(numpy.int64) for p in tokens]
        if not prompts or any(p.ndim != 1 or len(p) == 0 for p in prompts):
            raise ValueError('a list of prompts needs one or more 1-D prompts of one or more '
                             f'ids each, got shapes {[p.shape for p in prompts]}')
        return prompts, True
    ids = numpy.asarray(host(tokens))
    if ids.ndim != 2 or 0 in ids.shape or not numpy.issubdtype(ids.dtype, numpy.integer):
        raise ValueError(f'tokens are (batch, len) integer ids, got {ids.dtype} of shape '
                         f'{ids.shape}; prompts of different lengths go in a list')
    return list(ids.astype(numpy.int64)), False


def host(ids):
    return ids.asnumpy() if isinstance(ids, np.ndarray) else ids


def check(net, prompts, max_new_tokens, cache):
    if not isinstance(net, GPT):
        raise TypeError(f'generate runs a d2l.nn.GPT, not {type(net).__name__}')
    if net.mixtures():
        raise ValueError('generate does not run a GPT with mixtures of experts: an expert '
                         "takes a capacity of tokens out of those that pass together, so a "
                         'step of one token would route differently from the whole prefix')
    if cache not in CACHES:
        raise ValueError(f'cache={cache!r}: use one of {CACHES}')
    if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f'max_new_tokens={max_new_tokens!r}: a whole number, 0 or more')
    vocab_size, max_len = net.config[0], net.config[4]
    longest = max(map(len, prompts))
    if longest + max_new_tokens > max_len:
        raise ValueError(f'a prompt of {longest} tokens and max_new_tokens={max_new_tokens} '
                         f'make {longest + max_new_tokens} positions, more than the GPT\'s '
                         f'max_len={max_len} learnt ones: shorten one or the other')
    if any(p.min() < 0 or p.max() >= vocab_size for p in prompts):
        raise ValueError(f'prompt ids must lie in 0 .. {vocab_size - 1}, the GPT\'s vocabulary')


def check_sampling(temperature, top_k, vocab_size):
    if not isinstance(temperature, numbers.Real) or temperature < 0:
        raise ValueError(f'temperature={temperature!r}: 0 for greedy, or a number above 0')
    if top_k is not None and (not isinstance(top_k, numbers.Integral) or top_k < 1
                              or (vocab_size is not None and top_k > vocab_size)):
        raise ValueError(f'top_k={top_k!r}: None (every token) or 1 .. the vocabulary '
                         f'size {vocab_size}')


def parameter_of(net):
    """A parameter's array, for the device and dtype the GPT computes in."""
    return net[0].position.list_data()[0]
