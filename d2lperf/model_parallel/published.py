"""The layout calculator on the models people train today, as their papers publish them:
mixtures of experts (`Experts`: parameters total and active a token), grouped-query attention
and DeepSeek's latent attention (`ModelSizes`), and a `Layout` with context and expert
parallelism, FSDP and DualPipe's copies (`layout_memory`), so that DeepSeek-V3's and Llama 3
405B's published layouts are checked against the memory they ran in, and the layouts beside
them that do not fit show which dimensions memory sets. `gpt_with_experts` counts the
package's own GPT with mixtures on the model. Built on `predict.py`'s states and links.
Taught in "Long Sequences and Many Experts".
"""
from __future__ import annotations

import dataclasses

from ..comm import cost
from ..nn.footprint import MEGATRON
from ..nn.moe import MoE
from ..nn.transformer import MLP
from .predict import Cluster, sharded, values_of


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
