"""Serving many requests: static batching against iteration-level scheduling, on a simulated
clock.

Requests arrive by a seeded Poisson process, each with a prompt and an output length. A
server runs steps, prefill or decode, and the clock advances by what each step costs in a
cost model fitted to measured steps of a real GPT, so a run does not depend on how busy the
machine is while it simulates. Two policies share that clock:

* static batching waits for `batch_size` requests (or `timeout` seconds after the first),
  prefills them together, and decodes the batch until its longest output is done;
* iteration-level scheduling (Orca, Yu et al., OSDI 2022) decides at every step: finished
  sequences leave at once and waiting ones join, admitted first come, first served while the
  paged KV cache has free blocks (vLLM, Kwon et al., SOSP 2023). As vLLM does, a step that
  admits anyone is a prefill of the newcomers; a sequence that needs a block when none is
  free preempts the latest admitted one, which gives its blocks back and is prefilled again
  (prompt and tokens so far) when memory allows.

Tokens stream: a request's first token comes at the end of its prefill, and it is done at
its last token, even where static batching keeps its slot until the batch ends. Taught in
"Inference", section "Batching requests".
"""
import collections
import dataclasses
import itertools
import math

import numpy

from ..utils import median_seconds
from . import roofline
from .paged import BLOCK_SIZE, BlockTables, blocks_for


@dataclasses.dataclass(frozen=True)
class Request:
    """A request as the server sees it: when it came, and its lengths in tokens."""
    arrival: float          # seconds
    prompt: int             # tokens
    output: int             # tokens to generate, the first one by the prefill


@dataclasses.dataclass
class Served:
    """What happened to one request: when its tokens came, and how many."""
    request: Request
    first_token: float = None
    done: float = None
    tokens: int = 0

    @property
    def time_to_first_token(self):
        return self.first_token - self.request.arrival

    @property
    def latency(self):
        return self.done - self.request.arrival


# -- the workload --------------------------------------------------------------------------

def poisson_requests(rate, pairs, seed=0):
    """One request a (prompt, output) pair of `pairs` (`paged.corpus_requests` draws them from
    the course's text), arriving in that order at `rate` a second: exponential gaps."""
    if rate <= 0 or not len(pairs):
        raise ValueError(f'rate={rate} and {len(pairs)} pairs of lengths: both must be positive')
    arrivals = numpy.cumsum(numpy.random.default_rng(seed).exponential(1 / rate, len(pairs)))
    return [Request(float(t), int(p), int(o)) for t, (p, o) in zip(arrivals, pairs)]


# -- the cost of a step ----------------------------------------------------------------------

def features(phase, batch, tokens):
    """What a step's time grows with: a fixed cost (launches, the weights read once), each
    sequence, each token (for a decode step: each cached token its attention reads); and,
    for a prefill, the score matrices, s² a prompt (tokens² / batch for equal prompts)."""
    row = [1.0, batch, tokens]
    return row + [tokens * tokens / batch] if phase == 'prefill' else row


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """seconds = coefficients · features(phase, batch, tokens), one line for each phase:
    `prefill` (4 coefficients) and `decode` (3)."""
    prefill: tuple
    decode: tuple

    def step_seconds(self, phase, batch, tokens):
        return float(numpy.dot(getattr(self, phase), features(phase, batch, tokens)))


def fit_line(phase, rows):
    """Coefficients, none negative, through rows (batch, tokens, seconds) that minimize the
    squared relative error, and the largest relative error on the rows. A negative cost
    would make a large batch faster than a small one: every subset of the features is
    fitted, and the best fit without a negative coefficient kept."""
    rows = numpy.asarray(rows, dtype=float)
    design = numpy.array([features(phase, b, t) for b, t, _ in rows]) / rows[:, 2:]
    best = None
    for used in itertools.product([False, True], repeat=design.shape[1]):
        columns = numpy.flatnonzero(used)
        if not len(columns):
            continue
        coefficients = numpy.zeros(design.shape[1])
        coefficients[columns] = numpy.linalg.lstsq(design[:, columns], numpy.ones(len(rows)),
                                                   rcond=None)[0]
        error = numpy.abs(design @ coefficients - 1).max()
        if coefficients.min() >= 0 and (best is None or error < best[1]):
            best = tuple(float(c) for c in coefficients), float(error)
    return best


