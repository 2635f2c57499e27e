"""Devices: where an array lives, which array module computes on it, which worker runs it.

A `Device` is a kind ('cpu' or 'gpu') and an index. CPU devices are virtual: `cpu(0)` and
`cpu(1)` share the machine's cores but each gets its own engine workers, so two of them can
compute side by side ("Automatic Parallelism"). GPUs compute with CuPy, imported only when a
GPU is asked for, so the package runs on machines with neither CuPy nor a GPU. `transfer`
says how data moves between two devices. `memory(device)` says how many bytes the arrays on a
device hold, by kind (`MEMORY_KINDS`: weights, gradients, optimizer state, activations,
temporaries), and the peak ("Data Parallelism at Scale"); the ledger it reads and everything
that writes it (`Held`, the part of an array's engine variable that holds its bytes) live here.
"""
import collections
import dataclasses
import functools
import os
import threading

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


# -- memory: the bytes each device's arrays hold, by kind ----------------------------------

MEMORY_KINDS = ('weights', 'master weights', 'gradients', 'optimizer state', 'activations',
                'temporaries')

# Every change is appended, never added up in place: deque.append is atomic, so an array freed
# on an engine worker, or by the garbage collector in the middle of another update, never loses
# one. Reading the counts adds the pending changes up, in order; so does making an array once
# FOLD_AFTER are pending, few enough that the pending tuples never set off a garbage collection
# of their own (Python collects after 700 new container objects).
memory_changes = collections.deque()     # (device, kind, bytes): + when made, - when freed
FOLD_AFTER = 512
_fold_lock = threading.RLock()           # taken only to add up; appending never waits


class Ledger:
    """One device's running sums: bytes by kind, their total, the total's peak, the bytes by
    kind at that peak, and each kind's own peak (which may fall at another moment)."""

    __slots__ = ('by_kind', 'total', 'peak', 'at_peak', 'peak_by_kind')

    def __init__(self):
        self.by_kind = dict.fromkeys(MEMORY_KINDS, 0)
        self.total = self.peak = 0
        self.at_peak = dict(self.by_kind)
        self.peak_by_kind = dict(self.by_kind)

    def start_peaks(self):
        self.peak, self.at_peak = self.total, dict(self.by_kind)
        self.peak_by_kind = dict(self.by_kind)


_ledgers = collections.defaultdict(Ledger)      # device -> the changes added up so far


def fold_changes():
    """Add the pending changes up, in the order they happened, so that the peak is exact."""
    with _fold_lock:
        pop, ledgers = memory_changes.popleft, _ledgers
        for _ in range(len(memory_changes)):
            device, kind, nbytes = pop()
            ledger = ledgers[device]
            held = ledger.by_kind[kind] = ledger.by_kind[kind] + nbytes
            ledger.total += nbytes
            if nbytes > 0:
                if held > ledger.peak_by_kind[kind]:
                    ledger.peak_by_kind[kind] = held
                if ledger.total > ledger.peak:
                    ledger.peak, ledger.at_peak = ledger.total, dict(ledger.by_kind)


def mebibytes(nbytes):
    return f'{nbytes / 2 ** 20:.2f} MiB'


@dataclasses.dataclass(frozen=True, repr=False)
class Memory:
    """What `memory(device)` found: the bytes held by kind (every kind, zeros included), their
    total, the highest total since the start or the last `reset_peak`, the bytes by kind at
    that moment (the kind to shrink, by sharding, recomputing or freeing sooner, for a model to
    fit), and each kind's own highest since then (`peak_by_kind`: ZeRO-3's peak of weights
    falls while a unit is gathered, not necessarily at the peak of the total)."""

    device: Device
    by_kind: dict
    total: int
    peak: int
    at_peak: dict
    peak_by_kind: dict

    def __repr__(self):
        rows = [f'{self.device}: {mebibytes(self.total)} held, peak {mebibytes(self.peak)}',
                f'  {"":16s} {"now":>12s} {"at peak":>12s} {"own peak":>12s}']
        rows += [f'  {kind:16s} {mebibytes(self.by_kind[kind]):>12s} '
                 f'{mebibytes(self.at_peak[kind]):>12s} '
                 f'{mebibytes(self.peak_by_kind[kind]):>12s}' for kind in MEMORY_KINDS]
        return '\n'.join(rows)


def memory(device):
    """The bytes that arrays hold on `device` now, by kind, and the peak (a `Memory`).

    An array counts from its creation until the last array sharing its memory (base or view)
    is freed (see `Held`); a device never used holds nothing.
    """
    with _fold_lock:
        fold_changes()
        ledger = ledger_of(device, 'memory')
        return Memory(device, dict(ledger.by_kind), ledger.total, ledger.peak,
                      dict(ledger.at_peak), dict(ledger.peak_by_kind))


