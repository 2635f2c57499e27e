"""Devices: where an array lives, which array module computes on it, which worker runs it.

A `Device` is a kind ('cpu' or 'gpu') and an index. CPU devices are virtual: `cpu(0)` and
`cpu(1)` share the machine's cores but each gets its own engine workers, so two of them can
compute side by side ("Automatic Parallelism"); one can be slowed down to stand for a slower
device (`slow_down`). GPUs compute with CuPy, imported only when a GPU is asked for, so the
package runs on machines with neither CuPy nor a GPU. `transfer` says how data moves between
two devices.
"""
import functools
import os

import numpy


class Device:
    """A place to compute: `Device('cpu', 0)` or `Device('gpu', 1)`.

    There is one object per device, so comparing and hashing devices (which the engine does
    on every operation) is the built-in identity test, not a Python-level method.
    """

    __slots__ = ('kind', 'index')
    _made = {}

    def __new__(cls, kind, index=0):
        key = (kind, int(index))
        device = cls._made.get(key)
        if device is None:
            if kind not in ('cpu', 'gpu'):
                raise ValueError(f"device kind must be 'cpu' or 'gpu', not {kind!r}")
            device = cls._made[key] = super().__new__(cls)
            device.kind, device.index = key
        return device

    def __reduce__(self):
        return Device, (self.kind, self.index)

    @property
    def xp(self):
        """The array module that computes on this device: numpy, or cupy for a GPU."""
        return numpy if self.kind == 'cpu' else cupy_module()

    def __repr__(self):
        return f'{self.kind}({self.index})'


def cpu(i=0):
    """The i-th (virtual) CPU device."""
    return Device('cpu', i)


def gpu(i=0):
    """The i-th GPU; using it needs CuPy and an NVIDIA GPU."""
    return Device('gpu', i)


slowdowns = {}       # virtual CPU device -> the factor it is slowed down by (see slow_down)


def slow_down(device, factor):
    """Run the virtual CPU `device` at 1/`factor` of its speed, to stand for a slower device.

    Virtual CPU devices are equally fast; a real pair often is not (an older GPU beside a newer
    one, or the CPU beside a GPU). After each operation on a slowed device, its compute lane
    idles for `factor - 1` times as long as the operation took, as a device shared with another
    job would, so that dividing work between unequal devices can be measured on any machine.
    `factor` 1 gives the device its full speed back.
    """
    if not isinstance(device, Device) or device.kind != 'cpu':
        raise ValueError(f'only a virtual CPU device can be slowed down, not {device!r}: a GPU '
                         'has the speed it has')
    if not factor >= 1:
        raise ValueError(f'a slowdown factor is 1 (full speed) or more, not {factor!r}')
    if factor == 1:
        slowdowns.pop(device, None)
    else:
        slowdowns[device] = float(factor)


def available_cores():
    """The cores this process may run on (all of the machine's where the OS cannot tell):
    every virtual CPU device shares them."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def transfer(source, target):
    """The function that copies an array's data from the `source` device to the `target`.

    It runs on the copy lane the engine picks (`engine.copy_lane`), whose thread already has
    that lane's GPU and stream current: host to host is a NumPy copy; host to GPU, CuPy uploads
    on the current stream; GPU to host, `get` downloads on it and waits; GPU to GPU, a peer copy
    on the source's stream.
    """
    if source.kind == 'cpu' and target.kind == 'cpu':
        return numpy.ndarray.copy
    if source.kind == 'cpu':
        return lambda data: cupy_module().asarray(data)
    if target.kind == 'cpu':
        return lambda data: data.get()
    return functools.partial(_peer_copy, target.index)


def _peer_copy(target_index, data):
    """Copy a CuPy array to GPU `target_index` on the current (source) device's stream."""
    cupy = cupy_module()
    contiguous = cupy.ascontiguousarray(data)
    with cupy.cuda.Device(target_index):
        out = cupy.empty(contiguous.shape, contiguous.dtype)
    out.data.copy_from_device_async(contiguous.data, contiguous.nbytes,
                                    cupy.cuda.get_current_stream())
    return out


def cupy_module():
    """CuPy, for code about to run on a GPU. The one place the package imports it, at call time,
    so that a machine without it never does; where it is missing, an error says what to do."""
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError('this needs a GPU and CuPy: pip install -e .[gpu] '
                           '(cupy-cuda12x), or use d2l.try_gpu() to fall back to the CPU'
                           ) from err
    return cupy


def cupy_or_none():
    """CuPy if it imports and sees a GPU, else None; never raises."""
    try:
        cupy = cupy_module()
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return None


@functools.cache
def num_gpus():
    """How many GPUs CuPy can see (0 without CuPy or without a driver)."""
    cupy = cupy_or_none()
    return cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0


def try_gpu(i=0):
    """gpu(i) if it exists, else cpu(0)."""
    return gpu(i) if num_gpus() >= i + 1 else cpu()


def try_all_gpus():
    """Every GPU, or [cpu(0)] if there is none."""
    return [gpu(i) for i in range(num_gpus())] or [cpu()]


def try_devices(n):
    """n GPUs if the machine has them, else n virtual CPU devices cpu(1), ..., cpu(n).

    The virtual devices leave cpu(0) to the host, as on a GPU machine: data is loaded there
    and copied to the devices that compute.
    """
    if num_gpus() >= n:
        return [gpu(i) for i in range(n)]
    return [cpu(i) for i in range(1, n + 1)]
