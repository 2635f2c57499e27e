"""Tensor parallelism (Shoeybi et al., 2019, Megatron-LM): each Transformer layer split over t
devices, so that each holds and computes 1/t of its attention and its MLP.

Attention splits by heads: device r holds the query, key and value rows of heads r·a/t to
(r+1)·a/t and the matching columns of the output projection; the MLP's first product splits
by columns of its output (rows of the weight), its second by the matching rows of its input.
These are the column- and row-parallel layers of `layers.py`, with f and g inside them, and a
device's share of the GPT is the GPT itself made of them: `GPT(*net.config, spec=...)`, whose
blocks' forwards are the ones a GPT on one device runs. So a layer moves two allreduces of
(batch, sequence, hidden) values forward and two backward. The embeddings, the norms and the
head are copied whole on every device, where each computes the same values and gets the same
gradients. The backward passes of the t devices run side by side
(`autograd.backward_together`), so that each f finds every device's gradient.

Sequence parallelism (Korthikanti et al., 2022) splits what lies between the blocks too: the
residual stream, the norms and their activations, by tokens, 1/t a device. Each allreduce
becomes its two halves, where they belong: g is a reduce-scatter (each device keeps the sums of
its tokens), f an all-gather (each block's products see every token), and the bytes moved are
the same. The norms and embeddings, still copied whole, now see a device's tokens only, so
their gradients are summed over the devices after backward, as Megatron-LM does.
The same group holds the other dimensions of a grid that split a layer's work: context
parallelism (the sequence over c devices, `context.py`), data parallelism's d replicas, run
in lockstep, and expert parallelism, carved out of the d·c programs of each tensor rank
(`expert.GridMixture`). Taught in "Tensor and Sequence Parallelism" and "Long Sequences and
Many Experts".
"""
from __future__ import annotations

from typing import Sequence

from .. import autograd, comm
from ..device import Device
from ..nn.block import Block
from ..nn.parameter import ParameterDict
from ..nn.transformer import GPT
from ..np.multiarray import NDArray
from .context import ALGORITHMS
from .expert import GridMixture
from .layers import DeviceSpec, ParallelDense, TensorGroup
from .stage import Stage, copied, copy_onto, named


def tensor_parallel(net: GPT, devices: Sequence[Device], algorithm: str = 'ring',
                    sequence: bool = False, context: int = 1, context_algorithm: str = 'ring'):
    """A copy of the GPT `net` split over `devices` (the net itself is left as it is);
    `sequence=True` splits the residual stream and the norms by tokens too. With `context`
    = c > 1 the sequence is split over c groups of len(devices) / c (context parallelism:
    each holds zig-zag chunks, and the attention brings the others' keys and values by
    `context_algorithm`, 'ring', 'all_gather' or 'ulysses'). Data and expert parallelism
    join them in `parallel_gpt`, which sums the replicas' gradients."""
    return TensorParallelGPT(net, devices, algorithm, sequence, context=context,
                             context_algorithm=context_algorithm)


