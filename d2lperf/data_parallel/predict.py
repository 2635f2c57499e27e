"""Predict, then run: what a data-parallel step holds a device, what it moves, how long it takes.

Memory is ZeRO's table for the model's states (Rajbhandari et al., 2020). Each parameter holds
some bytes of each kind: its weight, its gradient and, inside the optimizer, its state (SGD 0
values a weight, SGD with momentum 1, Adam 2) and, under mixed precision, a float32 master copy
of the weight. The paper's mixed-precision Adam holds 2 + 2 + 12 = 16 bytes a parameter (its
K = 12 counts the master copy with Adam's two values). Plain data parallelism (stage 0) keeps
every kind whole on every device; stage 1 divides the optimizer's kinds by the n devices, stage
2 the gradients too, stage 3 the weights too: what a device holds between steps. During a
step it also holds whole the units it works on (`peak_states`), which sharding does not divide.
Activations are not in the table: they grow with the batch and the layers, not with the
parameters.

Traffic and time come from the two halves of an allreduce priced in the α-β model of
`comm.cost`: every stage reduce-scatters the gradients and all-gathers the weights (an
allreduce is exactly these two), and ZeRO-3, which frees each layer's weights after its
forward pass, all-gathers them once more for backward (`gathers=2`). A step is its compute
plus whatever of its communication does not hide behind backward.
"""
from __future__ import annotations

from ..comm import cost
# the bytes a model's states and a Transformer layer's activations take live below both
# calculators, data_parallel's and model_parallel's: their names stay reachable here
from ..nn.footprint import (MEGATRON, SHARDED_FROM, STAGES, STATE_VALUES, ZERO_PAPER,  # noqa
                            check, model_states, transformer_layer_activations)

def bytes_per_kind(optimizer: str = 'adam', weight_bytes: int = 4,
                   multi_precision: bool = False) -> dict[str, int]:
    """Bytes a parameter holds of each kind: weight and gradient in the weight's dtype; the
    optimizer's values (and, with `multi_precision`, the master copy) in float32."""
    check(1, 0, optimizer)
    state_bytes = 4 if multi_precision else weight_bytes
    kinds = {'weights': weight_bytes, 'gradients': weight_bytes,
             'optimizer state': STATE_VALUES[optimizer] * state_bytes}
    return {**kinds, 'master weights': 4} if multi_precision else kinds


def memory_per_device(num_params, devices, stage, optimizer='adam', bytes_per_value=4):
    """{kind: bytes} of the model's states one device holds, every value `bytes_per_value`."""
    held = model_states(num_params, devices, stage, bytes_per_kind(optimizer, bytes_per_value))
    del held['total']
    return held


def peak_states(units, devices, stage, optimizer='adam', prefetch=1, value_bytes=4):
    """{kind: its own peak in bytes during a step on the first device, ..., 'total': their sum,
    which bounds the states at the step's peak}, every value `value_bytes`, as the naive engine
    frees them; `units` is each unit's parameter sizes (in values), in forward order.

    Between steps ZeRO divides each kind by the n devices (`model_states`). During a step a
    device holds whole what it works on: without sharding, the largest parameter's gradient
    twice, as backward made it and in its own array; at stage 3 the unit gathered and the
    `prefetch` after it; at stages 2 and 3 the unit being sent twice, as backward made it and
    packed flat; at stage 1 each unit packed from the moment backward reached it. These terms
    grow with the largest unit, not with n: where one unit is most of the model, sharding more
    lowers nothing at the peak, and each stage's peak can exceed the one before."""
    check(devices, stage, optimizer)
    sizes = [value_bytes * sum(unit) for unit in units]
    whole, largest = sum(sizes), max(sizes)
    shard = value_bytes * sum(-(-sum(unit) // devices) for unit in units)   # the first chunks
    state = STATE_VALUES[optimizer]
    if stage == 0:
        peaks = {'weights': whole, 'gradients': whole + value_bytes * max(map(max, units)),
                 'optimizer state': state * whole}
    else:
        window = max(sum(sizes[i:i + prefetch + 1]) for i in range(len(sizes)))
        packed = max(sum(sizes[i:]) + sizes[i] for i in range(len(sizes)))
        peaks = {'weights': shard + window if stage == 3 else whole,
                 'gradients': packed if stage == 1 else shard + 2 * largest,
                 'optimizer state': state * shard}
    return {**peaks, 'total': sum(peaks.values())}


def halves(stage, gathers=1):
    """The collectives a step runs on all of the gradients or weights, in order."""
    check(2, stage)
    return ['all-gather'] * (gathers - 1) * (stage == 3) + ['reduce-scatter', 'all-gather']


def bytes_sent_per_device(size_bytes, devices, stage, gathers=1):
    """Bytes each device sends in a step: (n - 1)/n of all the data for each half, by the ring
    or the split (so 2Ψb for an allreduce, 3Ψb for ZeRO-3 with two gathers)."""
    return len(halves(stage, gathers)) * size_bytes * (devices - 1) / devices


def communication_seconds(bucket_bytes, devices, stage, alpha, beta, gathers=1):
    """Seconds the ring's halves take for buckets of these sizes, one after the other, on
    `devices` that each send and receive at 1/β bytes/s with α seconds a message."""
    topology = cost.Topology('this machine', devices, 1 / beta, 1 / beta, None, alpha)
    return sum(cost.half_time(half, 'ring', size, topology)
               for size in bucket_bytes for half in halves(stage, gathers))


def overlapped_end(ready, seconds):
    """When the last of a queue of collectives ends: the k-th starts when its bucket is ready
    (`ready[k]`, seconds into the step) and the one before it has ended, and takes
    `seconds[k]`. With the backward pass's end, this says what overlap can hide."""
    end = 0.0
    for start, duration in zip(ready, seconds):
        end = max(end, start) + duration
    return end
