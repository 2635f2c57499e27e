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

The models people train today need more than GPT-3's sizes: `ModelSizes` adds mixtures of
experts (`Experts`: parameters total and active a token), grouped-query attention and
DeepSeek's latent attention, and `layout_memory` a `Layout` with context and expert
parallelism, FSDP and DualPipe's copies, so that DeepSeek-V3's and Llama 3's published layouts
can be checked against the memory they ran in (`gpt_with_experts` counts the package's own
GPT with mixtures on the model). Taught in "Parallelism in Three Dimensions" and "Long
Sequences and Many Experts".
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from ..comm import cost
from ..nn.footprint import MEGATRON, STATE_VALUES, model_states, transformer_layer_activations
from ..nn.moe import MoE
from ..nn.transformer import MLP
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
        return cls(*net.config)

    def params(self):
        """Every parameter of the whole model, unsplit."""
        return sum(unit_values(self, unit, 1) for unit in range(self.layers + 2))


@functools.cache
def device_units(sizes, t, rank):
    """Device `rank`'s share of each unit of the GPT of `sizes` split over t devices, as
    `tensor_parallel` makes it, in shapes alone: a group that never runs, nothing drawn."""
    group = TensorGroup([None] * t)
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


# -- mixtures of experts, grouped-query attention, and two published layouts -----------------

@dataclasses.dataclass(frozen=True)
class Experts:
    """Which layers' MLPs are mixtures, and of what: `count` routed experts of hidden width
    `width`, each token sent to `top_k` of them, and `shared` experts every token goes
    through (DeepSeekMoE's). The first `dense_first` layers keep a dense MLP; after them every
    `every`-th layer is a mixture (`nn.GPT`'s moe_every)."""
    count: int
    top_k: int
    width: int
    every: int = 1
    dense_first: int = 0
    shared: int = 0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.count:
            raise ValueError(f'top_k={self.top_k} must be between 1 and the {self.count} '
                             'experts: a token goes to at least one expert, each at most once')

    def layers(self, total):
        """How many of `total` layers are mixtures."""
        return max(total - self.dense_first, 0) // self.every


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """A published decoder's sizes, built as Llama and DeepSeek build theirs: SwiGLU MLPs
    (three matrices), RMSNorm, no biases, rotary positions (no parameters), the embedding and
    the head untied. `ffn` is a dense MLP's width. `kv_heads` below `heads` is grouped-query
    attention (Ainslie et al., 2023): each key/value head serves heads/kv_heads query heads,
    so the key and value projections, and what attention keeps of them, shrink by that
    ratio. `attention`, where given, is one layer's attention parameters when they are not
    (grouped-)query attention's (DeepSeek's multi-head latent attention: `mla_values`).

    The package cannot build these models (its GPT is GPT-2's), so they are counted by
    formula; `gpt_with_experts` counts the package's own model on the model."""
    vocab: int
    layers: int
    hidden: int
    heads: int
    seq: int
    ffn: int
    kv_heads: int | None = None
    head_dim: int | None = None
    experts: Experts | None = None
    attention: int | None = None

    @property
    def query_width(self):
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self):
        """Features of a token's keys and values together."""
        return 2 * self.query_width * (self.kv_heads or self.heads) // self.heads

    def attention_values(self):
        if self.attention is not None:
            return self.attention
        return self.hidden * (self.query_width + self.kv_width) + self.query_width * self.hidden

    def mlp_values(self, width):
        return 3 * self.hidden * width

    def layer_values(self, mixture, active=False):
        """One layer's parameters (with `active`, those one token uses): two norms, the
        attention, and a dense MLP or the mixture: router, shared and routed experts."""
        dense = 2 * self.hidden + self.attention_values()
        if not mixture:
            return dense + self.mlp_values(self.ffn)
        e = self.experts
        routed = e.top_k if active else e.count
        return dense + e.count * self.hidden + (routed + e.shared) * self.mlp_values(e.width)

    def mixture_layers(self):
        return self.experts.layers(self.layers) if self.experts else 0

    def params(self, active=False):
        """Every parameter; with `active`, those a token uses: the dense part and, in a
        mixture, the router and the k routed (and shared) experts it goes to."""
        ends = 2 * self.vocab * self.hidden + self.hidden           # embedding, head, norm
        return ends + self.over_layers(lambda mixture: self.layer_values(mixture, active))

    def over_layers(self, count):
        """The sum of `count(mixture)` over the layers, dense (False) and mixtures (True)."""
        moe = self.mixture_layers()
        dense = (self.layers - moe) * count(False)
        return dense + moe * count(True) if moe else dense

    def routed_values(self):
        """The routed experts' parameters: what expert parallelism splits."""
        e = self.experts
        return self.mixture_layers() * e.count * self.mlp_values(e.width) if e else 0


