"""Predict, then run: what each device of a data × tensor × pipeline layout of a GPT holds,
sends and leaves idle, from the model's sizes and the layout alone.

Two calculators share the counting. `device_plan` counts this package's small GPT to the byte
(float32, its tape's activations, its split that keeps each split layer's output biases on
every device), so that a run on virtual devices can be checked against it. The parameters are
counted on the model itself: each device's share of each unit, built as `tensor_parallel`
builds it, in shapes alone (nothing is drawn), so that a change to the GPT changes the count.
`layout_costs` prices a real model on a real cluster with the papers' counts (Megatron-LM's
16-bit values and 18 bytes a parameter, or 6 + 12/d with its distributed optimizer; Korthikanti
et al.'s activations) and the α-β links of `comm.cost`, to choose a layout before renting the
machines.

Taught in "Parallelism in Three Dimensions"; the models of the papers, with experts and
grouped-query attention, are counted in `published.py`.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from ..comm import cost
from ..nn.footprint import MEGATRON, STATE_VALUES, model_states, transformer_layer_activations
from .context import ring_bytes_per_step
from .layers import DeviceSpec, TensorGroup
from .pipeline import cut
from .schedules import schedule
from .tensor import share, whole_copies


@dataclasses.dataclass(frozen=True)
class GPTSizes:
    """A GPT's sizes: its units are the embedding (0), `layers` Transformer layers, the head."""
    vocab: int
    layers: int
    hidden: int
    heads: int
    seq: int

    @classmethod
    def of(cls, net):
        """The sizes of `net`, a dense GPT (one with experts is counted by `published.py`)."""
        if net.config[5]:
            raise ValueError('GPTSizes counts a dense GPT; for one with experts, count it '
                             'with model_parallel.published.gpt_with_experts')
        return cls(*net.config[:5])

    def params(self):
        """Every parameter of the whole model, unsplit."""
        return sum(unit_values(self, unit, 1) for unit in range(self.layers + 2))


@functools.cache
def device_units(sizes, t, rank):
    """Device `rank`'s share of each unit of the GPT of `sizes` split over t devices, as
    `tensor_parallel` makes it, in shapes alone: a group that never runs, nothing drawn."""
    group = TensorGroup(t)
    return share(dataclasses.astuple(sizes), DeviceSpec(group, rank)).children()


def values_of(params):
    return sum(math.prod(param.shape) for param in params)


def unit_values(sizes, unit, t, trained=False, rank=0):
    """Values one of t devices holds of a unit (its trained ones, if `trained`), counted on
    the device's share of it: for a layer, 1/t of each split product and its bias, the norms
    whole, and the two output biases whole on every device, trained on the first only."""
    params = device_units(sizes, t, rank)[unit].collect_params().values()
    return values_of(p for p in params if not trained or p.grad_req != 'null')


def stage_units(sizes, pipeline, chunks, stage, unit_sizes=None):
    """[[units of a part], ...]: the parts stage `stage` holds, in chunk order."""
    spans = cut(sizes.layers + 2, pipeline * chunks, unit_sizes)
    units = range(sizes.layers + 2)
    return [list(units[spans[stage + c * pipeline]]) for c in range(chunks)]


