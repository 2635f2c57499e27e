"""The engine's running policy: which thread runs a ready operation, and how.

The dependency tracker (`tracking.py`) decides *when* an operation may run; this module decides
*where*. Every device has one worker thread per *lane*, as in MXNet's per-device engine: a
compute lane, and lanes that move data, so that a copy overlaps with computation that does
not depend on it. A thread that waits for a result may run a CPU lane's queue in its thread's
place (`Worker.run_here_until`): one thread at a time runs a lane, in the lane's order. On a
GPU each lane owns a CUDA stream (compute; host to device; device to host), so the copy
engines of the GPU work while its cores compute; the CUDA events that order the streams, and
the waits for them, are all here. Virtual CPU devices share the machine's cores, and their
BLAS threads fit the cores other programs leave free (`blas.SharedCores`); a device slowed
down keeps its `Pace`. `running_device()` says which device's operations the current thread
runs. A helping main thread holds Ctrl-C back until the operation in hand is done (`CtrlC`).
`RunNow` is the naive engine's policy: the caller's thread, at once. Taught in "Automatic
Parallelism".
"""
import collections
import queue
import threading
import time
import weakref
# The C functions behind `signal.signal` and `signal.getsignal`: the public wrappers convert
# handlers to enums, which costs five times the system call, on every helped wait.
from _signal import SIGINT, getsignal, signal as set_signal_handler
from _thread import get_ident

from .blas import SharedCores
from ..device import cpu, slowdowns
from .freed_memory import keep_freed_memory

COMPUTE, COPY_IN, COPY_OUT = 'compute', 'copy in', 'copy out'


def copy_lane(source, target):
    """The (device, lane) that runs a copy: a GPU's copy stream if one side is a GPU.

    Data leaving a GPU goes on its copy-out stream; data entering a GPU from the host on its
    copy-in stream; between GPUs on the source's copy-out stream (it waits for the source's
    kernels); between CPU devices on the target's copy-in thread.
    """
    if source.kind == 'gpu':
        return source, COPY_OUT
    return target, COPY_IN


running = threading.local()      # .device: the device whose operations this thread runs


def running_device():
    """The device whose operations this thread runs: an engine worker's own (cpu(0) on any
    other thread). Like CUDA's current device, it lets an operation find its device's
    resources, such as its random generator, without being handed them."""
    return getattr(running, 'device', None) or cpu()


# A GPU compute lane only launches its kernels: the engine counts the write done at once.
# The CUDA event recorded after them, per variable, is what later readers on other streams
# wait for; a reader on the same stream runs after them anyway.
write_events = weakref.WeakKeyDictionary()  # engine Var -> (stream, event) of its last write
gpu_lanes = []                                  # a GPU lane has started: events may exist


def synchronize(var):
    """Block until the kernels that last wrote `var` have finished (CPU work: nothing to do)."""
    if gpu_lanes:
        written = write_events.get(var)
        if written is not None:
            written[1].synchronize()


class Pace:
    """The speed of one CPU device, kept by whoever runs its operations (its compute lane, or
    the naive engine): on a device slowed down (`device.slow_down`), each operation is followed
    by the idle time the slower device would have taken longer. That time is owed and paid in
    sleeps of a millisecond or more, as the OS cannot sleep for the few microseconds one
    operation takes; one thread at a time runs a device's operations, so one debt is enough."""

    __slots__ = ('device', 'owed')

    def __init__(self, device):
        self.device, self.owed = device, 0.0

    def run_at_speed(self, op):
        factor = slowdowns.get(self.device)
        if factor is None:
            op.fn()
            return
        start = time.perf_counter()
        op.fn()
        owed = self.owed + (factor - 1) * (time.perf_counter() - start)
        if owed >= 1e-3:
            start = time.perf_counter()
            time.sleep(owed)
            owed -= time.perf_counter() - start
        self.owed = owed


