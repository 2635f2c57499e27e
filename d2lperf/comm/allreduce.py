"""Allreduce: every device's array becomes the reduction (sum, max, min or product) of all of them.

`allreduce` runs a schedule (`schedules.py`) as engine operations: each chunk of each array
gets an engine variable of its own, so a chunk moves on as soon as it is ready while the rest
of the array is still being sent or added, and computation that does not touch the arrays
runs beside it. Copies go on the copy lanes, reductions on the receiving device's compute
lane. Every operation is named by a `TransferName`: text such as
`'ring reduce-scatter 1 chunk 0 cpu(1)->cpu(2) send 64 B'` for a trace, and the same facts as
fields, so that a profile of a real run shows the chunks moving and what they weigh
(`transfers_in`, `bytes_sent`) without reading anything back out of the text.
`allreduce_on_first` is the MXNet edition's simple version, from "Training on Multiple
GPUs". `reduce_scatter` and `all_gather` are an allreduce's two halves apart, as sharded
training uses them: device i owns chunk i, its shard. `all_gather` takes the shards and
returns whole arrays; `all_gather_into` fills whole arrays in place from their own chunks.
Taught in "Parameter Servers".

The examples run as tests (tests/test_doctests.py), with `d2l` imported.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy

from .. import engine
from ..device import Device, cpu, part_of_larger, transfer
from ..np.multiarray import NDArray
from .schedules import chunk_bounds, half, schedule

REDUCTIONS = {'sum': 'add', 'max': 'maximum', 'min': 'minimum', 'prod': 'multiply'}


def allreduce(arrays: Sequence[NDArray], algorithm: str = 'ring',
              op: str = 'sum') -> list[NDArray]:
    """Reduce the arrays (one a device, one shape and dtype) with `op`, in place; returns them.

    `algorithm`: 'naive' (on the first device), 'cpu' (on the host), 'split' (device i
    reduces 1/n of the data), 'tree', 'ring' or 'ring2' (two rings, opposite ways).

    >>> x = [d2l.np.array([1.0, 2.0]), d2l.np.array([3.0, 5.0], device=d2l.cpu(1))]
    >>> [a.asnumpy() for a in d2l.comm.allreduce(x)]
    [array([4., 7.], dtype=float32), array([4., 7.], dtype=float32)]
    >>> d2l.comm.allreduce(x, 'tree', op='max')[1]
    array([4., 7.], dtype=float32, device=cpu(1))
    """
    arrays = list(arrays)
    _check(arrays, op)
    return _run(arrays, schedule(algorithm, len(arrays)), algorithm, op)


def reduce_scatter(arrays: Sequence[NDArray], algorithm: str = 'ring',
                   op: str = 'sum') -> list[NDArray]:
    """The first half of an allreduce: split every array (one a device, one shape and dtype)
    into n chunks, and leave on device i the reduction of everyone's chunk i. In place;
    returns device i's chunk i, a flat view of its array (its shard). The rest of each array
    holds partial reductions. `algorithm`: 'ring' or 'split'.

    >>> x = [d2l.np.array([1.0, 2.0, 3.0, 4.0]), d2l.np.ones((4,), device=d2l.cpu(1))]
    >>> [shard.asnumpy() for shard in d2l.comm.reduce_scatter(x)]
    [array([2., 3.], dtype=float32), array([4., 5.], dtype=float32)]
    """
    arrays = list(arrays)
    _check(arrays, op, 'reduce_scatter')
    _run(arrays, half('reduce-scatter', algorithm, len(arrays)), algorithm, op)
    return _shards(arrays)


def all_gather(shards: Sequence[NDArray], algorithm: str = 'ring') -> list[NDArray]:
    """The second half of an allreduce: from the shards (one a device, device i's holding chunk
    i of `chunk_bounds(total, n)`, as `reduce_scatter` returns them), a new whole array on every
    device: the shards one after the other, flat (reshape it to the shape that was split).
    So `all_gather(reduce_scatter(arrays))` holds the allreduce of the arrays. The shards are
    left as they are. `algorithm`: 'ring' or 'split'.

    >>> shards = [d2l.np.array([1.0, 2.0]), d2l.np.array([3.0], device=d2l.cpu(1))]
    >>> [whole.asnumpy() for whole in d2l.comm.all_gather(shards)]
    [array([1., 2., 3.], dtype=float32), array([1., 2., 3.], dtype=float32)]
    """
    shards = list(shards)
    _check_shards(shards)
    total = sum(shard.size for shard in shards)
    wholes = [NDArray((total,), shards[0].dtype, shard.device) for shard in shards]
    for whole, shard, bounds in zip(wholes, shards, chunk_bounds(total, len(shards))):
        fill(whole, shard, *bounds)
    return all_gather_into(wholes, algorithm)


def all_gather_into(arrays: Sequence[NDArray], algorithm: str = 'ring') -> list[NDArray]:
    """`all_gather` in place, for arrays that are already whole: device i's chunk i of its
    array is copied into every other array, so that all become the concatenation of the
    chunks. Returns the arrays. ZeRO gathers its weights this way, into arrays it reuses.
    A shard (a view of part of a larger array) is refused: it has no room for the others.

    >>> x = [d2l.np.array([1.0, 0.0]), d2l.np.array([0.0, 9.0], device=d2l.cpu(1))]
    >>> [a.asnumpy() for a in d2l.comm.all_gather_into(x)]    # chunk i from device i
    [array([1., 9.], dtype=float32), array([1., 9.], dtype=float32)]
    """
    arrays = list(arrays)
    _check(arrays, 'sum', 'all_gather_into')
    for array in arrays:
        if part_of_larger(array):
            raise ValueError(
                f'all_gather_into fills whole arrays in place, but the array on {array.device} '
                f'is a view of part of a larger one ({array.size} of its elements): a shard, '
                'such as reduce_scatter returns. Gather shards with all_gather(shards), which '
                'returns new whole arrays')
    return _run(arrays, half('all-gather', algorithm, len(arrays)), algorithm, 'sum')


def fill(array: NDArray, shard: NDArray, start: int, stop: int) -> None:
    """One engine operation: new memory for `array`, its chunk [start, stop) from `shard`.

    The rest of the memory is left unset, for an all-gather to write."""
    def run():
        data = array.data = array.device.xp.empty(array.shape, array.dtype)
        data.reshape(-1)[start:stop] = shard.data.reshape(-1)
    engine.push(run, [shard.var], [array.var], array.device, 'gather chunk')


def _shards(arrays):
    bounds = chunk_bounds(arrays[0].size, len(arrays))
    return [array.reshape(-1)[start:stop] for array, (start, stop) in zip(arrays, bounds)]


def _run(arrays, plan, algorithm, op):
    """Push every transfer of `plan` as engine operations on the arrays' chunks."""
    parties = [Party(array, plan.chunks) for array in arrays]
    if plan.parties > len(arrays):
        host = NDArray(arrays[0].shape, arrays[0].dtype, cpu(0))
        parties.append(Party(host, plan.chunks))
    for party in parties:
        party.open(algorithm)
    for step in plan.steps:
        for move in step.transfers:
            _push_transfer(parties, move, step, algorithm, op)
    for party in parties:
        party.close(algorithm)
    return arrays


