"""d2lperf: the package behind "Computational Performance, a runnable course".

Layers, each importing only those before it: device → engine → ops → ndarray (np, npx) →
autograd → nn → trainer. Beside them: utils (timers, workload sizes), hardware, and
profiler (engine events as a Chrome trace and a timeline).
"""
from . import engine
from .device import Device, cpu, gpu, num_gpus, try_all_gpus, try_gpu
from . import np, npx, autograd, nn
from .nn import L2Loss, SoftmaxCrossEntropyLoss
from .trainer import Trainer
from .utils import Accumulator, Benchmark, Timer, memory_in_use, quick_mode, workload
from . import profiler

__all__ = ['engine', 'Device', 'cpu', 'gpu', 'num_gpus', 'try_all_gpus', 'try_gpu', 'np', 'npx',
           'autograd', 'nn', 'L2Loss', 'SoftmaxCrossEntropyLoss', 'Trainer', 'Accumulator',
           'Benchmark', 'Timer', 'memory_in_use', 'quick_mode', 'workload', 'profiler']
