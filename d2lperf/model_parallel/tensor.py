"""Tensor parallelism (Shoeybi et al., 2019, Megatron-LM): each Transformer layer split over t
devices, so that each holds and computes 1/t of its attention and its MLP.

Attention splits by heads: device r holds the query, key and value rows of heads r·a/t to
(r+1)·a/t and the matching columns of the output projection; the MLP's first product splits
by columns of its output (rows of the weight), its second by the matching rows of its input.
Each device then computes a part of each block's output, and the parts add up to the whole:

* f, before each block: the identity forward (every device has the whole input), and in
  backward an allreduce of the input's gradients, since every part contributed to it;
* g, after each block: an allreduce of the parts forward, and the identity backward.

So a layer moves two allreduces of (batch, sequence, hidden) values forward and two backward.
The embeddings, the norms and the head are copied whole on every device, where each computes
the same values and gets the same gradients. The backward passes of the t devices run side by
side (`autograd.backward_together`), so that each f finds every device's gradient.

Sequence parallelism (Korthikanti et al., 2022) splits what lies between the blocks too: the
residual stream, the norms and their activations, by tokens, 1/t a device. Each allreduce
becomes its two halves, where they belong: g is a reduce-scatter (each device keeps the sums of
its tokens), f an all-gather (each block's products see every token), and the bytes moved are
the same. The norms and embeddings, still copied whole, now see a device's tokens only, so
their gradients are summed over the devices after backward, as Megatron-LM does.
Taught in "Model Parallelism".
"""
from __future__ import annotations

from typing import Sequence

from .. import autograd, comm
from ..device import Device
from ..nn.transformer import (GPT, CausalSelfAttention, GPTEmbedding, LanguageModelHead, MLP,
                              TransformerLayer)
from ..np.multiarray import NDArray
from .stage import Stage


def tensor_parallel(net: GPT, devices: Sequence[Device], algorithm: str = 'ring',
                    sequence: bool = False):
    """A copy of the GPT `net` split over `devices` (the net itself is left as it is);
    `sequence=True` splits the residual stream and the norms by tokens too."""
    return TensorParallelGPT(net, devices, algorithm, sequence)