def allreduce_on_first(data: Sequence[NDArray]) -> Sequence[NDArray]:
    """Sum the arrays in `data` (one a device) and give every one of them the sum, in place.

    The simplest algorithm, the one the MXNet edition of Dive into Deep Learning uses: copy
    every array to the first one's device and add it there, then copy the sum back to each
    device. The first device does all the adding and its links carry all the traffic
    ("Parameter Servers" improves on it).
    """
    if not data:
        raise ValueError('allreduce needs at least one array')
    first = data[0]
    for other in data[1:]:
        if other.shape != first.shape:
            raise ValueError(f'allreduce sums arrays of one shape, got {first.shape} on '
                             f'{first.device} and {other.shape} on {other.device}')
    for other in data[1:]:
        first += other.copyto(first.device)
    for other in data[1:]:
        other[...] = first.copyto(other.device)
    return data


class Party:
    """One array taking part, seen as `chunks` flat pieces with an engine variable each.

    `open` claims the whole array (it waits for everything pushed on it before) and hands
    its chunks out; `close` hands the array back once every chunk is done, so what is pushed
    on the array afterwards waits for the whole allreduce.
    """

    def __init__(self, array, chunks):
        self.array, self.device = array, array.device
        self.bounds = chunk_bounds(array.size, chunks)
        self.vars = [engine.Var() for _ in range(chunks)]
        self.flat = None                  # the array's values as one flat array, once open

    def open(self, algorithm):
        def run():
            data = self.array.data
            if data is None:                                  # the host's buffer
                data = self.array.data = self.device.xp.empty(self.array.shape,
                                                              self.array.dtype)
            self.flat = data.reshape(-1) if data.flags.c_contiguous else data.ravel()
        engine.push(run, [], [self.array.var] + self.vars, self.device, f'{algorithm} open')

    def close(self, algorithm):
        def run():
            data = self.array.data
            if not data.flags.c_contiguous:                   # flat was a copy: write it back
                data[...] = self.flat.reshape(data.shape)
            self.flat = None
        # A write of the chunks: it waits for their last readers (the sends) as well.
        engine.push(run, [], [self.array.var] + self.vars, self.device, f'{algorithm} close')

    def chunk(self, index):
        start, stop = self.bounds[index]
        return self.flat[start:stop]


