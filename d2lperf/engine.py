"""The dependency engine: the backend that runs what the Python frontend pushes.

As in MXNet's engine, it knows only *variables* (tags for pieces of data) and *operations*
(functions with the variables they read and write). Each variable keeps a queue of the
operations waiting for it; an operation runs once every variable has granted it access:
readers after the last writer, a writer after every earlier reader and writer (RAW, WAR,
WAW). Tracking is kept apart from the running policy (`workers.py`): ready operations go to
one worker thread per device and lane (compute, copy in, copy out). `D2LPERF_ENGINE=naive`
runs each operation at once on the caller's thread, for debugging. `trace()` (and the
profiler built on it) records what ran where and when. Taught in "Asynchronous Computation"
and "Automatic Parallelism".
"""
import collections
import contextlib
import itertools
import os
import threading
import time

from .device import set_running_device
from .workers import (COMPUTE, COPY_IN, COPY_OUT, PoliteLock, SharedCores, Worker,  # noqa: F401
                      copy_lane)

_var_ids = itertools.count()


class OperationError(RuntimeError):
    """An operation raised; it surfaces at the first wait on what the operation writes."""

    def __init__(self, name, cause):
        super().__init__(f"operation '{name}' failed: {type(cause).__name__}: {cause}")
        self.op_name = name


class Var:
    """A tag for one piece of data, with the queue of operations waiting to use it."""

    __slots__ = ('id', 'pending', 'num_reading', 'writing', 'error', 'event', '__weakref__')

    def __init__(self):
        self.id = next(_var_ids)
        self.pending = collections.deque()   # (operation, is_write) not yet granted
        self.num_reading = 0                 # granted reads still running
        self.writing = False                 # a granted write still running
        self.error = None                    # the OperationError that failed it, for good
        self.event = None                    # on a GPU: CUDA event of the last write

    def __repr__(self):
        return f'Var({self.id})'


class Operation:
    """A function with the variables it reads and writes; `waiting` counts missing grants.

    A variable may be read twice (x * x) but never both read and written by one operation:
    an in-place update lists its target among the writes only.
    """

    __slots__ = ('fn', 'name', 'device', 'lane', 'reads', 'writes', 'waiting', 'record')

    def __init__(self, fn, reads, writes, device, name, lane=COMPUTE):
        self.fn, self.name, self.device, self.lane = fn, name, device, lane
        self.reads, self.writes = reads, writes
        self.waiting = len(reads) + len(writes) + 1      # +1 until push is done
        self.record = None


# -- dependency tracking: pure bookkeeping on one variable, called under the engine lock --

def _append_read(var, op):
    """Grant `op` a read of `var` now (True) or queue it behind a writer."""
    if not var.writing and not var.pending:
        var.num_reading += 1
        return True
    var.pending.append((op, False))
    return False


def _append_write(var, op):
    """Grant `op` a write of `var` now (True) or queue it behind earlier readers and writers."""
    if not var.writing and not var.num_reading and not var.pending:
        var.writing = True
        return True
    var.pending.append((op, True))
    return False


def _complete_read(var, granted):
    var.num_reading -= 1
    if not var.num_reading and var.pending:     # the head must be a writer
        var.writing = True
        granted.append(var.pending.popleft()[0])


def _complete_write(var, granted):
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
    """What a trace keeps of one operation: for dependency graphs and the profiler.

    `worker` names the thread (or GPU stream) that ran it, `start` and `end` are
    `time.perf_counter()` seconds; on a GPU, `events` are the CUDA events around its kernels,
    which the profiler turns into device times.
    """

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


class ThreadedEngine:
    """Track dependencies under one lock; run ready operations on per-device workers."""

    def __init__(self, max_in_flight=None):
        self.lock = PoliteLock()
        self.idle = threading.Condition(self.lock)      # wait_all sleeps here
        self.room = threading.Condition(self.lock)      # push sleeps here when the bound is hit
        self.workers = {}                               # (device, lane) -> Worker
        self.cores = SharedCores()
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        self.errors = []
        self.recording = None

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        """Queue `fn` to run on `device`'s `lane` once `reads` and `writes` allow it."""
        op = Operation(fn, reads, writes, device, name, lane)
        if self.recording is not None and device is not None:
            op.record = OpRecord(op)
            self.recording.append(op.record)
        with self.lock:
            if device is not None:
                while self.max_in_flight and self.in_flight >= self.max_in_flight:
                    self.room.wait()
                self.in_flight += 1
            granted = 1                                  # the guard: push itself is done
            for var in op.reads:
                granted += _append_read(var, op)
            for var in op.writes:
                granted += _append_write(var, op)
            op.waiting -= granted
            ready = not op.waiting
        if ready:
            self._dispatch(op)

    def _dispatch(self, op):
        if op.device is None:                            # a waiter: no worker needed
            op.fn()
            self._complete(op, None)
        else:
            key = (op.device, op.lane)
            worker = self.workers.get(key) or self._start_worker(key)
            worker.ready.put(op)

    def _start_worker(self, key):
        with self.lock:
            if key not in self.workers:
                worker = self.workers[key] = Worker(self, *key, self.cores)
                if worker.cores is not None:
                    self.cores.add_device()
            return self.workers[key]

    def _run(self, op, worker):
        """Run one operation on `worker`; a failure is kept on what it writes, not raised here."""
        record = op.record
        if record is not None:
            record.worker, record.start = worker.name, time.perf_counter()
        error, own_error = inherited_error(op), None
        if error is None:
            try:
                if worker.stream is None:
                    op.fn()
                else:
                    worker.run_on_stream(op)
            except Exception as cause:                   # noqa: BLE001 - any failure travels on
                error = own_error = OperationError(op.name, cause)
        if record is not None:
            record.end = time.perf_counter()
        self._complete(op, error, own_error)

    def _complete(self, op, error, own_error=None):
        granted, ready = [], []
        with self.lock:
            for var in op.reads:
                _complete_read(var, granted)
            for var in op.writes:
                var.error = error             # (a GPU lane has set var.event already)
                _complete_write(var, granted)
            for other in granted:
                other.waiting -= 1
                if not other.waiting:
                    ready.append(other)
            if own_error is not None:
                self.errors.append(own_error)
            if op.device is not None:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.notify_all()
                if self.max_in_flight and self.in_flight < self.max_in_flight:
                    self.room.notify()
        for other in ready:
            self._dispatch(other)

    def wait_for(self, var):
        """Block until the last write of `var` is done; raise its error if it failed."""
        with self.lock:
            busy = var.writing or var.pending
        if busy:
            done = threading.Lock()
            done.acquire()
            self.push(done.release, [var], [], None, 'wait_for')
            done.acquire()
        _raise_or_sync(var)

    def wait_all(self):
        """Block until every pushed operation is done; raise the first error since the last call."""
        with self.lock:
            while self.in_flight:
                self.idle.wait()
            errors, self.errors = self.errors, []
        for worker in list(self.workers.values()):
            worker.synchronize()
        if errors:
            raise errors[0]


