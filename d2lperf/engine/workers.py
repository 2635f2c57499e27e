"""Workers: the engine's running policy, which thread runs a ready operation.

The dependency tracker (`tracking.py`) decides *when* an operation may run; this module decides
*where*. Every device has one worker thread per lane (`lanes.py`): its ready operations queue
there and run in arrival order. A thread that waits for a result may run a CPU lane's queue in
its thread's place (`Worker.run_here_until`): one thread at a time runs a lane, in the lane's
order, with Ctrl-C held back meanwhile (`interrupts.py`). A GPU lane launches its operations on
its own stream (`streams.py`); a CPU compute lane fits the BLAS threads to the cores others
leave free (`blas.SharedCores`) and keeps its device's pace (`pace.py`). `RunNow` is the naive
engine's policy: the caller's thread, at once. `running_device()` says which device's
operations the current thread runs. Taught in "Asynchronous Computation" and
"Automatic Parallelism".
"""
import collections
import queue
import threading

from .blas import SharedCores
from .freed_memory import keep_freed_memory
from .interrupts import ctrl_c
from .lanes import COMPUTE
from .pace import Pace
from .streams import GpuLane, run_on_gpu_now
from ..device import cpu, slowdowns

class Running(threading.local):
    """Per thread, `device`: the device whose operations the thread runs; None (the class's)
    on a thread that has run none, read without a `getattr` call."""

    device = None


running = Running()


def running_device():
    """The device whose operations this thread runs: an engine worker's own (cpu(0) on any
    other thread). Like CUDA's current device, it lets an operation find its device's
    resources, such as its random generator, without being handed them."""
    return running.device or cpu()


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


STOP = None                     # what a worker's wake-ups hold to end its thread
WAKE = True                     # look at the queue


class Worker:
    """One thread for one lane of one device, running its ready operations in arrival order.

    The ready operations wait in `queued`; whoever holds `runner` runs them, one at a time
    and in order: the lane's thread, or a caller that waits for one of them
    (`run_here_until`). The lane's thread is woken only where nobody holds `runner` (`wake`):
    whoever does runs what is queued meanwhile, and looks at the queue once more after letting
    `runner` go. `run(op, worker)` is the engine's: it executes the operation, with
    `worker.launch`, and releases what it held. `cores` (CPU compute lanes only) fits the BLAS
    threads before each operation and is told when the device is busy.
    """

    def __init__(self, device, lane, run, cores=None):
        self.device, self.lane, self.name = device, lane, f'{device} {lane}'
        self.run, self.cores = run, cores
        self.queued = collections.deque()
        self.wakeups = queue.SimpleQueue()       # WAKE (see `wake`), STOP at the end
        self.woken = False            # a WAKE is on its way that the thread has not acted on
        self.runner = threading.Lock()
        self.launch = None            # how it runs an operation: GpuLane.launch, Pace.run_at_speed
                                      # (on a device slowed down, looked at as a run starts), or
                                      # None: `op.fn()`
        self.gpu = None               # on a GPU: the lane's stream (a GpuLane)
        self.pace = None              # on a CPU compute lane: the device's Pace
        started = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(started,),
                                       name=f'd2lperf-{self.name}', daemon=True)
        self.thread.start()
        started.wait()

    def _loop(self, started):
        running.device = self.device
        if self.device.kind == 'gpu':
            self.gpu = GpuLane(self.device, self.lane)
            self.launch = self.gpu.launch
        elif self.lane == COMPUTE:
            self.pace = Pace(self.device)
            self.launch = self.pace.run_at_speed
        started.set()
        get = self.wakeups.get
        while get() is not STOP:
            # Before the look at the queue: what is appended after it wakes the thread again.
            # One run takes every operation queued by then: a wake-up left over finds the
            # queue empty, and must cost no more than a look.
            self.woken = False
            if self.queued:
                self.run_queued()

    def submit(self, op):
        self.queued.append(op)
        self.wake()

    def wake(self):
        """Have the lane's thread look at its queue, just appended to (`submit`,
        `ThreadedEngine.track`), unless someone runs the queue now: that one runs the new
        operation, or sees it when it looks again after letting `runner` go (`run_queued`).
        A chain of operations, each made ready by the last one's completion, then wakes no
        thread: waking one is a system call, and the woken thread takes the interpreter's
        lock from the one running the chain, only to find the lane taken.

        Nor does a push while a wake-up is on its way (`woken`): the thread looks at the queue
        after it has taken the wake-up and cleared `woken`, so it finds the operations
        appended before. Without this, a program that pushes faster than the lane runs put a
        wake-up on the queue for most operations (0.7 to 0.9 an `x + 1`, asynchronously), and
        the lane's thread took each off again. `woken` is set before the put: no Ctrl-C and
        no other thread can come between the two, and a put that set no flag (the lane's own
        `run_queued`) only wakes the thread once more."""
        if not self.woken and not self.runner.locked():
            self.woken = True
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
        if self.pace is not None:     # a device slowed down keeps its pace; any other runs its
            self.launch = self.pace.run_at_speed if self.device in slowdowns else None  # ops
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
            if queued:                 # appended while we ran, and left: nobody woke the lane
                self.wakeups.put(WAKE)
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
        caller = running.device
        running.device = self.device
        try:
            ran = self.run_queued(finished, helper=True)
        finally:
            running.device = caller
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
        caller = running.device
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

    def synchronize(self):
        """Wait for this lane's stream (if any) to finish everything launched on it."""
        if self.gpu is not None:
            self.gpu.synchronize()


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
