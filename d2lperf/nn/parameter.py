"""Parameters: named arrays a model learns, with a copy (and a gradient) on each device."""
from ..device import Device, cpu
from . import init as initializers


class DeferredInitializationError(RuntimeError):
    pass


class Parameter:
    """A learnable array. A 0 in `shape` is unknown until the first forward pass fills it in."""

    def __init__(self, name, shape, init=None):
        self.name, self.shape, self.init = name, tuple(shape), init
        self._data = None            # {device: NDArray}
        self._devices = None         # set by initialize(), kept while the shape is unknown

    def initialize(self, init=None, device=None, default_init=None, force_reinit=False):
        if self._data is not None and not force_reinit:
            return
        devices = device if isinstance(device, (list, tuple)) else [device or cpu()]
        if not all(isinstance(d, Device) for d in devices):
            raise TypeError(f'device must be a Device or a list of them, not {device!r}')
        self._devices = list(devices)
        self._init = self.init or init or default_init or initializers.Uniform()
        self._data = None
        if 0 not in self.shape:
            self._finish()

    def infer_shape(self, shape):
        """Fill in the unknown (0) dimensions once the first input shows them."""
        self.shape = tuple(shape)
        if self._devices is not None and self._data is None:
            self._finish()

    def _finish(self):
        first = self._init(self.shape, self._devices[0])
        self._data = {d: first if d == self._devices[0] else first.copyto(d)
                      for d in self._devices}
        for array in self._data.values():
            array.attach_grad()

    @property
    def copies(self):
        """{device: NDArray}: one copy per device; None until initialized, a new dict after
        each initialization (compiled code watches it to know when to read arrays again)."""
        return self._data

    def data(self, device=None):
        if self._data is None:
            raise DeferredInitializationError(
                f"parameter '{self.name}' has no value yet: call net.initialize() and run one "
                'batch through the net so that its shape is known')
        if device is None:
            return next(iter(self._data.values()))
        if device not in self._data:
            raise ValueError(f"parameter '{self.name}' lives on {list(self._data)}, not {device}; "
                             'pass device=... to initialize()')
        return self._data[device]

    def list_data(self):
        self.data()             # no value yet: the same clear error as data(), not a TypeError
        return list(self._data.values())

    def grad(self, device=None):
        return self.data(device).grad

    def list_grad(self):
        return [d.grad for d in self.list_data()]

    def set_data(self, value):
        for array in self._data.values():
            array[:] = value if array.device == value.device else value.copyto(array.device)

    def __repr__(self):
        return f'Parameter {self.name} (shape={self.shape})'
