"""The flat-buffer sum: a group of gradients summed over devices by one collective.

An allreduce pays its start-up cost (α) once however much it carries, so a group of gradients
goes as one message: each device packs its gradients of the group, one after the other, into a
flat buffer of its own, the buffers are allreduced, and the sums are unpacked into the
gradients. PyTorch's DDP does this a bucket at a time, Megatron-LM's DDP keeps its gradients in
such buffers. The buffers are allocated once, when the sum is made, and reused every step; a
group of one array needs none and is summed where it is. `Buckets` ("Data Parallelism at
Scale") and a 3D layout's replicas ("Parallelism in Three Dimensions") sum here.
"""
from __future__ import annotations

from typing import Sequence

from .. import engine, np
from ..device import label
from ..np.multiarray import NDArray
from .allreduce import allreduce


class FlatBufferSum:
    """Sums over devices of groups of arrays, each group through one flat buffer a device.

    `groups[i][d]` is device d's arrays of group i, or arrays of their shapes and dtypes (the
    weights whose gradients will be summed): the buffers are sized from them, once, and counted
    as `kind` in the memory ledger. `sum(i, arrays)` sums group i's `arrays[d]` (device d's, in
    the order of `groups[i][d]`) in place, with the allreduce `algorithm`.

    >>> on = lambda i, *values: d2l.np.array(values, device=d2l.cpu(i))
    >>> x = [[on(0, 1.0), on(0, 2.0, 3.0)], [on(1, 10.0), on(1, 20.0, 30.0)]]
    >>> summed = d2l.comm.FlatBufferSum([x])       # one group: two arrays on each device
    >>> summed.sum(0, x)
    >>> [a.asnumpy() for a in x[1]]
    [array([11.], dtype=float32), array([22., 33.], dtype=float32)]
    """

    def __init__(self, groups: Sequence[Sequence[Sequence[NDArray]]], algorithm: str = 'ring',
                 kind: str = 'gradients'):
        self.algorithm = algorithm
        self.buffers = [flat_buffers(group, kind) for group in groups]

    def sum(self, index: int, arrays: Sequence[Sequence[NDArray]]) -> None:
        """Group `index` summed over the devices: packed, allreduced, unpacked (each an engine
        operation, so the sum runs as soon as the arrays it reads are computed)."""
        buffers = self.buffers[index]
        if buffers is None:
            allreduce([group[0] for group in arrays], self.algorithm)
            return
        for buffer, group in zip(buffers, arrays, strict=True):
            pack(buffer, group, index)
        allreduce(buffers, self.algorithm)
        for buffer, group in zip(buffers, arrays):
            unpack(buffer, group, index)


def flat_buffers(group, kind):
    """One flat buffer a device, as long as its arrays of the group together (None for a group
    of one array a device)."""
    if len(group[0]) == 1:
        return None
    size = sum(array.size for array in group[0])
    return [label(np.zeros((size,), arrays[0].dtype, arrays[0].device), kind)
            for arrays in group]


def pack(buffer, arrays, index):
    """One engine operation: the arrays, one after the other, into the flat buffer."""
    def run():
        start = 0
        for array in arrays:
            buffer.data[start:start + array.size] = array.data.reshape(-1)
            start += array.size
    engine.push(run, [a.var for a in arrays], [buffer.var], buffer.device,
                f'flat sum {index} pack')


def unpack(buffer, arrays, index):
    """One engine operation: the summed flat buffer back into the arrays."""
    def run():
        start = 0
        for array in arrays:
            array.data[...] = buffer.data[start:start + array.size].reshape(array.shape)
            start += array.size
    engine.push(run, [buffer.var], [a.var for a in arrays], buffer.device,
                f'flat sum {index} unpack')
