"""The engine's running policy: which thread runs a ready operation, and how.

The dependency tracker (`engine.py`) decides *when* an operation may run; this module decides
*where*. Every device has one worker thread per *lane*, as in MXNet's per-device engine: a
compute lane, and lanes that move data, so that a copy overlaps with computation that does
not depend on it. On a GPU each lane owns a CUDA stream (compute; host to device; device to
host), so the copy engines of the GPU work while its cores compute. Virtual CPU devices share
the machine's cores; `SharedCores` can divide the BLAS threads among the busy ones.
`PoliteLock`, the engine's lock, keeps all these threads from convoying on the GIL. Taught in
"Automatic Parallelism".
"""
import collections
import itertools
import os
import queue
import threading
import time

from .device import set_running_device

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


STOP = None                     # what a worker's queue holds to end its thread


class Worker:
    """One thread for one lane of one device, running its ready operations in arrival order."""

    def __init__(self, engine, device, lane, cores):
        self.device, self.lane, self.name = device, lane, f'{device} {lane}'
        self.ready = queue.SimpleQueue()
        self.stream = None
        self.launched = collections.deque()   # GPU: (event, op), kept alive until the event
        self.cores = cores if device.kind == 'cpu' and lane == COMPUTE else None
        started = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(engine, started),
                                       name=f'd2lperf-{self.name}', daemon=True)
        self.thread.start()
        started.wait()

    def _loop(self, engine, started):
        set_running_device(self.device)
        if self.device.kind == 'gpu':
            self.stream = _use_gpu_stream(self.device)
        started.set()
        get, run, cores = self.ready.get, engine._run, self.cores
        while True:
            op = get()
            if op is STOP:
                return
            if cores is not None and cores.active:
                if not self._run_while_busy(op, run, cores):
                    return
            else:
                run(op, self)
            # Keep no reference to the last operation: freeing it when the next one
            # arrives would put that work on the critical path.
            del op

    def _run_while_busy(self, op, run, cores):
        """Count this device as busy from its first ready operation until its queue is empty;
        False once told to stop."""
        cores.enter()
        try:
            run(op, self)
            del op
            while not self.ready.empty():
                op = self.ready.get()
                if op is STOP:
                    return False
                run(op, self)
                del op
            return True
        finally:
            cores.leave()

    def stop(self):
        """End the thread once the operations queued before this call have run."""
        self.ready.put(STOP)
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
            if var.event is not None:
                stream.wait_event(var.event)
        record = op.record
        begin = stream.record() if record is not None else None
        op.fn()
        end = stream.record()
        if record is not None:
            record.events = (begin, end)
        if self.lane != COMPUTE:
            end.synchronize()
            end = None
        else:
            self._keep_until_done(end, op)
        for var in op.writes:
            var.event = end

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


def _use_gpu_stream(device):
    """Make `device` current on this thread and give the thread a stream of its own."""
    cupy = device.xp
    cupy.cuda.Device(device.index).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.use()
    return stream


class PoliteLock:
    """A lock that never sleeps while holding itself hostage to the GIL.

    A thread blocked in `Lock.acquire` has released the GIL; when the lock is handed to it,
    it holds the lock while it waits to get the GIL back, and the other thread, wanting the
    lock, must give the GIL up: from then on the two threads take turns at every operation
    (a lock convoy). Trying without blocking, and yielding the GIL between tries, avoids it.
    """

    __slots__ = ('_lock',)

    def __init__(self):
        self._lock = threading.Lock()

    def acquire(self, blocking=True):
        while not self._lock.acquire(False):
            if not blocking:
                return False
            time.sleep(0)
        return True

    def release(self):
        self._lock.release()

    def __enter__(self):
        self.acquire()

    def __exit__(self, *exc_info):
        self._lock.release()


class SharedCores:
    """Optionally divide the BLAS threads of the process among the CPU devices busy at once.

    Virtual CPU devices are threads on the same cores, and OpenBLAS's thread count is one
    setting for the whole process. While switched on (`engine.set_blas_division(True)`) and
    k > 1 CPU devices compute, the count drops to cores // k, so k devices run k products
    with fewer threads each instead of k × cores threads sharing the cores; when at most one
    is busy again, the count in force before comes back. It is off by default because on the
    2-core machine this course is tested on, dividing made two concurrent 1000 × 1000
    products about 1.2× slower than letting them share every thread (benchmarks/parallel.py).
    """

    def __init__(self, cores=None):
        self.cores = cores or available_cores()
        self.enabled = False
        self.devices = 0             # CPU devices with a compute worker
        self.active = False          # enabled, and at least two such devices
        self.busy = 0
        self.saved = None            # the thread count in force before dividing
        self.current = None          # the count this object last set
        self.lock = threading.Lock()
        self._blas = None

    def add_device(self):
        self.devices += 1
        self.active = self.enabled and self.devices > 1

    def enable(self, enabled):
        """Divide (True) or not (False), from each device's next idle moment; returns the old."""
        old, self.enabled = self.enabled, bool(enabled)
        self.active = self.enabled and self.devices > 1
        return old

    def enter(self):
        with self.lock:
            self.busy += 1
            self._apply()

    def leave(self):
        with self.lock:
            self.busy -= 1
            self._apply()

    def _apply(self):
        if self.busy > 1:
            if self.saved is None:
                self.saved = self._get()
            self._set(max(1, min(self.saved, self.cores // self.busy)))
        elif self.saved is not None:
            self._set(self.saved)
            self.saved = self.current = None

    def _controllers(self):
        if self._blas is None:
            self._blas = openblas_thread_controls()
        return self._blas

    def _get(self):
        return max([lib.get_num_threads() or 1 for lib in self._controllers()], default=1)

    def _set(self, threads):
        if threads != self.current:
            for lib in self._controllers():
                lib.set_num_threads(threads)
            self.current = threads


def available_cores():
    """The cores this process may run on (all of the machine's where the OS cannot tell)."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class OpenBLASThreads:
    """Get and set one OpenBLAS library's thread count from any thread.

    threadpoolctl finds the library; its own setter is not used because it lets only one
    thread (the first to call it) change the count, and here every device's worker may.
    """

    def __init__(self, path):
        import ctypes
        library = ctypes.CDLL(path)
        for prefix, suffix in itertools.product(('', 'scipy_'), ('', '64_', '_64')):
            name = f'{prefix}openblas_%s_num_threads{suffix}'
            if hasattr(library, name % 'get'):
                self.get_num_threads = getattr(library, name % 'get')
                self.set_num_threads = getattr(library, name % 'set')
                return
        raise LookupError(f'no openblas_get_num_threads in {path}')


def openblas_thread_controls():
    """One `OpenBLASThreads` per OpenBLAS the process has loaded (none: nothing to divide)."""
    import threadpoolctl
    return [OpenBLASThreads(info['filepath']) for info in threadpoolctl.threadpool_info()
            if info['internal_api'] == 'openblas' and info.get('threading_layer') != 'openmp']
