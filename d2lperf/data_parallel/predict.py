"""Predict, then run: what a data-parallel step holds a device, what it moves, how long it takes.

Memory is ZeRO's table for the model's states (Rajbhandari et al., 2020): with Ψ parameters of
b bytes and an optimizer that keeps K values a weight (SGD 0, SGD with momentum 1, Adam 2),
plain data parallelism holds Ψb of weights, Ψb of gradients and KΨb of state on every device;
stage 1 divides the state by the n devices, stage 2 the gradients too, stage 3 the weights too.
Activations are not in the table: they grow with the batch and the layers, not with Ψ.

Traffic and time come from the two halves of an allreduce priced in the α-β model of
`comm.cost`: every stage reduce-scatters the gradients and all-gathers the weights (an
allreduce is exactly these two), and ZeRO-3, which frees each layer's weights after its
forward pass, all-gathers them once more for backward (`gathers=2`). A step is its compute
plus whatever of its communication does not hide behind backward.
"""
from ..comm import cost

OPTIMIZER_STATES = {'sgd': 0, 'momentum': 1, 'adam': 2}
STAGES = (0, 1, 2, 3)            # 0: plain data parallelism


def memory_per_device(num_params, devices, stage, optimizer='adam', bytes_per_value=4):
    """{kind: bytes} of the model's states one device holds (the counter's kinds)."""
    check(devices, stage, optimizer)
    states = OPTIMIZER_STATES[optimizer]
    size = num_params * bytes_per_value
    return {'weights': size / devices if stage >= 3 else size,
            'gradients': size / devices if stage >= 2 else size,
            'optimizer state': states * size / (devices if stage >= 1 else 1)}


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
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f'unknown optimizer {optimizer!r}: the calculator knows '
                         f'{sorted(OPTIMIZER_STATES)}')
    if not (isinstance(devices, int) and devices >= 1):
        raise ValueError(f'devices is a whole number of at least 1, not {devices!r}')
