"""One device's half of a reduce-scatter or an all-gather over owners' shards, as the device's
own process would run it.

In a sharded job (ZeRO, FSDP) device d owns chunk d of a flat array. In a real job every
device's process runs its half and the halves meet in one collective; here one process runs
the devices one after another (their backward passes too), so each device sends its chunks as
soon as its own backward has made them, and receives the owners' chunks when it needs them,
without waiting for the other devices. Each transfer is named as `allreduce` names its own
(a `TransferName` of algorithm 'direct'), so `bytes_sent` counts these bytes with theirs.
`data_parallel.units` (ZeRO's units, "Data Parallelism at Scale") moves its units so.
"""
from __future__ import annotations

from typing import Sequence

from .. import engine
from ..device import transfer
from ..np.multiarray import NDArray
from .allreduce import TransferName


def send_to_owners(flat: NDArray, shards: Sequence[NDArray], bounds: Sequence[tuple[int, int]],
                   combine: bool) -> None:
    """Device `flat.device`'s half of a reduce-scatter: chunk `bounds[o]` of `flat` to the
    owner o, which sets its shard to it, or adds it there (`combine`: someone sent first)."""
    for owner, (shard, (start, stop)) in enumerate(zip(shards, bounds)):
        move(flat, shard, start, stop, 'reduce-scatter', owner, combine, reverse=True)


def receive_from_owners(shards: Sequence[NDArray], flat: NDArray,
                        bounds: Sequence[tuple[int, int]]) -> None:
    """Device `flat.device`'s half of an all-gather: each owner o's shard into chunk
    `bounds[o]` of `flat`."""
    for owner, (shard, (start, stop)) in enumerate(zip(shards, bounds)):
        move(shard, flat, start, stop, 'all-gather', owner, combine=False)


def move(source, target, start, stop, phase, owner, combine, reverse=False):
    """Copy chunk [start, stop) between a flat array and a shard on another device (or the
    same one), and set or add it there: from the owner's shard into `target`'s chunk (a
    gather), or, `reverse`, from `source`'s chunk into the owner's shard (a reduction)."""
    if stop == start:
        return
    source_device, target_device = source.device, target.device
    nbytes = (stop - start) * source.dtype.itemsize
    read = (lambda: source.data[start:stop]) if reverse else (lambda: source.data)

    def write(data):
        if reverse:
            if combine:
                target.data += data
            else:
                target.data[...] = data
        else:
            target.data[start:stop] = data

    def named(action, nbytes=0):
        return TransferName('direct', phase, 1, owner, source_device, target_device, action,
                            nbytes)
    action = 'add' if combine else 'set'
    # a set of the whole shard builds on none of its values: a failure it held (a step that
    # failed) is gone with them
    push = engine.push_overwrite if reverse and not combine else engine.push
    if source_device == target_device:
        push(lambda: write(read()), [source.var], [target.var], target_device, named(action))
        return
    received, copy = {}, transfer(source_device, target_device)
    copy_device, lane = engine.copy_lane(source_device, target_device)
    buffer = engine.Var()

    def sent():
        received['data'] = copy(read())
    engine.push(sent, [source.var], [buffer], copy_device, named('send', nbytes), lane)
    push(lambda: write(received.pop('data')), [buffer], [target.var], target_device,
         named(action))
