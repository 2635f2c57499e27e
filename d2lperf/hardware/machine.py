"""What is in the box: the CPU, its cores and caches, memory, the BLAS library and any GPU,
and how much of it other programs are using while we measure.

The first table of the chapter "Hardware", so that every later figure can be read against the
machine that produced it.
"""
import glob
import os
import platform
import subprocess

import numpy
import psutil
import threadpoolctl

from . import gpu
from ..engine.blas import CpuTimes, cpu_times, load_by_others       # noqa: F401


# --- What is in the box ------------------------------------------------------------------

def system_summary():
    """CPU model, cores, cache and memory sizes, BLAS library, and GPUs (empty without one)."""
    blas = [{'library': pool['internal_api'], 'threads': pool['num_threads'],
             'architecture': pool.get('architecture')}
            for pool in threadpoolctl.threadpool_info() if pool['user_api'] == 'blas']
    return {'cpu_model': _cpu_model(), 'physical_cores': psutil.cpu_count(logical=False),
            'logical_cpus': psutil.cpu_count(), 'caches_bytes': cache_sizes(),
            'memory_bytes': psutil.virtual_memory().total, 'blas': blas,
            'numpy': numpy.__version__, 'python': platform.python_version(),
            'gpus': gpu.gpu_summary()}


def _cpu_model():
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    return _sysctl('machdep.cpu.brand_string') or platform.processor() or platform.machine()


def _sysctl(name):
    """A macOS `sysctl` value as text, or None elsewhere."""
    try:
        return subprocess.run(['sysctl', '-n', name], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cache_sizes():
    """Cache sizes in bytes of the first CPU, e.g. {'L1d': 32768, 'L2': 524288, ...}."""
    sizes = {}
    root = '/sys/devices/system/cpu/cpu0/cache'
    for index in sorted(glob.glob(os.path.join(root, 'index[0-9]*'))):
        def read(name):
            with open(os.path.join(index, name)) as f:
                return f.read().strip()
        kind = {'Data': 'd', 'Instruction': 'i'}.get(read('type'), '')
        size = read('size')   # '32K', '1024K', '32M'
        scale = 1024 ** ('KMG'.index(size[-1]) + 1) if size[-1] in 'KMG' else 1
        sizes[f'L{read("level")}{kind}'] = int(size.rstrip('KMG')) * scale
    if not sizes:   # macOS
        for name, key in (('L1d', 'hw.l1dcachesize'), ('L2', 'hw.l2cachesize'),
                          ('L3', 'hw.l3cachesize')):
            value = _sysctl(key)
            if value and value.isdigit() and int(value) > 0:
                sizes[name] = int(value)
    return sizes


# --- Who else is using it ------------------------------------------------------------------

def describe_load(load, cores=None):
    """The load of other programs in words, for a verdict that cannot blame them blindly."""
    cores = cores or os.cpu_count()
    if load < 0.25:
        return (f'the cause is unknown: other programs kept only {load:.2f} of the {cores} '
                'cores busy meanwhile')
    return (f'other programs kept {load:.2f} of the {cores} cores busy meanwhile, which '
            'delays some operations more than others')
