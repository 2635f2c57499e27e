"""One array sent from its device to another, on the tape: the point-to-point transfer that
context parallelism's ring passes keys and values by, and its all-gather too.

Its gradient comes back the way the array went, by a send the other way, so a backward pass
moves the bytes its forward did. Both are named by a `TransferName` (phase 'forward' or
'backward'), so a profile counts them (`transfers_in`, `bytes_sent`). Taught in "Long
Sequences and Many Experts".
"""
from __future__ import annotations

from .. import autograd
from ..device import Device
from ..np.multiarray import NDArray, copy_to_device
from .allreduce import TransferName


def send(x: NDArray, device: Device, algorithm: str, step: int, chunk: int,
         phase: str = 'forward') -> NDArray:
    """A copy of `x` on `device`: one engine operation on a copy lane, named by a
    `TransferName` with `algorithm`, `phase`, `step` and `chunk`. Recorded, its gradient is
    sent back to x's device in the backward pass.

    >>> x = d2l.np.array([1.0, 2.0])
    >>> y = d2l.comm.send(x, d2l.cpu(1), 'ring attention', step=1, chunk=0)
    >>> y
    array([1., 2.], dtype=float32, device=cpu(1))
    """
    if not isinstance(device, Device):
        raise TypeError(f'send needs a Device such as d2l.cpu(1), not {device!r}')
    nbytes = x.size * x.dtype.itemsize
    name = TransferName(algorithm, phase, step, chunk, x.device, device, 'send', nbytes)
    out = copy_to_device(x, device, name)

    def backward(grads):
        return [send(grads[0], x.device, algorithm, step, chunk, 'backward')]
    return autograd.collective([out], [x], backward)[0]
