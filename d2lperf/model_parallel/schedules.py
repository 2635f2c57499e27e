"""Pipeline schedules as data: in which order each stage runs its micro-batches' passes.

A model cut into p stages, one a device, runs m micro-batches through them. A schedule says,
for each stage, its ordered actions: `Action(kind, microbatch, chunk, stage)`, kind 'F'
(forward) or 'B' (backward), on the model's part `stage` (the virtual stage s + chunk·p of
Megatron's layout, as PyTorch's pipelining numbers its stages). It is plain data, computed from
p, m and the chunks v alone, as `comm/schedules.py` is for allreduce: an executor runs it,
`simulate` times it, a chapter prints and draws it. Three schedules:

* 'gpipe' (Huang et al., 2019): every forward, then every backward. A stage holds the
  activations of all m micro-batches at once.
* '1f1b' (PipeDream-Flush, Narayanan et al., 2021): after p - s - 1 forwards of warm-up, stage
  s alternates one forward and one backward, so it holds at most p - s micro-batches. The same
  bubble as GPipe: (p - 1) / (m + p - 1) of the time, when every pass takes as long.
* 'interleaved' (Narayanan et al., 2021, Megatron-LM): each device holds v chunks of the model
  (virtual stages s, s + p, s + 2p, ...), and runs 1F1B over its chunks in groups of p
  micro-batches. The bubble shrinks by v: (p - 1) / (v · m) of the ideal time, for v times
  as many transfers between devices.
"""
import collections

Action = collections.namedtuple('Action', 'kind microbatch chunk stage')
SCHEDULES = ('gpipe', '1f1b', 'interleaved')


def schedule(name, stages, microbatches, chunks=1):
    """[[Action, ...] for each stage]: the order in which each stage runs its passes."""
    check(name, stages, microbatches, chunks)
    if name == 'gpipe':
        return [gpipe(stage, microbatches) for stage in range(stages)]
    if name == '1f1b':
        return [one_f_one_b(stage, stages, microbatches) for stage in range(stages)]
    return [interleaved(stage, stages, microbatches, chunks) for stage in range(stages)]


def gpipe(s, m):
    return [Action('F', i, 0, s) for i in range(m)] + [Action('B', i, 0, s) for i in range(m)]


def one_f_one_b(s, p, m):
    """Warm up with the forwards the later stages need before the first backward comes back,
    then one forward, one backward, and drain the backwards left."""
    warmup = min(p - s - 1, m)
    actions = [Action('F', i, 0, s) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action('F', warmup + i, 0, s), Action('B', i, 0, s)]
    return actions + [Action('B', i, 0, s) for i in range(m - warmup, m)]


def interleaved(s, p, m, v):
    """Megatron's interleaved 1F1B: the k-th forward of a device runs micro-batch
    (k // pv)·p + k % p on chunk (k // p) % v; backwards go through the chunks the other way."""
    total = m * v

    def action(kind, k):
        chunk = (k % (p * v)) // p
        chunk = chunk if kind == 'F' else v - 1 - chunk
        return Action(kind, (k // (p * v)) * p + k % p, chunk, virtual_stage(s, chunk, p))
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    actions = [action('F', k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [action('F', warmup + k), action('B', k)]
    return actions + [action('B', k) for k in range(total - warmup, total)]


def check(name, stages, microbatches, chunks):
    if name not in SCHEDULES:
        raise ValueError(f'unknown schedule {name!r}: choose one of {SCHEDULES}')
    for what, value in (('stages', stages), ('microbatches', microbatches), ('chunks', chunks)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f'{what} is a whole number of at least 1, not {value!r}')
    if name != 'interleaved' and chunks != 1:
        raise ValueError(f"{name} runs one chunk a stage, not {chunks}: use 'interleaved' for "
                         'more')
    if name == 'interleaved' and microbatches % stages:
        raise ValueError(f'interleaving runs the micro-batches in groups of one a stage: '
                         f'{microbatches} micro-batches do not divide among {stages} stages; '
                         f'use a multiple of {stages}')


# -- what a schedule implies, before anything runs ------------------------------------------

def virtual_stage(stage, chunk, stages):
    """Chunk c of device s holds the model's part s + c·p (Megatron's layout)."""
    return stage + chunk * stages


def in_order(plan):
    """Every action of the plan, one at a time, in an order an executor can run them: in
    rounds, each stage running its next action where what that action needs ran in an earlier
    round. So micro-batches enter as a wavefront: stage 0 starts the second while stage 1
    takes the first, and the engine's queue for each device fills in the order the devices can
    work through it. Each stage keeps its own order; what runs between the stages follows from
    the dependencies alone, and no timing decides it."""
    last = max(a.stage for actions in plan for a in actions)
    done, position = set(), [0] * len(plan)
    while any(k < len(actions) for k, actions in zip(position, plan)):
        ready = [s for s, actions in enumerate(plan) if position[s] < len(actions)
                 and all(need in done for need in needs(actions[position[s]], last))]
        if not ready:
            raise ValueError('this schedule deadlocks: an action waits for one that comes '
                             'after it on its own stage')
        for s in ready:
            action = plan[s][position[s]]
            yield action
            done.add((action.kind, action.microbatch, action.stage))
            position[s] += 1


def simulate(plan, forward=1.0, backward=2.0):
    """When each action starts and ends if every forward takes `forward` and every backward
    `backward` (per chunk), and nothing else costs time: {stage: [(Action, start, end)]}.

    A forward waits for the same micro-batch's forward on the virtual stage before it; a
    backward for its backward on the virtual stage after it (the last one, for its own
    forward); every action for the one before it on its device."""
    p = len(plan)
    last = max(a.stage for actions in plan for a in actions)
    done, timeline, clock = {}, {s: [] for s in range(p)}, [0.0] * p
    for action in in_order(plan):
        s = action.stage % p
        start = max(clock[s], dependency_end(action, last, done))
        end = start + (forward if action.kind == 'F' else backward)
        done[action.kind, action.microbatch, action.stage] = end
        timeline[s].append((action, start, end))
        clock[s] = end
    return timeline


def needs(action, last):
    """The (kind, micro-batch, stage) passes `action` waits for: a forward, the forward on the
    part before; a backward, its own forward and the backward on the part after (the last
    part's, its forward only). `last` is the last part's index."""
    mb, k = action.microbatch, action.stage
    if action.kind == 'F':
        return [('F', mb, k - 1)] if k > 0 else []
    return [('F', mb, k)] + ([('B', mb, k + 1)] if k < last else [])


def dependency_end(action, last, done):
    """When what `action` waits for ended: None if it has not run yet."""
    ends = [done.get(key) for key in needs(action, last)]
    return None if None in ends else max(ends, default=0.0)


def bubble(timeline):
    """(idle time over the whole, idle time over the ideal): the pipeline's bubble both ways,
    the first as GPipe's (p - 1)/(m + p - 1), the second as Megatron's (p - 1)/(v·m)."""
    makespan = max(end for actions in timeline.values() for _, _, end in actions)
    busy = sum(end - start for actions in timeline.values() for _, start, end in actions)
    idle = len(timeline) * makespan - busy
    return idle / (len(timeline) * makespan), idle / busy


def held_microbatches(actions):
    """The most micro-batches (chunk passes) a stage holds the activations of at once: those
    whose forward has run and whose backward has not."""
    held = peak = 0
    for action in actions:
        held += 1 if action.kind == 'F' else -1
        peak = max(peak, held)
    return peak
