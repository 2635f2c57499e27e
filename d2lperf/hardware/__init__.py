"""Microbenchmarks of the reader's own machine, run by the chapter "Hardware".

    machine           what is in the box: CPU, cores, caches, memory, BLAS, GPUs; the load
                      of others
    memory_hierarchy  bandwidth of each cache level and of main memory, latency, the order
                      of reads
    compute           vectorization, BLAS matrix multiply by size and precision, BLAS threads
                      and a busy core, the roofline
    io                cores writing one cache line, storage reads, messages over the network
                      stack
    gpu               device memory, host-device copies, kernel launches, tensor-core products

Every function returns plain rows (a list of dicts) whose numeric columns name their unit
(`_bytes`, `_seconds`, `_ns`, `_gb_per_s`, ...); `print_table` prints them. A timing is the
median of several repeats after one warm-up run; sizes come from `workload`, so
`D2LPERF_QUICK=1` shrinks them. The CPU-side functions are reachable from here
(`hardware.memory_bandwidth()`); the GPU and I/O ones through their module.
"""
from ..utils import median_seconds                                       # noqa: F401
from .machine import (cache_sizes, cpu_times, describe_load,             # noqa: F401
                      load_by_others, system_summary)
from .memory_hierarchy import (CACHE_LINE_BYTES, chase_cycle,            # noqa: F401
                               memory_bandwidth, pointer_chase, read_patterns,
                               stream_kernel, walk)
from .compute import (blas_threads, busy_core, kernel_counts,           # noqa: F401
                      matmul_flops, predict_seconds, products_under_load, roofline_bound,
                      roofline_kernels, threads_by_size, vectorization)
from . import gpu, io                                                    # noqa: F401


def print_table(rows, digits=3):
    """Print rows (dicts with the same keys) as aligned columns."""
    if not rows:
        print('(empty table)')
        return
    def cell(value):
        return f'{value:.{digits}g}' if isinstance(value, float) else str(value)
    columns = list(rows[0])
    cells = [columns] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print('  '.join(text.rjust(width) for text, width in zip(line, widths)))
