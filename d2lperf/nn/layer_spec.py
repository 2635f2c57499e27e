"""What the GPT's blocks are made of: the Dense layers a `LayerSpec` makes (Megatron-LM's
module specs: whole here, a device's share of each under tensor parallelism,
`model_parallel.layers`), and the MLP made of them, which a mixture of experts (`moe.py`)
copies E times. It sits below both the GPT (`transformer.py`) and the mixture, so that a GPT
can hold mixtures. Taught in "Model Parallelism" and "Tensor and Sequence Parallelism".
"""
from ..np import extension as npx
from .block import Dense, HybridBlock
from .init import Normal

INIT_SIGMA = 0.02                # GPT-2's weights: N(0, 0.02²)


def projection(units, in_units):
    """A Dense layer that maps the last axis only (inputs are (batch, seq, features))."""
    dense = Dense(units, in_units=in_units, flatten=False)
    dense.weight.init = Normal(INIT_SIGMA)
    return dense


class LayerSpec:
    """Which Dense layers the GPT's blocks are made of, and how many devices share each block
    (`parts`). This spec makes them whole, on one device; a tensor-parallel spec makes one
    device's share of each, with the collectives that join the devices inside the layers.

    * `column(units, in_units)`: a layer that may be split by its output features (the
      attention's query, key and value, by heads; the MLP's first): it reads the whole input;
    * `row(units, in_units)`: one that may be split by its input features (the attention's
      and the MLP's output projections): the block's output leaves it whole;
    * `replicated(units, in_units)`: one whole on every device (the head's);
    * `local_tokens(x)`: of the embeddings' output, the tokens this device holds;
    * `mixture(num_hiddens, num_experts, top_k)`: a mixture of experts (an expert-parallel
      spec makes one device's share of its experts);
    * `attention(q, k, v)`: causal attention of the heads (batch, heads, seq, d) it holds,
      over the tokens it holds (a context-parallel spec brings the other devices' keys and
      values)."""

    parts = 1

    def column(self, units, in_units):
        return projection(units, in_units)

    def row(self, units, in_units):
        return projection(units, in_units)

    def replicated(self, units, in_units):
        return projection(units, in_units)

    def local_tokens(self, x):
        return x

    def attention(self, q, k, v):
        return npx.attention(q, k, v)

    def mixture(self, num_hiddens, num_experts, top_k):
        from .moe import MoE          # the mixture is made of this module's MLP: import it late
        return MoE(num_hiddens, num_experts, top_k)


WHOLE = LayerSpec()


class MLP(HybridBlock):
    """Widen each position's features four times, GELU, and project back (a tensor-parallel
    spec gives each device some of the wide features)."""

    def __init__(self, num_hiddens, expansion=4, spec=WHOLE):
        super().__init__()
        self.hidden = spec.column(expansion * num_hiddens, num_hiddens)
        self.output = spec.row(num_hiddens, expansion * num_hiddens)

    def forward(self, x):
        return self.output(npx.gelu(self.hidden(x)))
