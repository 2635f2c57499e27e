"""A mixture of experts: E copies of the GPT's MLP, and a router that sends each token to k
of them (Shazeer et al., 2017). Switch Transformer's k = 1 (Fedus et al., 2021) and GShard's
k = 2 (Lepikhin et al., 2020). Taught in "Long Sequences and Many Experts".

Each expert takes at most its capacity, ⌈k · tokens / E · capacity factor⌉ tokens, so that
every expert's batch has one shape, known before the router has chosen: the buffer of E ·
capacity rows that expert parallelism sends between devices. A token over its expert's
capacity is dropped: the mixture adds nothing for it, and the residual connection around the
layer carries it on unchanged. The choices are made in the order of rank, then of token:
every token's first choice is placed before any token's second, as GShard does.

The router's softmax gives each token a probability per expert; the token's output is the
sum of its experts' outputs, each weighted by its probability (k = 1: the one probability,
as Switch; k = 2: the two renormalized to sum to 1, as GShard). The choices themselves are
read back to the host (a synchronization, as Megatron's router reads its token counts), and
move the tokens by lookups whose gradient is a scatter-add (`npx.embedding`): to expert
buffers, and back. `aux_loss` is Switch's load-balancing loss without its α, E · Σᵢ fᵢ · Pᵢ:
fᵢ the share of tokens whose first choice is expert i (also for k = 2, as GShard's loss
counts only the first choice), Pᵢ the mean router probability of expert i. It is 1 when the
router is uniform and reaches E when it sends every token to one expert.
"""
import collections
import math
import numbers

import numpy

from .. import np
from ..np import extension as npx
from .block import Block
from .layer_spec import MLP, projection

Routing = collections.namedtuple('Routing', 'probs choices slot_token token_slot dropped '
                                            'first_share capacity')
Routing.__doc__ = """What the router decided for `tokens` tokens of one device.

`probs` (tokens, E): the router's softmax (recorded). `choices` (tokens, k): each token's
experts, best first. `slot_token` (E · capacity,): the token in each row of the expert
buffer (expert e's rows are e · capacity onwards), `tokens` for an empty row (padding).
`token_slot` (tokens, k): the buffer row of each choice, E · capacity where it was dropped.
`dropped`: choices over capacity. `first_share` (E,): fᵢ, the share of first choices."""


def capacity(tokens, num_experts, top_k, capacity_factor):
    """Rows of each expert's buffer: ⌈k · tokens / E · capacity factor⌉ (rounded to 9 digits
    first, so that 1.1 · 10 is 11, not 12)."""
    return math.ceil(round(top_k * tokens / num_experts * capacity_factor, 9))


def route(probs_host, top_k, rows):
    """(choices, slot_token, token_slot, dropped, first_share) for a host array of router
    probabilities (tokens, E), with `rows` places an expert: ranks in order, tokens in order
    within a rank, each choice taking its expert's next free row."""
    tokens, experts = probs_host.shape
    choices = numpy.argsort(-probs_host, axis=1, kind='stable')[:, :top_k]
    slot_token = numpy.full(experts * rows, tokens, numpy.int64)
    token_slot = numpy.full((tokens, top_k), experts * rows, numpy.int64)
    taken = numpy.zeros(experts, numpy.int64)
    for rank in range(top_k):
        chosen = choices[:, rank][:, None] == numpy.arange(experts)          # (tokens, E)
        place = (numpy.cumsum(chosen, axis=0) - 1 + taken)[numpy.arange(tokens),
                                                            choices[:, rank]]
        kept = place < rows
        rows_taken = choices[kept, rank] * rows + place[kept]
        slot_token[rows_taken] = numpy.flatnonzero(kept)
        token_slot[kept, rank] = rows_taken
        taken += chosen.sum(axis=0)
    dropped = int((token_slot == experts * rows).sum())
    first_share = numpy.bincount(choices[:, 0], minlength=experts) / max(tokens, 1)
    return choices, slot_token, token_slot, dropped, first_share


