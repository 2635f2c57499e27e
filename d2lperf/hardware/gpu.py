"""GPU microbenchmarks for the chapter "Hardware" (chapters/hardware.md): device memory
bandwidth, host<->device copies, kernel launch latency, and matrix multiply in float32,
TF32, float16 and bfloat16 (the last three on tensor cores where the GPU has them).

CuPy is imported (through `device.cupy_or_none`) only when asked; without a GPU every
measurement prints that none was found and returns an empty table. Timings use CUDA events on the current stream.
"""
import time

import numpy

from ..device import cupy_or_none
from ..utils import median_seconds, workload

# Enumerations from CUDA's library_types.h and cublas_api.h, spelled out so that the
# matrix multiply below does not depend on how a CuPy version names them.
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_OP_N, CUBLAS_GEMM_DEFAULT, CUBLAS_POINTER_MODE_HOST = 0, -1, 0

# mode: (storage dtype, CUDA data type, cuBLAS compute type). bfloat16 has no NumPy dtype:
# it is stored as the upper 16 bits of a float32, in uint16.
GEMM_MODES = {'float32': (numpy.float32, CUDA_R_32F, CUBLAS_COMPUTE_32F),
              'tf32': (numpy.float32, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32),
              'float16': (numpy.float16, CUDA_R_16F, CUBLAS_COMPUTE_32F),
              'bfloat16': (numpy.uint16, CUDA_R_16BF, CUBLAS_COMPUTE_32F)}


def _no_gpu(what):
    print(f'No GPU found: skipping {what}.')
    return []


def gpu_summary():
    """Name, memory, SMs and clocks of each GPU; an empty list without one."""
    cp = cupy_or_none()
    if cp is None:
        return []
    gpus = []
    for device in range(cp.cuda.runtime.getDeviceCount()):
        p = cp.cuda.runtime.getDeviceProperties(device)
        name = p['name'].decode() if isinstance(p['name'], bytes) else str(p['name'])
        memory_khz, bus_bits = p.get('memoryClockRate') or 0, p.get('memoryBusWidth') or 0
        gpus.append({'name': name, 'compute_capability': f"{p['major']}.{p['minor']}",
                     'memory_bytes': p['totalGlobalMem'],
                     'multiprocessors': p['multiProcessorCount'],
                     'sm_clock_mhz': (p.get('clockRate') or 0) / 1e3,
                     'memory_clock_mhz': memory_khz / 1e3, 'memory_bus_bits': bus_bits,
                     'l2_cache_bytes': p.get('l2CacheSize') or 0,
                     # double data rate: two transfers per clock on each bus line
                     'peak_memory_gb_per_s': 2 * memory_khz * 1e3 * bus_bits / 8 / 1e9})
    return gpus


GPU_MIN_SECONDS = 1e-3        # each timed batch of GPU calls lasts at least this long


def gpu_seconds(cp, run, repeats):
    """`utils.median_seconds` of GPU work, on the CUDA-event clock."""
    return median_seconds(run, repeats, GPU_MIN_SECONDS, cuda_clock(cp))


def cuda_clock(cp):
    """A clock for `utils.median_seconds` that times GPU work with CUDA events: calls are
    queued back to back between two events, so the host's time to issue one call does not
    show as GPU idle time."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def time_calls(run, calls):
        start.record()
        for _ in range(calls):
            run()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) / 1e3
    return time_calls


def _device_stream_seconds(cp, kernel, n, repeats):
    """Seconds of one copy or triad over float64 device arrays of n elements."""
    a, b, c = cp.zeros(n), cp.ones(n), cp.full(n, 2.0)
    if kernel == 'copy':
        return gpu_seconds(cp, lambda: cp.copyto(a, b), repeats)
    triad = cp.ElementwiseKernel('float64 b, float64 c, float64 s', 'float64 a',
                                 'a = b + s * c', 'd2lperf_triad')
    return gpu_seconds(cp, lambda: triad(b, c, 3.0, a), repeats)


def gpu_memory_bandwidth(working_sets_bytes=None, repeats=5):
    """GB/s of copy (`a = b`) and triad (`a = b + 3 c`, one fused kernel) in device memory,
    counting bytes read + written as STREAM does (16 and 24 bytes per float64)."""
    cp = cupy_or_none()
    if cp is None:
        return _no_gpu('device memory bandwidth')
    free_bytes, _ = cp.cuda.runtime.memGetInfo()
    working_sets_bytes = working_sets_bytes or [2 ** k for k in range(20, workload(33, 27), 2)]
    rows = []
    for size in [s for s in working_sets_bytes if s < free_bytes // 2]:
        for kernel, arrays, per_element in (('copy', 2, 16), ('triad', 3, 24)):
            n = size // (8 * arrays)
            seconds = _device_stream_seconds(cp, kernel, n, repeats)
            rows.append({'kernel': kernel, 'working_set_bytes': 8 * arrays * n,
                         'bytes_counted': per_element * n, 'seconds': seconds,
                         'gb_per_s': per_element * n / seconds / 1e9})
    return rows


def host_device_copies(sizes_bytes=None, repeats=5):
    """GB/s of copies between host and device memory, from pageable and from pinned
    (page-locked) host buffers; pinned ones let the GPU's DMA engine read them directly."""
    cp = cupy_or_none()
    if cp is None:
        return _no_gpu('host<->device copies')
    sizes_bytes = sizes_bytes or [2 ** k for k in range(12, workload(31, 27), 3)]
    rows = []
    for size in sizes_bytes:
        device = cp.empty(size, numpy.uint8)
        hosts = {'pageable': numpy.ones(size, numpy.uint8),
                 'pinned': numpy.frombuffer(cp.cuda.alloc_pinned_memory(size), numpy.uint8, size)}
        for memory, host in hosts.items():
            for direction, run in (('host to device', lambda: device.set(host)),
                                   ('device to host', lambda: device.get(out=host))):
                seconds = gpu_seconds(cp, run, repeats)
                rows.append({'direction': direction, 'host_memory': memory, 'bytes': size,
                             'seconds': seconds, 'gb_per_s': size / seconds / 1e9})
    return rows


