"""Context parallelism on virtual devices: the causal mask's work per device, counted and
timed, and the three algorithms' times beside one device's.

    python benchmarks/context_parallel.py
    D2LPERF_QUICK=1 python benchmarks/context_parallel.py

First table: for c devices and each layout, max/mean of the counted work (exact: 2 - 1/c
contiguous, 1 zig-zag) beside max/mean of each device's busy seconds from the engine's
records (median over repeats). On a machine with fewer cores than devices the devices queue
for the cores, so the busy times flatten towards each other (the idle floor 1 - cores/c).
Second table: the seconds of a forward pass, ring, all-gather and Ulysses, beside the floor:
one device's tiled attention of the same sequence (median of interleaved repeats).
"""
import os
import statistics

import d2lperf as d2l
import numpy

from d2lperf import np, npx, profiler
from d2lperf.model_parallel import context
from d2lperf.utils import median_seconds
from parallel import report_other_load

SHAPE = d2l.workload((1, 8, 2048, 64), (1, 8, 512, 32))
DEVICE_COUNTS = (2, 4, 8)
REPEATS = d2l.workload(5, 3)


def busy_imbalance(q, group, layout):
    """max/mean of the devices' busy seconds in one forward pass, median over repeats."""
    ratios = []
    for _ in range(REPEATS):
        npx.waitall()
        with profiler.profile() as records:
            context.context_parallel_attention(q, q, q, group, layout=layout)
            npx.waitall()
        ratios.append(context.imbalance(context.busy_per_device(records, group)))
    return statistics.median(ratios)


def main():
    q = np.array(numpy.random.default_rng(0).normal(size=SHAPE).astype(numpy.float32))
    print(f'shape {SHAPE}, {os.cpu_count()} cores')
    print(f'{"devices":>7s} {"layout":>10s} {"counted max/mean":>17s} {"busy max/mean":>14s}')
    for c in DEVICE_COUNTS:
        group = [d2l.cpu(i) for i in range(c)]
        for layout in context.LAYOUTS:
            counted = float(context.imbalance(context.counted_work(c, layout)))
            print(f'{c:7d} {layout:>10s} {counted:17.3f} {busy_imbalance(q, group, layout):14.2f}')
    block = SHAPE[2] // 16

    def run(f):
        return lambda: (f(), npx.waitall())
    print(f'\n{"devices":>7s} {"one device (floor) s":>21s} {"ring s":>8s} {"all-gather s":>13s} '
          f'{"ulysses s":>10s}')
    for c in DEVICE_COUNTS:
        group = [d2l.cpu(i) for i in range(c)]
        runs = {'one': run(lambda: npx.attention(q, q, q, block_size=block))}
        for algorithm in context.ALGORITHMS:
            runs[algorithm] = run(lambda a=algorithm: context.context_parallel_attention(
                q, q, q, group, algorithm=a))
        t = median_seconds(runs, REPEATS)
        print(f'{c:7d} {t["one"]:21.4f} {t["ring"]:8.4f} {t["all_gather"]:13.4f} '
              f'{t["ulysses"]:10.4f}')


if __name__ == '__main__':
    report_other_load(main)
