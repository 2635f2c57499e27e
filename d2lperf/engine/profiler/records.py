"""Taking a profile and reading it: what every operation did, on which worker, when.

The records are the engine's own (`engine.start_recording`), so switching the profiler off
costs one branch per operation. Each has the operation's name, device, worker (a device's
compute, copy-in or copy-out lane) and its start and end; on a GPU the times come from CUDA
events around the kernels, not from the host clock. Taught in "Automatic Parallelism".
"""
import contextlib

from ... import engine
from ...device import cupy_module

_last = []          # the records of the last profile, for dump() and plot() without arguments


def start():
    """Record every operation pushed from now on; returns the list the records go to."""
    return engine.start_recording()


def stop():
    """Stop recording, wait for the recorded work, and return its records (device times)."""
    records = engine.stop_recording()
    use_device_times(records)
    _last[:] = [r for r in records if r.start is not None]
    return list(_last)


@contextlib.contextmanager
def profile():
    """`with profile() as records:` records the block; the records are complete after it."""
    records = start()
    try:
        yield records
    finally:
        stop()


def use_device_times(records, elapsed_ms=None):
    """Give GPU operations their kernel times, from CUDA events, on the host clock.

    Events only measure time between events, so each GPU's events are placed on the host
    clock with one offset: the smallest that starts no kernel before its worker launched it.
    """
    if elapsed_ms is None:
        elapsed_ms = _cuda_elapsed_ms
    by_device = {}
    for r in records:
        if r.events is not None:
            by_device.setdefault(r.device, []).append(r)
    for group in by_device.values():
        reference = group[0].events[0]
        relative = [(elapsed_ms(reference, r.events[0]) / 1e3,
                     elapsed_ms(reference, r.events[1]) / 1e3) for r in group]
        offset = max(r.start - begin for r, (begin, _) in zip(group, relative))
        for r, (begin, end) in zip(group, relative):
            r.start, r.end, r.events = offset + begin, offset + end, None
    return records


def _cuda_elapsed_ms(first, second):
    return cupy_module().cuda.get_elapsed_time(first, second)


# -- reading a profile ------------------------------------------------------------------------

def lanes(records=None):
    """{worker: [(start, end, record), ...]} sorted by start: the rows of the timeline."""
    rows = {}
    for r in sorted(records_or_last(records), key=lambda r: r.start):
        rows.setdefault(r.worker, []).append((r.start, r.end, r))
    return rows


def busy_time(intervals):
    """Seconds covered by at least one of the (start, end, ...) intervals."""
    total, reach = 0.0, float('-inf')
    for start, end, *_ in sorted(intervals, key=lambda i: i[0]):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def overlap(records, first, second):
    """Seconds during which the workers `first` and `second` were both running something."""
    rows = lanes(records)
    a, b = rows.get(first, []), rows.get(second, [])
    return busy_time(a) + busy_time(b) - busy_time(a + b)


def summary(records=None):
    """Per worker: operations, busy seconds and share of the whole span; prints and returns."""
    records = records_or_last(records)
    span = max(r.end for r in records) - min(r.start for r in records)
    table = {w: (len(rows), busy_time(rows)) for w, rows in lanes(records).items()}
    print(f'{"worker":18s} {"ops":>5s} {"busy s":>9s} {"of span":>8s}')
    for worker, (count, busy) in table.items():
        print(f'{worker:18s} {count:5d} {busy:9.4f} {100 * busy / span:7.1f}%')
    print(f'{"span":18s} {"":5s} {span:9.4f}')
    return {'span': span, 'workers': table}


def records_or_last(records):
    records = _last if records is None else records
    if not records:
        raise ValueError('no profile yet: record one with profiler.start() and profiler.stop()')
    return records