def kernel_launch_latency(launches=None):
    """Microseconds per launch of an empty kernel: queued back to back (the host's cost to
    issue one), and each waited for before the next (the full round trip)."""
    cp = cupy_or_none()
    if cp is None:
        return _no_gpu('kernel launch latency')
    launches = launches or workload(10000, 1000)
    empty = cp.RawKernel(r'extern "C" __global__ void d2lperf_empty() {}', 'd2lperf_empty')
    stream = cp.cuda.get_current_stream()

    def queued():
        for _ in range(launches):
            empty((1,), (1,), ())
        stream.synchronize()

    def waited():
        for _ in range(launches):
            empty((1,), (1,), ())
            stream.synchronize()
    rows = []
    for mode, run in (('queued', queued), ('launch and wait', waited)):
        run()   # warm-up: compiles and loads the kernel
        start = time.perf_counter()
        run()
        rows.append({'mode': mode, 'launches': launches,
                     'us_per_launch': (time.perf_counter() - start) / launches * 1e6})
    return rows


def _to_storage(cp, x, dtype):
    """float32 device array -> the storage of a GEMM mode (bfloat16: truncated high bits)."""
    if dtype is numpy.uint16:
        return (x.view(cp.uint32) >> 16).astype(cp.uint16)
    return x.astype(dtype)


def _to_float64(cp, x, dtype):
    if dtype is numpy.uint16:
        return (x.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return x.astype(cp.float64)


def gemm(cp, a, b, c, data_type, compute_type):
    """c = a @ b for square row-major matrices through cublasGemmEx.

    cuBLAS is column-major: read as column-major, our row-major a and b are a^T and b^T,
    and b^T a^T = (a b)^T, which read back as row-major is a b. Hence b goes first."""
    n, cublas = a.shape[0], cp.cuda.cublas
    handle = cp.cuda.device.get_cublas_handle()
    one, zero = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.float32)   # 32F compute: float32 scalars
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)   # alpha, beta live on the host
    try:
        cublas.gemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, one.ctypes.data,
                      b.data.ptr, data_type, n, a.data.ptr, data_type, n,
                      zero.ctypes.data, c.data.ptr, data_type, n, compute_type,
                      CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)


def gemm_error(cp, mode, n=64):
    """Largest error of one small product in `mode`, relative to the largest entry of the
    float64 product of the same (already rounded) inputs."""
    dtype, data_type, compute_type = GEMM_MODES[mode]
    x = cp.random.RandomState(0).uniform(-0.5, 0.5, (2, n, n), dtype=cp.float32)
    a, b = _to_storage(cp, x[0], dtype), _to_storage(cp, x[1], dtype)
    c = cp.empty((n, n), dtype)
    gemm(cp, a, b, c, data_type, compute_type)
    exact = _to_float64(cp, a, dtype) @ _to_float64(cp, b, dtype)
    return float(cp.abs(_to_float64(cp, c, dtype) - exact).max() / cp.abs(exact).max())


def gpu_matmul_flops(n=None, modes=tuple(GEMM_MODES), repeats=5):
    """TFLOP/s of an n x n matrix product in each mode, with the mode's relative error.

    float16 and bfloat16 accumulate in float32. A mode the GPU refuses (bfloat16 needs
    compute capability 8.0) is reported and left out; TF32 on an older GPU runs as float32."""
    cp = cupy_or_none()
    if cp is None:
        return _no_gpu('GPU matrix multiply')
    n = n or workload(8192, 2048)
    flops = n * n * (2 * n - 1)
    rows = []
    for mode in modes:
        dtype, data_type, compute_type = GEMM_MODES[mode]
        x = cp.random.RandomState(1).uniform(-0.5, 0.5, (2, n, n), dtype=cp.float32)
        a, b = _to_storage(cp, x[0], dtype), _to_storage(cp, x[1], dtype)
        c = cp.empty((n, n), dtype)
        del x
        try:
            error = gemm_error(cp, mode)
            seconds = gpu_seconds(cp, lambda: gemm(cp, a, b, c, data_type, compute_type), repeats)
        except cp.cuda.cublas.CUBLASError as failure:
            print(f'{mode}: not supported on this GPU ({failure})')
            continue
        rows.append({'mode': mode, 'n': n, 'flops': flops, 'seconds': seconds,
                     'tflop_per_s': flops / seconds / 1e12, 'max_relative_error': error})
    return rows
