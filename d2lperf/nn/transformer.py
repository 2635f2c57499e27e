"""A small GPT (Radford et al., 2019): embeddings, pre-norm Transformer layers of causal
multi-head self-attention and a GELU MLP, and a language-model head. Taught in "Model
Parallelism", which splits it across devices.

The network is a flat sequence of units, embedding, one block per layer, head, because
ZeRO-3 and FSDP shard a net by its children and pipeline parallelism cuts it between them.
Inside a layer, the attention's query, key, value and output projections and the MLP's two
Dense layers are separate, named parameters. Each block makes them through a `LayerSpec`
(Megatron-LM's module specs): the default makes whole Dense layers; tensor parallelism hands
in one that makes a device's share of each, a column-parallel layer for the query, key, value
and the MLP's first, a row-parallel one for the two outputs, with the collectives inside them
(`model_parallel.layers`). So each block's forward is written once, split or not.
"""
import math
import numbers

from ..np import extension as npx
from .block import HybridBlock, HybridSequential
from .init import Constant, Normal, Zero
from .layer_spec import INIT_SIGMA, MLP, WHOLE
from .moe import Mixture
from .parameter import Parameter

class Embedding(HybridBlock):
    """A table of `input_dim` learnt vectors of `output_dim` values, looked up by id."""

    def __init__(self, input_dim, output_dim):
        super().__init__()
        self.weight = Parameter('weight', (input_dim, output_dim), init=Normal(INIT_SIGMA))

    def forward(self, index):
        return npx.embedding(index, self.weight.data(index.device))

    def __repr__(self):
        return f'Embedding({self.weight.shape[0]} -> {self.weight.shape[1]})'


