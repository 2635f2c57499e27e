"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023), taught in "Inference".

A small draft model proposes `draft_tokens` (γ) tokens one at a time; the target scores the
prefix and all γ of them in one pass, which costs about as much as scoring one token, since
decoding is bound by reading the weights. A rejection rule then keeps each drafted token x
with probability min(1, p(x)/q(x)) (p the target's distribution there, q the draft's) and,
at the first rejection, draws from norm(max(0, p − q)) instead: what comes out is
distributed exactly as the target's own sampling. Greedy decoding is the same rule on
one-hot distributions: p/q is 1 where the draft chose the target's argmax and 0 elsewhere,
and the residual is the target's argmax, so one rule serves both.

The rule needs of a model only its next-token distributions, so a model is seen here as a
`Distributions`: a function of a sequence and a count that gives the distributions after
each of the sequence's last `count` prefixes. The rule can then be checked on explicit
tables as well as on GPTs. `recomputed` makes one from a GPT by a plain forward over the
whole sequence (exact; no cache to roll back past rejected tokens).
"""
import dataclasses
from typing import Callable, List

import numpy

from .. import np

# (tokens, count) -> (count, vocab) float64: distributions after each of the last count prefixes
Distributions = Callable[[List[int], int], numpy.ndarray]


def distribution(logits, temperature=0.0, top_k=None):
    """Next-token probabilities (float64) from (..., vocab) scores: a softmax of
    scores / temperature over the top_k largest (ties at the k-th kept), or, at temperature 0,
    one-hot at the argmax, which makes the rejection rule greedy decoding."""
    logits = numpy.asarray(logits, numpy.float64)
    if temperature == 0:
        return numpy.eye(logits.shape[-1])[logits.argmax(-1)]
    if top_k is not None:
        kth = numpy.sort(logits, -1)[..., -top_k, None]
        logits = numpy.where(logits < kth, -numpy.inf, logits)
    weights = numpy.exp((logits - logits.max(-1, keepdims=True)) / temperature)
    return weights / weights.sum(-1, keepdims=True)


def acceptance(p, q):
    """min(1, p(x)/q(x)) for every token x: the chance a drafted x is kept. Where q(x) = 0, x
    is never drafted; 1 there keeps the vector finite."""
    return numpy.minimum(1.0, numpy.divide(p, q, out=numpy.ones_like(p), where=q > 0))


def residual(p, q):
    """norm(max(0, p − q)): where to draw after a rejection, the mass the target puts on
    tokens the draft under-proposes. It is empty only when p = q, where nothing is rejected
    but by rounding; p then serves."""
    excess = numpy.maximum(p - q, 0.0)
    total = excess.sum()
    return excess / total if total > 0 else p


def overlap(p, q):
    """Σ_x min(p(x), q(x)): the chance the rule keeps the draft's token at this position
    (Leviathan's β; its mean over positions is the acceptance rate α)."""
    return float(numpy.minimum(p, q).sum())


def sample(probabilities, rng):
    """One token drawn from `probabilities`: where a uniform draw falls in their running sum
    (never on a token of probability 0; rng.choice checks its input, ten times slower)."""
    cumulative = numpy.cumsum(probabilities)
    return int(numpy.searchsorted(cumulative, rng.random() * cumulative[-1], side='right'))


def verify(p, q, drafted, rng):
    """The tokens one round emits: the drafted tokens the rule keeps, then one of the
    target's (from the residual at the first rejection, else from p after the last draft).
    p: (γ + 1, vocab) target rows, q: γ draft rows, drafted: γ ids."""
    for i, x in enumerate(drafted):
        if rng.random() >= acceptance(p[i], q[i])[x]:
            return list(drafted[:i]) + [sample(residual(p[i], q[i]), rng)]
    return list(drafted) + [sample(p[-1], rng)]


@dataclasses.dataclass
class Round:
    """What one target pass did: γ drafted, how many kept, and β at each position where the
    rule was tried (those before the first rejection, and that one)."""
    drafted: int
    accepted: int
    overlaps: List[float]


def speculate(target, draft, prompt, max_new_tokens, draft_tokens, rng, rounds=None):
    """`prompt` followed by `max_new_tokens` tokens, drafted by `draft` and checked by
    `target` (both `Distributions`), γ = draft_tokens a round. The last rounds draft fewer, so
    that a round never emits past the end. Each round is appended to `rounds` if given."""
    tokens, end = list(prompt), len(prompt) + max_new_tokens
    while len(tokens) < end:
        gamma = min(draft_tokens, end - len(tokens) - 1)
        drafted, q = [], []
        for _ in range(gamma):
            q.append(draft(tokens + drafted, 1)[0])
            drafted.append(sample(q[-1], rng))
        p = target(tokens + drafted, gamma + 1)
        emitted = verify(p, q, drafted, rng)
        if rounds is not None:
            tried = min(len(emitted), gamma)
            rounds.append(Round(gamma, len(emitted) - 1,
                                [overlap(p[i], q[i]) for i in range(tried)]))
        tokens += emitted
    return tokens


def recomputed(net, temperature=0.0, top_k=None):
    """A GPT as `Distributions`: a plain forward over the whole sequence at every call, its
    last `count` rows made distributions. Exact, and with nothing to roll back when drafted
    tokens are rejected; a KV cache would save the prefix's recomputation."""
    device = next(iter(net.collect_params().values())).list_device()[0]

    def next_distributions(tokens, count):
        logits = net(np.array(numpy.array([tokens], numpy.int64), device=device)).asnumpy()
        return distribution(logits[0, -count:], temperature, top_k)
    return next_distributions


def generate(target, draft, prompts, max_new_tokens, draft_tokens=4, temperature=0.0,
             top_k=None, seed=None, rounds=None):
    """Each prompt continued by `max_new_tokens` tokens from GPT `target`, drafted by GPT
    `draft`: the same tokens as the target alone when greedy (temperature 0), and the same
    distribution when sampling (temperature > 0, over the top_k). `prompts`: (batch, len) ids
    -> (batch, len + new) int64 NumPy array, or a list of 1-D prompts -> a list. Each prompt
    runs on its own: rows keep different numbers of drafted tokens, so a batch would fall out
    of step. `rounds`, a list, collects every round's `Round`."""
    check(target, draft, prompts, max_new_tokens, draft_tokens, temperature, top_k)
    rng = numpy.random.default_rng(seed)
    p, q = (recomputed(net, temperature, top_k) for net in (target, draft))
    rows = [speculate(p, q, [int(t) for t in numpy.asarray(prompt)], max_new_tokens,
                      draft_tokens, rng, rounds) for prompt in as_rows(prompts)]
    if isinstance(prompts, (list, tuple)):
        return [numpy.array(row, numpy.int64) for row in rows]
    return numpy.array(rows, numpy.int64)


def as_rows(prompts):
    if isinstance(prompts, (list, tuple)):
        return prompts
    array = prompts.asnumpy() if isinstance(prompts, np.NDArray) else numpy.asarray(prompts)
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(f'prompts of shape {array.shape}: give (batch, len) ids, len ≥ 1, or '
                         'a list of 1-D prompts')
    return list(array)


def check(target, draft, prompts, max_new_tokens, draft_tokens, temperature, top_k):
    """Refuse, naming the fix, what would fail later or silently differ from the target."""
    if not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f'draft_tokens={draft_tokens!r}: the draft proposes 1 or more tokens a '
                         'round (γ; 4 is a common choice)')
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f'max_new_tokens={max_new_tokens!r}: a whole number, 0 or more')
    if temperature < 0:
        raise ValueError(f'temperature={temperature}: 0 for greedy decoding, > 0 to sample')
    if top_k is not None and not 1 <= top_k <= target.config[0]:
        raise ValueError(f'top_k={top_k}: between 1 and the vocabulary, {target.config[0]}')
    if target.config[0] != draft.config[0]:
        raise ValueError(f'the target reads {target.config[0]} tokens but the draft '
                         f'{draft.config[0]}: both must share one vocabulary')
    lengths = [len(numpy.asarray(prompt)) for prompt in as_rows(prompts)]
    if not lengths or min(lengths) < 1:
        raise ValueError(f'prompts of lengths {lengths}: give at least one prompt, each of one '
                         'token or more (the GPT predicts from what it has read)')
    longest = max(lengths) + max_new_tokens - 1
    for name, net in (('target', target), ('draft', draft)):
        if longest > net.config[4]:
            raise ValueError(f'the {name} has positions for {net.config[4]} tokens, but '
                             f'generation reads up to {longest}: make max_new_tokens smaller '
                             'or the GPT with a larger max_len')
