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

The examples below run as tests (tests/test_doctests.py), with `d2l` imported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy

from .. import comm
from ..device import cpu
from ..np.multiarray import NDArray
from ..utils import atomic_write
from .base import KVStoreBase
from .keys import key_of_state, state_name

if TYPE_CHECKING:
    from ..device import Device
    from .base import Key, Keys, Optimizer, Values

LOCAL_TYPES = ('local', 'device')        # where the values live: host, or spread over devices


@KVStoreBase.register(*LOCAL_TYPES)
class KVStore(KVStoreBase):
    """A store in this process. `type` names the placement: 'local' or 'device'."""

    def __init__(self, type: str = 'local') -> None:
        if type not in LOCAL_TYPES:
            raise ValueError(f'KVStore places values by {LOCAL_TYPES}, not {type!r}')
        self.type = type
        self.values = {}                      # key -> NDArray, on the key's home device
        self.homed = set()                    # keys whose home is settled ('device')
        self.borrowed = set()                 # keys whose value is a caller's array (`_keep`)
        self.placed = {}                      # device -> bytes of the values homed there
        # How pushpull sums in place when there is nothing to update ("Parameter Servers").
        self.algorithm = 'cpu' if type == 'local' else 'ring'

    # -- the interface ---------------------------------------------------------------------

    def init(self, key: Keys, value: Values) -> None:
        """Store a first value for `key` (or for each of a list of keys): all, or none.

        >>> kv = d2l.kvstore.create('device')
        >>> kv.init(['a', 'b'], [d2l.np.ones((2,)), d2l.np.ones((2,), device=d2l.cpu(1))])
        >>> kv.values['b'].device                      # 'device' keeps it where it came from
        cpu(1)
        """
        pairs = [(k, _single(k, v)) for k, v in self.typed_pairs(key, value)]
        for index, (k, _) in enumerate(pairs):
            if k in self.values or k in [other for other, _ in pairs[:index]]:
                raise ValueError(f'key {k!r} is already initialized; init each key once')
        for k, v in pairs:
            self.values[k] = v.copyto(cpu(0) if self.type == 'local' else v.device)
        self.note_first_key([k for k, _ in pairs])

    def push(self, key: Keys, value: Values) -> None:
        """Reduce `value` (an array, or a list of them, one a device) into `key`'s value.

        >>> kv = d2l.kvstore.create('local'); kv.init(3, d2l.np.zeros((2,)))
        >>> kv.push(3, [d2l.np.full((2,), 1.0), d2l.np.full((2,), 2.0, device=d2l.cpu(1))])
        >>> kv.values[3].asnumpy(), kv.values[3].device
        (array([3., 3.], dtype=float32), cpu(0))
        """
        pairs = [(k, self.check(k, v)) for k, v in self.typed_pairs(key, value)]
        for k, values in pairs:
            self._apply(k, self._sum(k, values), values)

    def pull(self, key: Keys, out: Values) -> None:
        """Copy `key`'s value into `out` (an array, or a list of them on any devices).

        >>> kv = d2l.kvstore.create('local'); kv.init(3, d2l.np.full((2,), 5.0))
        >>> outs = [d2l.np.zeros((2,)), d2l.np.zeros((2,), device=d2l.cpu(1))]
        >>> kv.pull(3, out=outs); outs[1].asnumpy()
        array([5., 5.], dtype=float32)
        """
        pairs = [(k, self.check(k, o)) for k, o in self.typed_pairs(key, out)]
        for k, outs in pairs:
            for o in outs:
                o[...] = self.values[k] if o.device == self.values[k].device else \
                    self.values[k].copyto(o.device)

    def pushpull(self, key: Keys, value: Values, out: Values | None = None) -> None:
        """Push, then pull into `out` (by default into the pushed arrays themselves).

        A list of keys pushes every key before it pulls any (MXNet's rule): an array that
        serves several keys is summed for each before a pull overwrites it. Without an
        optimizer, summing arrays in place is an allreduce: the store runs one of `comm`'s
        algorithms over them ('cpu' for 'local', 'ring' for 'device') and keeps the sum: the
        home device's array itself, not a copy (`_keep`), when one of them lives there.

        >>> kv = d2l.kvstore.create('device'); kv.init(0, d2l.np.zeros((2,)))
        >>> grads = [d2l.np.full((2,), 1.0), d2l.np.full((2,), 2.0, device=d2l.cpu(1))]
        >>> kv.pushpull(0, grads); grads[1].asnumpy(), kv.values[0] is grads[0]
        (array([3., 3.], dtype=float32), True)
        """
        groups = [(k, self.check(k, v)) for k, v in self.typed_pairs(key, value)]
        for k, o in self.typed_pairs(key, out) if out is not None else ():
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

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """From now on a push is a gradient, and the store updates its values with `optimizer`.

        >>> d2l.kvstore.create('local').set_optimizer('sgd')     # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: set_optimizer takes an optimizer such as d2l.optimizer.SGD(...), not 'sgd'
        """
        if not hasattr(optimizer, 'update'):
            raise TypeError(f'set_optimizer takes an optimizer such as '
                            f'd2l.optimizer.SGD(learning_rate=0.1), not {optimizer!r}')
        self.optimizer = optimizer

    def barrier(self) -> None:
        """Wait for every worker: in one process there is nobody else to wait for.

        >>> d2l.kvstore.create('local').barrier()
        """

    def save_optimizer_states(self, path: str) -> None:
        """The optimizer's states (SGD's momentum, Adam's step count, mean and variance) to an
        .npz file, written atomically.

        >>> import os, tempfile
        >>> kv = d2l.kvstore.create('local'); kv.init(7, d2l.np.ones((2,)))
        >>> kv.set_optimizer(d2l.optimizer.SGD(learning_rate=1.0, momentum=0.5))
        >>> kv.push(7, d2l.np.ones((2,)))
        >>> path = os.path.join(tempfile.mkdtemp(), 'states.npz')
        >>> kv.save_optimizer_states(path); numpy.load(path)['int:7']
        array([-1., -1.], dtype=float32)
        """
        states = {state_name(k): v for k, v in self.optimizer_or_error().get_states().items()}
        atomic_write(path, lambda file: numpy.savez(file, **states))

    def load_optimizer_states(self, path: str) -> None:
        """The states that save_optimizer_states wrote; keys the store does not know are refused.

        >>> import os, tempfile
        >>> sgd = d2l.optimizer.SGD(learning_rate=1.0, momentum=0.5)
        >>> kv, other = d2l.kvstore.create('local'), d2l.kvstore.create('local')
        >>> kv.init(7, d2l.np.ones((2,))); kv.set_optimizer(sgd); kv.push(7, d2l.np.ones((2,)))
        >>> other.init(8, d2l.np.ones((2,))); other.set_optimizer(sgd)
        >>> path = os.path.join(tempfile.mkdtemp(), 'states.npz')
        >>> kv.save_optimizer_states(path); other.load_optimizer_states(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ... holds states for keys this store never initialized: [7]; ...
        """
        optimizer = self.optimizer_or_error()
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

    def _rehome(self, key: Key, values: list[NDArray]) -> Device:
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

    def check(self, key: Key, value: Values) -> list[NDArray]:
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


def _single(key, values):
    """The one array a key starts with: a list of several is refused (which one to keep?)."""
    if len(values) != 1:
        raise ValueError(f'init({key!r}, ...) takes one array, not a list')
    value = values[0]
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
