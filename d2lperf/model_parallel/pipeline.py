"""Pipeline parallelism: a net's layers cut into stages on devices, fed micro-batches in the
order a schedule gives (`schedules.py`).

Part k of the p·v parts lives on device k mod p (Megatron's layout: with v chunks, device s
holds parts s, s + p, ...). A forward pass of a part runs under `autograd.record` from a copy of
the part before's output, taken as a leaf, so that the part's backward stops at its own border
and hands the gradient of that copy back to the part before. The copies between devices are
engine operations like any other, so the engine runs a part as soon as its input has arrived.
A stage holds a micro-batch's activations from its forward to its backward: the schedule
decides how many at once. Taught in "Model Parallelism".
"""
from __future__ import annotations

from typing import Sequence

import numpy

from .. import autograd
from ..device import Device
from ..nn.block import Block
from ..np.multiarray import NDArray
from .schedules import schedule, simulate


class Pipeline:
    """`net`'s children cut into `len(devices) · chunks` consecutive parts, each part's
    parameters moved to its device, trained by the schedule `name` ('gpipe', '1f1b' or
    'interleaved'). `sizes` gives the number of layers in each part (default: as even as
    they come), for stages of unequal cost."""

    def __init__(self, net: Block, devices: Sequence[Device], name: str = '1f1b',
                 chunks: int = 1, sizes: Sequence[int] | None = None):
        self.devices, self.name, self.chunks = list(devices), name, chunks
        self.parts = cut(net.children(), len(self.devices) * chunks, sizes)
        for k, part in enumerate(self.parts):
            for layer in part:
                layer.reset_device(self.device_of(k))

    def device_of(self, part):
        return self.devices[part % len(self.devices)]

    def order(self, microbatches):
        """Every (stage, action) of the schedule, in an order that meets every dependency: by
        when the schedule's own simulation starts it."""
        plan = schedule(self.name, len(self.devices), microbatches, self.chunks)
        timeline = simulate(plan)
        return sorted(((start, stage, action) for stage, actions in timeline.items()
                       for action, start, _ in actions), key=lambda row: row[:2])

    def forward_backward(self, inputs: Sequence[NDArray], labels: Sequence[NDArray], loss):
        """Forward and backward of every micro-batch (`inputs[i]`, `labels[i]`), by the schedule;
        each parameter's `.grad` becomes the sum over the micro-batches. Returns the losses
        (each summed over its micro-batch), on the last part's device."""
        m, p = len(inputs), len(self.devices)
        outputs, borders, grads_in, losses = {}, {}, {}, [None] * m
        totals = {}
        for _, stage, action in self.order(m):
            part = stage + action.chunk * p
            if action.kind == 'F':
                source = inputs[action.microbatch] if part == 0 else \
                    outputs[action.microbatch, part - 1]
                border = self.arrive(source, part)
                borders[action.microbatch, part] = border
                with autograd.record():
                    out = self.run(part, border)
                    if part == len(self.parts) - 1:
                        out = loss(out, labels[action.microbatch].copyto(out.device)).sum()
                        losses[action.microbatch] = out
                outputs[action.microbatch, part] = out
            else:
                out = outputs.pop((action.microbatch, part))
                head = None if part == len(self.parts) - 1 else \
                    self.arrive(grads_in.pop((action.microbatch, part + 1)), part, leaf=False)
                out.backward(head)
                self.add_gradients(part, totals)
                border = borders.pop((action.microbatch, part))
                if part > 0:
                    grads_in[action.microbatch, part] = border.grad
        for param, total in totals.items():
            param.data().grad = total
        return losses

    def arrive(self, array, part, leaf=True):
        """`array` copied to part's device (an engine operation), outside the tape; a leaf
        with a gradient buffer where the part's backward must hand one back."""
        with autograd.pause():
            here = array.copyto(self.device_of(part)) if array.device != \
                self.device_of(part) else array.copy()
        if leaf and part > 0 and here.dtype.kind == 'f':
            here.attach_grad()
        return here

    def run(self, part, x):
        for layer in self.parts[part]:
            x = layer(x)
        return x

    def add_gradients(self, part, totals):
        """Each parameter's gradient of this micro-batch, added to the step's."""
        for layer in self.parts[part]:
            for param in layer.collect_params().values():
                if param.grad_req != 'write':
                    continue
                grad = param.data().grad
                totals[param] = grad if param not in totals else totals[param] + grad


def cut(layers, count, sizes=None):
    """`layers` into `count` consecutive parts of `sizes` layers (default: as even as they
    come, the first parts one longer); a clear error where they do not split."""
    if sizes is None:
        if len(layers) < count:
            raise ValueError(f'{len(layers)} layers do not split into {count} parts (devices '
                             f'× chunks): use fewer devices or chunks, or a deeper net')
        sizes = [len(part) for part in numpy.array_split(numpy.arange(len(layers)), count)]
    sizes = list(sizes)
    if len(sizes) != count or sum(sizes) != len(layers) or min(sizes) < 1:
        raise ValueError(f'sizes {sizes} must give each of the {count} parts at least one of '
                         f'the {len(layers)} layers, all of them in all')
    bounds = numpy.cumsum([0] + sizes)
    return [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
