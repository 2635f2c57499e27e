"""The pace of a virtual CPU device slowed down to stand for a slower one (`device.slow_down`).

Taught in "Distributed Training", where two unequal devices share a batch unevenly.
"""
import time

from ..device import slowdowns


class Pace:
    """The speed of one CPU device, kept by whoever runs its operations (its compute lane, or
    the naive engine): on a device slowed down (`device.slow_down`), each operation is followed
    by the idle time the slower device would have taken longer. That time is owed and paid in
    sleeps of a millisecond or more, as the OS cannot sleep for the few microseconds one
    operation takes; one thread at a time runs a device's operations, so one debt is enough."""

    __slots__ = ('device', 'owed')

    def __init__(self, device):
        self.device, self.owed = device, 0.0

    def run_at_speed(self, op):
        factor = slowdowns.get(self.device)
        if factor is None:
            op.fn()
            return
        start = time.perf_counter()
        op.fn()
        owed = self.owed + (factor - 1) * (time.perf_counter() - start)
        if owed >= 1e-3:
            start = time.perf_counter()
            time.sleep(owed)
            owed -= time.perf_counter() - start
        self.owed = owed
