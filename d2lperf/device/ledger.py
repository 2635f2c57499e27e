"""The memory ledger: how many bytes the arrays on each device hold, by kind, and the peak.

`memory(device)` reads it: the bytes held by kind (`MEMORY_KINDS`: weights, master weights,
gradients, optimizer state, activations, temporaries, and the keys and values that generation
keeps, kv cache), their total and the peak since `reset_peak` ("Data Parallelism at Scale",
"Memory", "Inference"). Everything that writes it is here too:
`Held`, the part of an array's engine variable that holds its bytes from creation until the
last array sharing them is freed, and `label`, `release` and `restore`, which the layers
above call to say what an array's bytes are for and when they are given back.
"""
import array
import collections
import dataclasses
import threading

import numpy

from .devices import Device

MEMORY_KINDS = ('weights', 'master weights', 'gradients', 'optimizer state', 'activations',
                'temporaries', 'kv cache')
KINDS = len(MEMORY_KINDS)
KIND_NUMBERS = {kind: number for number, kind in enumerate(MEMORY_KINDS)}
TEMPORARIES = KIND_NUMBERS['temporaries']

# Every change is appended, never added up in place: appending is atomic, so an array freed on
# an engine worker, or by the garbage collector in the middle of another update, never loses
# one. A change is one integer, bytes * ACCOUNTS + account, where the account numbers a device
# and a kind (`account`): appended to an array of int64 it allocates no object, so the pending
# changes neither cost a tuple each nor set off a garbage collection. Reading the counts adds
# them up, in order, with NumPy (`fold_changes`); so does making an array once FOLD_AFTER are
# pending, which bounds their memory (8 bytes each).
memory_changes = array.array('q')   # + bytes when made, - when freed
ACCOUNTS = 2 ** 16                  # devices * KINDS at most
LARGEST = (2 ** 63 - 1) // ACCOUNTS - 1     # bytes a change can carry: 2**47 - 2 (128 TiB)
FOLD_AFTER = 4096
_fold_lock = threading.RLock()      # taken only to add up, or to number a new device
_device_numbers = {}                # Device -> its number: its accounts are number * KINDS + kind
_devices = []                       # number -> Device


def device_number(device):
    """`device`'s number in the changes, given on its first array."""
    number = _device_numbers.get(device)
    if number is None:
        with _fold_lock:
            if device not in _device_numbers:
                if (len(_devices) + 1) * KINDS > ACCOUNTS:
                    raise RuntimeError(f'the memory ledger counts at most {ACCOUNTS // KINDS} '
                                       f'devices, and {device} would be one more')
                _devices.append(device)
                _device_numbers[device] = len(_devices) - 1
            number = _device_numbers[device]
    return number


def encoded(nbytes, where):
    """The changes that move `nbytes` (minus: free them) on account `where`: one, unless it is
    larger than LARGEST (an array made for its shape alone, such as the 400 TB one in
    "Asynchronous Computation", which fails when computed). Appended together, by one
    `extend`, the parts of a larger one reach the same sums and peaks as it would."""
    sign, left, parts = (1 if nbytes >= 0 else -1), abs(nbytes), []
    while True:
        part = min(left, LARGEST)
        parts.append(sign * part * ACCOUNTS + where)
        left -= part
        if not left:
            return parts


def account(device, kind):
    """The number of the ledger's account of `kind` on `device`, which a change carries."""
    return device_number(device) * KINDS + KIND_NUMBERS[kind]


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

    def add(self, sizes, kinds):
        """Add this device's changes (bytes, kind numbers), in order, as if one at a time.

        The running sums after each change hold every value the counts took: the highest
        total is the peak, found first where it is reached (as a one-at-a-time sum replaces
        the peak only when it is exceeded), and each kind's highest its own peak. Neither
        can be reached after a change that frees bytes, so the maxima are the peaks."""
        totals = numpy.cumsum(sizes) + self.total
        top = int(totals.argmax())
        at_top = dict(self.by_kind)
        for number in numpy.flatnonzero(numpy.bincount(kinds)).tolist():    # kinds present
            kind = MEMORY_KINDS[number]
            held = numpy.cumsum(numpy.where(kinds == number, sizes, 0)) + self.by_kind[kind]
            self.peak_by_kind[kind] = max(self.peak_by_kind[kind], int(held.max()))
            at_top[kind], self.by_kind[kind] = int(held[top]), int(held[-1])
        if totals[top] > self.peak:
            self.peak, self.at_peak = int(totals[top]), at_top
        self.total = int(totals[-1])


_ledgers = collections.defaultdict(Ledger)      # device -> the changes added up so far


def fold_changes():
    """Add the pending changes up, in the order they happened, so that the peaks are exact."""
    with _fold_lock:
        count = len(memory_changes)
        if not count:
            return
        taken = memory_changes[:count]      # a copy: appends meanwhile go after these
        del memory_changes[:count]
        sizes, accounts = numpy.divmod(numpy.frombuffer(taken, numpy.int64), ACCOUNTS)
        numbers, kinds = numpy.divmod(accounts, KINDS)
        for number in numpy.flatnonzero(numpy.bincount(numbers)).tolist():  # devices present
            mine = numbers == number
            _ledgers[_devices[number]].add(sizes[mine], kinds[mine])


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
    `account` the number of its device and kind in the changes (`account`); `counted` whether
    the ledger holds it now (`release` takes it out, `restore` back).
    """

    __slots__ = ()
    FIELDS = ('device', 'nbytes', 'kind', 'account', 'counted')

    def hold(self, device, nbytes):
        """Start counting `nbytes` on `device`, as temporaries; called once, at creation."""
        try:
            where = _device_numbers[device] * KINDS + TEMPORARIES
        except KeyError:                        # the device's first array
            where = device_number(device) * KINDS + TEMPORARIES
        self.device, self.nbytes, self.kind, self.account = device, nbytes, 'temporaries', where
        self.counted = True
        try:
            memory_changes.append(nbytes * ACCOUNTS + where)
        except OverflowError:                   # larger than LARGEST
            memory_changes.extend(encoded(nbytes, where))
        if len(memory_changes) > FOLD_AFTER:
            fold_changes()

    def label(self, kind):
        """Count the bytes as `kind`; released ones are counted as it when restored."""
        where = account(self.device, kind)
        if self.counted and where != self.account:  # one extend: no fold sees half of it
            memory_changes.extend(encoded(-self.nbytes, self.account) +
                                  encoded(self.nbytes, where))
        self.kind, self.account = kind, where

    def release(self):
        if self.counted:
            memory_changes.extend(encoded(-self.nbytes, self.account))
            self.counted = False

    def restore(self):
        if not self.counted:
            memory_changes.extend(encoded(self.nbytes, self.account))
            self.counted = True

    def __del__(self, record=memory_changes.append, extend=memory_changes.extend,
                encoded=encoded, accounts=ACCOUNTS):   # bound now: it runs at shutdown too
        # released bytes were taken off already, by `release`; one that a Ctrl-C stopped
        # before `hold` set `counted` has none counted
        try:
            counted = self.counted
        except AttributeError:
            return
        if counted:
            try:
                record(self.account - self.nbytes * accounts)
            except OverflowError:                   # larger than LARGEST
                extend(encoded(-self.nbytes, self.account))


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
