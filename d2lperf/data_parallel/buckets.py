"""Gradient buckets: sum the gradients a bucket at a time, each as soon as backward fills it.

One allreduce a parameter pays a message's start-up cost (α) per parameter; one allreduce of
everything waits for the whole backward pass before it starts. PyTorch's DDP (Li et al., VLDB
2020) and Horovod's tensor fusion sit between the two: parameters are grouped, in the order
backward completes their gradients (the reverse of the forward order), into buckets of about
`cap_bytes`; when a bucket's last gradient is pushed, its gradients are packed into one flat
buffer a device, the buffers are allreduced, and the sums unpacked into the gradients, while
backward goes on with the layers below. A cap smaller than any parameter gives one parameter
a bucket; an infinite cap gives one bucket. `overlap=False` waits for the whole backward pass
before summing anything, the step of frameworks without an asynchronous engine.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from .. import autograd, comm, engine
from ..nn.parameter import Parameter
from ..np.multiarray import NDArray
from .overlap import backward_all, backward_reporting, one_loss_a_device
from .updates import apply_updates, check_devices, copies_of, create_optimizer, trained


def plan_buckets(params, cap_bytes):
    """The parameters grouped into buckets, in reverse order: each bucket takes parameters until
    it holds at least `cap_bytes` (the last may hold less). A list of lists of parameters."""
    if not (isinstance(cap_bytes, (int, float)) and cap_bytes > 0):
        raise ValueError(f'a bucket size is a number of bytes above 0 (math.inf for one bucket), '
                         f'not {cap_bytes!r}')
    buckets, current, held = [], [], 0
    for param in reversed(list(params)):
        current.append(param)
        held += nbytes(param)
        if held >= cap_bytes:
            buckets.append(current)
            current, held = [], 0
    return buckets + [current] * bool(current)


def nbytes(param):
    weight = param.list_data()[0]
    return weight.size * weight.dtype.itemsize


class Buckets:
    """Data-parallel training whose gradient sums go a bucket at a time.

    `params`: `net.collect_params()`, initialized on the devices that compute (one copy each).
    `step(forward, batch_size)` runs `forward()` (which returns one loss a device) under
    `autograd.record`, backpropagates, sums, and updates every copy alike, as the Trainer does.
    """

    def __init__(self, params: dict | Sequence[Parameter], optimizer: str = 'sgd',
                 optimizer_params: dict | None = None, cap_bytes: float = math.inf,
                 overlap: bool = True, algorithm: str = 'ring'):
        self.names, self.params = trained(params)
        self.devices = check_devices(self.params)
        self.buckets = plan_buckets(self.params, cap_bytes)
        self.overlap = overlap
        self.optimizer = create_optimizer(optimizer, optimizer_params)
        self.scale = self.optimizer.rescale_grad       # the user's; step(b) scales by scale / b
        bucket_of = {id(param): i for i, bucket in enumerate(self.buckets) for param in bucket}
        self.bucket_of = [bucket_of[id(param)] for param in self.params]
        # one flat buffer a device for each bucket of several parameters, made once
        self.summed = comm.FlatBufferSum([[[p.list_data()[d] for p in bucket]
                                           for d in range(len(self.devices))]
                                          for bucket in self.buckets], algorithm)

    def step(self, forward: Callable[[], Sequence[NDArray]], batch_size: int) -> None:
        with autograd.record():
            losses = list(forward())
        self.backward(losses)
        self.update(batch_size)

    def backward(self, losses):
        """Backpropagate every device's loss and sum the gradients, bucket by bucket."""
        one_loss_a_device(losses, self.devices)
        if not self.overlap:
            backward_all(losses, self.params)
            engine.wait_all()                # nothing is summed before backward has finished
            for index in range(len(self.buckets)):
                self.sum_bucket(index)
            return
        missing = [len(bucket) for bucket in self.buckets]

        def ready(index):                    # every device's gradient of a parameter pushed
            bucket = self.bucket_of[index]
            missing[bucket] -= 1
            if missing[bucket] == 0:
                self.sum_bucket(bucket)
        backward_reporting(losses, self.params, ready)

    def sum_bucket(self, index):
        """Sum one bucket's gradients over the devices: packed into a flat buffer a device,
        allreduced and unpacked (`comm.FlatBufferSum`); a bucket of one is summed in place."""
        bucket = self.buckets[index]
        self.summed.sum(index, [[p.list_grad()[d] for p in bucket]
                                for d in range(len(self.devices))])

    def update(self, batch_size):
        apply_updates(self.optimizer, self.scale, batch_size, copies_of(self.params))

    def weights(self):
        """{name: NumPy array}: the first device's copy of every weight (all copies agree)."""
        return {name: p.list_data()[0].asnumpy() for name, p in zip(self.names, self.params)}

