"""The profiler: what every engine operation did, on which worker, from when to when.

`profile()` is the package's one way to take a profile (`records.py`); the dependency graphs
of "Asynchronous Computation" are drawn from the same records (`depgraph.py`). `dump` writes
the Chrome trace event format (`trace.py`); `plot` draws one lane per worker (`timeline.py`).
Taught in "Automatic Parallelism".

    d2l.profiler.start()
    ...                                   # push work
    records = d2l.profiler.stop()         # waits for it
    d2l.profiler.dump('trace.json')
    d2l.profiler.plot()
"""
from .records import (busy_time, lanes, overlap, profile, start, stop, summary,  # noqa: F401
                      use_device_times)
from .trace import chrome_trace, dump                                      # noqa: F401
from .timeline import COLORS, plot                                         # noqa: F401
from . import depgraph                                                     # noqa: F401