def unit_activations(sizes, unit, batch, t, sequence=False, alone=False):
    """Bytes of a unit's activations that one of t devices keeps from a micro-batch's forward
    to its backward, in float32.

    A layer keeps s·b·h·(8 + 12/t) + 3·a·s²·b/t values: the paper's 16sbh + as²b, and what
    this tape keeps more (`sec-memory`). The embedding keeps its lookup's output and the
    tokens; the head and the loss their inputs, the logits and the probabilities, the labels
    and each token's loss. With sequence parallelism (`sec-tensor-parallelism`) a layer keeps
    sbh·(4 + 18/t) values; the head's norm and gather keep 1/t of their inputs; and the
    embedding's sum stays whole, since a device's tokens are a view of it: the first layer
    counts their 1/t as its input, the embedding the rest, or all of it where the embedding
    ends its pipeline part (`alone`), whose output, that view, waits there for its gradient
    while the next stage keeps its own copy."""
    sbh, bs = sizes.seq * batch * sizes.hidden, sizes.seq * batch
    if unit == 0:
        whole_sum = (4 * sbh if alone else 4 * sbh * (t - 1) // t) if sequence else 0
        return 4 * sbh + 8 * bs + whole_sum
    if unit == sizes.layers + 1:
        inputs = 4 * sbh * (1 + 2 / t) if sequence else 8 * sbh
        return inputs + 8 * bs * sizes.vocab + 16 * bs
    as2b = sizes.heads * sizes.seq ** 2 * batch
    if sequence:
        return 4 * (4 * sbh + (18 * sbh + 3 * as2b) // t)
    return 4 * (8 * sbh + (12 * sbh + 3 * as2b) // t)


def token_values(sizes, unit):
    """Values of a unit's whole copies that see a device's tokens only under sequence
    parallelism (the embeddings and the norms), whose gradients are summed after a step."""
    return values_of(whole_copies(device_units(sizes, 1, 0)[unit]))


def peak_activations(sizes, t, pipeline, stage, name, microbatches, batch, chunks=1,
                     sequence=False):
    """The most activation bytes the stage holds at once as its schedule runs: each forward
    adds its part's, each backward frees them (what the naive engine does, freeing at once)."""
    parts = stage_units(sizes, pipeline, chunks, stage)
    each = [sum(unit_activations(sizes, u, batch, t, sequence, alone=1 not in part)
                for u in part) for part in parts]
    held = peak = 0
    for action in schedule(name, pipeline, microbatches, chunks)[stage]:
        held += each[action.chunk] if action.kind == 'F' else -each[action.chunk]
        peak = max(peak, held)
    return peak


def device_plan(sizes, data, tensor, pipeline, stage, rank, name, microbatches, batch,
                chunks=1, optimizer='adam', sequence=False):
    """{kind: bytes} that device (stage, rank) of the layout holds (weights, gradients,
    optimizer state and its peak of activations) and sends in one step (tensor, pipeline and
    data), for a global batch of `batch` sequences in float32."""
    units = [u for part in stage_units(sizes, pipeline, chunks, stage) for u in part]
    weights = 4 * sum(unit_values(sizes, u, tensor) for u in units)
    trained = 4 * sum(unit_values(sizes, u, tensor, True, rank) for u in units)
    micro = batch // (data * microbatches)
    boundary = 4 * micro * sizes.seq * sizes.hidden
    share = (tensor - 1) / tensor              # of each collective's bytes a device sends
    layers = sum(0 < u <= sizes.layers for u in units)
    tensor_sent = layers * microbatches * 4 * 2 * share * boundary
    if sequence:       # the head's gather, and the sums of the copies that saw 1/t of tokens
        tensor_sent += (sizes.layers + 1 in units) * microbatches * share * boundary
        tensor_sent += 2 * share * 4 * sum(token_values(sizes, u) for u in units)
    crossings = stage_crossings(pipeline, chunks, stage)
    return {'weights': weights, 'gradients': trained,
            'optimizer state': STATE_VALUES[optimizer] * trained,
            'activations': peak_activations(sizes, tensor, pipeline, stage, name,
                                            microbatches, micro, chunks, sequence),
            'tensor': tensor_sent,
            'pipeline': microbatches * boundary * crossings // (tensor if sequence else 1),
            'data': 2 * (data - 1) / data * trained}


def stage_crossings(pipeline, chunks, stage):
    """Boundaries between parts that the stage's micro-batches cross to another stage, forward
    and backward: a part's next and previous parts, where they live on another device (one
    stage run interleaved keeps all its chunks on its own devices and sends nothing)."""
    if pipeline == 1:
        return 0
    last = pipeline * chunks - 1
    return sum((k < last) + (k > 0) for k in range(stage, last + 1, pipeline))


def bubble(pipeline, microbatches, chunks=1):
    """The share of a step the stages idle, with balanced stages (every pass taking as long):
    (p - 1)/(v·m + p - 1), GPipe's (p - 1)/(m + p - 1) for one chunk. `layout_costs` counts
    the same idle time in seconds, (p - 1)/m of the compute."""
    return (pipeline - 1) / (chunks * microbatches + pipeline - 1)


# -- a real model on a real cluster ----------------------------------------------------------

GPT3 = GPTSizes(vocab=50257, layers=96, hidden=12288, heads=96, seq=2048)   # Brown et al., 2020


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Machines of `per_machine` devices of `memory` bytes that each compute `flops` a second
    (what a step achieves, not the peak), joined inside a machine by NVLink at `nvlink` bytes/s
    a device and direction, and between machines at `network` bytes/s a device."""
    machines: int
    per_machine: int
    memory: float
    flops: float
    nvlink: float
    network: float
    alpha: float = 5e-6

    @property
    def devices(self):
        return self.machines * self.per_machine

    def link(self, group):
        """Bytes/s a device of a ring of `group` devices sends at: NVLink while the ring fits
        in a machine, else the network, its slowest link, which sets the pace of every step."""
        return self.nvlink if group <= self.per_machine else self.network


def layer_activations(sizes, micro, tensor, sequence=True):
    """Bytes one Transformer layer keeps on one of t devices from a micro-batch of `micro`
    sequences (Korthikanti et al., 2022): with sequence parallelism 1/t of sbh(34 + 5as/h);
    with tensor parallelism alone, the 10sbh that lie between the blocks (the norms' inputs,
    each block's input and its dropout mask) stay whole on every device: sbh(10 + 24/t +
    5as/(ht))."""
    layer = transformer_layer_activations(sizes.seq, micro, sizes.hidden, sizes.heads)
    if sequence:
        return layer / tensor
    between = 10 * sizes.seq * micro * sizes.hidden
    return between + (layer - between) / tensor


def layout_costs(sizes, cluster, data, tensor, pipeline, batch, micro=1, sequence=True,
                 states=MEGATRON, zero_stage=0, context=1, fsdp=False):
    """{what: value} for one layout of `sizes` on `cluster`: bytes a device holds and the
    seconds of a step, none of its communication hidden (an upper bound).

    A device holds the states of its 1/(t·p) of the parameters (`states` bytes a parameter of
    each kind, Megatron-LM's 18 by default; `zero_stage=1` shards the optimizer's over the d
    replicas, Megatron's distributed optimizer: 6 + 12/d; `fsdp` shards every state and
    keeps the stage's 16-bit weights gathered through the step: 2 + 18/d, at ZeRO-1's
    traffic, one reduce-scatter and one all-gather a step) and the first stage's activations:
    1F1B keeps p micro-batches of its L/p layers, L layers' worth. A step is the compute, the
    bubble (the stages' idle time: compute·(p - 1)/m, its (p - 1)/(m + p - 1) share of the
    step), and tensor, pipeline and data parallelism's communication on their links.

    With context parallelism over c devices (`context`), a device keeps the activations of
    1/c of each sequence, the ring passes keys and values round each layer's attention, and
    the gradients are summed over the d·c devices that hold the same weights (Megatron-LM's)."""
    if zero_stage not in (0, 1):
        raise ValueError(f'the layout search shards the optimizer (zero_stage=1) or not (0), '
                         f'not {zero_stage!r}: a pipeline adds up gradients over its '
                         'micro-batches, and ZeRO-3 would gather the weights for each one; '
                         'fsdp=True shards every state and keeps the weights gathered')
    microbatches = batch // (data * micro)
    values = sizes.params() / (tensor * pipeline)
    held_states = sharded(values, data, states, zero_stage, fsdp)
    activations = sizes.layers * layer_activations(sizes, micro, tensor, sequence) / context
    compute = 6 * sizes.params() * batch * sizes.seq / (cluster.devices * cluster.flops)
    boundary = 2 * micro * sizes.seq * sizes.hidden          # 16-bit activations
    seconds = {
        'compute': compute,
        'bubble': compute * (pipeline - 1) / microbatches,
        'tensor': tensor_seconds(sizes, cluster, tensor, pipeline, microbatches, boundary),
        'pipeline': 0 if pipeline == 1 else 2 * microbatches * (
            cluster.alpha + boundary / (tensor if sequence else 1) / cluster.network),
        'context': context_seconds(sizes, cluster, tensor, pipeline, context, micro,
                                   microbatches),
        'data': data_seconds(cluster, data * context, values, states, 1 if fsdp else zero_stage)}
    held = held_states + activations
    return {'held': held, 'fits': held <= cluster.memory, 'states': held_states,
            'activations': activations, **seconds, 'step': sum(seconds.values())}


def tensor_seconds(sizes, cluster, tensor, pipeline, microbatches, boundary):
    """Four allreduces of a micro-batch's activations a layer of the stage (or their halves,
    the same bytes, under sequence parallelism), on NVLink or, for a group wider than a
    machine, on the network."""
    if tensor == 1:
        return 0
    link = cluster.link(tensor)
    group = cost.Topology('tensor group', tensor, link, link, None, cluster.alpha)
    layers_here = sizes.layers / pipeline
    return 4 * layers_here * microbatches * cost.allreduce_time('ring', boundary, group)


def context_seconds(sizes, cluster, tensor, pipeline, context, micro, microbatches):
    """The ring of each layer's attention: c - 1 steps forward, each sending a device's
    16-bit keys and values of s/c tokens and its 1/t of the heads (`ring_bytes_per_step`), and
    twice that backward (keys and values again, and their gradients). Megatron-LM's order,
    tp-cp-..., puts the c devices of a ring t apart: on NVLink while the t·c fit a machine."""
    if context == 1:
        return 0
    link = cluster.link(tensor * context)
    shape = (micro, sizes.heads // tensor, sizes.seq, sizes.hidden // sizes.heads)
    step = cluster.alpha + ring_bytes_per_step(shape, context, 'float16') / link
    return 3 * (context - 1) * step * microbatches * sizes.layers / pipeline


def data_seconds(cluster, data, values, states, zero_stage):
    """The sum over the d replicas of a device's gradients: an allreduce; with the optimizer
    sharded, a reduce-scatter of the gradients and an all-gather of the updated weights."""
    if data == 1:
        return 0
    network = cost.Topology('network', data, cluster.network, cluster.network, None,
                            cluster.alpha)
    gradients, weights = states['gradients'] * values, states['weights'] * values
    if zero_stage == 0:
        return cost.allreduce_time('ring', gradients, network)
    return cost.half_time('reduce-scatter', 'ring', gradients, network) + \
        cost.half_time('all-gather', 'ring', weights, network)


def layouts(sizes, cluster, batch, micro=1, sequence=True, states=MEGATRON, zero_stage=0,
            context=1, fsdp=False):
    """Every (d, t, p) that uses all of the cluster's devices (d·t·p·c, with `context`
    parallelism over c), whose t divides the heads and fills whole machines or divides one,
    that splits the layers into whole stages and the batch into micro-batches, with its
    `layout_costs`, fastest first among those that fit."""
    rows = []
    for tensor, pipeline in itertools.product(range(1, cluster.devices + 1),
                                              range(1, sizes.layers + 1)):
        data, rest = divmod(cluster.devices, tensor * pipeline * context)
        fills = cluster.per_machine % tensor == 0 or tensor % cluster.per_machine == 0
        if rest or not fills or sizes.heads % tensor or sizes.layers % pipeline or \
                batch % (data * micro):
            continue
        rows.append(((data, tensor, pipeline), layout_costs(
            sizes, cluster, data, tensor, pipeline, batch, micro, sequence, states, zero_stage,
            context, fsdp)))
    return sorted(rows, key=lambda row: (not row[1]['fits'], row[1]['step']))


def sharded(values, replicas, states, zero_stage=0, fsdp=False):
    """Bytes of the states of `values` parameters on one of `replicas` devices: ZeRO's
    table at `zero_stage`, or FSDP's, every state 1/d, plus the 16-bit weights it has
    gathered and keeps through the step (Llama 3 does not reshard after the forward pass,
    §3.3.2, to save the backward's all-gather; a pipeline would otherwise gather them again
    for each micro-batch)."""
    if fsdp:
        gathered = states['weights'] * values
        return model_states(values, replicas, 3, states)['total'] + gathered
    return model_states(values, replicas, zero_stage, states)['total']
