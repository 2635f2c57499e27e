"""Pipeline parallelism: a net's layers cut into stages on devices, fed micro-batches in the
order a schedule gives (`schedules.py`).

Part k of the p·v parts lives on stage k mod p (Megatron's layout: with v chunks, stage s
holds parts s, s + p, ...). Each part is a `Stage` (`stage.py`), built once from what the
caller gave for its stage: one device (a `Part`), or a group of t devices that split each of
its layers by tensor parallelism (`tensor.py`). A part computes a list of arrays, one a
device, and the pipeline calls only the Stage's methods; the schedule's actions name the part
they run on, and a step runs each stage's actions in their order, each as soon as what it
needs has run (`schedules.in_order`). A forward pass of a part runs under
`autograd.record` from a copy of the part before's output, taken as a leaf, so that the part's
backward stops at its own border and hands the gradient of that copy back to the part before.
The copies between stages are engine operations like any other, so the engine runs a part as
soon as its input has arrived. A stage holds a micro-batch's activations from its forward to
its backward: the schedule decides how many at once. Each micro-batch's backward adds its
gradients into the parameters' `.grad` (grad_req 'add' for the step): autograd accumulates,
and nothing else holds gradients. Taught in "Model Parallelism".
"""
from __future__ import annotations

import collections
import contextlib
from typing import Sequence

import numpy

from .. import autograd
from ..device import Device
from ..nn.block import Block
from ..nn.parameter import ParameterDict
from ..ops import differentiable
from ..np.multiarray import NDArray
from .schedules import check, in_order, schedule
from .stage import Stage, copy_onto, named
from .tensor import TensorParallelGPT


class Pipeline:
    """`net`'s children cut into `len(devices) · chunks` consecutive parts, trained by the
    schedule `schedule` ('gpipe', '1f1b' or 'interleaved'). `sizes` gives the number of layers
    in each part (default: as even as they come), for stages of unequal cost.

    `devices[s]` is stage s: a Device, whose parts' layers are moved there (the net itself is
    split), or a list of t Devices, whose parts are tensor-parallel copies of a GPT's layers
    (the net is left as it is; `sequence=True` splits their residual stream by tokens too,
    so that a stage sends each device's tokens only; `context` = c > 1 makes a group c·t
    devices that split the sequence too, and `data` = d > 1 d·c·t devices, d replicas of
    the group run in lockstep on 1/d of each micro-batch, over e of which `expert` = e > 1
    spreads the experts: `TensorParallelGPT`'s context, data and expert parallelism). `stages[k]` is the model's part k, a `Stage`, on devices[k mod p];
    the pipeline calls nothing else of it."""

    def __init__(self, net: Block, devices: Sequence[Device | Sequence[Device]],
                 schedule: str = '1f1b', chunks: int = 1, sizes: Sequence[int] | None = None,
                 algorithm: str = 'ring', sequence: bool = False, context: int = 1,
                 context_algorithm: str = 'ring', data: int = 1, expert: int = 1):
        self.devices, self.schedule, self.chunks = list(devices), schedule, chunks
        self.sent = collections.Counter()      # bytes each device sent to another stage
        p = len(self.devices)
        if p == 0:
            raise ValueError('a Pipeline needs at least one stage: devices is empty')
        check(schedule, p, p, chunks)
        spans = cut(len(net.children()), p * chunks, sizes)
        self.stages = build_stages(net, self.devices, spans, algorithm, sequence, context,
                                   context_algorithm, data, expert)

    def forward_backward(self, inputs: Sequence[NDArray], labels: Sequence[NDArray], loss):
        """Forward and backward of every micro-batch (`inputs[i]`, `labels[i]`), by the schedule;
        each parameter's `.grad` becomes the sum over the micro-batches (autograd adds them:
        grad_req 'add' for the step). Returns the losses (each summed over its micro-batch), on
        the last part's (first) device: with d replicas, d a micro-batch, each summed over its
        replica's share, micro-batch by micro-batch."""
        m, last = len(inputs), len(self.stages) - 1
        if m == 0 or len(labels) != m:
            raise ValueError(f'{m} micro-batches of inputs and {len(labels)} of labels: give '
                             'one label array an input, and at least one (no micro-batches, '
                             'no step)')
        plan = schedule(self.schedule, len(self.devices), m, self.chunks)
        outputs, borders, grads_in, losses = {}, {}, {}, [None] * m
        with accumulating(self.params(), self.own_devices()):
            for action in in_order(plan):
                k, mb, stage = action.stage, action.microbatch, self.stages[action.stage]
                if action.kind == 'F':
                    source = stage.inputs_of(inputs[mb]) if k == 0 else outputs[mb, k - 1]
                    borders[mb, k] = border = self.arrive(source, k, leaf=k > 0, count=k > 0)
                    with autograd.record():
                        outs = stage.forward(border, inputs[mb].shape)
                        if k == last:
                            outs = [loss(out, y.copyto(out.device)).sum() for out, y
                                    in zip(outs, stage.inputs_of(labels[mb]), strict=True)]
                            losses[mb] = stage.one_a_replica(outs)
                    outputs[mb, k] = outs
                else:
                    outs = outputs.pop((mb, k))
                    heads = None if k == last else \
                        self.arrive(grads_in.pop((mb, k + 1)), k, leaf=False)
                    stage.backward(outs, heads)
                    border = borders.pop((mb, k))
                    if k > 0:
                        grads_in[mb, k] = [x.grad for x in border]
        for stage in self.stages:
            stage.finish_gradients()
        return [replicas_loss for replicas in losses for replicas_loss in replicas]

    def arrive(self, arrays, k, leaf=True, count=True):
        """`arrays` copied to part k's devices, one each (an array given alone goes to all), as
        engine operations outside the tape; leaves with a gradient buffer where the part's
        backward must hand one back. What crosses between devices is added to `sent` (the
        micro-batches' inputs, from the host, are not: `count` False)."""
        devices = self.stages[k].devices
        arrays = arrays if isinstance(arrays, list) else [arrays] * len(devices)
        for x, device in zip(arrays, devices, strict=True):     # stages are groups alike
            if count and x.device != device:
                self.sent[x.device] += x.size * x.dtype.itemsize
        with autograd.pause():
            here = [x.copyto(device) if x.device != device else x.copy()
                    for x, device in zip(arrays, devices)]
        for x in here:
            if leaf and differentiable(x.dtype):
                x.attach_grad()
        return here

    def params(self):
        """Every part's parameters, in order."""
        return list(self.collect_params().values())

    def collect_params(self):
        """Every part's parameters by the net's names after their stage's
        (`stage1.rank0.3.mlp.dense1.weight`: stage 1, tensor rank 0, the net's unit 3)."""
        p = len(self.devices)
        return ParameterDict((f'stage{k % p}.{name}', param)
                             for k, stage in enumerate(self.stages)
                             for name, param in stage.collect_params().items())

    def own_devices(self):
        """The devices this pipeline's stages run on."""
        return {device for stage in self.stages for device in stage.devices}


