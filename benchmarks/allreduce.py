"""Allreduce on virtual devices (and GPUs where present), in the format of nccl-tests.

    python benchmarks/allreduce.py            # 1 KiB to 64 MiB
    D2LPERF_QUICK=1 python benchmarks/allreduce.py

Columns: size (bytes of float32 on each device), algorithm, devices, time (median of
interleaved repeats, µs), algbw = size / time and busbw = algbw · 2(n-1)/n (GB/s), and #wrong:
elements, over all devices, that differ from a NumPy reduction of the same data (checked on
a first run with random values; the timed runs reduce zeros, which cost the same).
The `floor` rows are what no algorithm on one memory system can beat: an n-way `np.add` and
one copy of the result, plain NumPy on preallocated arrays, so bound by memory bandwidth.
With CuPy and two or more GPUs, GPU rows follow, with NCCL (`cupy.cuda.nccl`) as reference.
Target (issue 10): ring busbw at 64 MiB on 2 devices ≥ 50 % of the floor's, #wrong = 0.
"""
import os
import platform

# d2lperf before NumPy, as the chapters: OpenBLAS then loads with its brief spin
# (engine/blas.py, spin_briefly), which the rows measured so far ran with.
import d2lperf as d2l
import numpy

from d2lperf import comm, np, npx
from d2lperf.comm.cost import bus_bandwidth
from d2lperf.utils import median_seconds
from parallel import report_other_load

ALGORITHMS = ('naive', 'cpu', 'split', 'tree', 'ring', 'ring2')
SIZES = [2 ** k for k in d2l.workload(range(10, 27, 2), [10, 16, 22])]
DEVICE_COUNTS = (2, 4, 8)
REPEATS = d2l.workload(5, 3)


def until_done(fn):
    return lambda: (fn(), npx.waitall())


def wrong_elements(algorithm, size, devices):
    """How many elements of an allreduce of random data differ from NumPy's sum."""
    rng = numpy.random.default_rng(size)
    hosts = [rng.standard_normal(size // 4, dtype=numpy.float32) for _ in devices]
    arrays = [np.array(h, device=d) for h, d in zip(hosts, devices)]
    comm.allreduce(arrays, algorithm)
    expected = numpy.sum(hosts, axis=0, dtype=numpy.float64)
    return sum(int((~numpy.isclose(a.asnumpy(), expected, rtol=1e-5, atol=1e-5)).sum())
               for a in arrays)


def time_algorithms(size, devices):
    """{algorithm: median seconds} of allreduce over zeros, the algorithms interleaved."""
    arrays = [np.zeros(size // 4, device=d) for d in devices]
    runs = {a: until_done(lambda a=a: comm.allreduce(arrays, a)) for a in ALGORITHMS}
    return median_seconds(runs, REPEATS, min_seconds=0.02)


def floor_seconds(size, n):
    """Median seconds of an n-way np.add and one copy, on preallocated float32 arrays."""
    arrays = [numpy.zeros(size // 4, dtype=numpy.float32) for _ in range(n + 2)]
    total, copy, inputs = arrays[0], arrays[1], arrays[2:]

    def reduce_and_copy():
        numpy.add(inputs[0], inputs[1], out=total)
        for other in inputs[2:]:
            numpy.add(total, other, out=total)
        numpy.copyto(copy, total)
    return median_seconds(reduce_and_copy, REPEATS, min_seconds=0.02)


def row(size, algorithm, n, seconds, wrong):
    algbw = size / seconds / 1e9
    busbw = bus_bandwidth(size, seconds, n) / 1e9
    print(f'{size:>10d}  {algorithm:>9s}  {n:>7d}  {seconds * 1e6:>11.1f}  {algbw:>11.3f}  '
          f'{busbw:>11.3f}  {wrong:>6}', flush=True)
    return busbw


def cpu_rows():
    """Print every CPU row; return {(size, n, algorithm): busbw} for the verdict."""
    busbw = {}
    for n in DEVICE_COUNTS:
        devices = [d2l.cpu(i) for i in range(1, n + 1)]
        for size in SIZES:
            wrong = {a: wrong_elements(a, size, devices) for a in ALGORITHMS}
            times = time_algorithms(size, devices)
            for algorithm in ALGORITHMS:
                busbw[size, n, algorithm] = row(size, algorithm, n, times[algorithm],
                                                wrong[algorithm])
            busbw[size, n, 'floor'] = row(size, 'floor', n, floor_seconds(size, n), '-')
    return busbw


def gpu_rows():
    """The same on GPUs, with NCCL's allreduce as the reference row (CuPy and 2+ GPUs)."""
    count = d2l.num_gpus()
    if count < 2:
        print('# GPU rows skipped: needs CuPy and at least two GPUs')
        return
    import cupy
    from cupy.cuda import nccl
    for n in sorted({2, count}):
        devices = [d2l.gpu(i) for i in range(n)]
        communicators = nccl.NcclCommunicator.initAll(list(range(n)))
        for size in SIZES:
            wrong = {a: wrong_elements(a, size, devices) for a in ALGORITHMS}
            times = time_algorithms(size, devices)
            for algorithm in ALGORITHMS:
                row(size, algorithm, n, times[algorithm], wrong[algorithm])
            row(size, 'nccl', n, nccl_seconds(cupy, nccl, communicators, size), '-')


def nccl_seconds(cupy, nccl, communicators, size):
    buffers = []
    for i in range(len(communicators)):
        with cupy.cuda.Device(i):
            buffers.append(cupy.zeros(size // 4, dtype=cupy.float32))

    def allreduce():
        nccl.groupStart()
        for i, (communicator, buffer) in enumerate(zip(communicators, buffers)):
            with cupy.cuda.Device(i):
                communicator.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                                       nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                       cupy.cuda.get_current_stream().ptr)
        nccl.groupEnd()
        for i in range(len(communicators)):
            with cupy.cuda.Device(i):
                cupy.cuda.get_current_stream().synchronize()
    return median_seconds(allreduce, REPEATS, min_seconds=0.02)


def verdict(busbw):
    size = max(SIZES)
    ring, floor = busbw[size, 2, 'ring'], busbw[size, 2, 'floor']
    print(f'# target: ring busbw at {size / 2 ** 20:g} MiB on 2 devices >= 50 % of the floor: '
          f'{ring:.3f} / {floor:.3f} GB/s = {100 * ring / floor:.0f} %, '
          f'{"met" if ring >= 0.5 * floor else "missed"}')


def main():
    print(f'# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
          f'{d2l.num_gpus()} GPUs; float32, median of {REPEATS} interleaved repeats')
    print(f'# {"size":>8s}  {"algorithm":>9s}  {"devices":>7s}  {"time (us)":>11s}  '
          f'{"algbw GB/s":>11s}  {"busbw GB/s":>11s}  {"#wrong":>6s}')
    def table():
        busbw = cpu_rows()
        gpu_rows()
        verdict(busbw)
    report_other_load(table, prefix='# ')


if __name__ == '__main__':
    main()
