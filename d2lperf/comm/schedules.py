"""Allreduce algorithms as schedules: which chunk moves from which party to which, step by step.

A schedule is plain data, computed from the number of devices alone: the executor
(`allreduce.py`) turns it into engine operations, the cost model (`cost.py`) prices it, and a
chapter can print it. Parties are numbered 0 .. n-1 (the devices, in the order given); the
'cpu' algorithm adds party n, the host. A transfer either *combines* the chunk it carries
with the target's (adds it, for a sum) or *overwrites* the target's chunk with it. Transfers
within one step do not depend on each other; a step depends on the steps before it.
Taught in "Parameter Servers"; the algorithms' costs are in Thakur, Rabenseifner and Gropp
(2005). `pairwise_exchange` is the all-to-all's schedule (`all_to_all.py`), from the same paper.
"""
import collections

Transfer = collections.namedtuple('Transfer', 'source target chunk combine')
Step = collections.namedtuple('Step', 'phase number transfers')
Schedule = collections.namedtuple('Schedule', 'algorithm parties chunks steps')


def chunk_bounds(size, count):
    """[(start, stop)] of `count` near-equal chunks of `size` elements; the first ones one longer.

    Sizes that do not divide, sizes smaller than `count`, and 0 all work: some chunks are empty.
    """
    each, extra = divmod(size, count)
    bounds, start = [], 0
    for i in range(count):
        stop = start + each + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def naive(n):
    """The MXNet edition's: each device sends its array to device 0, which sends the result back."""
    reduce = [Transfer(i, 0, 0, True) for i in range(1, n)]
    broadcast = [Transfer(0, i, 0, False) for i in range(1, n)]
    return Schedule('naive', n, 1, _nonempty([Step('reduce', 1, reduce),
                                               Step('broadcast', 1, broadcast)]))


def cpu(n):
    """Aggregate on the host (party n): the first array overwrites its buffer, the rest combine."""
    host = n
    reduce = [Transfer(i, host, 0, i > 0) for i in range(n)]
    broadcast = [Transfer(host, i, 0, False) for i in range(n)]
    return Schedule('cpu', n + 1, 1, [Step('reduce', 1, reduce), Step('broadcast', 1, broadcast)])


def split(n):
    """Device c aggregates chunk c, 1/n of the data, then sends it to everyone."""
    reduce = [Transfer(i, c, c, True) for c in range(n) for i in range(n) if i != c]
    broadcast = [Transfer(c, i, c, False) for c in range(n) for i in range(n) if i != c]
    return Schedule('split', n, n, _nonempty([Step('reduce', 1, reduce),
                                               Step('broadcast', 1, broadcast)]))


def tree(n):
    """Pairwise sums up a binary tree (round k: device i + 2^k into device i), then back down."""
    distances = []
    distance = 1
    while distance < n:
        distances.append(distance)
        distance *= 2
    reduce = [Step('reduce', k + 1, [Transfer(i + d, i, 0, True) for i in range(0, n - d, 2 * d)])
              for k, d in enumerate(distances)]
    broadcast = [Step('broadcast', k + 1,
                      [Transfer(i, i + d, 0, False) for i in range(0, n - d, 2 * d)])
                 for k, d in enumerate(reversed(distances))]
    return Schedule('tree', n, 1, reduce + broadcast)


def ring(n):
    """Reduce-scatter, then all-gather, around the ring 0 → 1 → ... → n-1 → 0, over n chunks.

    In step s of the reduce-scatter device i sends chunk i - s to device i + 1, which adds it
    to its own: after n - 1 steps device i holds the whole of chunk i + 1. The all-gather
    passes those finished chunks on around the ring in n - 1 more steps.
    """
    return Schedule('ring', n, n, _ring_steps(n, forward=True))


def ring2(n):
    """Two rings in opposite directions, each carrying half of the data (n chunks each)."""
    steps = [Step(a.phase, a.number, a.transfers + b.transfers)
             for a, b in zip(_ring_steps(n, True), _ring_steps(n, False, first_chunk=n))]
    return Schedule('ring2', n, 2 * n, steps)


