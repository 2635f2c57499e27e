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
                       complete_write, execute, failure, forget_failures, free_to_run,
                       set_error, take_back)
from .interrupts import ctrl_c
from .lanes import COMPUTE
from .streams import synchronize
from .workers import RunNow, Workers


class Engine:
    """What the rest of the package may ask of an engine, whichever runs the operations:
    `push`, `wait_for(var)`, `wait_all()`, `stop()`; how many operations are `in_flight`, and
    at most how many may be (`max_in_flight`, None: no bound); the `recording` list."""

    in_flight, max_in_flight, recording = 0, None, None

    def push(self, fn, reads, writes, device, name, lane=COMPUTE, overwrites=False,
             skippable=False):
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
    """Track dependencies under one lock; run ready operations on per-device workers.

    Ctrl-C raises KeyboardInterrupt in the main thread at any point of its Python (CPython
    runs the handler at a function's start, after a call returns, or at a loop's end: never
    between two plain statements such as `a.b = c` and `d += 1`). Whatever the engine's main
    thread does is therefore either undone or finished when one lands: a push takes its grants
    back or hands the operation over (`track`); a waiter left asleep is woken later for
    nothing. Nothing is counted that will not run, and every wait still returns."""

    def __init__(self, max_in_flight=None):
        # A plain lock, taken with `with`: its C `__enter__` and `__exit__` leave no point in
        # between for Ctrl-C to land with the lock taken and no `with` to give it back.
        self.lock = threading.Lock()
        self.workers = Workers(self.run)
        self.in_flight = 0
        self.waiters = 0            # unfinished waiters (no device): not in flight, yet they
                                    # hold variables too
        self.limit = max_in_flight
        self.errors = []
        self.idle_sleepers = []                 # locks that wait_all sleeps on
        self.room_sleepers = []                 # locks that push sleeps on at the bound
        self.helping = True

    @property
    def max_in_flight(self):
        return self.limit

    @max_in_flight.setter
    def max_in_flight(self, limit):
        with self.lock:
            self.limit = limit
            wake(self.room_sleepers)

    def push(self, fn, reads, writes, device, name, lane=COMPUTE, overwrites=False,
             skippable=False):
        """Queue `fn` to run on `device`'s `lane` once `reads` and `writes` allow it; where
        `overwrites`, `fn` replaces all of what it writes; where `skippable`, a failed input
        skips it (`Operation`)."""
        op = Operation(fn, reads, writes, device, name, lane, self.recording, overwrites,
                       skippable)
        if device is None:
            return self.push_waiter(op)
        try:
            worker = self.workers.lanes[device, lane]
        except KeyError:                            # the lane's first operation
            worker = self.workers.start(device, lane)
        while True:
            with self.lock:
                if not self.limit or self.in_flight < self.limit:
                    return self.track(op, worker)
                room = sleeper(self.room_sleepers)
            room.acquire()      # until there is room; Ctrl-C here: the lock is released
                                # later, for nobody

    def track(self, op, worker):
        """Under the lock: take `op`'s grants, count it in flight, and hand it to `worker` if
        it is ready. A Ctrl-C during the grants takes them back (`take_back`): the push did
        not happen. Once `op` is counted, one finishes the push: `op` will run."""
        self.take_grants(op)
        self.in_flight += 1             # straight after the grants: nothing can come between
        handed = False
        try:
            for var in op.writes:
                var.writer = op
            if not op.waiting:
                handed = True           # nor between this and the append
                worker.queued.append(op)
                worker.wake()
        except BaseException:
            for var in op.writes:
                var.writer = op
            if not op.waiting:
                if not handed:
                    worker.queued.append(op)
                worker.wake()           # a second wake-up finds the queue empty: harmless
            raise

    def take_grants(self, op):
        """Under the lock: the grants `op` gets at once, and its place in the queues of the
        others; all taken back if Ctrl-C lands in the middle (`take_back`)."""
        tracked = 0                     # variables done
        try:
            for var in op.reads:
                append_read(var, op)
                tracked += 1
            for var in op.writes:
                append_write(var, op)
                tracked += 1
        except BaseException:
            take_back(op, tracked)
            raise

    def push_waiter(self, op):
        """A waiter (no device: `wait_for`, `wait_to_write`) runs on the thread of the operation
        that lets it in (`complete`); where nothing it reads or writes is in use, on this one,
        at once (`run_waiter_here`)."""
        with self.lock:
            free = free_to_run(op.reads, op.writes)
            if not free:
                self.take_grants(op)
                self.waiters += 1       # not ready: a variable it waits for is in use
        if free:
            self.run_waiter_here(op)

    def run_waiter_here(self, op):
        """Take the waiter's grants, run it and let them go, with Ctrl-C held back meanwhile
        (`interrupts.CtrlC`, as a helping thread does): nothing can come between the grants and
        their release. Rare (its variables are mostly in use), so the two system calls of the
        hold cost little."""
        held = ctrl_c.hold()
        try:
            with self.lock:
                self.take_grants(op)
                self.waiters += 1
            if not op.waiting:          # else busy again meanwhile: it runs when let in
                self._dispatch(op)
        finally:
            if held:
                ctrl_c.release()        # raises KeyboardInterrupt if Ctrl-C came meanwhile

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
        lock = self.lock                      # tried once, never waited for: no convoy
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
                set_error(var, error)

    def keep_failure(self, error, writes):
        """A failure of an operation run under the lock: on what it writes, for the wait, and
        once for `wait_all`. True: the operation has run."""
        for var in writes:
            set_error(var, error)
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
        wait_all. Runs on a worker's thread, or on a main thread that helps and holds Ctrl-C
        back meanwhile (`interrupts.CtrlC`)."""
        granted, ready = [], []
        with self.lock:
            for var in op.reads:
                complete_read(var, granted)
            for var in op.writes:
                if error is not None or var.error is not None:
                    set_error(var, error)
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
                if not self.in_flight and self.idle_sleepers:
                    wake(self.idle_sleepers)
                if self.room_sleepers and self.in_flight < self.limit:
                    wake(self.room_sleepers)
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
            raise reported(var.error)
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
        try:
            worker = self.workers.lanes[writer.device, writer.lane]
        except KeyError:                    # a waiter (no device) writes it
            return 0
        return worker.run_here_until(lambda: var.writer is not writer)

    def sleep_until_written(self, var):
        done = threading.Lock()
        done.acquire()
        self.push(done.release, [var], [], None, 'wait_for')
        done.acquire()         # Ctrl-C here: the waiter runs later, releasing a lock nobody needs

    def wait_all(self):
        """Block until nothing is in flight; raise the first failure since the last wait_all
        that no wait has raised yet."""
        while True:
            with self.lock:
                if not self.in_flight:
                    break
                idle = sleeper(self.idle_sleepers)
            idle.acquire()     # Ctrl-C here: the lock is released later, for nobody
        self.workers.synchronize()
        with self.lock:
            forget_failures()
            errors, self.errors = self.errors, []
            for error in errors:               # raised before the lock is let go: no Ctrl-C
                if not error.reported:         # can come between taking them and raising
                    raise reported(error)

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
    """Run every operation at once on the caller's thread: errors point at the line that failed.

    Ctrl-C inside an operation raises KeyboardInterrupt, as in plain NumPy: the operation is
    not failed, and neither is what it writes (`execute`)."""

    def __init__(self):
        self.run_now = RunNow().run

    def push(self, fn, reads, writes, device, name, lane=COMPUTE, overwrites=False,
             skippable=False):
        op = Operation(fn, reads, writes, device, name, lane, self.recording, overwrites,
                       skippable)
        error, _ = execute(op, 'caller', self.run_now, Exception)
        for var in writes:
            if error is not None or var.error is not None:
                set_error(var, error)
        if error is not None:
            raise reported(error)

    def wait_for(self, var):
        if var.error is not None:
            raise reported(var.error)

    def wait_all(self):
        forget_failures()


def reported(error):
    """`error`, marked as shown to the user: `wait_all` will not raise it again."""
    error.reported = True
    return error


def sleeper(sleepers):
    """A lock, taken, in `sleepers`: the caller lets the engine's lock go, then sleeps on it
    until `wake`. Unlike `Condition.wait`, which can return without its lock retaken when
    Ctrl-C lands inside, a Ctrl-C here leaves only a lock that will be released for nobody."""
    lock = threading.Lock()
    lock.acquire()
    sleepers.append(lock)
    return lock


def wake(sleepers):
    """Wake every sleeper (under the engine's lock); each looks again at what it waits for."""
    for lock in sleepers:
        lock.release()
    sleepers.clear()