class TensorParallelGPT(Stage):
    """The GPT as t device programs run side by side: `ranks[r]` holds device r's part.

    `net(tokens)` returns the logits on every device (the same values); `backward(losses)`
    runs every device's backward pass at once, and `finish_gradients()` ends the step;
    `collect_params()` has every device's parameters (each on one device: a Trainer updates
    each where it lives). As a pipeline's `Stage` it holds some of the units only."""

    def __init__(self, net, devices, algorithm='ring', sequence=False, units=slice(None)):
        """`units`: the slice of `net`'s children this holds (a pipeline part), all by
        default."""
        self.devices, self.algorithm, self.sequence = list(devices), algorithm, sequence
        t = len(self.devices)
        check_collectives(t, algorithm, sequence)
        for layer in net[1:-1]:
            heads = layer.attention.num_heads
            if heads % t:
                raise ValueError(f'{heads} attention heads do not split among {t} devices: '
                                 f'use a number of devices that divides {heads}')
        self.ranks = [Rank(net, rank, t, device, units)
                      for rank, device in enumerate(self.devices)]
        self.hidden = net[0].token.weight.shape[1]

    def __call__(self, tokens: NDArray) -> list[NDArray]:
        """The tokens through the embedding, the layers and the head: the logits on every
        device."""
        return self.forward([tokens.copyto(device) for device in self.devices], tokens.shape)

    def forward(self, xs, tokens_shape):
        """What reaches this part (one array on each device: the tokens, or with sequence
        parallelism each device's tokens of the micro-batch whose tokens have `tokens_shape`)
        through the units it holds."""
        ranks = self.ranks
        if ranks[0].embedding is not None:
            xs = [rank.embedding(tokens) for rank, tokens in zip(ranks, xs)]
            shape = xs[0].shape
            if self.sequence:
                xs = self.my_tokens(xs)
        else:
            shape = tuple(tokens_shape) + (self.hidden,)
        for depth in range(len(ranks[0].layers)):
            layers = [rank.layers[depth] for rank in ranks]
            xs = self.block(xs, [layer.attention_norm for layer in layers],
                            [layer.attention for layer in layers], shape)
            xs = self.block(xs, [layer.mlp_norm for layer in layers],
                            [layer.mlp for layer in layers], shape)
        if ranks[0].head is None:
            return xs
        normed = [rank.head.norm(x) for rank, x in zip(ranks, xs)]
        if self.sequence:             # each device's head is whole: its gradient is too
            normed = self.gather_tokens(normed, shape, summed=False)
        return [rank.head.output(x) for rank, x in zip(ranks, normed)]

    def block(self, xs, norms, parts, shape):
        """x + g(part(f(norm(x)))) on every device: one residual block of a layer."""
        normed = [norm(x) for norm, x in zip(norms, xs)]
        if self.sequence:
            outputs = self.scatter_tokens([part(h) for part, h in zip(
                parts, self.gather_tokens(normed, shape))])
        else:
            inputs = autograd.reduce_in_backward(normed, self.allreduce)
            outputs = self.allreduce_forward([part(h) for part, h in zip(parts, inputs)])
        return [x + out for x, out in zip(xs, outputs)]

    # -- sequence parallelism: the residual stream split by tokens ---------------------------
    def my_tokens(self, xs):
        """Each device's share of the tokens, (tokens / t, hidden), from its whole copy."""
        t, hidden = len(xs), xs[0].shape[-1]
        count = xs[0].size // hidden
        if count % t:
            raise ValueError(f'{count} tokens (batch × sequence) do not split among {t} '
                             'devices: use a batch or sequence length that t divides')
        each = count // t
        return [x.reshape(count, hidden)[r * each:(r + 1) * each] for r, x in enumerate(xs)]

    def gather_tokens(self, shards, shape, summed=True):
        """f: every device's tokens on every device (an all-gather). In backward, each
        device's tokens' gradients summed over the devices (a reduce-scatter), where each
        device's part of the block gave a part of them; where whole copies gave each device
        the whole gradient (`summed=False`, the head), each device keeps its tokens' own."""
        with autograd.pause():
            flat = [shard.reshape(-1) for shard in shards]
        wholes = [whole.reshape(shape) for whole in comm.all_gather(flat, self.algorithm)]
        each = shards[0].shape

        def backward(grads):
            if summed:
                return [g.reshape(each) for g in comm.reduce_scatter(grads, self.algorithm)]
            return [g.reshape(-1, each[1])[r * each[0]:(r + 1) * each[0]]
                    for r, g in enumerate(grads)]
        return autograd.collective(wholes, shards, backward)

    def scatter_tokens(self, parts):
        """g: the parts summed, each device keeping its tokens' sums (a reduce-scatter, in
        place: nothing reads the parts again); in backward, an all-gather."""
        shape, hidden = parts[0].shape, parts[0].shape[-1]
        with autograd.pause():
            mine = [s.reshape(-1, hidden).copy()
                    for s in comm.reduce_scatter(parts, self.algorithm)]

        def backward(grads):
            flat = [g.reshape(-1) for g in grads]
            return [w.reshape(shape) for w in comm.all_gather(flat, self.algorithm)]
        return autograd.collective(mine, parts, backward)

    def allreduce(self, arrays):
        return comm.allreduce(arrays, self.algorithm)

    def allreduce_forward(self, parts):
        """g: the parts summed on every device, the identity in backward (a recorded copy,
        whose gradient is its output's, then summed in place outside the tape)."""
        outs = [part.copy() for part in parts]
        return self.allreduce(outs)

    def backward(self, outs, heads=None):
        """Every device's backward pass of one micro-batch side by side, from `heads` (None
        at the loss). One head (and head gradient) a device, or a device's walk would be left
        out and the collectives in backward would pair the wrong arrays: a drift raises."""
        t = len(self.ranks)
        if len(outs) != t:
            raise ValueError(f'{len(outs)} heads for {t} devices: a tensor-parallel backward '
                             'walks one head a device, side by side')
        if heads is not None and len(heads) != t:
            raise ValueError(f'{len(heads)} head gradients for {t} devices: give one a device')
        autograd.backward_together(outs, head_grads=heads)

    def finish_gradients(self):
        """With sequence parallelism, the gradients of the whole copies that saw a device's
        tokens only, summed over the devices (a pipeline does it once, after the step's last
        micro-batch)."""
        if self.sequence:
            for copies in zip(*(rank.token_params() for rank in self.ranks)):
                self.allreduce([param.grad() for param in copies])

    def params(self):
        """Every device's parameters, in order, each where it lives."""
        return list(self.collect_params().values())

    def collect_params(self):
        return {f'rank{r}.{name}': param for r, rank in enumerate(self.ranks)
                for name, param in rank.collect_params().items()}