class TensorParallelGPT(Stage):
    """The GPT as t device programs run side by side: `ranks[r]` is device r's share.

    `net(tokens)` returns the logits on every device (the same values); `backward(losses)`
    runs every device's backward pass at once, and `finish_gradients()` ends the step;
    `collect_params()` has every rank's parameters (`rank1.3.mlp.dense1.weight`: rank 1's
    share of the GPT's). As a pipeline's `Stage` it holds the units `units` of the net.

    With context parallelism (`context` = c) there are c·t ranks, t fastest, each context
    rank's t a tensor-parallel group of its own over its chunks of the sequence. With `data`
    = d replicas the group runs d·c·t programs, in lockstep, each replica's on 1/d of the
    batch: program p runs rank p mod c·t, whose parameters have one copy a replica (one
    Parameter, as a data-parallel net's), each layer reading the copy on the device of what
    reaches it."""

    def __init__(self, net, devices, algorithm='ring', sequence=False, units=slice(None),
                 context=1, context_algorithm='ring', data=1, expert=1):
        self.devices, self.sequence = list(devices), sequence
        t = check_context(len(self.devices) // data, context, context_algorithm, net.config)
        check_collectives(t, algorithm, sequence)
        check_experts(expert, data * context, net.config)
        self.group = TensorGroup(t, algorithm, sequence, context, context_algorithm, data,
                                 expert)
        ranks = len(self.devices) // data
        self.ranks = [Rank(net, DeviceSpec(self.group, rank), device, units)
                      for rank, device in enumerate(self.devices[:ranks])]
        for replica in range(1, data):
            for rank, device in zip(self.ranks, self.devices[replica * ranks:]):
                copy_onto(list(rank.collect_params().values()), device)
        for param, holders in self.expert_copies().items():
            param.reset_device(holders)

    def expert_copies(self):
        """{an expert's parameter: the devices of the programs that run its share of the GPT
        and whose expert rank holds the expert}: where its copies live."""
        copies = {}
        for program, device in enumerate(self.devices):
            for mixture in self.ranks[program % len(self.ranks)].grid_mixtures():
                local = mixture.num_experts // self.group.expert
                for e, params in mixture.expert_params().items():
                    if e // local == self.group.expert_rank(program):
                        for param in params:
                            copies.setdefault(param, []).append(device)
        return copies

    def __call__(self, tokens: NDArray) -> list[NDArray]:
        """The tokens through the embedding, the layers and the head: the logits on every
        device (of its replica's share of the batch)."""
        return self.forward([x.copyto(device) for x, device in
                             zip(self.inputs_of(tokens), self.devices)], tokens.shape)

    def inputs_of(self, tokens):
        """What each program reads of a (batch, ...) array of the tokens or the labels: its
        replica's 1/d of the batch."""
        d, batch = self.group.data, tokens.shape[0]
        if batch % d:
            raise ValueError(f'a micro-batch of {batch} does not split into {d} replicas: use '
                             f'a batch that {d} × the micro-batches divides')
        each = batch // d
        return [tokens[r * each:(r + 1) * each] for r in map(self.group.data_rank,
                                                             range(len(self.devices)))]

    def one_a_replica(self, outs):
        return [outs[first] for first in range(0, len(outs), len(self.ranks))]

    def forward(self, xs, tokens_shape):
        """What reaches this part (one array a device: the tokens, or, with sequence
        parallelism, each device's tokens of the micro-batch whose tokens have
        `tokens_shape`) through the units it holds: each device's program on its own share
        (each layer reads its parameters' copies on the device of what reaches it)."""
        return self.group.run(lambda rank, x: self.ranks[rank % len(self.ranks)](x), xs,
                              tokens_shape)

    def backward(self, outs, heads=None):
        """Every device's backward pass of one micro-batch side by side, from `heads` (None
        at the loss). One head (and head gradient) a device, or a device's walk would be left
        out and the collectives in backward would pair the wrong arrays: a drift raises."""
        n = len(self.devices)
        if len(outs) != n:
            raise ValueError(f'{len(outs)} heads for {n} devices: a tensor-parallel backward '
                             'walks one head a device, side by side')
        if heads is not None and len(heads) != n:
            raise ValueError(f'{len(heads)} head gradients for {n} devices: give one a device')
        autograd.backward_together(outs, head_grads=heads)

    def finish_gradients(self):
        """With sequence parallelism, the gradients of the whole copies that saw a device's
        tokens only, summed over the t devices; with context parallelism, every gradient
        summed over the c devices that hold the same share, each of which saw its chunks of
        the sequence only (a pipeline does it once, after the step's last micro-batch). The
        sum over the replicas is the caller's (`ParallelGPT.sum_gradients`)."""
        group = self.group
        if self.sequence:
            for first in range(0, len(self.devices), group.size):
                self.sum_over(group.tensor_peers(first), Rank.token_params)
        if group.context > 1:
            for first in range(0, len(self.devices), group.size * group.context):
                for part in range(first, first + group.size):
                    self.sum_over(group.context_peers(part), Rank.dense_params)
        for param, holders in self.expert_copies().items():
            group.allreduce([param.grad(device) for device in holders])

    def summed_over_replicas(self):
        """The parameters whose gradients the caller sums over the replicas: all but the
        experts', which `finish_gradients` sums over the programs that hold them."""
        experts = self.expert_copies()
        return [param for param in self.params() if param not in experts]

    def sum_over(self, peers, params_of):
        """Each of `params_of(rank)`'s gradients summed over the programs `peers` (those with
        a copy on the peers' devices: a share's experts live on some of its programs only)."""
        def held(peer):
            device = self.devices[peer]
            return [param for param in params_of(self.ranks[peer % len(self.ranks)])
                    if device in param.list_device()]
        for params in zip(*map(held, peers), strict=True):
            self.group.allreduce([param.grad(self.devices[peer])
                                  for param, peer in zip(params, peers)])

    def collect_params(self):
        return ParameterDict((f'rank{r}.{name}', param) for r, rank in enumerate(self.ranks)
                             for name, param in rank.collect_params().items())


def check_context(devices, context, algorithm, config):
    """The tensor-parallel size, `devices` / `context`, or a clear error for a context split
    that could not run."""
    if not isinstance(context, int) or context < 1 or devices % context:
        raise ValueError(f'context={context!r} must be a whole number of at least 1 that '
                         f'divides the {devices} devices (c groups of t)')
    if algorithm not in ALGORITHMS:
        raise ValueError(f'unknown context_algorithm={algorithm!r}; use one of {ALGORITHMS}')
    t, heads = devices // context, config[3]
    if algorithm == 'ulysses' and (heads // max(t, 1)) % context:
        raise ValueError(f'Ulysses splits the {heads // t} heads a device holds over '
                         f'{context} devices: use a context size that divides them, or the ring')
    return t


def check_experts(expert, replicas, config):
    """Refuse an expert group that does not divide the d·c programs of a tensor rank, or
    whose size does not divide the experts."""
    num_experts = config[5]
    if not isinstance(expert, int) or expert < 1 or replicas % expert:
        raise ValueError(f'expert={expert!r}: expert parallelism is carved out of the data × '
                         f'context ranks ({replicas}); use a size that divides them')
    if expert > 1 and (num_experts == 0 or num_experts % expert):
        raise ValueError(f'expert={expert} needs a GPT whose mixtures\' {num_experts} experts '
                         f'split among {expert} ranks: use num_experts a multiple of {expert}')


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
    """One device's share of the GPT's units `units`: the GPT made by `spec`, with the
    weights of `net`, on `device`."""

    def __init__(self, net, spec, device, units=slice(None)):
        self.share = share(net.config, spec)
        self.units = self.share.children()[units]
        for mine, whole in zip(self.units, net.children()[units], strict=True):
            fill(mine, whole)
            mine.reset_device(device)

    def __call__(self, x):
        for unit in self.units:
            x = unit(x)
        return x

    def dense_params(self):
        """The trained parameters but the experts' of a grid's mixtures."""
        experts = {id(p) for mixture in self.grid_mixtures()
                   for params in mixture.expert_params().values() for p in params}
        return [param for param in self.collect_params().values()
                if param.grad_req != 'null' and id(param) not in experts]

    def grid_mixtures(self):
        """Its units' mixtures spread over an expert group, in order."""
        return [block for unit in self.units for block in blocks_in(unit)
                if isinstance(block, GridMixture)]

    def token_params(self):
        """The whole copies that see only this device's tokens under sequence parallelism:
        every parameter but those of the layers that gather the tokens (the split layers,
        and the head's)."""
        return [param for unit in self.units for param in whole_copies(unit)]

    def collect_params(self):
        """Its parameters by the GPT's names (`3.mlp.dense1.weight`: unit 3's)."""
        return named(self.share, self.units)


def share(config, spec):
    """The GPT of sizes `config` made of `spec`'s layers, its values not drawn yet (shapes
    alone: what `predict` counts)."""
    return GPT(*config, spec=spec)


def fill(mine: Block, whole: Block):
    """`mine` (a device's share of `whole`) with whole's values: each parallel layer takes
    its share, the rest is copied whole."""
    if isinstance(mine, (ParallelDense, GridMixture)):
        mine.take(whole)
    elif not any(isinstance(block, ParallelDense) for block in blocks_in(mine)):
        copied(mine, whole)
    else:
        for a, b in zip(mine.children(), whole.children(), strict=True):
            fill(a, b)


def blocks_in(block):
    """`block` and every block inside it."""
    return [block] + [inner for child in block.children() for inner in blocks_in(child)]


def whole_copies(block):
    """The parameters of `block` outside its parallel layers."""
    if isinstance(block, ParallelDense):
        return []
    own = [p for name, p in block.collect_params().items() if '.' not in name]
    return own + [p for child in block.children() for p in whole_copies(child)]