def _raise_or_sync(var):
    if var.error is not None:
        raise var.error
    if var.event is not None:
        var.event.synchronize()


class NaiveEngine:
    """Run every operation at once on the caller's thread: errors point at the line that failed."""

    def __init__(self):
        self.recording = None

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        op = Operation(fn, reads, writes, device, name, lane)
        record = None
        if self.recording is not None and device is not None:
            record = OpRecord(op)
            record.worker, record.start = 'caller', time.perf_counter()
            self.recording.append(record)
        error = inherited_error(op)
        if error is None:
            try:
                _run_now(op)
            except Exception as cause:                   # noqa: BLE001
                error = OperationError(name, cause)
        if record is not None:
            record.end = time.perf_counter()
        for var in op.writes:
            var.error, var.event = error, None
        if error is not None:
            raise error

    def wait_for(self, var):
        _raise_or_sync(var)

    def wait_all(self):
        pass


def _run_now(op):
    set_running_device(op.device)
    if op.device is None or op.device.kind == 'cpu':
        op.fn()
        return
    cupy = op.device.xp
    with cupy.cuda.Device(op.device.index):
        op.fn()
        cupy.cuda.get_current_stream().synchronize()


# -- the engine in use, and the module-level functions the rest of the package calls --

ENGINES = {'threaded': ThreadedEngine, 'naive': NaiveEngine}


def _engine_from_environment():
    kind = os.environ.get('D2LPERF_ENGINE', 'threaded')
    if kind not in ENGINES:
        raise ValueError(f'D2LPERF_ENGINE={kind!r} is not an engine; use one of {sorted(ENGINES)}')
    engine = ENGINES[kind]()
    limit = os.environ.get('D2LPERF_MAX_IN_FLIGHT')
    if limit and kind == 'threaded':
        engine.max_in_flight = int(limit)
    return engine


_engine = _engine_from_environment()


def current():
    """The engine in use."""
    return _engine


def use(kind):
    """Switch to the 'threaded' or 'naive' engine, after finishing all pushed work."""
    global _engine
    if kind not in ENGINES:
        raise ValueError(f'{kind!r} is not an engine; use one of {sorted(ENGINES)}')
    _engine.wait_all()
    for worker in getattr(_engine, 'workers', {}).values():
        worker.stop()
    recording = _engine.recording
    _engine = ENGINES[kind]()
    _engine.recording = recording
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


def in_flight():
    """How many pushed operations have not finished yet (0 for the naive engine)."""
    return getattr(_engine, 'in_flight', 0)


def set_max_in_flight(limit):
    """Block `push` while `limit` operations are unfinished (None: no bound); returns the old."""
    if limit is not None and limit < 1:
        raise ValueError(f'max_in_flight must be a positive count or None, not {limit!r}')
    old = getattr(_engine, 'max_in_flight', None)
    if isinstance(_engine, ThreadedEngine):
        with _engine.lock:
            _engine.max_in_flight = limit
            _engine.room.notify_all()
    return old


def set_blas_division(enabled):
    """Divide BLAS threads among busy CPU devices (True) or not (False, the default); returns
    the old setting. See `workers.SharedCores` for what was measured."""
    if not isinstance(_engine, ThreadedEngine):
        return False
    old = _engine.cores.enable(enabled)
    for device, lane in list(_engine.workers):
        if old != bool(enabled) and device.kind == 'cpu' and lane == COMPUTE:
            push(lambda: None, [], [], device, 'set_blas_division')   # an idle worker looks again
    return old


def start_recording():
    """Keep an `OpRecord` of every operation pushed from now on; returns the list they go to.

    Costs one branch per operation while off. The list fills as operations are pushed; their
    `start` and `end` are known once they ran (after `stop_recording`, for all of them).
    """
    records = []
    _engine.recording = records
    return records


def stop_recording():
    """Stop recording, wait for every recorded operation to finish, return the records."""
    records, _engine.recording = _engine.recording, None
    _engine.wait_all()
    return records if records is not None else []


@contextlib.contextmanager
def trace():
    """Record every operation pushed inside the block (name, device, vars, worker, times)."""
    records = start_recording()
    try:
        yield records
    finally:
        stop_recording()