def mla_values(hidden, heads, q_rank, kv_rank, nope_dim, rope_dim, v_dim):
    """One layer of DeepSeek's multi-head latent attention (DeepSeek-V2, §2.1; DeepSeek-V3,
    §2.1.1): queries and keys/values go down to latent vectors of `q_rank` and `kv_rank`
    features (each normed) and back up to the heads; a decoupled key of `rope_dim` features
    is shared by the heads; the output projection maps the heads' values back."""
    query = hidden * q_rank + q_rank + q_rank * heads * (nope_dim + rope_dim)
    key_value = hidden * (kv_rank + rope_dim) + kv_rank + kv_rank * heads * (nope_dim + v_dim)
    return query + key_value + heads * v_dim * hidden


def gpt_with_experts(sizes, num_experts, top_k=1, moe_every=2):
    """(total, active) parameters of the package's GPT of `sizes` (a `GPTSizes`) whose every
    `moe_every`-th layer's MLP is an `nn.MoE`, counted on the blocks themselves, built in
    shapes alone (nothing drawn): a change to the mixture changes the count. A token uses the
    router and `top_k` of the experts."""
    mixture, mlp = MoE(sizes.hidden, num_experts, top_k), MLP(sizes.hidden)
    expert = values_of(mixture.experts[0].collect_params().values())
    swapped = sizes.layers // moe_every
    total = sizes.params() + swapped * (values_of(mixture.collect_params().values())
                                        - values_of(mlp.collect_params().values()))
    return total, total - swapped * (num_experts - top_k) * expert


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a job splits a model: `data` × `tensor` × `pipeline` × `context` devices, and
    `expert` ranks for the mixtures' routed experts, carved out of the data × context ones
    (Megatron-LM's: it does not multiply the devices). `tokens`: a micro-batch's tokens (None:
    one sequence).
    `zero_stage=1` shards the master weights and the optimizer's state over the replicas;
    `fsdp` shards weights, gradients and optimizer state (ZeRO-3's table) and keeps the
    stage's 16-bit weights gathered through the step, as Llama 3 does (it does not reshard
    after the forward pass, to save the backward's all-gather). `copies`: copies of a stage's
    parameters a device holds (DualPipe's 2). `in_flight`: micro-batches whose activations
    the first stage keeps at its peak (None: 1F1B's p)."""
    data: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    tokens: int | None = None
    zero_stage: int = 0
    fsdp: bool = False
    copies: int = 1
    in_flight: int | None = None

    @property
    def devices(self):
        return self.data * self.tensor * self.pipeline * self.context

    def __post_init__(self):
        if self.fsdp and self.zero_stage:
            raise ValueError(f'fsdp=True shards every state already: leave zero_stage '
                             f'({self.zero_stage}) at 0')
        if (self.data * self.context) % self.expert:
            raise ValueError(f'{self.expert} expert ranks are carved out of the data × '
                             f'context ranks ({self.data} × {self.context}): use a divisor')


def token_activations(sizes, mixture):
    """Bytes one layer keeps of a token for its backward, in 16-bit values: Korthikanti et
    al.'s count (their Table 2) with what these models change. No dropout; the attention's
    scores are never kept (FlashAttention recomputes them); keys and values are kv_heads/heads
    as wide (GQA); SwiGLU keeps three wide values (its two products' outputs and their
    product) where GeLU keeps two. Attention: the norm's input, the projections' input, the
    queries, keys, values and the heads' output. MLP: the norm's input, its input and the
    wide values; a mixture keeps, for each of the k experts a token goes to, its copy of the
    token, the wide values and the expert's output (for the gate's gradient)."""
    h = sizes.hidden
    attention = 2 * h + 2 * sizes.query_width + sizes.kv_width
    if not mixture:
        return 2 * (attention + 2 * h + 3 * sizes.ffn)
    e = sizes.experts
    experts = e.top_k * (2 * h + 3 * e.width) + e.shared * 3 * e.width
    return 2 * (attention + 2 * h + experts)


def layout_memory(sizes, layout, memory=80e9, states=MEGATRON):
    """{what: bytes} a device of the first pipeline stage holds at its peak, for a
    `ModelSizes`: its states and its activations, and whether they fit in `memory`."""
    held_states = stage_states(sizes, layout, states)
    activations = first_stage_activations(sizes, layout)
    held = held_states + activations
    return {'states': held_states, 'activations': activations, 'held': held,
            'fits': held <= memory}


def stage_states(sizes, layout, states):
    """A stage's parameters on one device: the dense ones 1/t of them, the routed experts
    1/ep of them (whole experts, no tensor split), each sharded over its own replicas: the
    d data-parallel ranks for the dense part, the d·c/ep that hold the same experts."""
    pipeline = layout.pipeline
    dense = (sizes.params() - sizes.routed_values()) / (layout.tensor * pipeline)
    routed = sizes.routed_values() / (layout.expert * pipeline)
    expert_replicas = layout.data * layout.context // layout.expert
    stage, fsdp = layout.zero_stage, layout.fsdp
    return layout.copies * (sharded(dense, layout.data, states, stage, fsdp) +
                            sharded(routed, expert_replicas, states, stage, fsdp))


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


def first_stage_activations(sizes, layout):
    """The first stage's peak: `in_flight` micro-batches of its layers, each device keeping
    1/c of a micro-batch's tokens (context parallelism) and 1/t of what each keeps (sequence
    parallelism). The embedding and the head take a layer's place each, as Llama 3 balances
    its stages (§3.3.2: one layer fewer on the first and the last), so the first stage has
    (L + 2)/p - 1 layers."""
    pipeline = layout.pipeline
    layers = (sizes.layers + 2) / pipeline - 1 if pipeline > 1 else sizes.layers
    in_flight = layout.in_flight or pipeline
    return in_flight * layers * device_tokens(sizes, layout) * mean_token_activations(sizes)


def device_tokens(sizes, layout):
    """Tokens of a micro-batch whose activations one device keeps: 1/(c·t) of them."""
    return (layout.tokens or sizes.seq) / (layout.context * layout.tensor)


def mean_token_activations(sizes):
    return sizes.over_layers(lambda mixture: token_activations(sizes, mixture)) / sizes.layers


def tokens_that_fit(sizes, layout, memory=80e9, states=MEGATRON):
    """The most tokens a micro-batch may have for the layout to fit in `memory`: what its
    states leave, over what a token's activations take at the first stage's peak (0 when the
    states alone do not fit)."""
    one_token = dataclasses.replace(layout, tokens=1)
    room = memory - stage_states(sizes, layout, states)
    return max(room, 0) / first_stage_activations(sizes, one_token)


def all_to_all_seconds(sizes, cluster, layout, microbatches):
    """The mixtures' all-to-alls in a step: dispatch and combine, forward and backward, for
    each mixture layer of a stage and each micro-batch, each moving a device's k copies of
    its tokens' 16-bit features. Megatron-LM's order, tp-cp-ep-dp-pp, puts a device's ep
    group-mates t·c apart: the group stays on NVLink while t·c·ep fit in a machine, and
    otherwise sends (ep - m)/ep of its bytes over the network, m its mates in a machine."""
    if layout.expert == 1 or not sizes.experts:
        return 0
    size = 2 * sizes.experts.top_k * device_tokens(sizes, layout) * sizes.hidden
    mates = max(cluster.per_machine // (layout.tensor * layout.context), 1)
    one = cost.all_to_all_across_time(size, layout.expert, mates, cluster.nvlink,
                                      cluster.network, cluster.alpha)
    return 4 * one * microbatches * sizes.mixture_layers() / layout.pipeline


# Llama 3 405B (Dubey et al., 2024, "The Llama 3 Herd of Models"), Table 3: 126 layers, model
# dimension 16,384, FFN dimension 53,248, 128 attention heads, 8 key/value heads, a vocabulary
# of 128K tokens (128,256 in the released configuration), SwiGLU; 128K tokens a sequence in
# its long-context stage (§3.4.2).
LLAMA3_405B = ModelSizes(vocab=128256, layers=126, hidden=16384, heads=128, seq=131072,
                         ffn=53248, kv_heads=8)
# Table 4's long-context row: 16,384 H100s, TP 8, CP 16, PP 16, 16 sequences of 131,072 tokens
# a DP rank, 16M tokens a batch. The table prints DP = 4 there, but 16,384 GPUs and 16M tokens
# both need DP = 8 (8·16·16·8 = 16,384; 16 · 131,072 · 8 = 16.8M): we take 8. DP is FSDP
# (§3.3.2), and each micro-batch one sequence. Memory sets CP (16 brings a rank back to the 8K
# tokens Llama 3 trained without activation checkpointing), PP and FSDP (halve either and the
# layout no longer fits); the all-gather of keys and values over the ring is not memory's
# choice but the document masks' and GQA's (the gathered keys and values are small, §3.3.2).
LLAMA3_LONG_CONTEXT = Layout(data=8, tensor=8, pipeline=16, context=16, fsdp=True)

# DeepSeek-V3 (DeepSeek-AI, 2024, arXiv 2412.19437), §4.2: 61 layers, hidden 7,168, 128 heads
# of 128 features (plus 64 decoupled for RoPE), latent attention with KV compression 512 and
# query compression 1,536; every layer but the first three a mixture of 1 shared and 256
# routed experts of width 2,048, 8 routed a token; 671B parameters, 37B activated a token;
# 4K tokens a sequence. Vocabulary 129,280 and the dense layers' width 18,432 are the released
# configuration's (config.json). The multi-token-prediction module (14B more) is not counted.
# head_dim 192 is a query's and a key's 128 + 64 features; what attention keeps counts the
# values' 128 as 192 too, a small overcount beside the 1 shared + 8 routed experts'.
DEEPSEEK_V3 = ModelSizes(
    vocab=129280, layers=61, hidden=7168, heads=128, seq=4096, ffn=18432, head_dim=192,
    experts=Experts(count=256, top_k=8, width=2048, dense_first=3, shared=1),
    attention=mla_values(7168, 128, q_rank=1536, kv_rank=512, nope_dim=128, rope_dim=64,
                         v_dim=128))
# §3.2: "16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP) spanning 8 nodes,
# and ZeRO-1 Data Parallelism (DP)" on 2,048 H800s (§3.1), no tensor parallelism. DualPipe
# (§3.2.1, Table 2) keeps two copies of the parameters and PP + 1 micro-batches' activations.
# Memory sets EP's floor (on one node the experts leave no room) and, with PP, the micro-batch
# that fits; DualPipe costs memory and is chosen to hide the all-to-all, and tensor
# parallelism is left out because §3.2.3's savings make it unneeded, not for lack of memory.
DEEPSEEK_V3_LAYOUT = Layout(data=128, pipeline=16, expert=64, zero_stage=1, copies=2,
                            in_flight=17)
# §3.3.3: FP32 master weights and gradients, AdamW's two moments in BF16. The 16-bit weights
# the FP8 GEMMs are cast from we take as BF16, as Megatron-LM's (the paper does not say).
DEEPSEEK_STATES = {'weights': 2, 'gradients': 4, 'master weights': 4, 'optimizer state': 4}
# §3.1, §3.2.2: 8 H800s a node on NVLink at 160 GB/s, InfiniBand at 50 GB/s a GPU. The paper
# gives no achieved rate: `flops` is the dense BF16 peak the H800 shares with the H100 SXM.
H800_CLUSTER = Cluster(machines=256, per_machine=8, memory=80e9, flops=989e12, nvlink=160e9,
                       network=50e9)
