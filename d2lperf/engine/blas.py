"""BLAS threads that fit the cores: the one setting that every CPU device touches.

OpenBLAS's thread count is one setting for the whole process, and a product is only as fast
as its slowest thread: a thread that waits for a core another program holds makes every
product wait for it. `threads_that_fit` is the policy: the cores other programs leave free
(`load_by_others`, sampled every `SAMPLE_SECONDS`, counted in whole cores by `cores_taken`),
divided among the CPU devices computing at once when asked (`engine.set_blas_division(True)`).
`SharedCores` applies it before each operation of a CPU device, reading the load once per
period however many devices ask, and keeping the count if the load cannot be read;
`OpenBLASThreads` reads and sets the count from any thread. `spin_briefly` makes OpenBLAS's
idle threads give their cores back soon after a product, whichever of NumPy and d2lperf came
first, where that is safe.
Taught in "Automatic Parallelism" and "Hardware".
"""
import collections
import contextlib
import ctypes
import itertools
import os
import sys
import threading
import time
import warnings

SAMPLE_SECONDS = 0.2      # how often the load of other programs is read: ~20 µs each time

CpuTimes = collections.namedtuple('CpuTimes', 'busy_seconds own_seconds wall_seconds')


def cpu_times():
    """A snapshot for `load_by_others`: CPU seconds all cores and this process have been busy,
    and the wall clock. The process's own seconds include those of its children once they have
    ended (a training run started with `subprocess.run` is ours, not another program's)."""
    cores, own = _psutil().cpu_times(), _this_process().cpu_times()
    idle = cores.idle + getattr(cores, 'iowait', 0.0)
    own_seconds = own.user + own.system + own.children_user + own.children_system
    return CpuTimes(sum(cores) - idle, own_seconds, time.perf_counter())


def load_by_others(before, after):
    """Cores that other programs kept busy, on average, between two `cpu_times()` snapshots."""
    others = (after.busy_seconds - before.busy_seconds) - (after.own_seconds - before.own_seconds)
    return max(0.0, others / max(after.wall_seconds - before.wall_seconds, 1e-9))


def cores_taken(others, taken=0):
    """Whole cores that other programs hold, from the cores they kept busy on average and the
    count before: one more once they keep it more than half busy, one fewer only once they
    leave it three quarters idle. Without that margin our own threads, which squeeze theirs,
    would flip the count, and every change of BLAS's thread count changes the last bits of
    some products (a matrix times a vector is summed in another order)."""
    while others > taken + 0.5:
        taken += 1
    while taken > 0 and others < taken - 0.75:
        taken -= 1
    return taken


