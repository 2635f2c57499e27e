"""The dependency engine: the backend that runs what the Python frontend pushes.

As in MXNet's engine, it knows only *variables* (tags for pieces of data) and *operations*
(functions with the variables they read and write). Each variable keeps a queue of the
operations waiting for it; an operation runs once every variable has granted it access:
readers after the last writer, a writer after every earlier reader and writer (RAW, WAR,
WAW). Tracking is kept apart from the running policy (`workers.py`): ready operations go to
one worker thread per device and lane (compute, copy in, copy out). `D2LPERF_ENGINE=naive`
runs each operation at once on the caller's thread, for debugging. Both keep the interface of
`Engine` and run operations through `execute`, which keeps a failure on what the operation
writes and records what ran where and when (`start_recording`, the profiler's source).
Taught in "Asynchronous Computation" and "Automatic Parallelism".
"""
import collections
import itertools
import os
import threading
import time

from .workers import (COMPUTE, COPY_IN, COPY_OUT, PoliteLock, Workers, copy_lane,  # noqa: F401
                      run_now, synchronize)

_var_ids = itertools.count()


class OperationError(RuntimeError):
    """An operation raised; it surfaces at the first wait on what the operation writes."""

    def __init__(self, name, cause):
        super().__init__(f"operation '{name}' failed: {type(cause).__name__}: {cause}")
        self.op_name = name


class Var:
    """A tag for one piece of data, with the queue of operations waiting to use it."""

    __slots__ = ('id', 'pending', 'num_reading', 'writing', 'error', '__weakref__')

    def __init__(self):
        self.id = next(_var_ids)
        self.pending = collections.deque()   # (operation, is_write) not yet granted
        self.num_reading = 0                 # granted reads still running
        self.writing = False                 # a granted write still running
        self.error = None                    # the OperationError that failed it, for good

    def __repr__(self):
        return f'Var({self.id})'


class Operation:
    """A function with the variables it reads and writes; `waiting` counts missing grants.

    A variable may be read twice (x * x) but never both read and written by one operation:
    an in-place update lists its target among the writes only. While the engine records
    (`recording` is a list), the operation's `OpRecord` goes into it.
    """

    __slots__ = ('fn', 'name', 'device', 'lane', 'reads', 'writes', 'waiting', 'record')

    def __init__(self, fn, reads, writes, device, name, lane=COMPUTE, recording=None):
        self.fn, self.name, self.device, self.lane = fn, name, device, lane
        self.reads, self.writes = reads, writes
        self.waiting = len(reads) + len(writes) + 1      # +1 until push is done
        self.record = None
        if recording is not None and device is not None:
            self.record = OpRecord(self)
            recording.append(self.record)


# -- dependency tracking: pure bookkeeping on one variable, called under the engine lock --

def append_read(var, op):
    """Grant `op` a read of `var` now (True) or queue it behind a writer."""
    if not var.writing and not var.pending:
        var.num_reading += 1
        return True
    var.pending.append((op, False))
    return False


def append_write(var, op):
    """Grant `op` a write of `var` now (True) or queue it behind earlier readers and writers."""
    if not var.writing and not var.num_reading and not var.pending:
        var.writing = True
        return True
    var.pending.append((op, True))
    return False


def complete_read(var, granted):
    var.num_reading -= 1
    if not var.num_reading and var.pending:     # the head must be a writer
        var.writing = True
        granted.append(var.pending.popleft()[0])


def complete_write(var, granted):
    """The write is done: let the following readers in together, or else the next writer."""
    var.writing = False
    pending = var.pending
    while pending and not pending[0][1]:
        granted.append(pending.popleft()[0])
        var.num_reading += 1
    if not var.num_reading and pending:
        var.writing = True
        granted.append(pending.popleft()[0])


class OpRecord:
    """What a trace keeps of one operation, for dependency graphs and the profiler: `worker`
    names the thread (or GPU stream) that ran it, `start` and `end` are `time.perf_counter()`
    seconds; on a GPU, `events` are the CUDA events around its kernels (for device times)."""

    __slots__ = ('name', 'device', 'lane', 'reads', 'writes', 'worker', 'start', 'end', 'events')

    def __init__(self, op):
        self.name, self.device, self.lane = op.name, op.device, op.lane
        self.reads = [v.id for v in op.reads]
        self.writes = [v.id for v in op.writes]
        self.worker, self.start, self.end, self.events = None, None, None, None

    def __repr__(self):
        return f'OpRecord({self.name!r}, reads={self.reads}, writes={self.writes})'


def inherited_error(op):
    """The failure `op` inherits: from what it reads, or from what it updates, since a write
    into a failed array (`x += 1`, `x[0] = 5`, a view of it) builds on values nobody has."""
    for var in op.reads:
        if var.error is not None:
            return var.error
    for var in op.writes:
        if var.error is not None:
            return var.error
    return None


def execute(op, where, launch=None):
    """Run one operation as every engine does; return (its error or None, whether its own).

    An operation that inherits a failure does not run; `launch(op)` runs it where given (a GPU
    stream's way, the naive engine's), else `op.fn()`. The record gets `where` and the times."""
    record = op.record
    if record is not None:
        record.worker, record.start = where, time.perf_counter()
    error = inherited_error(op)
    own = error is None
    if own:
        try:
            if launch is None:
                op.fn()
            else:
                launch(op)
        except Exception as cause:                       # noqa: BLE001 - any failure travels on
            error = OperationError(op.name, cause)
    if record is not None:
        record.end = time.perf_counter()
    return error, own and error is not None


