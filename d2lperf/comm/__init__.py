"""Communication between devices: splitting a minibatch among them, and allreduce across them.

    split       `split_and_load` and `split_batch`: one slice of a minibatch a device; and
                `get_params`: a copy of the parameters a device, for training by hand.
    schedules   the allreduce algorithms as data: which chunk goes where, step by step, and
                their two halves apart (reduce-scatter, all-gather).
    allreduce   a schedule run as engine operations, in place, with any of four reductions;
                reduce_scatter and all_gather, the halves that sharded training uses; every
                operation named by a TransferName, whose fields a profile's reader counts.
    flat_sum    `FlatBufferSum`: a group of gradients summed by one allreduce, packed into a
                flat buffer a device that is allocated once; buckets and 3D layouts sum so.
    device_halves
                one device's half of a reduce-scatter or an all-gather over owners' shards,
                as its own process would run it: ZeRO's units move so.
    all_to_all  every device a different chunk to every other (expert parallelism's
                dispatch), by the pairwise exchange, its operations named as the allreduce's.
    send        one array from one device to another, its gradient sent back in backward:
                the point-to-point transfer context parallelism's ring is made of.
    cost        what each algorithm costs on a topology, in the α-β model.
    replay      an allreduce replayed from the profiler's records: each chunk's contents
                after every step, and when each transfer ran, drawn.

Data parallelism ("Training on Multiple GPUs") needs the first and the third; "Parameter
Servers" compares the algorithms, measured and modelled.
"""
from .split import get_params, slice_sizes, split_and_load, split_batch
from .schedules import chunk_bounds, half, schedule
from .allreduce import (REDUCTIONS, TransferName, all_gather, all_gather_into, allreduce,
                        allreduce_on_first, bytes_sent, fill, reduce_scatter, transfers_in)
from .flat_sum import FlatBufferSum
from .all_to_all import all_to_all
from .send import send
from .device_halves import receive_from_owners, send_to_owners
from .replay import chunk_states, draw_chunk_states, draw_transfers
from . import cost

__all__ = ['get_params', 'slice_sizes', 'split_and_load', 'split_batch', 'chunk_bounds', 'half', 'schedule',
           'REDUCTIONS', 'allreduce', 'allreduce_on_first', 'reduce_scatter', 'all_gather',
           'all_gather_into', 'fill', 'TransferName', 'transfers_in', 'bytes_sent',
           'FlatBufferSum', 'send_to_owners', 'receive_from_owners', 'chunk_states',
           'draw_chunk_states', 'draw_transfers', 'cost', 'send']
__all__ += ['all_to_all']
