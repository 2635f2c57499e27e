"""All-to-all: every device sends a different chunk of its array to every other device.

Device i's array is cut into n equal chunks along its first axis; chunk j goes to device j,
which stacks what it receives in the order of the senders. So result j is the concatenation
over i of chunk j of arrays[i]: a transpose of the (sender, receiver) grid. Expert parallelism
sends each token to the device of its expert this way, and brings it back by the same call,
since the transpose of the transpose is the grid again.

The schedule is the pairwise exchange (Thakur, Rabenseifner and Gropp, 2005): in step s,
device i sends its chunk (i + s) mod n to device (i + s) mod n, so that in every step each
device sends one chunk and receives one, and its links in and out are both busy. Each device
keeps its own chunk (a copy on its compute lane) and sends (n - 1)/n of its array.
Every operation is named by a `TransferName`, as the allreduce's are, so that `bytes_sent`
reads the traffic off a profile. Taught in "Long Sequences and Many Experts".

The examples run as tests (tests/test_doctests.py), with `d2l` imported.
"""
from __future__ import annotations

from typing import Sequence

import numpy

from .. import engine
from ..device import transfer
from ..np.multiarray import NDArray
from .allreduce import Party, TransferName, check_one_shape_a_device
from .schedules import ALL_TO_ALL as ALGORITHM, pairwise_exchange


def all_to_all(arrays: Sequence[NDArray]) -> list[NDArray]:
    """New arrays, one a device: result j holds chunk j of every array, sender by sender.

    The arrays (one a device, one shape and dtype) are split in n equal chunks on axis 0,
    which n must divide. The arrays themselves are left as they are.

    >>> x = [d2l.np.array([1.0, 2.0]), d2l.np.array([3.0, 4.0], device=d2l.cpu(1))]
    >>> [a.asnumpy() for a in d2l.comm.all_to_all(x)]
    [array([1., 3.], dtype=float32), array([2., 4.], dtype=float32)]
    """
    arrays = list(arrays)
    _check(arrays)
    n = len(arrays)
    outs = [NDArray(a.shape, a.dtype, a.device) for a in arrays]
    senders = [Party(a, n) for a in arrays]
    receivers = [Party(out, n) for out in outs]
    for party in senders + receivers:
        party.open(ALGORITHM)
    for i in range(n):
        _keep(senders[i], receivers[i], i)
    for step in pairwise_exchange(n).steps:
        for move in step.transfers:
            _send(senders[move.source], receivers[move.target], move, step)
    for party in senders + receivers:
        party.close(ALGORITHM)
    return outs


def bytes_each_sends(size_bytes: int, devices: int) -> int:
    """Bytes each device sends in an all-to-all of its `size_bytes` array: all of it but the
    chunk it keeps, (n - 1)/n of it."""
    return size_bytes * (devices - 1) // devices


def _keep(sender, receiver, index):
    """The chunk a device sends itself: a copy on its own compute lane, nothing on a link."""
    def run():
        receiver.chunk(index)[...] = sender.chunk(index)
    name = TransferName(ALGORITHM, ALGORITHM, 0, index, sender.device, receiver.device, 'keep')
    engine.push(run, [sender.vars[index]], [receiver.vars[index]], sender.device, name)


def _send(sender, receiver, move, step):
    """Chunk `move.chunk` of the sender into the receiver's place for the sender (its index).

    Into a CPU array the copy lane writes straight into it; into a GPU array only the
    receiver's compute stream writes (as in the allreduce), so the data lands in a buffer
    first."""
    chunk, place = move.chunk, move.source
    start, stop = sender.bounds[chunk]

    def named(action, nbytes=0):
        return TransferName(ALGORITHM, ALGORITHM, step.number, chunk, sender.device,
                            receiver.device, action, nbytes)
    sent = named('send', (stop - start) * sender.array.dtype.itemsize)
    copy_device, lane = engine.copy_lane(sender.device, receiver.device)
    target_var = receiver.vars[place]
    if receiver.device.kind == 'cpu':
        def copy_into():
            source, target = sender.chunk(chunk), receiver.chunk(place)
            if isinstance(source, numpy.ndarray):
                numpy.copyto(target, source)
            else:
                source.get(out=target)
        engine.push(copy_into, [sender.vars[chunk]], [target_var], copy_device, sent, lane)
        return
    received, move_data = {}, transfer(sender.device, receiver.device)

    def send():
        received['data'] = move_data(sender.chunk(chunk))

    def place_it():
        receiver.chunk(place)[...] = received.pop('data')
    buffer = engine.Var()
    engine.push(send, [sender.vars[chunk]], [buffer], copy_device, sent, lane)
    engine.push(place_it, [buffer], [target_var], receiver.device, named('set'))


def _check(arrays):
    check_one_shape_a_device(arrays, 'all_to_all', 'all_to_all')
    first, n = arrays[0], len(arrays)
    if first.ndim == 0 or first.shape[0] % n:
        raise ValueError(f'all_to_all splits each array in {n} equal chunks on axis 0, but '
                         f'its shape is {list(first.shape)}: pad the first axis to a multiple '
                         f'of {n}')
    if len({a.device for a in arrays}) < n:
        raise ValueError('all_to_all takes one array a device, each on a different device; '
                         f'got devices {[str(a.device) for a in arrays]}')
