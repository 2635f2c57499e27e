"""Host memory that the next training step reuses instead of asking the OS for it again.

A training step allocates and frees the same large temporaries every time: im2col columns,
activations and their gradients, tens of MiB each. By default glibc's malloc gives big blocks
back to the OS as soon as they are freed (an `munmap`, or a trim of the heap's top), so the
next step touches brand-new pages and the kernel zeroes each one on a page fault (the
Training section of benchmarks/RESULTS.md says what that cost a LeNet step). MXNet keeps
freed CPU memory in a pool (its pooled storage manager) for the same reason. Here three
`mallopt` settings make glibc do it: one heap for every thread (no per-thread arenas whose
heaps come and go), no block served by `mmap`, and no trimming. The price: the process keeps
its peak heap until it exits. Only glibc has `mallopt`; elsewhere this does nothing.

One limit: glibc fixes its count of heaps when a second thread first allocates. Where other
threads did so before the setting (CUDA's, once CuPy has been used), each worker thread
started later gets a heap of its own, and such a heap is at most 64 MiB: freed blocks below
that are kept as above, a block of 64 MiB or more is mapped afresh each time (an H200
machine's unit tests counted 544 page faults a step for 64 MiB; tests/test_freed_memory.py).

The setting belongs to the process that runs the work, so it is made in one place, once: when
the engine starts its first worker thread (`workers.Workers.start`; the naive engine, when it
runs its first operation), before any of those threads allocates. Importing d2lperf leaves
the C library as it was. A distributed job gets it the same way, in every rank whose engine
starts: MPICH's and NumPy's buffers for a large message are such blocks too, allocated afresh
for each transfer (RESULTS.md, "Allocator settings", measured what keeping them saves).
"""
import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
NEVER = 1 << 30         # bytes: larger than any block a chapter frees

kept = None             # keep_freed_memory's answer once asked (None: the C library untouched)


def keep_freed_memory():
    """Ask the C library to keep freed blocks for reuse, once a process; True if it took
    every setting (the answer of the first call, which made the settings)."""
    global kept
    if kept is None:
        kept = _set((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, NEVER), (M_TRIM_THRESHOLD, NEVER))
    return kept


def returning_freed_memory():
    """glibc's own thresholds for the duration of a `with` block: big blocks are mapped and
    unmapped one by one again, so that resident memory follows live data, as a measurement of
    what a program holds needs; the blocks kept so far are given back first."""
    return _Thresholds()


class _Thresholds:
    DEFAULT = 128 * 1024         # glibc's starting mmap and trim thresholds, in bytes

    def __enter__(self):
        keep_freed_memory()      # decided now, so an engine starting inside cannot undo this
        _set((M_MMAP_THRESHOLD, self.DEFAULT), (M_TRIM_THRESHOLD, self.DEFAULT))
        _trim()

    def __exit__(self, *exc):
        _set((M_MMAP_THRESHOLD, NEVER), (M_TRIM_THRESHOLD, NEVER))


def _set(*settings):
    """mallopt each (option, value); True if the C library took them all."""
    try:
        mallopt = ctypes.CDLL(None).mallopt      # the C library this process already uses
    except (OSError, AttributeError):            # not glibc (macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(option, value) == 1 for option, value in settings])


def _trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
