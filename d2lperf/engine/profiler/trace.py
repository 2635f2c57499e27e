"""A profile as a Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing."""
import json

from ...utils import atomic_write
from .records import records_or_last


def chrome_trace(records=None):
    """The Chrome trace event format: one complete event ('X') per operation, in µs.

    A device is a process and each of its lanes a thread, named by metadata events.
    """
    records = records_or_last(records)
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
                       'args': {'device': str(r.device), 'reads': r.reads, 'writes': r.writes,
                                'helped by': r.helped}})
    events += [{'name': 'process_name', 'ph': 'M', 'pid': pid, 'args': {'name': device}}
               for device, pid in devices.items()]
    return {'traceEvents': events, 'displayTimeUnit': 'ms'}


def dump(path='trace.json', records=None):
    """Write the profile as a Chrome trace (open it in Perfetto or chrome://tracing),
    atomically: a reader, or a crash, never sees half a trace."""
    text = json.dumps(chrome_trace(records))
    atomic_write(path, lambda file: file.write(text.encode()))
    return path
