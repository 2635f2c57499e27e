"""The in-process stores: 'local' keeps every value on the host (cpu(0)), 'device' spreads
the keys over the devices that push them, each key on one of them, so that no device does all
the adding. Both sum with comm's allreduce where a key's values fill every device. As in
MXNet, a store's keys are all ints or all strings: the first key decides. Saved optimizer
states name each key by `keys.state_name`, the encoding every store writes and reads, so
states saved by one store load into another.

A key is summed in its own dtype, as MXNet's local store sums it (its CPU reduction runs in
the key's dtype): a float16 key in float16, every addition rounded, so that 1 + 2048 + 1 is
2048. Summing a few devices' gradients loses a few roundings; a weight updated here thousands
of times in float16 loses an update each time it is smaller than half a unit in the last
place, so keep such a key in float32. The distributed servers sum float16 in float32
(`server.py` says why).
"""
import numpy

from .. import comm
from ..device import cpu
from ..np.multiarray import NDArray
from ..utils import atomic_write
from .base import KVStoreBase
from .keys import key_of_state, pairs, state_name

LOCAL_TYPES = ('local', 'device')        # where the values live: host, or spread over devices


@KVStoreBase.register(*LOCAL_TYPES)
class KVStore(KVStoreBase):
    """A store in this process. `type` names the placement: 'local' or 'device'."""

    def __init__(self, type='local'):
        if type not in LOCAL_TYPES:
            raise ValueError(f'KVStore places values by {LOCAL_TYPES}, not {type!r}')
        self.type = type
        self.values = {}                      # key -> NDArray, on the key's home device
        self.homed = set()                    # keys whose home is settled ('device')
        self.borrowed = set()                 # keys whose value is a caller's array (`_keep`)
        self.placed = {}                      # device -> bytes of the values homed there
        self.optimizer = None
        self.first_key = None                 # its type is the type of every key
        # How pushpull sums in place when there is nothing to update ("Parameter Servers").
        self.algorithm = 'cpu' if type == 'local' else 'ring'

    # -- the interface ---------------------------------------------------------------------

    def init(self, key, value):
        """Store a first value for `key` (or for each of a list of keys): all, or none."""
        pairs = [(k, _single(k, v)) for k, v in self._typed_pairs(key, value)]
        for index, (k, _) in enumerate(pairs):
            if k in self.values or k in [other for other, _ in pairs[:index]]:
                raise ValueError(f'key {k!r} is already initialized; init each key once')
        for k, v in pairs:
            self.values[k] = v.copyto(cpu(0) if self.type == 'local' else v.device)
        if self.first_key is None and pairs:
            self.first_key = pairs[0][0]

    def push(self, key, value):
        """Reduce `value` (an array, or a list of them, one a device) into `key`'s value."""
        pairs = [(k, self.check(k, v)) for k, v in self._typed_pairs(key, value)]
        for k, values in pairs:
            self._apply(k, self._sum(k, values), values)

    def pull(self, key, out):
        """Copy `key`'s value into `out` (an array, or a list of them on any devices)."""
        pairs = [(k, self.check(k, o)) for k, o in self._typed_pairs(key, out)]
        for k, outs in pairs:
            for o in outs:
                o[...] = self.values[k] if o.device == self.values[k].device else \
                    self.values[k].copyto(o.device)

    def pushpull(self, key, value, out=None):
        """Push, then pull into `out` (by default into the pushed arrays themselves).

        A list of keys pushes every key before it pulls any (MXNet's rule): an array that
        serves several keys is summed for each before a pull overwrites it. Without an
        optimizer, summing arrays in place is an allreduce: the store runs one of `comm`'s
        algorithms over them ('cpu' for 'local', 'ring' for 'device') and keeps the sum: the
        home device's array itself, not a copy (`_keep`), when one of them lives there.
        """
        groups = [(k, self.check(k, v)) for k, v in self._typed_pairs(key, value)]
        for k, o in self._typed_pairs(key, out) if out is not None else ():
            self.check(k, o)                   # a refused output is refused before the push
        if self.optimizer is not None or out is not None or _share_memory(groups):
            self.push(key, value)
            self.pull(key, value if out is None else out)
            return
        for k, values in groups:
            if len({v.device for v in values}) < len(values):
                self.push(k, values)
                self.pull(k, values)
                continue
            comm.allreduce(values, algorithm=self.algorithm)
            home = self._rehome(k, values)
            summed = next((v for v in values if v.device == home), None)
            if summed is None:
                self._keep(k, values[0].copyto(home))
            else:
                self._keep(k, summed, borrowed=True)

    def set_optimizer(self, optimizer):
        """From now on a push is a gradient, and the store updates its values with `optimizer`."""
        if not hasattr(optimizer, 'update'):
            raise TypeError(f'set_optimizer takes an optimizer such as '
                            f'd2l.optimizer.SGD(learning_rate=0.1), not {optimizer!r}')
        self.optimizer = optimizer

    def barrier(self):
        """Wait for every worker: in one process there is nobody else to wait for."""

    def save_optimizer_states(self, path):
        """The optimizer's states (SGD's momentum, Adam's step count, mean and variance) to an
        .npz file, written atomically."""
        states = {state_name(k): v for k, v in self._optimizer_or_error().get_states().items()}
        atomic_write(path, lambda file: numpy.savez(file, **states))

    def load_optimizer_states(self, path):
        """The states that save_optimizer_states wrote; keys the store does not know are refused."""
        optimizer = self._optimizer_or_error()
        try:
            with numpy.load(path, allow_pickle=False) as saved:
                states = {key_of_state(name): saved[name] for name in saved.files}
        except (ValueError, OSError) as error:
            raise ValueError(f'{path} is not an optimizer-state file written by '
                             f'save_optimizer_states (.npz of plain arrays): {error}') from error
        unknown = [k for k in states if k not in self.values]
        if unknown:
            raise ValueError(f'{path} holds states for keys this store never initialized: '
                             f'{unknown}; load it into the store that saved it')
        for k, state in states.items():
            value = self.values[k]
            shape, dtype = optimizer.state_of(value)
            if state.shape != shape or state.dtype != dtype:
                raise ValueError(f'{path} holds a state of {state.dtype}{list(state.shape)} '
                                 f'for key {k!r}, whose value is {value.dtype}{list(value.shape)}'
                                 f': {type(optimizer).__name__} keeps {dtype}{list(shape)}')
        optimizer.set_states(states, lambda k: self.values[k].device)

    # -- where values live and sums happen ------------------------------------------------

    def _sum(self, key, values):
        """The sum of `values` on `key`'s home device: one copy and one add per other array."""
        home = self._rehome(key, values)
        total = None
        for v in values:
            v = v if v.device == home else v.copyto(home)
            total = v if total is None else total + v
        return total

    def _rehome(self, key, values):
        """'device': the first push moves a key to the least loaded of the pushing devices,
        counting the bytes of the keys already placed there (MXNet's greedy rule)."""
        current = self.values[key].device
        if self.type == 'local' or key in self.homed:
            return current
        devices = list(dict.fromkeys(v.device for v in values))
        home = min(devices, key=lambda d: (self.placed.get(d, 0), devices.index(d)))
        self.placed[home] = self.placed.get(home, 0) + _nbytes(self.values[key])
        self.homed.add(key)
        if home != current:
            self._keep(key, self.values[key].copyto(home))
        return home

    def _apply(self, key, total, pushed):
        """Store `total`, the sum of the `pushed` arrays, or update the value with it."""
        if self.optimizer is None:
            self._keep(key, total.copy() if any(total is v for v in pushed) else total)
        else:
            self._own(key)
            self.optimizer.update(key, self.values[key], total)

    def _keep(self, key, value, borrowed=False):
        """`value` becomes `key`'s value, by reference: no copy. A `borrowed` one is a caller's
        array (pushpull's sum, in place): the store reads it, and copies it before writing into
        it itself; the caller leaves it alone until its next push, as the Trainer does
        (backward gives every `.grad` a new array)."""
        self.values[key] = value
        (self.borrowed.add if borrowed else self.borrowed.discard)(key)

    def _own(self, key):
        """A value of the store's own to write into: a borrowed one is copied first."""
        if key in self.borrowed:
            self._keep(key, self.values[key].copy())

    # -- checks -----------------------------------------------------------------------------

    def _typed_pairs(self, key, value):
        return pairs(key, value, self.first_key)

    def check(self, key, value):
        """The arrays of one push or pull for `key`, after checking them against its value."""
        if key not in self.values:
            raise KeyError(f'key {key!r} was never initialized; call init({key!r}, value) '
                           f'first (known keys: {sorted(map(str, self.values))})')
        arrays = value if isinstance(value, (list, tuple)) else [value]
        stored = self.values[key]
        if not arrays:
            raise ValueError(f'key {key!r}: got an empty list of arrays')
        for a in arrays:
            if not isinstance(a, NDArray):
                raise TypeError(f'key {key!r}: expected d2lperf arrays, got {type(a).__name__}')
            if a.shape != stored.shape or a.dtype != stored.dtype:
                raise ValueError(f'key {key!r} holds {stored.dtype}{list(stored.shape)}, got '
                                 f'{a.dtype}{list(a.shape)} on {a.device}')
        return list(arrays)

    def _optimizer_or_error(self):
        if self.optimizer is None:
            raise ValueError('this store has no optimizer, hence no states: call '
                             'set_optimizer first')
        return self.optimizer


def _single(key, value):
    if isinstance(value, (list, tuple)):
        raise ValueError(f'init({key!r}, ...) takes one array, not a list')
    if not isinstance(value, NDArray):
        raise TypeError(f'key {key!r}: expected a d2lperf array, got {type(value).__name__}')
    return value


def _share_memory(groups):
    """Whether arrays of [(key, arrays)] share memory: the same array twice, or views of one
    array (a view shares its base's engine variable)."""
    variables = [id(a.var) for _, arrays in groups for a in arrays]
    return len(set(variables)) < len(variables)


def _nbytes(array):
    return array.size * array.dtype.itemsize
