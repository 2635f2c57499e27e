"""Where arrays live and what they hold there.

    devices   a device (cpu(i), gpu(i)), the array module that computes on it, how data moves
              between two, virtual CPU devices slowed down, the cores they share.
    ledger    the bytes the arrays on each device hold, by kind, and the peak (`memory`,
              `reset_peak`), with all that writes it (`Held`, `label`, `release`, `restore`).

Both are one layer, the package's lowest but utils: every layer above imports from here.
"""
from .devices import (Device, available_cores, cpu, cupy_module, cupy_or_none, gpu, num_gpus,
                      slow_down, slowdowns, transfer, try_all_gpus, try_devices, try_gpu)
from .ledger import (MEMORY_KINDS, Held, Memory, label, memory, part_of_larger, release,
                     reset_peak, restore)

__all__ = ['Device', 'available_cores', 'cpu', 'cupy_module', 'cupy_or_none', 'gpu',
           'num_gpus', 'slow_down', 'slowdowns', 'transfer', 'try_all_gpus', 'try_devices',
           'try_gpu', 'MEMORY_KINDS', 'Held', 'Memory', 'label', 'memory', 'part_of_larger',
           'release', 'reset_peak', 'restore']
