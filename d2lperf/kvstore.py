"""The (key, value) store: push gradients, pull weights, and let the store decide where to sum.

Taught in "Parameter Servers". A store keeps one value a key. `push` hands it values, one a
device, which it reduces (sums); `pull` copies the value into arrays on any devices. Without
an optimizer a push *replaces* the value by the sum of what was pushed; with one
(`set_optimizer`), the sum is a gradient and the store updates the value it holds by the
optimizer's rule. These are MXNet's rules, and every store follows them.

What differs between stores is only *where* the values live and the sums happen, the
placement: `'local'` keeps every value on the host (`cpu(0)`), `'device'` spreads the keys over
the devices that push them, each key on one of them, so that no device does all the adding.
The distributed stores (`'dist_sync'`, `'dist_device_sync'`, `'dist_async'`) keep the values
in server processes; they live in `kvstore_dist`, which needs MPI.

A refused call (unknown key, second init, wrong shape or dtype) raises before anything is
pushed, so it leaves the store as it was.
"""
import numpy

from . import comm
from .device import cpu
from .ndarray import NDArray
from .utils import atomic_write

LOCAL_TYPES = ('local', 'device')
DIST_TYPES = ('dist_sync', 'dist_device_sync', 'dist_async')


def create(name='local'):
    """A store by MXNet's name: 'local', 'device', 'dist_sync', 'dist_device_sync', 'dist_async'."""
    if name in LOCAL_TYPES:
        return KVStore(name)
    if name in DIST_TYPES:
        try:
            from .kvstore_dist import create_dist
        except ImportError as error:
            raise ImportError(f'the {name!r} store runs over MPI and needs mpi4py: install the '
                              f"package's mpi extra (pip install -e '.[mpi]')") from error
        return create_dist(name)
    raise ValueError(f'unknown kvstore {name!r}; use one of {LOCAL_TYPES + DIST_TYPES}')