def measure_cost(net, batches, lengths, most_tokens=4096, repeats=5):
    """A `LinearCost` fitted to prefill and decode steps of `net` timed at every batch size
    and length (prefills of at most `most_tokens`), with the fit's largest relative error on
    them for each phase. All steps are timed round-robin, so that a drift in the machine's
    load hits them alike."""
    steps = {('decode', b, s): roofline.decode_step(net, b, s) for b in batches for s in lengths}
    steps.update({('prefill', b, s): roofline.prefill_step(net, b, s)
                  for b in batches for s in lengths if b * s <= most_tokens})
    seconds = median_seconds(steps, repeats)
    fits = {phase: fit_line(phase, [(b, b * s, t) for (p, b, s), t in seconds.items()
                                    if p == phase]) for phase in ('prefill', 'decode')}
    cost = LinearCost(fits['prefill'][0], fits['decode'][0])
    return cost, {phase: fit[1] for phase, fit in fits.items()}


# -- the KV memory ---------------------------------------------------------------------------

class BlockPool:
    """The paged cache's block tables (`paged.BlockTables`), asked before each growth whether
    enough blocks are free, as a scheduler must ask, and the most blocks ever held at once."""

    def __init__(self, blocks):
        self.tables, self.peak = BlockTables(blocks), 0

    @property
    def free(self):
        return len(self.tables.allocator.free_blocks)

    def hold(self, owner, tokens):
        """Grow `owner` to `tokens` tokens; False, changing nothing, when the blocks they
        need are not free."""
        tables = self.tables
        if blocks_for([tokens]) - len(tables.tables.get(owner, [])) > self.free:
            return False
        tables.grow(owner, max(tokens - tables.lengths.get(owner, 0), 0))
        self.peak = max(self.peak, tables.allocator.num_blocks - self.free)
        return True

    def release(self, owner):
        if owner in self.tables.tables:
            self.tables.free(owner)


# -- the two policies -------------------------------------------------------------------------

def check_fits(requests, max_tokens):
    for r in requests:
        if r.prompt < 1 or r.output < 1:
            raise ValueError(f'{r}: prompts and outputs need at least one token')
        if r.prompt + r.output > max_tokens:
            raise ValueError(f'{r} needs {r.prompt + r.output} tokens of KV cache, more than '
                             f'the {max_tokens} the server holds: give it more blocks')


def static_batching(requests, cost, batch_size, timeout):
    """Serve `requests` in batches of up to `batch_size`, each run to its longest output.

    A batch starts when the server is free and `batch_size` requests wait, or when the first
    of them has waited `timeout` seconds. Its prompts are padded to the longest, as one
    rectangular (batch, length) array must be. Returns one `Served` a request, in order."""
    if batch_size < 1 or timeout < 0:
        raise ValueError(f'batch_size={batch_size}, timeout={timeout}: a batch holds at least '
                         'one request, and the server waits 0 seconds or more')
    check_fits(requests, math.inf)
    served = [Served(r) for r in requests]
    queue = collections.deque(sorted(served, key=lambda s: s.request.arrival))
    clock = 0.0
    while queue:
        full = queue[batch_size - 1].request.arrival if len(queue) >= batch_size else math.inf
        clock = max(clock, min(queue[0].request.arrival + timeout, full))
        batch = []
        while queue and len(batch) < batch_size and queue[0].request.arrival <= clock:
            batch.append(queue.popleft())
        prompt = max(s.request.prompt for s in batch)
        clock += cost.step_seconds('prefill', len(batch), len(batch) * prompt)
        for s in batch:
            s.first_token = clock
        for step in range(max(s.request.output for s in batch)):
            if step:                # the prefill gave the first token, each decode one more
                clock += cost.step_seconds('decode', len(batch), len(batch) * (prompt + step))
            for s in batch:
                if s.tokens < s.request.output:
                    s.tokens += 1
                    s.done = clock
    return served


