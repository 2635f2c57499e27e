"""The dependency engine: the backend that runs what the Python frontend pushes.

Tracking (`tracking.py`: variables, operations, the rules that order them, failures) is kept
apart from the running policy (`engines.py`: the threaded and the naive engine; `workers.py`:
a thread per device and lane (`lanes.py`), helped by the threads that wait; `streams.py`: a
GPU lane's CUDA stream and the events that order the streams; `interrupts.py`: Ctrl-C held
back while a waiting thread helps; `pace.py`: a virtual device slowed down; `blas.py`: BLAS
threads that fit the cores other programs leave, shared by virtual CPU devices; `pieces.py`:
a large operation cut over those cores; `freed_memory.py`: freed memory kept for the next
step). The rest of the package calls
only the functions below, on the engine in use, which `current()` builds on first use:
importing the package starts no thread and changes no setting. Its one effect is to load
NumPy, with OpenBLAS's brief spin (`blas.spin_briefly`, which leaves `os.environ` as it found
it). `start_recording` keeps a record of every operation, the profiler's source. Taught in
"Asynchronous Computation" and "Automatic Parallelism".
"""
from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from . import blas
blas.spin_briefly()         # before the imports below load NumPy, and with it OpenBLAS
from .tracking import OperationError, OpRecord, Var                      # noqa: F401
from . import engines
from .engines import Engine, NaiveEngine, ThreadedEngine
from .lanes import COMPUTE, COPY_IN, COPY_OUT, copy_lane                 # noqa: F401
from .streams import gpu_lanes

if TYPE_CHECKING:
    from ..device import Device


# -- the engine in use, and the module-level functions the rest of the package calls --

ENGINES = {'threaded': ThreadedEngine, 'naive': NaiveEngine}


def new_engine(kind):
    check_kind(kind)
    return ENGINES[kind]()


def check_kind(kind, where=''):
    if kind not in ENGINES:
        raise ValueError(f'{where}{kind!r} is not an engine; use one of {sorted(ENGINES)}')


def kind_from_environment():
    """D2LPERF_ENGINE, checked as d2lperf is imported, so that a typo fails at once."""
    kind = os.environ.get('D2LPERF_ENGINE', 'threaded')
    check_kind(kind, 'D2LPERF_ENGINE=')
    return kind


_first_kind = kind_from_environment()
_engine = None                 # built by `current()`: importing d2lperf builds nothing
_building = threading.Lock()


def current():
    """The engine in use, built on first use (two threads' first pushes build one)."""
    global _engine
    if _engine is None:
        with _building:
            if _engine is None:
                _engine = new_engine(_first_kind)
    return _engine


def use(kind):
    """Switch to the 'threaded' or 'naive' engine, after finishing all pushed work."""
    global _engine
    engine = new_engine(kind)
    with _building:
        if _engine is not None:      # finished first: two engines never track one variable
            _engine.stop()
            engine.recording = _engine.recording
        _engine = engine
    return engine


def push(fn: Callable[[], None], reads: Sequence[Var], writes: Sequence[Var],
         device: Device | None, name: str, lane: str = COMPUTE) -> None:
    """Run `fn` on `device` once the variables it reads and writes are ready; returns at once.

    `lane` picks the device's worker: COMPUTE, or COPY_IN / COPY_OUT for moving data.
    """
    (_engine or current()).push(fn, reads, writes, device, name, lane)  # once built: no call


def push_overwrite(fn: Callable[[], None], reads: Sequence[Var], writes: Sequence[Var],
                   device: Device, name: str) -> None:
    """`push` an operation that replaces all of what it writes (`x[:] = y`, `set_data`): it
    builds on none of their values, so it runs even where they failed, and clears their
    failure once it has succeeded."""
    (_engine or current()).push(fn, reads, writes, device, name, COMPUTE, True)


def push_update(fn: Callable[[], None], reads: Sequence[Var], writes: Sequence[Var],
                device: Device, name: str) -> None:
    """`push` an optimizer's update of `writes` in place from `reads`: where a gradient it reads
    failed (one bad batch), it is skipped, so that the weights and the optimizer's state keep
    their values and the next step trains on; the failure still surfaces at the next wait."""
    (_engine or current()).push(fn, reads, writes, device, name, COMPUTE, False, True)


def push_short(fn: Callable[[], None], reads: Sequence[Var], writes: Sequence[Var],
               device: Device | None, name: str) -> None:
    """`push` an operation that takes less than a thread hand-off (a compiled forward at batch
    1): where it is ready and its device's compute lane idle, it runs on this thread at once,
    rather than wake the lane's thread for the caller to wait for it
    (`ThreadedEngine.push_short`). It runs holding the engine's lock, so `fn` must neither
    push nor wait."""
    (_engine or current()).push_short(fn, reads, writes, device, name)


def wait_for(var: Var) -> None:
    """Block until the last write of `var` pushed so far is done; raise its failure, if any.

    A write already done, on a CPU (the common case after a short push: `push_short`), leaves
    nothing to wait for, whichever the engine: no call into it."""
    if var.writer is not None or var.error is not None or gpu_lanes:
        (_engine or current()).wait_for(var)


def wait_all() -> None:
    (_engine or current()).wait_all()


def raise_known_failure(vars: Sequence[Var]) -> None:
    """Raise the failure of the first of `vars` that has failed by now, without waiting for
    the rest: a step that finds its gradient already failed raises at once, as PyTorch's does.
    A failure still on its way skips the update instead (`push_update`)."""
    for var in vars:
        if var.error is not None:
            raise engines.reported(var.error)


def wait_to_write(var):
    """Block until no operation reads or writes `var`, so that code outside the engine (an MPI
    receive) may fill in its buffer. The caller must not push operations on `var` meanwhile."""
    done = threading.Event()
    push(done.set, [], [var], None, 'wait_to_write')
    done.wait()


def in_flight():
    """How many pushed operations have not finished yet (0 for the naive engine)."""
    return current().in_flight


def set_max_in_flight(limit):
    """Block `push` while `limit` operations are unfinished (None: no bound); returns the old."""
    if limit is not None and limit < 1:
        raise ValueError(f'max_in_flight must be a positive count or None, not {limit!r}')
    engine = current()
    old, engine.max_in_flight = engine.max_in_flight, limit
    return old


def set_blas_division(enabled):
    """Divide BLAS threads among busy CPU devices (True) or not (False, the default); returns
    the old setting. See `blas.SharedCores` for what was measured."""
    return current().set_blas_division(enabled)


def set_helping(enabled):
    """Let a thread that waits for a result run the ready work it waits for itself (True, the
    default), or sleep until a worker has done it (False); returns the old setting. See
    `ThreadedEngine.run_lane_until_written` for the rule and why it is safe."""
    return current().set_helping(enabled)


def blas_thread_changes():
    """How often the engine has changed BLAS's thread count (to fit the free cores, or to
    divide them among devices): a change alters the last bits of some products, so two runs
    agree bit for bit only if neither changed it."""
    return current().blas_thread_changes()


def start_recording():
    """Keep an `OpRecord` of every operation pushed from now on; returns the list they go to.

    Costs one branch per operation while off. Records are complete after `stop_recording`;
    `profiler.profile()` is the context manager around the two."""
    records = []
    current().recording = records
    return records


def stop_recording():
    """Stop recording, wait for every recorded operation to finish, return the records."""
    engine = current()
    records, engine.recording = engine.recording, None
    engine.wait_all()
    return records if records is not None else []