class KVStore:
    """A store in this process. `type` names the placement: 'local' or 'device'."""

    rank, num_workers = 0, 1                  # one worker: this process

    def __init__(self, type='local'):
        if type not in LOCAL_TYPES:
            raise ValueError(f'KVStore places values by {LOCAL_TYPES}, not {type!r}')
        self.type = type
        self.values = {}                      # key -> NDArray, on the key's home device
        self.homed = set()                    # keys whose home is settled ('device')
        self.placed = {}                      # device -> bytes of the values homed there
        self.optimizer = None
        # How pushpull sums in place when there is nothing to update ("Parameter Servers").
        self.algorithm = 'cpu' if type == 'local' else 'ring'

    # -- the interface ---------------------------------------------------------------------

    def init(self, key, value):
        """Store a first value for `key` (or for each of a list of keys)."""
        pairs = [(k, _single(k, v)) for k, v in _pairs(key, value)]
        for k, _ in pairs:
            if k in self.values:
                raise ValueError(f'key {k!r} is already initialized (shape '
                                 f'{self.values[k].shape}); init each key once')
        for k, v in pairs:
            self.values[k] = v.copyto(cpu(0) if self.type == 'local' else v.device)

    def push(self, key, value):
        """Reduce `value` (an array, or a list of them, one a device) into `key`'s value."""
        pairs = [(k, self._check(k, v)) for k, v in _pairs(key, value)]
        for k, values in pairs:
            self._apply(k, self._sum(k, values))

    def pull(self, key, out):
        """Copy `key`'s value into `out` (an array, or a list of them on any devices)."""
        pairs = [(k, self._check(k, o)) for k, o in _pairs(key, out)]
        for k, outs in pairs:
            for o in outs:
                o[...] = self.values[k] if o.device == self.values[k].device else \
                    self.values[k].copyto(o.device)

    def pushpull(self, key, value, out=None):
        """Push, then pull into `out` (by default into the pushed arrays themselves).

        Without an optimizer, summing arrays in place is an allreduce: the store runs one of
        `comm`'s algorithms over them ('cpu' for 'local', 'ring' for 'device') and keeps the sum.
        """
        if self.optimizer is not None or out is not None:
            self.push(key, value)
            self.pull(key, value if out is None else out)
            return
        for k, values in [(k, self._check(k, v)) for k, v in _pairs(key, value)]:
            if len({v.device for v in values}) < len(values):
                self.push(k, values)
                self.pull(k, values)
                continue
            comm.allreduce(values, algorithm=self.algorithm)
            home = self._rehome(k, values)
            summed = next((v for v in values if v.device == home), values[0])
            self.values[k][...] = summed if summed.device == home else summed.copyto(home)

    def set_optimizer(self, optimizer):
        """From now on a push is a gradient, and the store updates its values with `optimizer`."""
        if not hasattr(optimizer, 'update'):
            raise TypeError(f'set_optimizer takes an optimizer such as '
                            f'd2l.optimizer.SGD(learning_rate=0.1), not {optimizer!r}')
        self.optimizer = optimizer

    def barrier(self):
        """Wait for every worker: in one process there is nobody else to wait for."""

    def save_optimizer_states(self, path):
        """The optimizer's states (SGD's momentum) to an .npz file, written atomically."""
        states = {_encode(k): v for k, v in self._optimizer_or_error().get_states().items()}
        atomic_write(path, lambda file: numpy.savez(file, **states))

    def load_optimizer_states(self, path):
        """The states that save_optimizer_states wrote; keys the store does not know are refused."""
        optimizer = self._optimizer_or_error()
        try:
            with numpy.load(path, allow_pickle=False) as saved:
                states = {_decode(name): saved[name] for name in saved.files}
        except (ValueError, OSError) as error:
            raise ValueError(f'{path} is not an optimizer-state file written by '
                             f'save_optimizer_states (.npz of plain arrays): {error}') from error
        unknown = [k for k in states if k not in self.values]
        if unknown:
            raise ValueError(f'{path} holds states for keys this store never initialized: '
                             f'{unknown}; load it into the store that saved it')
        for k, state in states.items():
            if state.shape != self.values[k].shape:
                raise ValueError(f'{path} holds a state of shape {state.shape} for key {k!r}, '
                                 f'whose value has shape {self.values[k].shape}')
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
            self.values[key] = self.values[key].copyto(home)
        return home

    def _apply(self, key, total):
        if self.optimizer is None:
            self.values[key][...] = total
        else:
            self.optimizer.update(key, self.values[key], total)

    # -- checks -----------------------------------------------------------------------------

    def _check(self, key, value):
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


def _pairs(key, value):
    """[(key, value)] for one key, or for a list of keys with a list of values."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ValueError(f'{len(key)} keys need a list of {len(key)} values, got '
                             f'{type(value).__name__} of length {len(value) if hasattr(value, "__len__") else 1}')
        pairs = list(zip(key, value))
    else:
        pairs = [(key, value)]
    for k, _ in pairs:
        if not isinstance(k, (int, str)) or isinstance(k, bool):
            raise TypeError(f'keys are ints or strings, not {k!r}')
    return pairs


def _single(key, value):
    if isinstance(value, (list, tuple)):
        raise ValueError(f'init({key!r}, ...) takes one array, not a list')
    if not isinstance(value, NDArray):
        raise TypeError(f'key {key!r}: expected a d2lperf array, got {type(value).__name__}')
    return value


def _nbytes(array):
    return array.size * array.dtype.itemsize


def _encode(key):
    """A key as an .npz entry name: ints and strings never collide ('i:3' against 's:3')."""
    return f'i:{key}' if isinstance(key, int) else f's:{key}'


def _decode(name):
    kind, _, text = name.partition(':')
    if kind == 'i' and text.lstrip('-').isdigit():
        return int(text)
    if kind == 's':
        return text
    raise ValueError(f'{name!r} is not a key written by save_optimizer_states')