class Engine:
    """What the rest of the package may ask of an engine, whichever runs the operations:
    `push`, `wait_for(var)`, `wait_all()`, `stop()`; how many operations are `in_flight`, and
    at most how many may be (`max_in_flight`, None: no bound); the `recording` list."""

    in_flight, max_in_flight, recording = 0, None, None

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        raise NotImplementedError

    def wait_for(self, var):
        raise NotImplementedError

    def wait_all(self):
        raise NotImplementedError

    def stop(self):
        """Finish what was pushed and end the engine's threads, if it has any."""
        self.wait_all()

    def set_blas_division(self, enabled):
        """Divide BLAS threads among busy CPU devices; returns the old setting."""
        return False


class ThreadedEngine(Engine):
    """Track dependencies under one lock; run ready operations on per-device workers."""

    def __init__(self, max_in_flight=None):
        self.lock = PoliteLock()
        self.idle = threading.Condition(self.lock)      # wait_all sleeps here
        self.room = threading.Condition(self.lock)      # push sleeps here when the bound is hit
        self.workers = Workers(self.run)
        self.in_flight = 0
        self.limit = max_in_flight
        self.errors = []

    @property
    def max_in_flight(self):
        return self.limit

    @max_in_flight.setter
    def max_in_flight(self, limit):
        with self.lock:
            self.limit = limit
            self.room.notify_all()

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        """Queue `fn` to run on `device`'s `lane` once `reads` and `writes` allow it."""
        op = Operation(fn, reads, writes, device, name, lane, self.recording)
        with self.lock:
            if device is not None:
                while self.limit and self.in_flight >= self.limit:
                    self.room.wait()
                self.in_flight += 1
            granted = 1                                  # the guard: push itself is done
            for var in op.reads:
                granted += append_read(var, op)
            for var in op.writes:
                granted += append_write(var, op)
            op.waiting -= granted
            ready = not op.waiting
        if ready:
            self._dispatch(op)

    def _dispatch(self, op):
        if op.device is None:                            # a waiter: no worker needed
            op.fn()
            self.complete(op, None, False)
        else:
            self.workers.submit(op)

    def run(self, op, worker):
        """What a worker does with a ready operation: execute it, then let its followers in."""
        error, own = execute(op, worker.name, worker.launch)
        self.complete(op, error, own)

    def complete(self, op, error, own):
        """Release what `op` held; dispatch what that made ready; keep its own error for wait_all."""
        granted, ready = [], []
        with self.lock:
            for var in op.reads:
                complete_read(var, granted)
            for var in op.writes:
                var.error = error
                complete_write(var, granted)
            for other in granted:
                other.waiting -= 1
                if not other.waiting:
                    ready.append(other)
            if own:
                self.errors.append(error)
            if op.device is not None:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.notify_all()
                if self.limit and self.in_flight < self.limit:
                    self.room.notify()
        for other in ready:
            self._dispatch(other)

    def wait_for(self, var):
        with self.lock:
            busy = var.writing or var.pending
        if busy:
            done = threading.Lock()
            done.acquire()
            self.push(done.release, [var], [], None, 'wait_for')
            done.acquire()
        if var.error is not None:
            raise var.error
        synchronize(var)              # a GPU worker may have only launched the write

    def wait_all(self):
        with self.lock:
            while self.in_flight:
                self.idle.wait()
            errors, self.errors = self.errors, []
        self.workers.synchronize()
        if errors:
            raise errors[0]

    def stop(self):
        self.wait_all()
        self.workers.stop()

    def set_blas_division(self, enabled):
        """See `blas.SharedCores` for what was measured."""
        old = self.workers.cores.enable(enabled)
        for device in self.workers.cpu_compute_devices() if old != bool(enabled) else ():
            self.push(lambda: None, [], [], device, 'set_blas_division')   # idle: look again
        return old


class NaiveEngine(Engine):
    """Run every operation at once on the caller's thread: errors point at the line that failed."""

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        op = Operation(fn, reads, writes, device, name, lane, self.recording)
        error, _ = execute(op, 'caller', run_now)
        for var in writes:
            var.error = error
        if error is not None:
            raise error

    def wait_for(self, var):
        if var.error is not None:
            raise var.error

    def wait_all(self):
        pass


# -- the engine in use, and the module-level functions the rest of the package calls --

ENGINES = {'threaded': ThreadedEngine, 'naive': NaiveEngine}


def new_engine(kind, where=''):
    if kind not in ENGINES:
        raise ValueError(f'{where}{kind!r} is not an engine; use one of {sorted(ENGINES)}')
    return ENGINES[kind]()


def _engine_from_environment():
    engine = new_engine(os.environ.get('D2LPERF_ENGINE', 'threaded'), 'D2LPERF_ENGINE=')
    limit = os.environ.get('D2LPERF_MAX_IN_FLIGHT')
    if limit:
        engine.max_in_flight = int(limit)
    return engine


_engine = _engine_from_environment()


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