class LayerNorm(HybridBlock):
    """Normalize each position's features, then scale and shift them (learnt)."""

    def __init__(self, units, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.gamma = Parameter('gamma', (units,), init=Constant(1.0))
        self.beta = Parameter('beta', (units,), init=Zero())

    def forward(self, x):
        device = x.device
        return npx.layer_norm(x, self.gamma.data(device), self.beta.data(device), self.eps)

    def __repr__(self):
        return f'LayerNorm({self.gamma.shape[0]})'


class GPTEmbedding(HybridBlock):
    """Each token's vector plus its position's: (batch, seq) ids -> (batch, seq, units)."""

    def __init__(self, vocab_size, num_hiddens, max_len, spec=WHOLE):
        super().__init__()
        self.spec = spec
        self.token = Embedding(vocab_size, num_hiddens)
        self.position = Parameter('position', (max_len, num_hiddens), init=Normal(INIT_SIGMA))

    def forward(self, tokens):
        x = npx.add_position_embedding(self.token(tokens), self.position.data(tokens.device))
        return self.spec.local_tokens(x)


class CausalSelfAttention(HybridBlock):
    """Multi-head attention in which each position attends to itself and earlier ones.

    Its `num_heads` heads are shared among `spec.parts` devices: `self.num_heads` are the
    heads it computes (all of them, unless a tensor-parallel spec splits it), over the tokens
    `spec.attention` brings (a context-parallel spec brings other devices' keys and values)."""

    def __init__(self, num_hiddens, num_heads, spec=WHOLE):
        super().__init__()
        if num_hiddens % num_heads:
            raise ValueError(f'{num_hiddens} features do not split among num_heads={num_heads} '
                             'heads: use a number of heads that divides num_hiddens')
        if num_heads % spec.parts:
            raise ValueError(f'{num_heads} attention heads do not split among {spec.parts} '
                             f'devices: use a number of devices that divides {num_heads}')
        self.num_heads, self.spec = num_heads // spec.parts, spec
        self.query = spec.column(num_hiddens, num_hiddens)
        self.key = spec.column(num_hiddens, num_hiddens)
        self.value = spec.column(num_hiddens, num_hiddens)
        self.output = spec.row(num_hiddens, num_hiddens)

    def split_heads(self, x):
        """(batch, seq, heads · d) -> (batch, heads, seq, d)."""
        batch, seq, width = x.shape
        return x.reshape(batch, seq, self.num_heads, width // self.num_heads).transpose(0, 2, 1, 3)

    def forward(self, x):
        heads = (self.split_heads(f(x)) for f in (self.query, self.key, self.value))
        return self.output(merge_heads(self.spec.attention(*heads)))

    def attend(self, q, k, v, bias=None):
        """The heads' attention, (batch, t, heads · d), for queries (batch, heads, t, d) over
        keys and values (batch, heads, s, d), s ≥ t: the queries are the last t positions, and
        a KV cache (`d2l.inference`) holds the s - t before them, already split into heads.
        `bias` (batch, 1, 1, s), added to the scores, hides a batch's padding from generation."""
        scores = (q @ k.transpose(0, 1, 3, 2)) * (1 / math.sqrt(q.shape[-1]))
        return merge_heads(npx.causal_softmax(scores if bias is None else scores + bias) @ v)


def merge_heads(heads):
    """(batch, heads, seq, d) -> (batch, seq, heads · d)."""
    batch, count, seq, size = heads.shape
    return heads.transpose(0, 2, 1, 3).reshape(batch, seq, count * size)


class TransformerLayer(HybridBlock):
    """Pre-norm residual layer (GPT-2's): x + attention(norm(x)), then x + mlp(norm(x)). With
    `num_experts` > 0 the MLP is a mixture of that many (`MoE`, each token to `top_k`), whole
    on each device that holds the layer."""

    def __init__(self, num_hiddens, num_heads, spec=WHOLE, num_experts=0, top_k=1):
        super().__init__()
        self.attention_norm = LayerNorm(num_hiddens)
        self.attention = CausalSelfAttention(num_hiddens, num_heads, spec)
        self.mlp_norm = LayerNorm(num_hiddens)
        self.mlp = (spec.mixture(num_hiddens, num_experts, top_k) if num_experts
                    else MLP(num_hiddens, spec=spec))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LanguageModelHead(HybridBlock):
    """The final norm and the projection to one score per vocabulary entry."""

    def __init__(self, num_hiddens, vocab_size, spec=WHOLE):
        super().__init__()
        self.norm = LayerNorm(num_hiddens)
        self.output = spec.replicated(vocab_size, num_hiddens)

    def forward(self, x):
        return self.output(self.norm(x))


class GPT(HybridSequential):
    """tokens (batch, seq) int -> logits (batch, seq, vocab_size), causal.

    Its children, in order: a GPTEmbedding, `num_layers` TransformerLayers, a
    LanguageModelHead (`net[0]`, `net[1:-1]`, `net[-1]`). The head has its own weights (GPT-2
    ties them to the token table; tying would make two units share a parameter, which
    sharding by units cannot express). With `num_experts` > 0, every `moe_every`-th layer's
    MLP is a mixture of experts (layers moe_every, 2·moe_every, ..., counted from 1, as
    Switch and GShard alternate dense and mixture layers); `mixtures()` gives them, and the
    sum of their `aux_loss` is the load-balancing loss to add, times α. Such a GPT runs
    imperatively: the router reads its choices back to the host, which a traced forward
    cannot (hybridize's trace stops there, naming it). `config` is its sizes,
    the arguments it was made with but `spec`: `GPT(*net.config, spec=...)` makes the same
    model, split as `spec` says.

    >>> net = GPT(vocab_size=50, num_layers=2, num_hiddens=32, num_heads=2, max_len=16)
    >>> [type(unit).__name__ for unit in net.children()]
    ['GPTEmbedding', 'TransformerLayer', 'TransformerLayer', 'LanguageModelHead']
    >>> moe = GPT(50, 4, 32, 2, 16, num_experts=4, top_k=2, moe_every=2)
    >>> [type(layer.mlp).__name__ for layer in moe.children()[1:-1]]
    ['MLP', 'MoE', 'MLP', 'MoE']
    """

    def __init__(self, vocab_size, num_layers, num_hiddens, num_heads, max_len, num_experts=0,
                 top_k=1, moe_every=2, spec=WHOLE):
        super().__init__()
        if not isinstance(num_layers, numbers.Integral) or num_layers < 0:
            raise ValueError(f'num_layers={num_layers!r}: a GPT has a whole number of layers, '
                             '0 or more (with 0 it is a bigram model: embedding, then head)')
        check_experts(num_experts, moe_every)
        self.config = (vocab_size, num_layers, num_hiddens, num_heads, max_len, num_experts,
                       top_k, moe_every)
        self.add(GPTEmbedding(vocab_size, num_hiddens, max_len, spec))
        self.add(*(TransformerLayer(num_hiddens, num_heads, spec,
                                    num_experts if layer % moe_every == 0 else 0, top_k)
                   for layer in range(1, num_layers + 1)))
        self.add(LanguageModelHead(num_hiddens, vocab_size, spec))

    def mixtures(self):
        """The layers' mixtures of experts (`MoE`), in order: none without experts."""
        return [layer.mlp for layer in self.children()[1:-1] if isinstance(layer.mlp, Mixture)]


def check_experts(num_experts, moe_every):
    if not isinstance(num_experts, numbers.Integral) or num_experts < 0:
        raise ValueError(f'num_experts={num_experts!r}: 0 for dense MLPs, or the number of '
                         'experts in each mixture layer')
    if not isinstance(moe_every, numbers.Integral) or moe_every < 1:
        raise ValueError(f'moe_every={moe_every!r}: every how many layers one is a mixture, '
                         '1 or more (1: every layer, 2: every second, as Switch)')
