"""Data, tensor and pipeline parallelism at once (Narayanan et al., 2021, "3D parallelism"),
with context parallelism inside: d·c·t·p devices as a grid, each of d replicas a pipeline of
p stages, each stage c·t devices that split its sequence (c) and its layers (t).

Megatron-LM orders the grid with t fastest, then c, d, and p: the t devices of a stage are
neighbours (one machine's NVLink carries tensor parallelism's four allreduces a layer), the
context ranks next (the ring passes keys and values every layer), a stage's d replicas then
(data parallelism sums gradients once a step), and the stages are farthest apart (a pipeline
sends one micro-batch's activations a boundary). The grid is one Pipeline whose stage s is
the group of all d·c·t devices of stage s: the replicas' programs run in lockstep in one
group (`TensorGroup`), each replica's on 1/d of every micro-batch, so that a collective may
join replicas (the experts' all-to-all). The d replicas are one model: each parameter of a
stage's rank is one Parameter with a copy on that rank's device in each replica, as a
data-parallel net's parameters are. After the step's micro-batches each parameter's gradient
is summed over its d copies, a device's gradients packed into one flat buffer
(`comm.FlatBufferSum`), as the data-parallel chapters' buckets are. A Trainer then only
updates (`update`: the gradients are summed). Taught in "Parallelism in Three Dimensions".
"""
from __future__ import annotations

import collections
import numbers
from typing import Sequence

from .. import comm, np
from ..device import Device
from ..nn.transformer import GPT
from ..np.multiarray import NDArray
from .pipeline import Pipeline


def parallel_gpt(net: GPT, devices: Sequence[Device], data: int = 1, tensor: int = 1,
                 pipeline: int = 1, schedule: str = '1f1b', chunks: int = 1,
                 algorithm: str = 'ring', sequence: bool = False, context: int = 1,
                 context_algorithm: str = 'ring', expert: int = 1) -> ParallelGPT:
    """A copy of the GPT `net` on `data · context · tensor · pipeline` devices (the net is
    left as it is), trained with `schedule` over its pipeline stages; `sequence=True` adds
    sequence parallelism to the tensor-parallel groups, `context` = c > 1 splits the
    sequence over c of them (`context_algorithm`: 'ring', 'all_gather' or 'ulysses'), and
    `expert` = e > 1 spreads a GPT's experts over e of the d·c ranks (Megatron's order
    tp-cp-ep-dp-pp: the expert groups are consecutive)."""
    return ParallelGPT(net, devices, data, tensor, pipeline, schedule, chunks, algorithm,
                       sequence, context, context_algorithm, expert)


class ParallelGPT:
    """One Pipeline (`pipeline`) whose stage s is the group of d·c·t devices `grid[s]`, run
    in lockstep; `grid[s][r][i]` is the device of stage s, replica r, program i of the
    replica (tensor rank i mod t of context rank i // t: Megatron's order, tp fastest, then
    cp, dp and pp)."""

    def __init__(self, net, devices, data=1, tensor=1, pipeline=1, schedule='1f1b', chunks=1,
                 algorithm='ring', sequence=False, context=1, context_algorithm='ring',
                 expert=1):
        devices = list(devices)
        sizes = (('data', data), ('tensor', tensor), ('pipeline', pipeline),
                 ('context', context))
        for name, size in sizes:
            at_least_one(name, size)
        group = context * tensor
        if len(devices) != data * group * pipeline:
            raise ValueError(f'{len(devices)} devices do not make a grid of '
                             + ' × '.join(f'{name} {size}' for name, size in sizes)
                             + f': give {data * group * pipeline} devices, or other sizes')
        self.data, self.tensor, self.pipeline, self.algorithm = data, tensor, pipeline, algorithm
        self.context = context
        self.grid = [[devices[(s * data + r) * group:(s * data + r + 1) * group]
                      for r in range(data)] for s in range(pipeline)]
        self.pipeline = Pipeline(net, [sum(self.grid[s], []) for s in range(pipeline)],
                                 schedule=schedule, chunks=chunks, algorithm=algorithm,
                                 sequence=sequence, context=context,
                                 context_algorithm=context_algorithm, data=data,
                                 expert=expert)
        summed = [p for stage in self.pipeline.stages for p in stage.summed_over_replicas()]
        self.groups, self.summed = sum_over_replicas(summed, data, algorithm)

    def forward_backward(self, tokens: NDArray, labels: NDArray, loss,
                         microbatches: int) -> list[NDArray]:
        """One step's forward and backward of the batch (`tokens`, `labels`): 1/d of it a
        replica, in `microbatches` micro-batches; then every gradient summed over the replicas.
        Returns the losses, each summed over its micro-batch, replica by replica. Then a
        Trainer's `update` (not `step`, which would sum them again) applies them."""
        at_least_one('microbatches', microbatches)
        batch = tokens.shape[0]
        if batch % (self.data * microbatches):
            raise ValueError(f'a batch of {batch} does not split into {self.data} replicas × '
                             f'{microbatches} micro-batches: use a batch that '
                             f'{self.data * microbatches} divides')
        xs, ys = (interleaved(array, self.data, microbatches) for array in (tokens, labels))
        losses = self.pipeline.forward_backward(xs, ys, loss)
        self.sum_gradients()
        return [losses[mb * self.data + r] for r in range(self.data)
                for mb in range(microbatches)]

    def sum_gradients(self):
        """Each gradient summed over its d copies, a group at a time: the parameters of one
        device of replica 0, their gradients there and in the other replicas packed into one
        flat buffer a device and allreduced (`comm.FlatBufferSum`, as DDP's buckets)."""
        for index, params in enumerate(self.groups):
            self.summed.sum(index, by_replica(params, lambda copy: copy.grad))

    def collect_params(self):
        """Every parameter once, by the net's name after its place in a replica's pipeline
        (`stage1.rank0.3.mlp.dense1.weight`), with a copy a replica: a Trainer updates each
        copy where it lives."""
        return self.pipeline.collect_params()


def sum_over_replicas(params, data, algorithm):
    """The trained parameters grouped by the device of their first copy (replica 0's), and
    the flat-buffer sum of each group over the `data` replicas, its buffers made once. None
    where there is one replica: nothing to sum."""
    if data == 1:
        return [], None
    on_device = collections.defaultdict(list)    # a device of replica 0 -> its parameters
    for param in params:
        if param.grad_req == 'write':
            on_device[param.list_device()[0]].append(param)
    groups = list(on_device.values())
    # counted as temporaries, as when each step made its own buffers: the calculator
    # (`predict.device_plan`) counts a device's gradients, not the buffers that sum them
    return groups, comm.FlatBufferSum([by_replica(params, lambda copy: copy)
                                       for params in groups], algorithm, kind='temporaries')


def by_replica(params, of):
    """`of(copy)` for each of `params`' copies, replica by replica: [replica][parameter]."""
    return [[of(copy) for copy in copies] for copies in zip(*(p.list_data() for p in params))]


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


def interleaved(array, data, microbatches):
    """The pipeline's micro-batches of a batch whose replica r trains on its r-th 1/d, in
    `microbatches` pieces: micro-batch j holds each replica's j-th piece, replica by replica."""
    pieces = split(array, data * microbatches)
    if data == 1:
        return pieces
    return [np.concatenate([pieces[r * microbatches + j] for r in range(data)])
            for j in range(microbatches)]