def check_collectives(t, algorithm, sequence):
    """Refuse, when built, a group that could not run its first collective: no devices, an
    unknown allreduce algorithm, or, under sequence parallelism, one with no halves."""
    if t < 1:
        raise ValueError('tensor parallelism needs at least one device, got none')
    comm.schedule(algorithm, t)
    if sequence:
        try:
            comm.half('reduce-scatter', algorithm, t)
        except ValueError as error:
            raise ValueError(f'sequence=True splits each allreduce into a reduce-scatter and '
                             f'an all-gather: {error}. Use one of those, or sequence=False'
                             ) from None


class Rank:
    """Device `rank`'s part of the GPT: whole copies of the embedding, the norms and the head,
    and 1/t of each layer's attention heads and MLP features, with the weights of `net`."""

    def __init__(self, net, rank, t, device, units=slice(None)):
        self.device = device
        children = net.children()
        mine = range(len(children))[units]
        embedding, head = children[0], children[-1]
        vocab, hidden = embedding.token.weight.shape
        self.embedding = self.head = None
        if 0 in mine:
            self.embedding = copied(GPTEmbedding(vocab, hidden, embedding.position.shape[0]),
                                    embedding, device)
        if len(children) - 1 in mine:
            self.head = copied(LanguageModelHead(hidden, vocab), head, device)
        self.layers = [split_layer(children[k], rank, t, device) for k in mine
                       if 0 < k < len(children) - 1]

    def token_params(self):
        """The whole copies that see only this device's tokens under sequence parallelism:
        the embeddings and every norm."""
        blocks = [self.embedding, self.head and self.head.norm] + [
            norm for layer in self.layers for norm in (layer.attention_norm, layer.mlp_norm)]
        return [p for block in blocks if block is not None
                for p in block.collect_params().values()]

    def collect_params(self):
        named = [('embedding', self.embedding), ('head', self.head)] + [
            (f'layer{i}', layer) for i, layer in enumerate(self.layers)]
        params = {}
        for name, block in named:
            if block is not None:
                params.update(block.collect_params(f'{name}.'))
        return params


def split_layer(layer, rank, t, device):
    """Device `rank`'s share of a TransformerLayer: its heads, its MLP features, whole norms."""
    hidden = layer.attention_norm.gamma.shape[0]
    heads = layer.attention.num_heads
    part = TransformerLayer(hidden, heads)
    part.attention = CausalSelfAttention(hidden, heads // t, width=hidden // t)
    wide = layer.mlp.hidden.weight.shape[0]
    part.mlp = MLP(hidden, width=wide // t)
    for name in ('query', 'key', 'value'):           # by rows: this device's heads
        rows = slice(rank * hidden // t, (rank + 1) * hidden // t)
        take(getattr(part.attention, name), getattr(layer.attention, name), rows, rows)
    rows = slice(rank * wide // t, (rank + 1) * wide // t)
    take(part.mlp.hidden, layer.mlp.hidden, rows, rows)
    by_columns = (slice(None), slice(rank * hidden // t, (rank + 1) * hidden // t))
    take(part.attention.output, layer.attention.output, by_columns, None, rank == 0)
    by_columns = (slice(None), slice(rank * wide // t, (rank + 1) * wide // t))
    take(part.mlp.output, layer.mlp.output, by_columns, None, rank == 0)
    for name in ('attention_norm', 'mlp_norm'):
        copied(getattr(part, name), getattr(layer, name), device)
    part.reset_device(device)
    return part


def take(dense, whole, weight_key, bias_key=slice(None), bias_here=True):
    """`dense`'s weight as `whole`'s weight[weight_key]; its bias as whole's bias[bias_key],
    or, for a split input (`bias_key` None), the whole bias on one device only: the parts are
    summed, so the bias is added once (the other devices' biases stay zero, untrained)."""
    in_dtypes_of(dense, whole)
    dense.weight.set_data(whole.weight.data()[weight_key].copy())
    if bias_key is not None:
        dense.bias.set_data(whole.bias.data()[bias_key].copy())
    elif bias_here:
        dense.bias.set_data(whole.bias.data().copy())
    else:
        dense.bias.grad_req = 'null'
        dense.bias.initialize(force_reinit=True)


def copied(block, source, device):
    """`block` (built alike) with `source`'s values, on `device`."""
    in_dtypes_of(block, source)
    for mine, theirs in zip(block.collect_params().values(), source.collect_params().values()):
        mine.set_data(theirs.data().copy())
    block.reset_device(device)
    return block


def in_dtypes_of(block, source):
    """`block` initialized with each parameter in the dtype of `source`'s (built alike): a
    float16 net splits into float16 parts, its float32 norms stay float32."""
    for mine, theirs in zip(block.collect_params().values(), source.collect_params().values()):
        mine.cast(theirs.data().dtype)
    block.initialize()