class TransferName(str):
    """The name of one allreduce operation, carrying what it moved as fields.

    As text (what a trace, a timeline or an error shows) it reads
    `'<algorithm> <phase> <step> chunk <c> <from>-><to> <action>[ <bytes> B]'`; as data it
    holds those facts in `fields`: algorithm, phase, step, chunk, source and target (the
    Devices), action ('send', 'set' or the reduction) and bytes (a send's; 0 for the others).
    `transfers_in` reads the fields, never the text, so renaming a device or a phase can change
    what a trace shows but never the counts."""

    def __new__(cls, algorithm: str, phase: str, step: int, chunk: int, source: Device,
                target: Device, action: str, bytes: int = 0) -> TransferName:
        text = f'{algorithm} {phase} {step} chunk {chunk} {source}->{target} {action}'
        name = super().__new__(cls, f'{text} {bytes} B' if bytes else text)
        name.fields = dict(algorithm=algorithm, phase=phase, step=step, chunk=chunk,
                           source=source, target=target, action=action, bytes=bytes)
        return name


def transfers_in(records: Iterable) -> list[dict]:
    """The allreduce operations among profiler records, as dicts: the fields of their
    `TransferName` (algorithm, phase, step, chunk, source, target, action, bytes), and the
    record's worker, start and end. Records of other operations are left out, whatever their
    names say."""
    return [dict(record.name.fields, worker=record.worker, start=record.start, end=record.end)
            for record in records if isinstance(record.name, TransferName)]


def bytes_sent(records: Iterable, phase: str | None = None) -> int:
    """Bytes the sends among `records` moved from one device to another (those of one `phase`,
    such as 'reduce-scatter', if given), read off the engine's records of what ran."""
    return sum(t['bytes'] for t in transfers_in(records)
               if t['action'] == 'send' and phase in (None, t['phase']))


