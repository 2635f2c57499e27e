"""The profiler: what every engine operation did, on which worker, from when to when.

It is the engine's own record of what ran (`engine.start_recording`), so switching it off
costs one branch per operation, and `profile()` is the package's one way to take it: the
dependency graphs of "Asynchronous Computation" are drawn from the same records. Each record has the operation's name, device, worker (a device's compute,
copy-in or copy-out lane) and its start and end; on a GPU the times come from CUDA events
around the kernels, not from the host clock. `dump` writes the Chrome trace event format
(open it in https://ui.perfetto.dev or chrome://tracing); `plot` draws one lane per worker,
so overlap can be seen. Taught in "Automatic Parallelism".

    d2l.profiler.start()
    ...                                   # push work
    records = d2l.profiler.stop()         # waits for it
    d2l.profiler.dump('trace.json')
    d2l.profiler.plot()
"""
import contextlib
import json

from . import engine
from .utils import atomic_write

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
    import cupy
    return cupy.cuda.get_elapsed_time(first, second)


# -- reading a profile ------------------------------------------------------------------------

def lanes(records=None):
    """{worker: [(start, end, record), ...]} sorted by start: the rows of the timeline."""
    rows = {}
    for r in sorted(_or_last(records), key=lambda r: r.start):
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
    records = _or_last(records)
    span = max(r.end for r in records) - min(r.start for r in records)
    table = {w: (len(rows), busy_time(rows)) for w, rows in lanes(records).items()}
    print(f'{"worker":18s} {"ops":>5s} {"busy s":>9s} {"of span":>8s}')
    for worker, (count, busy) in table.items():
        print(f'{worker:18s} {count:5d} {busy:9.4f} {100 * busy / span:7.1f}%')
    print(f'{"span":18s} {"":5s} {span:9.4f}')
    return {'span': span, 'workers': table}


# -- showing a profile ------------------------------------------------------------------------

def chrome_trace(records=None):
    """The Chrome trace event format: one complete event ('X') per operation, in µs.

    A device is a process and each of its lanes a thread, named by metadata events.
    """
    records = _or_last(records)
    origin = min((r.start for r in records), default=0.0)
    devices, workers, events = {}, {}, []
    for r in records:
        pid = devices.setdefault(str(r.device), len(devices))
        if r.worker not in workers:
            workers[r.worker] = (pid, len(workers))
            events.append({'name': 'thread_name', 'ph': 'M', 'pid': pid,
                           'tid': workers[r.worker][1], 'args': {'name': r.worker}})
        events.append({'name': r.name, 'cat': r.lane, 'ph': 'X', 'pid': pid,
                       'tid': workers[r.worker][1], 'ts': (r.start - origin) * 1e6,
                       'dur': (r.end - r.start) * 1e6,
                       'args': {'device': str(r.device), 'reads': r.reads, 'writes': r.writes}})
    events += [{'name': 'process_name', 'ph': 'M', 'pid': pid, 'args': {'name': device}}
               for device, pid in devices.items()]
    return {'traceEvents': events, 'displayTimeUnit': 'ms'}


def dump(path='trace.json', records=None):
    """Write the profile as a Chrome trace (open it in Perfetto or chrome://tracing),
    atomically: a reader, or a crash, never sees half a trace."""
    text = json.dumps(chrome_trace(records))
    atomic_write(path, lambda file: file.write(text.encode()))
    return path


COLORS = {engine.COMPUTE: '#3367d6', engine.COPY_IN: '#e8710a', engine.COPY_OUT: '#0f9d58'}


def plot(records=None, ax=None, label_ops=False):
    """A timeline: one lane per worker, a bar per operation (ms from the first start)."""
    import matplotlib.pyplot as plt
    rows = lanes(records)
    origin = min(start for row in rows.values() for start, _, _ in row)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.2))
    for y, (worker, row) in enumerate(sorted(rows.items(), reverse=True)):
        bars = [((s - origin) * 1e3, (e - s) * 1e3) for s, e, _ in row]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS.get(row[0][2].lane, '#777'),
                       edgecolors='white', linewidth=0.5)
        if label_ops:
            for (x, width), (_, _, r) in zip(bars, row):
                ax.text(x + width / 2, y, r.name, ha='center', va='center', fontsize=7,
                        color='white', clip_on=True)
    ax.set_yticks(range(len(rows)), sorted(rows, reverse=True))
    ax.set_xlabel('time (ms)')
    ax.set_xlim(left=0)
    ax.grid(axis='x', alpha=0.3)
    return ax


def _or_last(records):
    records = _last if records is None else records
    if not records:
        raise ValueError('no profile yet: record one with profiler.start() and profiler.stop()')
    return records
