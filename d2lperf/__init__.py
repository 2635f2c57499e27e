"""d2lperf: the package behind "Computational Performance, a runnable course".

Layers, each importing only those before it: device → engine → ops → ndarray (np, npx) →
autograd → hybrid (the tracing compiler) → nn → trainer. Beside them: utils (timers, workload
sizes), data (Fashion-MNIST with an offline fallback), hardware (microbenchmarks, imported on
demand as ``d2lperf.hardware``), profiler (engine events as a Chrome trace and a timeline)
and depgraph (the engine's recorded dependencies, drawn).
"""
from . import engine
from .device import Device, cpu, gpu, num_gpus, try_all_gpus, try_devices, try_gpu
from . import np, npx, autograd, nn
from .nn import L2Loss, SoftmaxCrossEntropyLoss
from .trainer import Trainer
from .utils import Accumulator, Benchmark, Timer, memory_in_use, quick_mode, workload
from . import data, hybrid, profiler

__all__ = ['engine', 'Device', 'cpu', 'gpu', 'num_gpus', 'try_all_gpus', 'try_devices', 'try_gpu', 'np', 'npx',
           'autograd', 'nn', 'L2Loss', 'SoftmaxCrossEntropyLoss', 'Trainer', 'Accumulator',
           'Benchmark', 'Timer', 'memory_in_use', 'quick_mode', 'workload', 'data', 'hybrid', 'profiler']