class RunNow:
    """The naive engine's policy: run each operation on the caller's thread and wait for it,
    on a GPU too; a CPU device keeps its `Pace` as it would on its worker."""

    def __init__(self):
        self.paces = {}                 # CPU device -> its Pace

    def run(self, op):
        keep_freed_memory()         # once: the process runs work now (see freed_memory)
        device = running.device = op.device
        if device is None:
            op.fn()
        elif device.kind == 'cpu':
            pace = self.paces.get(device) or self.paces.setdefault(device, Pace(device))
            pace.run_at_speed(op)
        else:
            run_on_gpu_now(device, op)


def run_on_gpu_now(device, op):
    cupy = device.xp
    with cupy.cuda.Device(device.index):
        op.fn()
        cupy.cuda.get_current_stream().synchronize()
    for var in op.writes:
        write_events.pop(var, None)


STOP = None                     # what a worker's wake-ups hold to end its thread
WAKE = True                     # one per ready operation: look at the queue


class Worker:
    """One thread for one lane of one device, running its ready operations in arrival order.

    The ready operations wait in `queued`; whoever holds `runner` runs them, one at a time
    and in order: the lane's thread, or a caller that waits for one of them
    (`run_here_until`). `run(op,
    worker)` is the engine's: it executes the operation, with `worker.launch`, and releases what
    it held. `cores` (CPU compute lanes only) fits the BLAS threads before each operation and
    is told when the device is busy.
    """

    def __init__(self, device, lane, run, cores=None):
        self.device, self.lane, self.name = device, lane, f'{device} {lane}'
        self.run, self.cores = run, cores
        self.queued = collections.deque()
        self.wakeups = queue.SimpleQueue()       # WAKE per queued operation, STOP at the end
        self.runner = threading.Lock()
        self.stream, self.launch = None, None     # on a GPU: its stream, and run_on_stream
        self.pace = None                          # on a CPU compute lane: the device's Pace
        self.launched = collections.deque()   # GPU: (event, op), kept alive until the event
        started = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(started,),
                                       name=f'd2lperf-{self.name}', daemon=True)
        self.thread.start()
        started.wait()

    def _loop(self, started):
        running.device = self.device
        if self.device.kind == 'gpu':
            self.stream, self.launch = use_gpu_stream(self.device), self.run_on_stream
            gpu_lanes.append(self.name)
        elif self.lane == COMPUTE:
            self.pace = Pace(self.device)
            self.launch = self.pace.run_at_speed
        started.set()
        get = self.wakeups.get
        while get() is not STOP:
            # One wake-up per operation, but one run takes every operation queued by then:
            # the wake-ups left over find the queue empty, and must cost no more than a look.
            if self.queued:
                self.run_queued()

    def submit(self, op):
        self.queued.append(op)
        self.wakeups.put(WAKE)

    def wake(self):
        """Have the lane's thread look at its queue (`ThreadedEngine.track` appends to it)."""
        self.wakeups.put(WAKE)

    def run_queued(self, finished=None, helper=False):
        """Run the queued operations in order until none is left or `finished()`; how many ran
        (0 also where another thread is running them: it runs them all). The device counts as
        busy meanwhile; the records of operations run by a `helper` thread carry its name, and
        a helper stops at a Ctrl-C it holds back (`CtrlC`), leaving the rest to the lane's
        thread."""
        if not self.runner.acquire(False):
            return 0
        cores, queued, ran = self.cores, self.queued, 0
        busy = cores is not None and cores.active
        if busy:
            cores.enter()
        try:
            while queued and not (finished and finished()):
                if helper and ctrl_c.noted:
                    break
                if cores is not None:
                    cores.fit()          # before the pop: nothing it does can lose an operation
                op = queued.popleft()
                if helper and op.record is not None:       # before it completes: waiters
                    op.record.helped = threading.current_thread().name     # may read it
                self.run(op, self)
                ran += 1
                # Keep no reference to the last operation: freeing it when the next one
                # arrives would put that work on the critical path.
                del op
        finally:
            if busy:
                cores.leave()
            self.runner.release()
        return ran

    def run_here_until(self, finished):
        """Run this lane's ready operations on the calling thread, in the lane's order, until
        `finished()`: how many it ran. A thread that would otherwise sleep until the lane's
        thread woke up, ran them and woke it in turn does the work itself. GPU lanes only
        launch kernels on their stream, so they are never helped. Ctrl-C waits until the
        operation in hand has completed, then interrupts the caller (`CtrlC`)."""
        if self.device.kind != 'cpu' or not self.queued:
            return 0
        held = ctrl_c.hold()
        caller = getattr(running, 'device', None)
        running.device = self.device
        try:
            ran = self.run_queued(finished, helper=True)
        finally:
            running.device = caller
            if self.queued:
                self.wakeups.put(WAKE)     # the lane's thread may have woken and found us running
            if held:
                ctrl_c.release()           # raises KeyboardInterrupt if Ctrl-C came meanwhile
        return ran

    def run_here_if_idle(self, fn):
        """`run_here(fn)` if this lane has nothing queued and nobody running it (its thread
        then sleeps on, never woken); False if it does not.

        The caller holds the lane's `runner` meanwhile, as a helping waiter does
        (`run_here_until`). Work queued on the lane meanwhile, by other threads, is left to
        the lane's thread, woken after."""
        if self.queued or not self.runner.acquire(False):
            return False
        try:
            return self.run_here(fn)
        finally:
            self.runner.release()
            if self.queued:
                self.wakeups.put(WAKE)

    def run_here(self, fn):
        """Call `fn()` on the calling thread as an operation of this lane, which the caller
        knows to be idle (`ThreadedEngine.push_short` holds Ctrl-C back); False, with nothing
        done, where the lane's own way of running counts: on a GPU, where devices divide the
        BLAS threads (the lane's thread counts its device busy), or on a device slowed down
        (it keeps the pace). What `fn` raises goes to the caller."""
        if self.pace is None or self.cores.active or self.device in slowdowns:
            return False
        caller = getattr(running, 'device', None)
        running.device = self.device
        try:
            fn()
        finally:
            running.device = caller
        return True

    def stop(self):
        """End the thread once the operations queued before this call have run."""
        self.wakeups.put(STOP)
        self.thread.join()

    def run_on_stream(self, op):
        """Launch `op` on this lane's stream: after the kernels that wrote what it reads.

        A copy lane waits for its copy to finish, so the engine completes a copy only once
        the data has moved: later writers of its source (on any stream) cannot overtake it.
        A compute lane returns at once; the op (and so the arrays its closure holds) is
        kept until its kernels are done, so memory is never recycled under a running kernel.
        """
        stream = self.stream
        for var in op.reads:
            written = write_events.get(var)
            if written is not None and written[0] is not stream:
                stream.wait_event(written[1])
        record = op.record
        begin = stream.record() if record is not None else None
        op.fn()
        end = stream.record()
        if record is not None:
            record.events = (begin, end)
        if self.lane != COMPUTE:
            end.synchronize()
            for var in op.writes:
                write_events.pop(var, None)
            return
        self._keep_until_done(end, op)
        for var in op.writes:
            write_events[var] = (stream, end)

    def _keep_until_done(self, event, op):
        launched = self.launched
        while launched and launched[0][0].done:
            launched.popleft()
        launched.append((event, op))

    def synchronize(self):
        """Wait for this lane's stream (if any) to finish everything launched on it."""
        if self.stream is not None:
            self.stream.synchronize()
            self.launched.clear()


