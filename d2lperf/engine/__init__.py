"""The dependency engine: the backend that runs what the Python frontend pushes.

Tracking (`tracking.py`: variables, operations, the rules that order them, failures) is kept
apart from the running policy (`engines.py`: the threaded and the naive engine; `workers.py`:
a thread per device and lane, CUDA streams; `blas.py`: BLAS threads that fit the cores other
programs leave, shared by virtual CPU devices; `host_memory.py`: freed memory kept for the next
step). The rest of the package calls
only the functions below, on the engine in use. `start_recording` keeps a record of every
operation, the profiler's source. Taught in "Asynchronous Computation" and "Automatic
Parallelism".
"""
import os
import threading

from . import blas
blas.spin_briefly()         # before the imports below load NumPy, and with it OpenBLAS
from .tracking import OperationError, OpRecord, Var                      # noqa: F401
from .engines import Engine, NaiveEngine, ThreadedEngine
from .workers import COMPUTE, COPY_IN, COPY_OUT, copy_lane               # noqa: F401


# -- the engine in use, and the module-level functions the rest of the package calls --

ENGINES = {'threaded': ThreadedEngine, 'naive': NaiveEngine}


def new_engine(kind, where=''):
    if kind not in ENGINES:
        raise ValueError(f'{where}{kind!r} is not an engine; use one of {sorted(ENGINES)}')
    return ENGINES[kind]()


_engine = new_engine(os.environ.get('D2LPERF_ENGINE', 'threaded'), 'D2LPERF_ENGINE=')


def current():
    """The engine in use."""
    return _engine


def use(kind):
    """Switch to the 'threaded' or 'naive' engine, after finishing all pushed work."""
    global _engine
    engine = new_engine(kind)
    _engine.stop()
    engine.recording, _engine = _engine.recording, engine
    return _engine


def push(fn, reads, writes, device, name, lane=COMPUTE):
    """Run `fn` on `device` once the variables it reads and writes are ready; returns at once.

    `lane` picks the device's worker: COMPUTE, or COPY_IN / COPY_OUT for moving data.
    """
    _engine.push(fn, reads, writes, device, name, lane)


def wait_for(var):
    _engine.wait_for(var)


def wait_all():
    _engine.wait_all()


def wait_to_write(var):
    """Block until no operation reads or writes `var`, so that code outside the engine (an MPI
    receive) may fill in its buffer. The caller must not push operations on `var` meanwhile."""
    done = threading.Event()
    push(done.set, [], [var], None, 'wait_to_write')
    done.wait()


def in_flight():
    """How many pushed operations have not finished yet (0 for the naive engine)."""
    return _engine.in_flight


def set_max_in_flight(limit):
    """Block `push` while `limit` operations are unfinished (None: no bound); returns the old."""
    if limit is not None and limit < 1:
        raise ValueError(f'max_in_flight must be a positive count or None, not {limit!r}')
    old, _engine.max_in_flight = _engine.max_in_flight, limit
    return old


def set_blas_division(enabled):
    """Divide BLAS threads among busy CPU devices (True) or not (False, the default); returns
    the old setting. See `blas.SharedCores` for what was measured."""
    return _engine.set_blas_division(enabled)


def set_helping(enabled):
    """Let a thread that waits for a result run the ready work it waits for itself (True, the
    default), or sleep until a worker has done it (False); returns the old setting. See
    `ThreadedEngine.help` for the rule and why it is safe."""
    return _engine.set_helping(enabled)


def blas_thread_changes():
    """How often the engine has changed BLAS's thread count (to fit the free cores, or to
    divide them among devices): a change alters the last bits of some products, so two runs
    agree bit for bit only if neither changed it."""
    return _engine.workers.cores.changes if hasattr(_engine, 'workers') else 0


def start_recording():
    """Keep an `OpRecord` of every operation pushed from now on; returns the list they go to.

    Costs one branch per operation while off. Records are complete after `stop_recording`;
    `profiler.profile()` is the context manager around the two."""
    records = []
    _engine.recording = records
    return records


def stop_recording():
    """Stop recording, wait for every recorded operation to finish, return the records."""
    records, _engine.recording = _engine.recording, None
    _engine.wait_all()
    return records if records is not None else []
