"""What every key-value store is: one interface, and a registry that creates a store by name.

As MXNet's `KVStoreBase`: each backend subclasses `KVStoreBase` and registers itself under the
names it answers to ('local' and 'device' in `local.py`; the distributed ones in `dist.py`),
so that `create(name)` needs no list of backends, and a caller recognises a store with
`isinstance(store, KVStoreBase)`. Taught in "Parameter Servers".
"""


class KVStoreBase:
    """A (key, value) store: `init` a key once, `push` values into it, `pull` its value out.

    Without an optimizer a push stores the sum of the pushed values; with one
    (`set_optimizer`), the store updates its value with the sum as a gradient (MXNet's rules).
    A refused call (unknown key, second init, wrong shape or dtype) changes nothing.

    >>> import d2lperf as d2l
    >>> isinstance(d2l.kvstore.create('local'), d2l.kvstore.KVStoreBase)
    True
    """

    registry = {}        # name -> the class (or function) that makes a store of that name
    type = None          # the name it was created by
    rank, num_workers = 0, 1

    @staticmethod
    def register(*names):
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
    def create(name='local'):
        """The store registered as `name`; a ValueError lists the registered names.

        >>> d2l.kvstore.create('device').type
        'device'
        """
        if name not in KVStoreBase.registry:
            raise ValueError(f'unknown kvstore {name!r}; the registered stores are '
                             f'{tuple(KVStoreBase.registry)}')
        return KVStoreBase.registry[name](name)

    def check(self, key, arrays):
        """The checks every push and pull of `key` passes before anything moves: the key is
        known, and `arrays` (an array or a list) match its value's shape and dtype. Raises
        KeyError or ValueError, so that a refused call leaves the store as it was; returns
        what the backend goes on with (the arrays, or the key's id, shape and dtype)."""
        raise NotImplementedError

    def init(self, key, value):
        """Give `key` (or each of a list of keys) its first value.

        >>> kv = d2l.kvstore.create('local')
        >>> kv.init('w', d2l.np.ones((2,)))
        """
        raise NotImplementedError

    def push(self, key, value):
        """Push `value` (an array, or a list of them, one a device) into `key`: summed.

        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.ones((2,)))
        >>> kv.push('w', [d2l.np.ones((2,)), d2l.np.ones((2,), device=d2l.cpu(1))])
        """
        raise NotImplementedError

    def pull(self, key, out):
        """Copy `key`'s value into `out` (an array, or a list of them).

        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.full((2,), 2.0))
        >>> out = d2l.np.zeros((2,)); kv.pull('w', out=out); out.asnumpy()
        array([2., 2.], dtype=float32)
        """
        raise NotImplementedError

    def pushpull(self, key, value, out=None):
        """Push, then pull into `out` (by default into the pushed arrays themselves).

        >>> kv = d2l.kvstore.create('device'); kv.init('w', d2l.np.ones((2,)))
        >>> x = [d2l.np.ones((2,)), d2l.np.ones((2,), device=d2l.cpu(1))]
        >>> kv.pushpull('w', x); x[1].asnumpy()
        array([2., 2.], dtype=float32)
        """
        raise NotImplementedError

    def set_optimizer(self, optimizer):
        """From now on a push is a gradient, applied to the value by `optimizer`.

        >>> kv = d2l.kvstore.create('local'); kv.init('w', d2l.np.full((2,), 2.0))
        >>> kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5))
        >>> out = d2l.np.zeros((2,))
        >>> kv.push('w', d2l.np.ones((2,))); kv.pull('w', out=out); out.asnumpy()
        array([1.5, 1.5], dtype=float32)
        """
        raise NotImplementedError

    def barrier(self):
        """Wait until every worker gets here."""
        raise NotImplementedError

    def save_optimizer_states(self, path):
        """The optimizer's states to an .npz file (never a pickle)."""
        raise NotImplementedError

    def load_optimizer_states(self, path):
        """The states `save_optimizer_states` wrote, checked against the store's keys."""
        raise NotImplementedError