def _ring_steps(n, forward, first_chunk=0):
    """The ring's steps; backwards is the forward ring seen in a mirror (party i as -i)."""
    way = 1 if forward else -1

    def transfer(i, chunk, combine):
        return Transfer(i, (i + way) % n, first_chunk + (way * chunk) % n, combine)
    reduce_scatter = [Step('reduce-scatter', s + 1,
                           [transfer(i, way * i - s, True) for i in range(n)])
                      for s in range(n - 1)]
    all_gather = [Step('all-gather', s + 1,
                       [transfer(i, way * i + 1 - s, False) for i in range(n)])
                  for s in range(n - 1)]
    return reduce_scatter + all_gather


def _nonempty(steps):
    return [step for step in steps if step.transfers]


SCHEDULES = {'naive': naive, 'cpu': cpu, 'split': split, 'tree': tree, 'ring': ring,
             'ring2': ring2}


# -- the two halves of an allreduce, apart: device i owns chunk i ------------------------------

def _ring_phase(n, phase, shift):
    """One phase of the ring with chunks renumbered so that device i owns chunk i: in step s,
    device i sends chunk i - s + shift to device i + 1."""
    combine = phase == 'reduce-scatter'
    return [Step(phase, s + 1, [Transfer(i, (i + 1) % n, (i - s + shift) % n, combine)
                                for i in range(n)])
            for s in range(n - 1)]


def ring_reduce_scatter(n):
    """The ring's first phase: after n - 1 steps device i holds the whole of chunk i."""
    return Schedule('ring', n, n, _ring_phase(n, 'reduce-scatter', -1))


def ring_all_gather(n):
    """The ring's second phase: device i's chunk i travels around to every device."""
    return Schedule('ring', n, n, _ring_phase(n, 'all-gather', 0))


def split_reduce_scatter(n):
    return Schedule('split', n, n, split(n).steps[:1])


def split_all_gather(n):
    return Schedule('split', n, n, split(n).steps[1:])


# Only the algorithms whose allreduce is a reduce-scatter followed by an all-gather: the others
# reduce everything on one device (naive, cpu) or up a tree, so their halves are no half.
HALVES = {'reduce-scatter': {'ring': ring_reduce_scatter, 'split': split_reduce_scatter},
          'all-gather': {'ring': ring_all_gather, 'split': split_all_gather}}


def half(collective, algorithm, n):
    """The schedule of `collective` ('reduce-scatter' or 'all-gather') by `algorithm` over `n`
    devices, device i owning chunk i."""
    algorithms = HALVES[collective]
    if algorithm not in algorithms:
        raise ValueError(f'{collective} runs by {sorted(algorithms)}, not {algorithm!r}: the '
                         'other allreduce algorithms reduce on one device, not in chunks')
    if not isinstance(n, int) or n < 1:
        raise ValueError(f'a {collective} needs at least one device, not {n!r}')
    return algorithms[algorithm](n) if n > 1 else Schedule(algorithm, 1, 1, [])


def schedule(algorithm, n):
    """The schedule of `algorithm` over `n` devices."""
    if algorithm not in SCHEDULES:
        raise ValueError(f'unknown allreduce algorithm {algorithm!r}; use one of '
                         f'{sorted(SCHEDULES)}')
    if not isinstance(n, int) or n < 1:
        raise ValueError(f'an allreduce needs at least one device, not {n!r}')
    return SCHEDULES[algorithm](n)


ALL_TO_ALL = 'all-to-all'


def pairwise_exchange(n):
    """The all-to-all's schedule: step s (1 .. n-1), device i sends chunk (i + s) mod n to
    device (i + s) mod n. A transfer's `chunk` is the sender's; the receiver puts it at the
    sender's place. Each device's own chunk stays where it is (no transfer)."""
    steps = [Step(ALL_TO_ALL, s, [Transfer(i, (i + s) % n, (i + s) % n, False)
                                  for i in range(n)]) for s in range(1, n)]
    return Schedule(ALL_TO_ALL, n, n, steps)
