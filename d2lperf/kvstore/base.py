"""What every key-value store is: one interface, and a registry that creates a store by name.

As MXNet's `KVStoreBase`: each backend subclasses `KVStoreBase` and registers itself under the
names it answers to ('local' and 'device' in `local.py`; the distributed ones in `dist.py`),
so that `create(name)` needs no list of backends, and a caller recognises a store with
`isinstance(store, KVStoreBase)`. What every backend does alike (a call's keys checked
against the store's first key, the refusal of states without an optimizer) lives here once.
Taught in "Parameter Servers".

Type hints name arrays and devices only under TYPE_CHECKING: the stores load with the package,
and importing the array module here would close an import cycle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ClassVar, Sequence, Union

from .keys import as_list, pairs

if TYPE_CHECKING:
    from ..np.multiarray import NDArray
    from ..optimizer import SGD, Adam

    Optimizer = Union[SGD, Adam]

    Key = Union[int, str]
    Keys = Union[Key, Sequence[Key]]
    Values = Union[NDArray, Sequence[NDArray], Sequence[Sequence[NDArray]]]


class KVStoreBase:
    """A (key, value) store: `init` a key once, `push` values into it, `pull` its value out.

    Without an optimizer a push stores the sum of the pushed values; with one
    (`set_optimizer`), the store updates its value with the sum as a gradient (MXNet's rules).
    A refused call (unknown key, second init, wrong shape or dtype) changes nothing.

    >>> import d2lperf as d2l
    >>> isinstance(d2l.kvstore.create('local'), d2l.kvstore.KVStoreBase)
    True
    >>> kv = d2l.kvstore.create('local')
    >>> kv.type, kv.rank, kv.num_workers
    ('local', 0, 1)
    """

    registry: ClassVar[dict[str, Callable[[str], KVStoreBase]]] = {}   # name -> its maker
    type: str | None = None          # the name it was created by
    rank: int = 0                    # this worker's number among the workers
    num_workers: int = 1             # how many workers push into the store
    first_key: Key | None = None     # its type is the type of every key
    optimizer: Optimizer | None = None

    @staticmethod
    def register(*names: str) -> Callable:
        """Register a store class (or a function of the name that makes one) under `names`.

        >>> @KVStoreBase.register('mine')
        ... class Mine(KVStoreBase):
        ...     def __init__(self, type):
        ...         self.type = type
        >>> d2l.kvstore.create('mine').type
        'mine'
        >>> del KVStoreBase.registry['mine']
        """
        def add(maker):
            for name in names:
                KVStoreBase.registry[name] = maker
            return maker
        return add

    @staticmethod
    def create(name: str = 'local') -> KVStoreBase:
        """The store registered as `name`; a ValueError lists the registered names.

        >>> d2l.kvstore.create('device').type
        'device'
        """
        if name not in KVStoreBase.registry:
            raise ValueError(f'unknown kvstore {name!r}; the registered stores are '
                             f'{tuple(KVStoreBase.registry)}')
        return KVStoreBase.registry[name](name)

    def check(self, key: Key, arrays: Values):
        """The checks every push and pull of `key` passes before anything moves: the key is
        known, and `arrays` (an array or a list) match its value's shape and dtype. Raises
        KeyError or ValueError, so that a refused call leaves the store as it was; returns
        what the backend goes on with (the arrays, or the key's id, shape and dtype)."""
        raise NotImplementedError

    def init(self, key: Keys, value: Values) -> None:
        """Give `key` (or each of a list of keys) its first value.

        >>> kv = d2l.kvstore.create('local')
        >>> kv.init('w', d2l.np.ones((2,)))
        >>> kv.init('w', d2l.np.ones((2,)))
        Traceback (most recent call last):
        ValueError: key 'w' is already initialized; init each key once
        """
        raise NotImplementedError

    def push(self, key: Keys, value: Values) -> None:
        """Push `value` (an array, or a list of them, one a device) into `key`: summed.

        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.ones((2,)))
        >>> kv.push('w', [d2l.np.ones((2,)), d2l.np.ones((2,), device=d2l.cpu(1))])
        >>> out = d2l.np.zeros((2,)); kv.pull('w', out=out); out.asnumpy()
        array([2., 2.], dtype=float32)
        """
        raise NotImplementedError

    def pull(self, key: Keys, out: Values) -> None:
        """Copy `key`'s value into `out` (an array, or a list of them).

        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.full((2,), 2.0))
        >>> out = d2l.np.zeros((2,)); kv.pull('w', out=out); out.asnumpy()
        array([2., 2.], dtype=float32)
        """
        raise NotImplementedError

    def pushpull(self, key: Keys, value: Values, out: Values | None = None) -> None:
        """Push, then pull into `out` (by default into the pushed arrays themselves).

        >>> kv = d2l.kvstore.create('device'); kv.init('w', d2l.np.ones((2,)))
        >>> x = [d2l.np.ones((2,)), d2l.np.ones((2,), device=d2l.cpu(1))]
        >>> kv.pushpull('w', x); x[1].asnumpy()
        array([2., 2.], dtype=float32)
        """
        raise NotImplementedError

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """From now on a push is a gradient, applied to the value by `optimizer`.

        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.full((2,), 2.0))
        >>> kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5))
        >>> out = d2l.np.zeros((2,))
        >>> kv.push('w', d2l.np.ones((2,))); kv.pull('w', out=out); out.asnumpy()
        array([1.5, 1.5], dtype=float32)
        """
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every worker gets here.

        >>> d2l.kvstore.create('local').barrier()      # one process: nobody to wait for
        """
        raise NotImplementedError

    def save_optimizer_states(self, path: str) -> None:
        """The optimizer's states to an .npz file (never a pickle).

        >>> import os, tempfile, numpy
        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.ones((2,)))
        >>> kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5, momentum=0.9))
        >>> kv.push('w', d2l.np.ones((2,)))
        >>> path = os.path.join(tempfile.mkdtemp(), 'states.npz')
        >>> kv.save_optimizer_states(path); sorted(numpy.load(path).files)
        ['str:w']
        """
        raise NotImplementedError

    def load_optimizer_states(self, path: str) -> None:
        """The states `save_optimizer_states` wrote, checked against the store's keys.

        >>> import os, tempfile
        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.ones((2,)))
        >>> kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5, momentum=0.9))
        >>> path = os.path.join(tempfile.mkdtemp(), 'states.npz')
        >>> kv.save_optimizer_states(path); kv.load_optimizer_states(path)
        >>> d2l.kvstore.create('local').load_optimizer_states(path)
        Traceback (most recent call last):
        ValueError: this store has no optimizer, hence no states: call set_optimizer first
        """
        raise NotImplementedError

    # -- what every store does alike --------------------------------------------------------

    def typed_pairs(self, key: Keys, value: Values) -> list[tuple[Key, list[NDArray]]]:
        """[(key, [arrays])] of a call, one pair a key, each value a list (one array a
        device), after checking the keys' types against the store's first key.

        >>> kv = d2l.kvstore.create('local'); kv.init(0, d2l.np.ones((2,)))
        >>> one, two = d2l.np.ones((2,)), [d2l.np.ones((2,))] * 2
        >>> [(k, len(arrays)) for k, arrays in kv.typed_pairs([1, 2], [one, two])]
        [(1, 1), (2, 2)]
        """
        return [(one_key, as_list(values))
                for one_key, values in pairs(key, value, self.first_key)]

    def note_first_key(self, keys: Sequence[Key]) -> None:
        """Remember the first key ever initialized: its type is the type of every key."""
        if self.first_key is None and keys:
            self.first_key = keys[0]

    def optimizer_or_error(self) -> Optimizer:
        """The store's optimizer, whose states are saved and loaded; refused without one."""
        if self.optimizer is None:
            raise ValueError('this store has no optimizer, hence no states: call '
                             'set_optimizer first')
        return self.optimizer
