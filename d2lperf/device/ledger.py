"""The memory ledger: how many bytes the arrays on each device hold, by kind, and the peak.

`memory(device)` reads it: the bytes held by kind (`MEMORY_KINDS`: weights, master weights,
gradients, optimizer state, activations, temporaries, and the keys and values that generation
keeps, kv cache), their total and the peak since `reset_peak` ("Data Parallelism at Scale",
"Memory", "Inference"). Everything that writes it is here too:
`Held`, the part of an array's engine variable that holds its bytes from creation until the
last array sharing them is freed, and `label`, `release` and `restore`, which the layers
above call to say what an array's bytes are for and when they are given back.
"""
import collections
import dataclasses
import threading

from .devices import Device

MEMORY_KINDS = ('weights', 'master weights', 'gradients', 'optimizer state', 'activations',
                'temporaries', 'kv cache')

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
