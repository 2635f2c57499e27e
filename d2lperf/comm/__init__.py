"""Communication between devices: splitting a minibatch among them, and allreduce across them.

    split       `split_and_load` and `split_batch`: one slice of a minibatch a device.
    schedules   the allreduce algorithms as data: which chunk goes where, step by step.
    allreduce   a schedule run as engine operations, in place, with any of four reductions.
    cost        what each algorithm costs on a topology, in the α-β model.
    replay      an allreduce replayed from the profiler's records: each chunk's contents
                after every step, and when each transfer ran, drawn.

Data parallelism ("Training on Multiple GPUs") needs the first and the third; "Parameter
Servers" compares the algorithms, measured and modelled.
"""
from .split import slice_sizes, split_and_load, split_batch
from .schedules import chunk_bounds, schedule
from .allreduce import REDUCTIONS, allreduce, allreduce_on_first, transfers_in
from .replay import chunk_states, draw_chunk_states, draw_transfers
from . import cost

__all__ = ['slice_sizes', 'split_and_load', 'split_batch', 'chunk_bounds', 'schedule',
           'REDUCTIONS', 'allreduce', 'allreduce_on_first', 'transfers_in', 'chunk_states',
           'draw_chunk_states', 'draw_transfers', 'cost']