def reset_peak(device=None):
    """Start measuring the peak afresh from the total held now: on `device`, or on every
    device (as torch.cuda.reset_peak_memory_stats does)."""
    with _fold_lock:
        fold_changes()
        ledgers = _ledgers.values() if device is None else [ledger_of(device, 'reset_peak')]
        for ledger in ledgers:
            ledger.start_peaks()


def ledger_of(device, caller):
    if not isinstance(device, Device):
        raise TypeError(f'{caller} needs a Device such as d2l.cpu(1) or d2l.gpu(0), '
                        f'not {device!r}')
    return _ledgers[device]


class Held:
    """What an engine variable that owns an array's memory does with the ledger: it holds the
    memory's bytes on its device from the array's creation until the variable dies, that is
    until the last array sharing the memory (base or view) is freed, as 'temporaries' until
    labelled. What an operation makes for itself while it runs (im2col's columns, a compiled
    graph's intermediates) is no array and is not counted.

    A mixin, because the variable is the engine's (a layer above): `np.multiarray.HeldVar` is
    `Held` and `engine.Var` together and declares `Held.FIELDS` as its slots, so the ledger
    reads and writes only fields that this class names. `nbytes` is the memory's size;
    `counted` whether the ledger holds it now (`release` takes it out, `restore` back).
    """

    __slots__ = ()
    FIELDS = ('device', 'nbytes', 'kind', 'counted')

    def hold(self, device, nbytes):
        """Start counting `nbytes` on `device`, as temporaries; called once, at creation."""
        self.device, self.nbytes, self.kind, self.counted = device, nbytes, 'temporaries', True
        memory_changes.append((device, 'temporaries', nbytes))
        if len(memory_changes) > FOLD_AFTER:
            fold_changes()

    def label(self, kind):
        """Count the bytes as `kind`; released ones are counted as it when restored."""
        if self.counted and self.kind != kind:  # one extend: nobody sees the bytes between kinds
            memory_changes.extend(((self.device, self.kind, -self.nbytes),
                                   (self.device, kind, self.nbytes)))
        self.kind = kind

    def release(self):
        if self.counted:
            memory_changes.append((self.device, self.kind, -self.nbytes))
            self.counted = False

    def restore(self):
        if not self.counted:
            memory_changes.append((self.device, self.kind, self.nbytes))
            self.counted = True

    def __del__(self, record=memory_changes.append):    # bound now: it runs at shutdown too
        # released bytes were taken off already, by `release`; one that a Ctrl-C stopped
        # before `hold` has none counted
        if getattr(self, 'counted', False):
            record((self.device, self.kind, -self.nbytes))


def label(array, kind):
    """Count `array`'s bytes as `kind` (one of MEMORY_KINDS) from now on; returns the array.

    The bytes are held by the array's engine variable, so labelling a view labels the memory
    it shares with its base; a variable that holds no memory (not a `Held`) is left as it is.
    """
    if kind not in MEMORY_KINDS:
        raise ValueError(f'{kind!r} is not a kind of memory; use one of {MEMORY_KINDS}')
    if isinstance(array.var, Held):
        array.var.label(kind)
    return array


def release(array):
    """Stop counting `array`'s bytes: its data is freed while the array lives on (ZeRO-3 frees
    gathered weights that the autograd tape still holds), until `restore` counts them again.

    The bytes belong to the memory, which a view shares with its base: freeing part of it
    means nothing, so a view of part of a larger array is refused."""
    if isinstance(array.var, Held):
        _refuse_part(array, 'release')
        array.var.release()
    return array


def restore(array):
    """Count `array`'s bytes again, its data back (after `release`): the whole memory the
    array lives in."""
    if isinstance(array.var, Held):
        _refuse_part(array, 'restore')
        array.var.restore()
    return array


def part_of_larger(array):
    """Whether `array` is a view of part of a larger array: it takes fewer bytes than the
    memory it shares (counted or released), as a shard or a row does."""
    var = array.var
    return isinstance(var, Held) and array.size * array.dtype.itemsize < var.nbytes


def _refuse_part(array, caller):
    if part_of_larger(array):
        raise ValueError(f'{caller} acts on the memory an array holds, and this array on '
                         f'{array.device} is a view of {array.size * array.dtype.itemsize} of '
                         f'the {array.var.nbytes} bytes of a larger array: {caller} the array '
                         'it is a view of')