def build_stages(net, devices, spans, algorithm, sequence, context=1, context_algorithm='ring',
                 data=1, expert=1):
    """Part k of `net` (its children `spans[k]`) as the Stage that stage k mod p runs: a
    `Part` on one Device, or a `TensorParallelGPT` on a group of Devices."""
    p = len(devices)
    if all(isinstance(stage, Device) for stage in devices):
        if context * data > 1:
            raise ValueError(f'context={context} and data={data} split a stage over its '
                             'devices: give each stage a list of devices (d·c·t), not one '
                             'Device')
        return [Part(net, devices[k % p], span) for k, span in enumerate(spans)]
    if all(isinstance(stage, (list, tuple)) for stage in devices):
        check_groups(devices)
        return [TensorParallelGPT(net, devices[k % p], algorithm, sequence, span, context,
                                  context_algorithm, data, expert)
                for k, span in enumerate(spans)]
    raise ValueError('each stage is a Device, or each is a list of Devices (a tensor-'
                     f'parallel group), not a mix: {devices}')


class Part(Stage):
    """Consecutive layers of `net` (its children `units`) on one device: a pipeline part of
    any net, moved there in place."""

    def __init__(self, net, device, units=slice(None)):
        self.net, self.layers, self.devices = net, net.children()[units], [device]
        for layer in self.layers:
            layer.reset_device(device)

    def __len__(self):
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def forward(self, xs, shape):
        """The layers in turn (one device: `shape` tells it nothing it does not see)."""
        x, = xs
        for layer in self.layers:
            x = layer(x)
        return [x]

    def backward(self, outs, heads=None):
        out, = outs
        out.backward(None if heads is None else heads[0])

    def collect_params(self):
        """Its parameters by the net's names (`3.mlp.dense1.weight`: the net's unit 3's)."""
        return named(self.net, self.layers)


def check_groups(stages):
    """Tensor-parallel stages of one size: stage k hands device i's activations to device i
    of stage k + 1, and its backward one gradient a device. Groups of 2 and 1 devices lost
    rank 1's gradient with no error."""
    sizes = [len(group) for group in stages]
    if min(sizes) < 1:
        raise ValueError(f'stage {sizes.index(0)} is an empty group: each tensor-parallel '
                         'stage needs at least one device')
    for k, size in enumerate(sizes):
        if size != sizes[0]:
            raise ValueError(f'a Pipeline needs tensor-parallel groups of one size: stage {k} '
                             f'has {size} device{"s" * (size != 1)}, stage 0 has {sizes[0]} '
                             f'(sizes {sizes}); give every stage the same number of devices')


@contextlib.contextmanager
def accumulating(params, devices):
    """The step's parameters' copies on `devices` (the pipeline's own) zeroed and added into (`autograd.adding`), so that each micro-batch's backward
    adds its gradient to `.grad`. No parameter changes its grad_req: a Ctrl-C anywhere in the
    step leaves none adding into the next. (One the user set to 'add' keeps adding over
    steps, until its zero_grad().)"""
    copies = [array for param in params if param.grad_req == 'write'
              for array in param.list_data() if array.device in devices]
    for array in copies:
        array.attach_grad()
    with autograd.adding(copies):
        yield

def cut(length, count, sizes=None):
    """`length` layers into `count` slices of consecutive layers, `sizes` long (default: as
    even as they come, the first one longer); a clear error where they do not split."""
    if sizes is None:
        if length < count:
            raise ValueError(f'{length} layers do not split into {count} parts (devices '
                             f'× chunks): use fewer devices or chunks, or a deeper net')
        sizes = [len(part) for part in numpy.array_split(numpy.arange(length), count)]
    sizes = list(sizes)
    if len(sizes) != count or sum(sizes) != length or min(sizes) < 1:
        raise ValueError(f'sizes {sizes} must give each of the {count} parts at least one of '
                         f'the {length} layers, all of them in all')
    bounds = numpy.cumsum([0] + sizes).tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