class CtrlC:
    """Ctrl-C held back while the main thread runs a lane's operations (`Worker.run_here_until`).

    With helping off, Ctrl-C finds the waiting main thread asleep; the operations run on,
    whole, on their lane's thread. A main thread that helps runs them itself, and Python
    raises KeyboardInterrupt at its next bytecode: inside an operation (half done, its value
    lost) or inside the engine's bookkeeping (a lane left locked, an operation taken from its
    queue and never run: later waits hang). So while the main thread helps (the only thread
    that Python delivers signals to), SIGINT's handler is this object, which only notes the
    signal. `release` puts the handler back and calls it once the operation in hand has
    completed and the lane is free: the caller gets its KeyboardInterrupt, nothing is lost.
    """

    __slots__ = ('handler', 'noted', 'frame')

    def __init__(self):
        self.handler, self.noted, self.frame = None, False, None     # noted: only while held

    def hold(self):
        """Hold Ctrl-C back if this is the main thread and SIGINT has a Python handler (not
        ignored, nor the default that ends the process) that is not this one already (an
        operation the main thread helps with may wait in turn); True if it now does. Every
        short push asks (`ThreadedEngine.push_short`): the two system calls that swap the
        handler are most of its cost, so nothing else is done."""
        if get_ident() != MAIN_THREAD:
            return False
        handler = getsignal(SIGINT)
        if handler is self or not callable(handler):
            return False
        self.handler = handler
        set_signal_handler(SIGINT, self)      # a SIGINT already pending raises first
        return True

    def __call__(self, signum, frame):
        self.noted, self.frame = True, frame

    def release(self):
        """Give SIGINT its handler back; call it if Ctrl-C came while it was held."""
        handler = self.handler
        try:
            set_signal_handler(SIGINT, handler)   # a SIGINT still pending is noted first
        finally:                # even if a new one raised at once: this one goes with it
            noted, self.noted = self.noted, False
        if noted:
            frame, self.frame = self.frame, None
            handler(SIGINT, frame)