class Mixture(Block):
    """What every part of a mixture holds: the router, and routing, dispatch and combine over
    all E experts. The experts are the subclass's: all of them (`MoE`), or one device's
    share (`model_parallel.expert.ExpertRank`). After a forward pass, `aux_loss` holds
    Switch's load-balancing loss without α (recorded, so that `loss + alpha * aux_loss`
    trains the router) and `dropped` the choices that went over capacity (tokens, for
    top_k = 1)."""

    def __init__(self, num_hiddens, num_experts, top_k=1, capacity_factor=1.25):
        super().__init__()
        check(num_experts, top_k, capacity_factor)
        self.num_hiddens, self.num_experts, self.top_k = num_hiddens, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.router = projection(num_experts, num_hiddens)
        self.aux_loss, self.dropped = None, None

    def route(self, tokens):
        """The router's choices for (tokens, hiddens), the router's copy on their device;
        sets `aux_loss` and `dropped`."""
        probs = npx.softmax(self.router(tokens))
        rows = capacity(tokens.shape[0], self.num_experts, self.top_k, self.capacity_factor)
        decided = route(probs.asnumpy(), self.top_k, rows)
        routing = Routing(probs, *decided, rows)
        first_share = np.array(routing.first_share.astype(probs.dtype), device=probs.device)
        self.aux_loss = self.num_experts * (probs.mean(axis=0) * first_share).sum()
        self.dropped = routing.dropped
        return routing

    def dispatch(self, tokens, routing):
        """The expert buffer (E · capacity, hiddens): expert e's tokens in its rows, zeros
        in the rows no token took."""
        padded = np.concatenate([tokens, np.zeros((1, tokens.shape[1]), tokens.dtype,
                                                  tokens.device)])
        return npx.embedding(self.ids(routing.slot_token, tokens), padded)

    def combine(self, outputs, routing):
        """Each token's experts' outputs (rows of the buffer `outputs`), weighted by their
        probabilities; zero for a choice dropped."""
        padded = np.concatenate([outputs, np.zeros((1, outputs.shape[1]), outputs.dtype,
                                                   outputs.device)])
        picked = npx.embedding(self.ids(routing.token_slot, outputs), padded)  # (tokens, k, h)
        gates = self.gates(routing)
        return (picked * gates.reshape(*gates.shape, 1)).sum(axis=1)

    def gates(self, routing):
        """(tokens, k) weights: the chosen experts' probabilities, renormalized for k > 1."""
        probs, choices = routing.probs, routing.choices
        picked = [npx.pick(probs, self.ids(choices[:, rank], probs)).reshape(-1, 1)
                  for rank in range(self.top_k)]
        if self.top_k == 1:
            return picked[0]
        return np.concatenate(picked, axis=1) / sum(picked[1:], picked[0])

    @staticmethod
    def ids(host, like):
        return np.array(host, device=like.device)


class MoE(Mixture):
    """(..., num_hiddens) -> (..., num_hiddens): each token through its top_k experts' MLPs.

    >>> moe = d2l.nn.MoE(8, num_experts=4, top_k=2, capacity_factor=2.0).initialize()
    >>> moe(d2l.np.ones((2, 3, 8))).shape, moe.dropped
    ((2, 3, 8), 0)
    """

    def __init__(self, num_hiddens, num_experts, top_k=1, capacity_factor=1.25):
        super().__init__(num_hiddens, num_experts, top_k, capacity_factor)
        self.experts = []
        for e in range(num_experts):
            expert = MLP(num_hiddens)
            setattr(self, f'expert{e}', expert)          # a child: its parameters are ours
            self.experts.append(expert)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens)
        rows = routing.capacity
        buffer = self.dispatch(tokens, routing)
        outputs = [expert(buffer[e * rows:(e + 1) * rows])
                   for e, expert in enumerate(self.experts)]
        return self.combine(np.concatenate(outputs), routing).reshape(x.shape)

    def __repr__(self):
        return (f'MoE({self.num_experts} experts, top_k={self.top_k}, '
                f'capacity_factor={self.capacity_factor})')


def check(num_experts, top_k, capacity_factor):
    if not isinstance(num_experts, numbers.Integral) or num_experts < 1:
        raise ValueError(f'num_experts={num_experts!r}: a mixture needs a whole number of '
                         'experts, 1 or more')
    if top_k not in (1, 2) or top_k > num_experts:
        raise ValueError(f'top_k={top_k!r}: the router sends each token to 1 expert (Switch) '
                         f'or 2 (GShard), at most num_experts={num_experts}')
    if not isinstance(capacity_factor, numbers.Real) or capacity_factor <= 0:
        raise ValueError(f'capacity_factor={capacity_factor!r} must be a number above 0 (1.0: '
                         'room for an even share of the tokens; Switch trains with 1.25)')
