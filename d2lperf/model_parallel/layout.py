"""Data, tensor and pipeline parallelism at once (Narayanan et al., 2021, "3D parallelism"):
d·t·p devices as a grid, each of d replicas a pipeline of p stages, each stage t devices that
split its layers by tensor parallelism.

Megatron-LM orders the grid with t fastest, then d, then p: the t devices of a stage are
neighbours (one machine's NVLink carries tensor parallelism's four allreduces a layer), a
stage's d replicas come next (data parallelism sums gradients once a step), and the stages
are farthest apart (a pipeline sends one micro-batch's activations a boundary). Each replica
trains on 1/d of the batch; after every replica's pipeline has run its micro-batches, each
parameter's gradient is summed over the d copies of it, a device's gradients packed into one
flat buffer (`comm.FlatBufferSum`), as the data-parallel chapters' buckets are.
Taught in "Parallelism in Three Dimensions".
"""
from __future__ import annotations

import collections
import numbers
from typing import Sequence

from .. import comm
from ..device import Device
from ..nn.transformer import GPT
from ..np.multiarray import NDArray
from .pipeline import Pipeline


def parallel_gpt(net: GPT, devices: Sequence[Device], data: int = 1, tensor: int = 1,
                 pipeline: int = 1, schedule: str = '1f1b', chunks: int = 1,
                 algorithm: str = 'ring', sequence: bool = False) -> ParallelGPT:
    """A copy of the GPT `net` on `data · tensor · pipeline` devices (the net is left as it
    is), trained with `schedule` over its pipeline stages; `sequence=True` adds sequence
    parallelism to the tensor-parallel groups."""
    return ParallelGPT(net, devices, data, tensor, pipeline, schedule, chunks, algorithm,
                       sequence)


class ParallelGPT:
    """`replicas[r]` is replica r's Pipeline; `grid[s][r][i]` the device of stage s, replica r,
    tensor rank i."""

    def __init__(self, net, devices, data=1, tensor=1, pipeline=1, schedule='1f1b', chunks=1,
                 algorithm='ring', sequence=False):
        devices = list(devices)
        for name, size in (('data', data), ('tensor', tensor), ('pipeline', pipeline)):
            at_least_one(name, size)
        if len(devices) != data * tensor * pipeline:
            raise ValueError(f'{len(devices)} devices do not make a grid of data {data} × '
                             f'tensor {tensor} × pipeline {pipeline}: give '
                             f'{data * tensor * pipeline} devices, or other sizes')
        self.data, self.tensor, self.pipeline, self.algorithm = data, tensor, pipeline, algorithm
        self.grid = [[devices[(s * data + r) * tensor:(s * data + r + 1) * tensor]
                      for r in range(data)] for s in range(pipeline)]
        self.replicas = [Pipeline(net, [self.grid[s][r] for s in range(pipeline)],
                                  schedule=schedule, chunks=chunks, algorithm=algorithm,
                                  sequence=sequence)
                         for r in range(data)]
        self.groups, self.summed = sum_over_replicas(self.replicas, algorithm)

    def forward_backward(self, tokens: NDArray, labels: NDArray, loss,
                         microbatches: int) -> list[NDArray]:
        """One step's forward and backward of the batch (`tokens`, `labels`): 1/d of it a
        replica, in `microbatches` micro-batches; then every gradient summed over the replicas.
        Returns the losses, each summed over its micro-batch, replica by replica."""
        at_least_one('microbatches', microbatches)
        batch = tokens.shape[0]
        if batch % (self.data * microbatches):
            raise ValueError(f'a batch of {batch} does not split into {self.data} replicas × '
                             f'{microbatches} micro-batches: use a batch that '
                             f'{self.data * microbatches} divides')
        pieces = self.data * microbatches
        xs, ys = split(tokens, pieces), split(labels, pieces)
        losses = []
        for r, replica in enumerate(self.replicas):
            mine = slice(r * microbatches, (r + 1) * microbatches)
            losses += replica.forward_backward(xs[mine], ys[mine], loss)
        self.sum_gradients()
        return losses

    def sum_gradients(self):
        """Each gradient summed over its d copies, a group at a time: the gradients that one
        device of replica 0 holds, and their copies in the other replicas, packed into one
        flat buffer a device and allreduced (`comm.FlatBufferSum`, as DDP's buckets)."""
        for index, copies in enumerate(self.groups):
            self.summed.sum(index, [[param.grad() for param in params] for params in copies])

    def collect_params(self):
        """Every device's parameters, each where it lives (a Trainer updates each there)."""
        return {f'replica{r}.{k}': param for r, replica in enumerate(self.replicas)
                for k, param in enumerate(replica.params())}


def sum_over_replicas(replicas, algorithm):
    """The trained parameters grouped by the device that holds them in replica 0 (`group[r]`:
    replica r's copies of the group, in one order), and the flat-buffer sum of each group over
    the replicas, its buffers made once. None where there is one replica: nothing to sum."""
    if len(replicas) == 1:
        return [], None
    per_replica = [[p for p in replica.params() if p.grad_req == 'write']
                   for replica in replicas]
    on_device = collections.defaultdict(list)    # a device of replica 0 -> its params' k
    for k, param in enumerate(per_replica[0]):
        on_device[param.data().device].append(k)
    groups = [[[params[k] for k in ks] for params in per_replica] for ks in on_device.values()]
    # counted as temporaries, as when each step made its own buffers: the calculator
    # (`predict.device_plan`) counts a device's gradients, not the buffers that sum them
    return groups, comm.FlatBufferSum([[[p.data() for p in params] for params in copies]
                                       for copies in groups], algorithm, kind='temporaries')


def at_least_one(name, size):
    """Refuse a size of the grid (or a count of micro-batches) that is not a whole number of
    at least 1: a 0 divided the batch by zero."""
    if not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f'{name}={size!r}: each size of the layout (data, tensor, pipeline) '
                         'and the number of micro-batches is a whole number of at least 1')


def split(array, pieces):
    """`array` cut into `pieces` equal slices along the batch (views: no copy)."""
    each = array.shape[0] // pieces
    return [array[i * each:(i + 1) * each] for i in range(pieces)]
