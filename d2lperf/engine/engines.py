"""The engines: two policies that run the operations the tracker lets through.

`ThreadedEngine` tracks dependencies under one lock and hands each ready operation to a worker
thread of its device and lane (`workers.py`), so the caller's thread returns at once and
independent work overlaps; a caller that then waits for a result runs the ready work it waits
for itself (`ThreadedEngine.run_lane_until_written`) rather than sleeping through two thread
hand-offs. `NaiveEngine` runs each operation at once on the caller's thread, for debugging
(`D2LPERF_ENGINE=naive`): a failure then points at the line that caused it. Both keep the
interface of `Engine`. Taught in "Asynchronous Computation" and "Automatic Parallelism".
"""
import functools
import threading

from . import tracking
from .tracking import (Operation, OpRecord, append_read, append_write, complete_read,
                       complete_write, execute, failure, free_to_run)
from .workers import COMPUTE, PoliteLock, RunNow, Workers, ctrl_c, synchronize


class Engine:
    """What the rest of the package may ask of an engine, whichever runs the operations:
    `push`, `wait_for(var)`, `wait_all()`, `stop()`; how many operations are `in_flight`, and
    at most how many may be (`max_in_flight`, None: no bound); the `recording` list."""

    in_flight, max_in_flight, recording = 0, None, None

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        raise NotImplementedError

    def push_short(self, fn, reads, writes, device, name):
        """`push` an operation too short to gain from running on another thread."""
        self.push(fn, reads, writes, device, name)

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

    def set_helping(self, enabled):
        """Let a waiting thread run the work it waits for; returns the old setting."""
        return False

    def threads_per_operation(self):
        """How many threads one operation may use (`pieces`); one, unless cores are shared."""
        return 1

    def blas_thread_changes(self):
        """How often this engine has changed BLAS's thread count."""
        return 0


