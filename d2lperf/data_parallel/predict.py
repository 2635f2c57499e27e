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

STATE_VALUES = {'sgd': 0, 'momentum': 1, 'adam': 2}      # values the optimizer keeps a weight
STAGES = (0, 1, 2, 3)            # 0: plain data parallelism
SHARDED_FROM = {'optimizer state': 1, 'master weights': 1, 'gradients': 2, 'weights': 3}
ZERO_PAPER = {'weights': 2, 'gradients': 2, 'optimizer state': 12}     # ZeRO's Figure 1
# Megatron-LM's mixed precision: 16-bit weights, float32 gradients (summed over devices in
# float32), a float32 master copy and Adam's two values; 18 bytes, 6 + 12/d at stage 1 (its
# distributed optimizer)
MEGATRON = {'weights': 2, 'gradients': 4, 'master weights': 4, 'optimizer state': 8}


def model_states(num_params: float, devices: int, stage: int,
                 bytes_per_kind: dict[str, float] = ZERO_PAPER) -> dict[str, float]:
    """{kind: bytes one device holds, ..., 'total': their sum} at this ZeRO stage.

    Each kind is whole on every device below the stage that shards it (`SHARDED_FROM`) and
    divided by the devices from there on, ZeRO's and FSDP's rule alike."""
    check(devices, stage)
    unknown = set(bytes_per_kind) - set(SHARDED_FROM)
    if unknown:
        raise ValueError(f'the calculator knows the model-state kinds {sorted(SHARDED_FROM)}, '
                         f'not {sorted(unknown)} (activations depend on the batch: measure them)')
    held = {kind: num_params * size / (devices if stage >= SHARDED_FROM[kind] else 1)
            for kind, size in bytes_per_kind.items()}
    return {**held, 'total': sum(held.values())}


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


def transformer_layer_activations(seq, batch, hidden, heads, value_bytes=2, dropout=True):
    """Bytes one Transformer layer keeps for its backward pass (Korthikanti et al., 2022):
    with 16-bit values and one-byte dropout masks, s·b·h·(34 + 5·a·s/h).

    In values: 16·sbh of inputs the layer's products, norms and GELU need (the norms' inputs,
    Q, K, V, the inputs of both MLP products and of the output projection) and a·s²·b for the
    attention probabilities; dropout adds its output after the softmax (a·s²·b more values)
    and three masks of a byte a value (2·sbh + a·s²·b)."""
    sbh, as2b = seq * batch * hidden, heads * seq * seq * batch
    values = 16 * sbh + as2b + dropout * as2b
    return value_bytes * values + dropout * (2 * sbh + as2b)


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


def check(devices, stage, optimizer='sgd'):
    if stage not in STAGES:
        raise ValueError(f'a ZeRO stage is 0 (plain data parallelism), 1, 2 or 3, not {stage!r}')
    if optimizer not in STATE_VALUES:
        raise ValueError(f'unknown optimizer {optimizer!r}: the calculator knows '
                         f'{sorted(STATE_VALUES)}')
    if not (isinstance(devices, int) and devices >= 1):
        raise ValueError(f'devices is a whole number of at least 1, not {devices!r}')
