"""Timing and bookkeeping helpers every chapter uses.

`Benchmark` and `Timer` measure wall-clock time; with an asynchronous engine, what they
measure is only meaningful once the work has been waited for (see "Asynchronous
Computation"). `workload` is the one place that picks a chapter's size from `D2LPERF_QUICK`.
"""
import os
import time

import numpy


def quick_mode():
    """True when `D2LPERF_QUICK=1`: tests and CI shrink every workload to fit 2 CPU cores."""
    return os.environ.get('D2LPERF_QUICK', '0') not in ('', '0', 'false', 'False')


def workload(full, quick):
    """The size a chapter runs: `full` as the text describes it, `quick` under `D2LPERF_QUICK=1`."""
    return quick if quick_mode() else full


class Timer:
    """Record several running times."""

    def __init__(self):
        self.times = []
        self.start()

    def start(self):
        self.tik = time.perf_counter()

    def stop(self):
        """Stop the timer, record the time since `start` and return it in seconds."""
        self.times.append(time.perf_counter() - self.tik)
        return self.times[-1]

    def avg(self):
        return sum(self.times) / len(self.times)

    def sum(self):
        return sum(self.times)

    def cumsum(self):
        return numpy.cumsum(self.times).tolist()


class Benchmark:
    """Context manager that prints how long its body took: `{description}: {secs:.4f} sec`."""

    def __init__(self, description='Done'):
        self.description = description
        self.seconds = None

    def __enter__(self):
        self.timer = Timer()
        return self

    def __exit__(self, *exc_info):
        self.seconds = self.timer.stop()
        print(f'{self.description}: {self.seconds:.4f} sec')


class Accumulator:
    """Sum `n` running quantities (loss, correct predictions, examples seen)."""

    def __init__(self, n):
        self.data = [0.0] * n

    def add(self, *args):
        self.data = [a + float(b) for a, b in zip(self.data, args)]

    def reset(self):
        self.data = [0.0] * len(self.data)

    def __getitem__(self, idx):
        return self.data[idx]


def memory_in_use(device=None):
    """Bytes this process holds: host memory (resident set) and, on a GPU, CuPy's pool in use."""
    import psutil
    used = {'host': psutil.Process().memory_info().rss, 'device': None}
    if device is not None and device.kind == 'gpu':
        used['device'] = device.xp.get_default_memory_pool().used_bytes()
    return used
