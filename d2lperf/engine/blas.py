"""BLAS threads shared by virtual CPU devices: the one setting that all of them touch.

Virtual CPU devices are threads on the same cores, and OpenBLAS's thread count is one
setting for the whole process. `SharedCores` can divide it among the devices computing at
once (`engine.set_blas_division(True)`); `OpenBLASThreads` reads and sets it from any
thread. Taught in "Automatic Parallelism".
"""
import itertools
import threading

from ..device import available_cores


class SharedCores:
    """Optionally divide the BLAS threads of the process among the CPU devices busy at once.

    While switched on and k > 1 CPU devices compute, the count drops to cores // k, so k
    devices run k products with fewer threads each instead of k × cores threads sharing the
    cores; once no device is busy, the count in force before comes back. Not as soon as one
    is left: devices that work in step (data parallelism) each idle for a moment between
    operations, and giving every thread back then lets the next product of the other device
    start on all of them, beside this device's own; on 2 cores that made a two-device LeNet
    step 1.4× slower than keeping the division until both were done. It is off
    by default because on the 2-core machine this course is tested on, dividing made two
    concurrent 1000 × 1000 products about 1.2× slower than letting them share every thread
    (benchmarks/parallel.py).
    """

    def __init__(self, cores=None, controllers=None):
        self.cores = cores or available_cores()
        self.enabled = False
        self.devices = 0             # CPU devices with a compute worker
        self.active = False          # enabled, and at least two such devices
        self.busy = 0
        self.saved = None            # the thread count in force before dividing
        self.current = None          # the count this object last set
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.controllers = controllers     # found on first use: importing them costs time

    def add_device(self):
        self.devices += 1
        self.active = self.enabled and self.devices > 1

    def enable(self, enabled):
        """Divide (True) or not (False), from each device's next idle moment; returns the old."""
        old, self.enabled = self.enabled, bool(enabled)
        self.active = self.enabled and self.devices > 1
        return old

    def enter(self):
        """A device starts computing."""
        with self.lock:
            self.busy += 1
            self.apply()

    def leave(self):
        """A device has nothing left to compute."""
        with self.lock:
            self.busy -= 1
            self.apply()
            if not self.busy:
                self.idle.notify_all()

    def wait_until_idle(self):
        """Block until no device computes, so that the full thread count is back."""
        with self.lock:
            while self.busy:
                self.idle.wait()

    def apply(self):
        if self.busy > 1:
            if self.saved is None:
                self.saved = self.get()
            self.set(max(1, min(self.saved, self.cores // self.busy)))
        elif not self.busy and self.saved is not None:
            self.set(self.saved)
            self.saved = self.current = None

    def libraries(self):
        if self.controllers is None:
            self.controllers = openblas_thread_controls()
        return self.controllers

    def get(self):
        return max([lib.get_num_threads() or 1 for lib in self.libraries()], default=1)

    def set(self, threads):
        if threads != self.current:
            for lib in self.libraries():
                lib.set_num_threads(threads)
            self.current = threads


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
