"""Intra-op parallelism: a large operation cut into pieces that run on the device's cores at once.

NumPy runs a copy, an elementwise function or a reduction on one core, and lets go of the
interpreter lock while it does. An operation cut along one axis into pieces, each run by its
own thread, keeps every core busy and gives, bit for bit, the values of the whole: every
element is computed by the same code from the same inputs, only on another core. Products are
not cut: BLAS has threads of its own. A device runs one operation at a time, so a product never
competes with the pieces of another operation of the same device.

How many pieces (`count`): one for every half `SPLIT_BYTES` of an operation's bytes, times its
`weight` (how much sooner than a copy it gains from being cut), up to the threads one operation
may use (`Engine.threads_per_operation`: the cores other programs leave free, divided among the
CPU devices computing at once with `engine.set_blas_division(True)` (`blas.SharedCores`); one
on the naive engine). A piece must pay for waking a thread and waiting for it, so an operation
takes a second core from `SPLIT_BYTES` of weighted bytes, and a core more for every half
`SPLIT_BYTES` after: a machine with more cores gives them to the larger operations, each
piece still large enough to pay. The first piece runs on the calling thread, the others on
the process's `piece_threads`. Taught in "Training on Multiple GPUs" ("Sharing the cores
well").
"""
import concurrent.futures
import os
import threading

# Measured on the course's 2-core VM (`python benchmarks/parallel.py`, table "Pieces"): a
# strided copy cut in two took 1.6 times as long as the whole at 1 MB, as long at 2 MB, 0.8
# times at 4 MB and 0.55 at 8 MB. Waking a piece thread and waiting for it costs 25-65 µs
# (RESULTS.md, "Pieces for the GPT's passes"), and each NumPy call of a piece takes the
# interpreter lock in turn with the other pieces. So a copy is cut from 8 MB, in pieces of
# 4 MB or more; a pass with more arithmetic a byte gains sooner, by its `weight`.
SPLIT_BYTES = 8 << 20


def count(nbytes, weight=1):
    """How many pieces an operation over `nbytes` should be cut into (1: run it whole):
    `weight` is how many times sooner than a copy it gains from being cut (GELU's tanh: 8)."""
    most = int(nbytes * weight // (SPLIT_BYTES / 2))
    if most < 2:
        return 1
    from . import current                      # the engine in use (a package import, no cycle)
    return min(most, current().threads_per_operation())


def spans(size, pieces):
    """`pieces` (start, stop) spans that cover range(size) in order, as even as can be; fewer
    where size < pieces, so that none is empty."""
    pieces = max(1, min(pieces, size))
    bounds = [size * i // pieces for i in range(pieces + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def run(piece, size, pieces):
    """Call `piece(start, stop)` for each span of range(size): the first on this thread, the
    others on `piece_threads`, all at once; return when all are done. A piece's error is raised
    here, after every piece has finished (the first one raised, if several did)."""
    parts = spans(size, pieces)
    if len(parts) == 1:
        piece(0, size)
        return
    futures = [piece_threads.submit(piece, start, stop) for start, stop in parts[1:]]
    error = None
    try:
        piece(*parts[0])
    except Exception as raised:                  # noqa: BLE001 - raised below, once all are done
        error = raised
    for future in futures:
        raised = future.exception()
        error = error or raised
    if error is not None:
        raise error


class PieceThreads:
    """The threads that run the pieces after the first, started by the first operation cut.

    One set for the process, as there is one set of cores: engines come and go (`engine.use`)
    and share them. The lock keeps two devices' first cut operations from starting two sets.
    """

    def __init__(self):
        self.pool, self.lock = None, threading.Lock()

    def submit(self, piece, start, stop):
        if self.pool is None:
            with self.lock:
                if self.pool is None:
                    self.pool = concurrent.futures.ThreadPoolExecutor(
                        max(1, (os.cpu_count() or 2) - 1), thread_name_prefix='d2lperf-piece')
        return self.pool.submit(piece, start, stop)


piece_threads = PieceThreads()


def copy(xp, view):
    """A contiguous copy of `view` (`xp.ascontiguousarray`), in pieces along its first axis
    that is long enough (im2col's columns are such a copy)."""
    pieces = count(view.nbytes) if xp.__name__ == 'numpy' else 1
    if pieces == 1:
        return xp.ascontiguousarray(view)
    out = xp.empty(view.shape, view.dtype)
    axis = next((a for a, n in enumerate(view.shape) if n >= pieces), 0)

    def piece(start, stop):
        where = (slice(None),) * axis + (slice(start, stop),)
        out[where] = view[where]
    run(piece, view.shape[axis], pieces)
    return out


def over_axis(xp, size, nbytes, piece, weight=1):
    """Run `piece(start, stop)` over range(size) (an axis the caller's work is independent
    along), in pieces where it is large enough (`count`), else whole."""
    pieces = count(nbytes, weight) if xp.__name__ == 'numpy' else 1
    run(piece, size, pieces)


def elementwise(xp, piece, like, *inputs, weight=1):
    """A new array shaped and laid out as `like`, filled by `piece(out, *inputs)` (NumPy
    functions with `out=`, applied element by element; the inputs shaped as `like`), in pieces
    where large: flat pieces where every array is one contiguous block, else pieces along the
    axis outermost in memory, every piece a block of whole rows of memory."""
    out = xp.empty_like(like)
    arrays = (out,) + inputs
    if all(a.flags.c_contiguous for a in arrays):         # one block each: cut them flat
        arrays, axis = tuple(a.reshape(-1) for a in arrays), 0
    else:
        axis = max(range(out.ndim), key=lambda a: (out.shape[a] > 1, abs(out.strides[a])))

    def block(start, stop):
        where = (slice(None),) * axis + (slice(start, stop),)
        piece(*[a[where] for a in arrays])
    if out.ndim:
        over_axis(xp, arrays[0].shape[axis], out.nbytes, block, weight)
    else:
        piece(out, *inputs)
    return out