class ThreadedEngine(Engine):
    """Track dependencies under one lock; run ready operations on per-device workers."""

    def __init__(self, max_in_flight=None):
        self.lock = PoliteLock()
        self.idle = threading.Condition(self.lock)      # wait_all sleeps here
        self.room = threading.Condition(self.lock)      # push sleeps here when the bound is hit
        self.workers = Workers(self.run)
        self.in_flight = 0
        self.waiters = 0            # unfinished waiters (no device): not in flight, yet they
                                    # hold variables too
        self.limit = max_in_flight
        self.errors = []
        self.waiting_all = 0                            # threads asleep in wait_all
        self.helping = True

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
            if device is None:
                self.waiters += 1
            for var in op.reads:
                granted += append_read(var, op)
            for var in op.writes:
                granted += append_write(var, op)
                var.writer = op
            op.waiting -= granted
            ready = not op.waiting
        if ready:
            self._dispatch(op)

    def push_short(self, fn, reads, writes, device, name):
        """`push` an operation too short to gain from another thread: where nothing it reads
        or writes is in use and its device's compute lane is idle, it runs on this thread
        before the call returns.

        Handing it to the lane would cost a wake-up of the lane's thread, and the caller, who
        usually waits for the result next, its own wait: more than the operation itself. It
        runs holding the engine's lock, so no other push or completion can touch its
        variables meanwhile: it takes no grants and gives none back (0.1 µs a variable, nine
        for a compiled MLP), is never counted in flight, and needs no `Operation` unless the
        engine records or an operation has failed (`run_locked`). With no pushed operation
        unfinished (none in flight, no waiter), no variable can be in use and no lane busy:
        none is looked at. Only an operation shorter than a thread hand-off may keep the other
        threads waiting so long. Where another thread holds the lock, the lane has work, or
        helping is off, it is pushed as any other. Ctrl-C is held back from before the lock
        is taken until it is let go."""
        lane = self.workers.lanes.get((device, COMPUTE)) if self.helping else None
        if lane is None:
            return self.push(fn, reads, writes, device, name)
        run = fn
        if self.recording is not None or tracking.an_operation_failed:
            run = functools.partial(self.run_locked, Operation(fn, reads, writes, device, name),
                                    lane)
        held = ctrl_c.hold()
        lock = self.lock.plain                # tried once, never waited for: no convoy
        try:
            ran = lock.acquire(False)
            if ran:
                try:
                    if self.in_flight or self.waiters:      # variables, the lane may be in use
                        ran = free_to_run(reads, writes) and lane.run_here_if_idle(run)
                    else:                     # nothing pushed is unfinished: all is idle
                        ran = lane.run_here(run)
                except (Exception, KeyboardInterrupt) as cause:  # noqa: BLE001 - for the wait
                    ran = self.keep_failure(failure(name, cause), writes)
                finally:
                    lock.release()
        finally:
            if held:
                ctrl_c.release()              # raises KeyboardInterrupt if Ctrl-C came meanwhile
        if not ran:
            self.push(fn, reads, writes, device, name)

    def run_locked(self, op, lane):
        """Execute `op` under the engine's lock (`push_short`), keeping its record (this
        thread is named as the one that helped its lane) and the failure it inherits; it
        granted nothing, so only its failure, if any, is left to keep."""
        if self.recording is not None:
            op.record = OpRecord(op)
            op.record.helped = threading.current_thread().name
            self.recording.append(op.record)
        error, own = execute(op, lane.name, lane.launch)
        if own:
            self.keep_failure(error, op.writes)
        elif error is not None:
            for var in op.writes:
                var.error = error

    def keep_failure(self, error, writes):
        """A failure of an operation run under the lock: on what it writes, for the wait, and
        once for `wait_all`. True: the operation has run."""
        for var in writes:
            var.error = error
        self.errors.append(error)
        return True

    def _dispatch(self, op):
        if op.device is None:                            # a waiter: no worker needed
            try:
                op.fn()
            finally:             # even with Ctrl-C right after fn: let go of what it read
                self.complete(op, None, False)
        else:
            self.workers.submit(op)

    def run(self, op, worker):
        """What a worker does with a ready operation: execute it, then let its followers in."""
        error, own = execute(op, worker.name, worker.launch)
        self.complete(op, error, own)

    def complete(self, op, error, own):
        """Release what `op` held; dispatch what that made ready; keep its own error for
        wait_all."""
        granted, ready = [], []
        with self.lock:
            for var in op.reads:
                complete_read(var, granted)
            for var in op.writes:
                var.error = error
                if var.writer is op:
                    var.writer = None
                complete_write(var, granted)
            for other in granted:
                other.waiting -= 1
                if not other.waiting:
                    ready.append(other)
            if own:
                self.errors.append(error)
            if op.device is not None:
                self.in_flight -= 1
                if not self.in_flight and self.waiting_all:
                    self.idle.notify_all()
                if self.limit and self.in_flight < self.limit:
                    self.room.notify()
            else:
                self.waiters -= 1
        for other in ready:
            self._dispatch(other)

    def wait_for(self, var):
        """Block until the last write of `var` pushed so far is done; helping where it can."""
        while (writer := var.writer) is not None:
            if not (self.helping and self.run_lane_until_written(writer, var)):
                self.sleep_until_written(var)
                break
        if var.error is not None:
            raise var.error
        synchronize(var)              # a GPU worker may have only launched the write

    def run_lane_until_written(self, writer, var):
        """Instead of sleeping until a worker has written `var`, run the ready operations of the
        writer's lane on this thread, in the lane's order, until the write is done; how many ran.

        The waiter would only sleep meanwhile, and the lane's thread would have to wake up, run
        them and wake the waiter: two thread hand-offs, each longer than a small operation.
        Every rule holds: the operations were ready (their dependencies met), they run in the
        lane's order and one at a time (whoever holds the lane's `runner`), and they complete
        as on the worker. Nothing runs where the lane is busy on its own thread, where the
        write still waits for other work, or on a GPU."""
        return self.workers.run_lane_until(writer, lambda: var.writer is not writer)

    def sleep_until_written(self, var):
        done = threading.Lock()
        done.acquire()
        self.push(done.release, [var], [], None, 'wait_for')
        done.acquire()

    def wait_all(self):
        with self.lock:
            self.waiting_all += 1
            while self.in_flight:
                self.idle.wait()
            self.waiting_all -= 1
            errors, self.errors = self.errors, []
        self.workers.synchronize()
        if errors:
            raise errors[0]

    def stop(self):
        self.wait_all()
        self.workers.stop()

    def set_helping(self, enabled):
        """See `run_lane_until_written`; returns the old setting."""
        old, self.helping = self.helping, bool(enabled)
        return old

    def threads_per_operation(self):
        """The BLAS threads in force: they fit the cores others leave (`blas.SharedCores`)."""
        return self.workers.cores.threads_in_force()

    def blas_thread_changes(self):
        return self.workers.cores.changes

    def set_blas_division(self, enabled):
        """See `blas.SharedCores` for what was measured."""
        old = self.workers.divide_blas(enabled)
        for device in self.workers.cpu_compute_devices() if old != bool(enabled) else ():
            self.push(lambda: None, [], [], device, 'set_blas_division')   # idle: look again
        return old


class NaiveEngine(Engine):
    """Run every operation at once on the caller's thread: errors point at the line that failed."""

    def __init__(self):
        self.run_now = RunNow().run

    def push(self, fn, reads, writes, device, name, lane=COMPUTE):
        op = Operation(fn, reads, writes, device, name, lane, self.recording)
        error, _ = execute(op, 'caller', self.run_now)
        for var in writes:
            var.error = error
        if error is not None:
            raise error

    def wait_for(self, var):
        if var.error is not None:
            raise var.error

    def wait_all(self):
        pass