ctrl_c = CtrlC()           # one is enough: only the main thread holds it
MAIN_THREAD = threading.main_thread().ident    # compared on every help and short push


class Workers:
    """The workers of one engine, one per (device, lane), each started by its first operation.

    CPU compute lanes share the machine's cores: `cores` counts them, and divides the BLAS
    threads among the busy ones when asked to."""

    def __init__(self, run):
        self.run, self.lanes = run, {}             # (device, lane) -> Worker
        self.cores = SharedCores()
        self.lock = threading.Lock()

    def submit(self, op):
        """Queue a ready operation on its device's lane."""
        worker = self.lanes.get((op.device, op.lane)) or self.start(op.device, op.lane)
        worker.submit(op)

    def run_lane_until(self, op, finished):
        """Run, on the calling thread, the ready operations queued on `op`'s lane until
        `finished()`: how many ran (0 where nobody may help; see `Worker.run_here_until`)."""
        worker = self.lanes.get((op.device, op.lane)) if op.device is not None else None
        return worker.run_here_until(finished) if worker is not None else 0

    def start(self, device, lane):
        with self.lock:
            if (device, lane) not in self.lanes:
                keep_freed_memory()      # once, before the first worker allocates
                shares_cores = device.kind == 'cpu' and lane == COMPUTE
                if shares_cores:
                    self.cores.add_device()
                cores = self.cores if shares_cores else None
                self.lanes[device, lane] = Worker(device, lane, self.run, cores)
            return self.lanes[device, lane]

    def divide_blas(self, enabled):
        """Divide the BLAS threads among busy CPU devices or not; returns the old setting."""
        return self.cores.enable(enabled)

    def cpu_compute_devices(self):
        return [device for device, lane in list(self.lanes)
                if device.kind == 'cpu' and lane == COMPUTE]

    def synchronize(self):
        """Once the engine has nothing in flight: wait for the GPU streams and for the BLAS
        threads to be given back."""
        for worker in list(self.lanes.values()):
            worker.synchronize()
        self.cores.wait_until_idle()

    def stop(self):
        for worker in list(self.lanes.values()):
            worker.stop()
        self.lanes.clear()


def use_gpu_stream(device):
    """Make `device` current on this thread and give the thread a stream of its own."""
    cupy = device.xp
    cupy.cuda.Device(device.index).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.use()
    return stream