def iteration_level(requests, cost, blocks):
    """Serve `requests` step by step within a KV cache of `blocks` 16-token blocks (Orca's
    scheduling, vLLM's memory). Returns (one `Served` a request, in order; the `BlockPool`,
    whose peak is the most blocks ever held; the number of preemptions)."""
    check_fits(requests, blocks * BLOCK_SIZE)
    pool, preempted = BlockPool(blocks), 0
    arrivals = collections.deque(sorted(range(len(requests)), key=lambda i: requests[i].arrival))
    served = [Served(r) for r in requests]
    waiting, running, clock = collections.deque(), [], 0.0

    def length(i):                  # the tokens request i holds in the cache
        return requests[i].prompt + served[i].tokens
    while arrivals or waiting or running:
        while arrivals and requests[arrivals[0]].arrival <= clock:
            waiting.append(arrivals.popleft())
        if not waiting and not running:
            clock = requests[arrivals[0]].arrival
            continue
        joining = []
        while waiting and pool.hold(waiting[0], length(waiting[0]) + 1):
            joining.append(waiting.popleft())
        if joining:
            clock += cost.step_seconds('prefill', len(joining), sum(map(length, joining)))
            stepped = joining
            running += joining
        else:
            for i in list(running):             # each needs room for its next token
                while i in running and not pool.hold(i, length(i) + 1):
                    victim = running.pop()      # the latest admitted gives its blocks back
                    pool.release(victim)
                    waiting.appendleft(victim)
                    preempted += 1
            clock += cost.step_seconds('decode', len(running), sum(map(length, running)))
            stepped = running
        for i in list(stepped):
            served[i].tokens += 1
            if served[i].first_token is None:
                served[i].first_token = clock
            if served[i].tokens == requests[i].output:
                served[i].done = clock
                running.remove(i)
                pool.release(i)
    return served, pool, preempted


# -- what a run gives ----------------------------------------------------------------------------

def summary(served):
    """Throughput (output tokens a second, from the first arrival to the last token) beside
    what was asked (the same tokens over the span of the arrivals: a server that keeps up
    serves about that much), and time to first token and end-to-end latency, mean, p50 and
    p99, in seconds."""
    arrivals = [s.request.arrival for s in served]
    tokens = sum(s.tokens for s in served)
    ttft = numpy.array([s.time_to_first_token for s in served])
    latency = numpy.array([s.latency for s in served])
    row = {'requests': len(served),
           'asked_tokens_per_s': tokens / max(max(arrivals) - min(arrivals), 1e-12),
           'tokens_per_s': tokens / (max(s.done for s in served) - min(arrivals))}
    for name, values in (('ttft', ttft), ('latency', latency)):
        row[f'{name}_mean'] = float(values.mean())
        row[f'{name}_p50'], row[f'{name}_p99'] = map(float, numpy.percentile(values, [50, 99]))
    return row


def solo_rate(cost, pairs):
    """Requests a second a server can take one at a time, at the mean (prompt, output) of
    `pairs`: the unit in which arrival rates are given, so that a sweep means the same on a
    fast and a slow machine."""
    prompt, output = numpy.mean(pairs, axis=0)
    decode = sum(cost.step_seconds('decode', 1, prompt + step) for step in range(1, round(output)))
    return 1 / (cost.step_seconds('prefill', 1, prompt) + decode)


def compare_policies(pairs, cost, loads, batch_size, seed=0):
    """Both policies on the same requests, one a (prompt, output) pair, at each load
    (arrival rate over `solo_rate`): one `summary` row for each, with its policy and rate.

    The two get the same KV memory: what static batching holds, a slot of the longest
    request for each of its `batch_size` sequences, is the iteration-level server's block
    budget. Static batching waits at most one prefill of a full batch for its batch to fill:
    waiting longer would cost more than the batch saves."""
    pairs = numpy.asarray(pairs)
    blocks = batch_size * blocks_for([pairs.sum(axis=1).max()])
    timeout = cost.step_seconds('prefill', batch_size, batch_size * pairs[:, 0].mean())
    rows = []
    for load in loads:
        rate = load * solo_rate(cost, pairs)
        requests = poisson_requests(rate, pairs, seed)
        served, pool, preempted = iteration_level(requests, cost, blocks)
        rows.append({'policy': 'iteration-level', 'load': load, 'rate': rate,
                     **summary(served), 'peak_blocks': pool.peak, 'preempted': preempted})
        rows.append({'policy': 'static', 'load': load, 'rate': rate,
                     **summary(static_batching(requests, cost, batch_size, timeout)),
                     'peak_blocks': blocks, 'preempted': 0})
    return rows