def threads_that_fit(limit, cores, taken, busy_devices=1):
    """The BLAS threads one product may use: the cores that other programs leave free, shared
    among this process's CPU devices computing at once, never more than `limit` (the count the
    process started with) and never fewer than one."""
    return max(1, min(limit, (cores - taken) // max(1, busy_devices)))


def _psutil():
    import psutil             # on first use: importing it costs milliseconds
    return psutil


_process = None


def _this_process():
    global _process
    if _process is None:
        _process = _psutil().Process()
    return _process


class SharedCores:
    """Keep the BLAS threads at `threads_that_fit` while CPU devices compute.

    `fit()` runs before each operation of a CPU device: at most every `SAMPLE_SECONDS` it reads
    the load of other programs, and it sets the count only when the answer changes, so that
    deciding costs a clock read per operation. With division switched on, the devices busy at
    once share the free cores, and keep sharing them until no device is busy, not as soon as
    one is left: devices that work in step (data parallelism) each idle for a moment between
    operations, and giving every thread back then lets the next product of the other device
    start on all of them, beside this device's own; on 2 cores that made a two-device LeNet
    step 1.4× slower than keeping the division until both were done. Division is off by
    default because on the 2-core machine this course is tested on, dividing made two
    concurrent 1000 × 1000 products about 1.2× slower than letting them share every thread
    (benchmarks/parallel.py).
    """

    def __init__(self, cores=None, controllers=None, sample=None):
        from ..device import available_cores    # here: device imports NumPy (see spin_briefly)
        self.cores = cores or available_cores()
        self.enabled = False
        self.devices = 0             # CPU devices with a compute worker
        self.active = False          # enabled, and at least two such devices
        self.busy = 0
        self.sharing = 1             # devices sharing the free cores until no device is busy
        self.limit = None            # the count before the first fit, or last set by others
        self.current = None          # the count this object last set
        self.set_on = None           # the libraries it set it on
        self.others = 0.0            # cores other programs kept busy, last sampled
        self.taken = 0               # whole cores they hold, by cores_taken
        self.changes = 0             # how often the count was changed
        self.sample = sample or cpu_times
        self.last_sample = None      # the sample the next load is measured from
        self.last_sampled = float('-inf')      # when the load was last read, or tried
        self.told = False            # that the sampler failed
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.controllers = controllers     # None: every OpenBLAS loaded, found when needed
        self.found = None                  # those found, until the next load sample

    def add_device(self):
        self.devices += 1
        self.active = self.enabled and self.devices > 1

    def enable(self, enabled):
        """Divide (True) or not (False), from each device's next idle moment; returns the old."""
        old, self.enabled = self.enabled, bool(enabled)
        self.active = self.enabled and self.devices > 1
        return old

    def fit(self):
        """Before an operation: the count that fits the free cores, read again when stale."""
        if time.perf_counter() - self.last_sampled < SAMPLE_SECONDS:     # nearly always
            return
        with self.lock:
            # Another lane may have read the load while this one waited for the lock: a
            # second read now would measure it over a few milliseconds.
            if not self.sampled_recently():
                self.read_load()
                self.found = None          # and look again for an OpenBLAS loaded since
                self.apply()

    def sampled_recently(self):
        return time.perf_counter() - self.last_sampled < SAMPLE_SECONDS

    def read_load(self):
        """Sample the load of other programs and count the cores they take. A load measured
        over less than half the sample period is ignored: the OS counts CPU time in ticks of
        10 ms, and one tick over a gap of 5 ms reads as two cores. A sampler that fails
        keeps the count (it runs in a lane that has taken an operation from its queue)."""
        self.last_sampled = time.perf_counter()
        try:
            now = self.sample()
        except Exception as error:
            self.tell_once(error)
            return
        if self.last_sample is None:
            self.last_sample = now
        elif now.wall_seconds - self.last_sample.wall_seconds >= SAMPLE_SECONDS / 2:
            self.others = load_by_others(self.last_sample, now)
            self.taken = cores_taken(self.others, self.taken)
            self.last_sample = now

    def tell_once(self, error):
        """Say once that the load cannot be read, and what the user can do instead."""
        if self.told:
            return
        self.told = True
        message = (f'd2lperf could not read the load of other programs '
                   f'({type(error).__name__}: {error}), so the BLAS thread count no longer '
                   'follows it and stays as it is; to choose it yourself, use '
                   'threadpoolctl.threadpool_limits(n).')
        try:
            warnings.warn(message, RuntimeWarning)
        except Warning:           # warnings made errors (-W error) must not end the lane
            print(f'RuntimeWarning: {message}', file=sys.stderr)

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
        """Block until no device computes, so that the undivided thread count is back."""
        with self.lock:
            while self.busy:
                self.idle.wait()

    def apply(self):
        """Set the count that fits. A count someone else set since (`threadpool_limits(1)`
        around a benchmark's one-thread row) is the new limit: never more than they asked."""
        if self.limit is None:           # no OpenBLAS to ask: every core, as MKL takes
            self.limit = self.current = self.get() or self.cores
            self.set_on = self.libraries()
        elif (outside := self.get()) not in (None, self.current):
            self.limit = self.current = outside
        # Devices enter and leave only while division is on; the most busy at once since the
        # last idle moment share the cores until the next one.
        self.sharing = max(self.sharing, self.busy) if self.busy else 1
        self.set(threads_that_fit(self.limit, self.cores, self.taken, self.sharing))

    def libraries(self):
        """The OpenBLAS libraries to set, looked for once per load sample rather than each time
        a device starts or stops computing."""
        if self.controllers is not None:
            return self.controllers
        if self.found is None:
            self.found = openblas_thread_controls()
        return self.found

    def get(self):
        """BLAS's thread count now (None: no OpenBLAS to ask)."""
        return max([lib.get_num_threads() or 1 for lib in self.libraries()], default=None)

    def set(self, threads):
        libraries = self.libraries()
        if threads != self.current or libraries is not self.set_on:    # or a new OpenBLAS
            for lib in libraries:
                lib.set_num_threads(threads)
            self.changes += threads != self.current and bool(libraries)
            self.current, self.set_on = threads, libraries

    def threads_in_force(self):
        """The threads one operation may use now: the count that fitted last (1 before the
        first fit), or fewer where someone set BLAS's count lower since (`threadpool_limits(1)`
        around a benchmark's one-thread row). Without OpenBLAS the count still fits the
        free cores: only nobody tells BLAS."""
        fitted, outside = self.current or 1, self.get()
        return max(1, min(fitted, outside or fitted))


class OpenBLASThreads:
    """Get and set one OpenBLAS library's thread count from any thread.

    threadpoolctl's own setter is not used because it lets only one thread (the first to call
    it) change the count, and here every device's worker may.
    """

    def __init__(self, get_num_threads, set_num_threads):
        self.get_num_threads, self.set_num_threads = get_num_threads, set_num_threads


def openblas_thread_controls():
    """One `OpenBLASThreads` per OpenBLAS the process has loaded (none with MKL or Accelerate:
    then `SharedCores` counts the free cores, and nothing sets BLAS's threads).

    Finding them takes a millisecond, so they are found again only once the process has
    imported another module: a new OpenBLAS comes with one (SciPy, imported after NumPy by
    scikit-learn, brings its own). One answer for the whole process, as the libraries are the
    process's."""
    global _controls
    imported = modules_imported()
    if _controls is None or _controls[0] != imported:
        _controls = (imported, tuple(find_openblas()))
    return _controls[1]


_controls = None        # (modules_imported() when found, the controls found then)


def modules_imported():
    """A count that changes whenever the process imports a module, read in nanoseconds."""
    return len(sys.modules)


def find_openblas():
    """An `OpenBLASThreads` for each OpenBLAS loaded now (`openblas_libraries`)."""
    for library in openblas_libraries():
        yield OpenBLASThreads(*openblas_thread_functions(library))


def openblas_libraries():
    """The OpenBLAS libraries loaded now, by one rule: a BLAS library that exports OpenBLAS's
    thread-count functions (`openblas_thread_functions`). One whose threads are OpenMP's is
    left out: its count is per calling thread."""
    for path in loaded_libraries():
        name = os.path.basename(path).lower()
        if name.startswith('lib') and 'blas' in name:       # not a module linked to one
            library = ctypes.CDLL(path)
            if openblas_thread_functions(library) is not None and not uses_openmp(library):
                yield library


def loaded_libraries():
    """The paths of the shared libraries the process has loaded, read without calling back
    into Python: from /proc/self/maps on Linux, from dyld on macOS, none elsewhere.

    Not glibc's `dl_iterate_phdr`, the way threadpoolctl lists them: it calls its Python
    callback while it holds the loader's lock, and the engine's workers look from their own
    threads. Meanwhile the main thread may import an extension module, which holds the GIL and
    waits for that lock: each thread then waits for the other's, for ever."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, '_dyld_image_count'):                      # macOS
        libc._dyld_get_image_name.restype = ctypes.c_char_p
        return [libc._dyld_get_image_name(i).decode()
                for i in range(libc._dyld_image_count())]
    try:
        with open('/proc/self/maps') as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    paths = [f[5].strip() for f in fields if len(f) == 6 and f[5].startswith('/')]
    return list(dict.fromkeys(path for path in paths if '.so' in os.path.basename(path)))


def uses_openmp(library):
    """Whether an OpenBLAS runs its threads with OpenMP (`openblas_get_parallel` says 2)."""
    for prefix, suffix in itertools.product(('', 'scipy_'), ('', '64_', '_64')):
        parallel = getattr(library, f'{prefix}openblas_get_parallel{suffix}', None)
        if parallel is not None:
            return parallel() == 2
    return False


def openblas_thread_functions(library):
    """OpenBLAS's (get, set) thread-count functions in `library`, or None where it has none
    (MKL, BLIS, Accelerate). Some builds rename them: SciPy's wheels put scipy_ before the
    name, and 64_ or _64 after it where integers are 64 bits."""
    for prefix, suffix in itertools.product(('', 'scipy_'), ('', '64_', '_64')):
        get = getattr(library, f'{prefix}openblas_get_num_threads{suffix}', None)
        if get is not None:
            return get, getattr(library, f'{prefix}openblas_set_num_threads{suffix}')
    return None


SPIN = 16       # OpenBLAS's idle threads spin 2**SPIN cycles (tens of µs), not 2**28 (~0.1 s)
RESTART = ('openblas_read_env', 'blas_thread_shutdown_', 'blas_thread_init')


def spin_briefly():
    """Give OpenBLAS idle threads that sleep tens of microseconds after a product, not a tenth
    of a second; called as d2lperf is imported. A value of OPENBLAS_THREAD_TIMEOUT set by the
    user is kept.

    Between products OpenBLAS keeps its threads spinning, so that the next product starts at
    once. Meanwhile they hold cores that the pieces of the next operation (`engine.pieces`),
    another device's worker or another program could use: on 2 cores a LeNet step ran 1.10×
    as fast with the brief spin, and 1.13× with its large operations in pieces
    (benchmarks/training.py, OPENBLAS_THREAD_TIMEOUT=16 against unset, alternating runs).
    OpenBLAS reads the variable as its threads start. Before NumPy is loaded, it is set while
    NumPy loads; after, OpenBLAS's threads are restarted with it (`restart_alone`) where that
    is safe. It is set only for that moment: programs the process starts do not inherit it."""
    if 'OPENBLAS_THREAD_TIMEOUT' in os.environ:
        return
    if 'numpy' not in sys.modules:
        with brief_spin_variable():
            import numpy   # noqa: F401  (its OpenBLAS reads the variable as it loads)
    else:
        restart_alone()


@contextlib.contextmanager
def brief_spin_variable():
    os.environ['OPENBLAS_THREAD_TIMEOUT'] = str(SPIN)
    try:
        yield
    finally:
        del os.environ['OPENBLAS_THREAD_TIMEOUT']


def restart_alone():
    """Restart every loaded OpenBLAS's threads with the brief spin, but only where no other
    thread can be inside a product: a shutdown while another thread's product runs leaves that
    product waiting forever. So every thread of the process but this one must be one of
    OpenBLAS's own idle threads, counted from /proc; elsewhere (a Jupyter kernel's threads,
    another library's pool, no /proc) OpenBLAS keeps its spin. Returns whether it restarted."""
    libraries = list(openblas_libraries())
    if not libraries or not all(hasattr(lib, name) for lib in libraries for name in RESTART):
        return False
    idle_threads = sum(openblas_thread_functions(lib)[0]() - 1 for lib in libraries)
    if idle_threads == 0 or threads_of_this_process() != 1 + idle_threads:
        return False
    with brief_spin_variable():
        for lib in libraries:
            lib.openblas_read_env()          # the variable, read again
            lib.blas_thread_shutdown_()      # idle threads end ...
            lib.blas_thread_init()           # ... and start again with the brief spin
    return True


def threads_of_this_process():
    """The process's threads, Python's and every library's (None where /proc is missing)."""
    try:
        return len(os.listdir('/proc/self/task'))
    except OSError:
        return None