def _push_transfer(parties, move, step, algorithm, op):
    """One transfer: a copy on the copy lane; a combine then reduces on the target's device.

    An overwrite into a CPU array copies straight into it. Into a GPU array, only the target's
    own compute stream writes: the engine orders GPU streams by what operations read.
    """
    source, target = parties[move.source], parties[move.target]
    chunk, var = move.chunk, target.vars[move.chunk]
    start, stop = source.bounds[chunk]

    def named(action, nbytes=0):
        return TransferName(algorithm, step.phase, step.number, chunk, source.device,
                            target.device, action, nbytes)
    sent = named('send', (stop - start) * source.array.dtype.itemsize)
    copy_device, lane = engine.copy_lane(source.device, target.device)
    if not move.combine and target.device.kind == 'cpu':
        def copy_into():
            _copy_into_host(target.chunk(chunk), source.chunk(chunk))
        engine.push(copy_into, [source.vars[chunk]], [var], copy_device, sent, lane)
        return
    received, move_data = {}, transfer(source.device, target.device)

    def send():
        received['data'] = move_data(source.chunk(chunk))
    buffer = engine.Var()
    engine.push(send, [source.vars[chunk]], [buffer], copy_device, sent, lane)
    reduction = getattr(target.device.xp, REDUCTIONS[op])

    def apply():
        mine = target.chunk(chunk)
        if move.combine:
            reduction(mine, received.pop('data'), out=mine)
        else:
            mine[...] = received.pop('data')
    engine.push(apply, [buffer], [var], target.device, named(op if move.combine else 'set'))


def _copy_into_host(target, source):
    if isinstance(source, numpy.ndarray):
        numpy.copyto(target, source)
    else:
        source.get(out=target)                     # from a GPU, on this lane's stream


def _check(arrays, op, what='allreduce'):
    if op not in REDUCTIONS:
        raise ValueError(f'unknown reduction op={op!r}; use one of {sorted(REDUCTIONS)}')
    check_one_shape_a_device(arrays, what, 'allreduce')
    if len({a.var for a in arrays}) < len(arrays):
        raise ValueError('allreduce got the same array (or views of one array) twice; give '
                         'it one distinct array per device')


def check_one_shape_a_device(arrays, what, collective):
    """A collective's arrays: at least one, all NDArrays, one shape and dtype."""
    if not arrays:
        raise ValueError(f'{what} needs at least one array, one a device')
    _check_ndarrays(arrays, collective)
    first = arrays[0]
    for other in arrays[1:]:
        if other.shape != first.shape or other.dtype != first.dtype:
            raise ValueError(
                f'{collective} needs one shape and dtype on every device, got {first.dtype}'
                f'{list(first.shape)} on {first.device} and {other.dtype}{list(other.shape)} on '
                f'{other.device}; reshape or astype them to match first')


def _check_ndarrays(arrays, what):
    if not all(isinstance(a, NDArray) for a in arrays):
        kinds = sorted({type(a).__name__ for a in arrays})
        raise TypeError(f'{what} takes d2lperf NDArrays, got {kinds}; wrap NumPy arrays '
                        'with d2l.np.array(x, device=...)')


def _check_shards(shards):
    """Shards as reduce_scatter gives them: flat, one dtype, shard i chunk i of the whole."""
    if not shards:
        raise ValueError('all_gather needs at least one shard, one a device')
    _check_ndarrays(shards, 'all_gather')
    for shard in shards:
        if shard.ndim != 1 or shard.dtype != shards[0].dtype:
            raise ValueError(
                f'all_gather takes shards, flat and of one dtype, as reduce_scatter returns '
                f'them; got {shard.dtype}{list(shard.shape)} on {shard.device} beside '
                f'{shards[0].dtype}{list(shards[0].shape)}. To fill whole arrays in place '
                'from their own chunks, call all_gather_into(arrays)')
    sizes = [s.size for s in shards]
    expected = [stop - start for start, stop in chunk_bounds(sum(sizes), len(shards))]
    if sizes != expected:
        raise ValueError(f'all_gather takes shard i as chunk i of comm.chunk_bounds(total, n), '
                         f'as reduce_scatter returns them: sizes {expected} for {len(shards)} '
                         f'shards of {sum(sizes)} elements, not {sizes}')
