"""Host memory that the next training step reuses instead of asking the OS for it again.

A training step allocates and frees the same large temporaries every time: im2col columns,
activations and their gradients, tens of MiB each. By default glibc's malloc gives big blocks
back to the OS as soon as they are freed (an `munmap`, or a trim of the heap's top), so the
next step touches brand-new pages and the kernel zeroes each one on a page fault (the
Training section of benchmarks/RESULTS.md says what that cost a LeNet step). MXNet keeps
freed CPU memory in a pool (its pooled storage manager) for the same reason. Here three
`mallopt` settings make glibc do it: one heap for every thread (no per-thread arenas whose
heaps come and go), no block served by `mmap`, and no trimming. The price: the process keeps
its peak heap until it exits. Only glibc has `mallopt`; elsewhere this does nothing. The
engine's workers ask for it when they are imported, before any of their threads allocates.
"""
import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
NEVER = 1 << 30         # bytes: larger than any block a chapter frees


def keep_freed_memory():
    """Ask the C library to keep freed blocks for reuse; True if it took every setting."""
    try:
        mallopt = ctypes.CDLL(None).mallopt      # the C library this process already uses
    except (OSError, AttributeError):            # not glibc (macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, NEVER), (M_TRIM_THRESHOLD, NEVER))
    return all([mallopt(option, value) == 1 for option, value in settings])


def release_freed_memory():
    """Give the blocks kept for reuse back to the OS (glibc's `malloc_trim`): resident memory
    then counts live data only, which a measurement of what a program holds needs."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))
