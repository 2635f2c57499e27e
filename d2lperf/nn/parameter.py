"""Parameters: named arrays a model learns, with a copy (and a gradient) on each device."""
import collections

import numpy

from .. import autograd
from ..device import Device, cpu, label
from . import init as initializers


class DeferredInitializationError(RuntimeError):
    pass


class Parameter:
    """A learnable array. A 0 in `shape` is unknown until the first forward pass fills it in.

    `replacements` counts, over every parameter, the times one was given new arrays (drawn,
    cast, moved, set by ZeRO): compiled code keeps the arrays it read until it changes."""

    replacements = 0

    def __init__(self, name, shape, init=None, grad_req='write'):
        autograd.check_grad_req(grad_req)
        self.name, self.shape, self.init = name, tuple(shape), init
        self._grad_req = grad_req
        self._data = None            # {device: NDArray}
        self._devices = None         # set by initialize(), kept while the shape is unknown
        self.dtype = None            # None: the initializer's (float32); set by cast()

    @property
    def grad_req(self):
        """MXNet's: 'write' (each backward pass replaces the gradient), 'add' (backward passes
        add to it until `zero_grad()`: micro-batches accumulate) or 'null' (no gradient: state
        a layer updates itself, or a weight frozen)."""
        return self._grad_req

    @grad_req.setter
    def grad_req(self, req):
        autograd.check_grad_req(req)
        self._grad_req = req
        for array in (self._data or {}).values():
            self._attach_grad(array)

    def zero_grad(self):
        """Every copy's gradient back to zeros (fresh arrays), for grad_req 'add'."""
        for array in (self._data or {}).values():
            if array.grad is not None:
                array.attach_grad()

    def initialize(self, init=None, device=None, default_init=None, force_reinit=False):
        if self._data is not None and not force_reinit:
            return
        self._devices = _device_list(device)
        self._init = self.init or init or default_init or initializers.Uniform()
        self._replace(None)
        if 0 not in self.shape:
            self._finish()

    def infer_shape(self, shape):
        """Fill in the unknown (0) dimensions once the first input shows them."""
        self.shape = tuple(shape)
        if self._devices is not None and self._data is None:
            self._finish()

    def _finish(self):
        first = self._init(self.shape, self._devices[0])
        if self.dtype is not None and first.dtype != self.dtype:
            first = first.astype(self.dtype)
        self._keep({d: first if d == self._devices[0] else first.copyto(d)
                    for d in self._devices})

    def _keep(self, copies):
        """Hold `copies` ({device: NDArray}) as the weights, each with a gradient buffer."""
        for array in copies.values():
            label(array, 'weights')
            self._attach_grad(array, fresh=True)
        self._replace(copies)

    def _attach_grad(self, array, fresh=False):
        """Give `array` this parameter's grad_req, which backward reads from the array, and a
        gradient buffer to go with it: zeros where `fresh` or it has none, else the one kept."""
        if self.grad_req != 'null' and (fresh or array.grad is None):
            array.attach_grad()
        autograd.mark_variables([array], [array.grad], self.grad_req)

    def _replace(self, copies):
        self._data = copies
        Parameter.replacements += 1

    def cast(self, dtype):
        """Every copy (and its gradient) in `dtype`, as Gluon's Parameter.cast: float16
        weights for mixed precision, whose float32 masters the optimizer keeps
        (multi_precision). Before the shape is known it applies when the values are drawn."""
        self.dtype = numpy.dtype(dtype)
        if self._data is not None:
            self._keep({d: a.astype(self.dtype) for d, a in self._data.items()})

    def reset_device(self, device):
        """Move the values to `device` (one Device or a list), as Gluon's reset_device: a copy
        of the first one on each; pipeline parallelism places each stage's weights this way."""
        devices = _device_list(device)
        first = self._copies()[self._devices[0]]
        self._devices = devices
        self._keep({d: first if d == first.device else first.copyto(d) for d in devices})

    @property
    def copies(self):
        """{device: NDArray}: one copy per device; None until initialized, a new dict after
        each initialization."""
        return self._data

    def set_copies(self, arrays):
        """Put `arrays` (one a device, in list_device() order) in place of the copies, or
        drop them (None): ZeRO stage 3 keeps a chunk of each weight between steps, and gathers
        the whole into fresh arrays for the next step."""
        if arrays is not None:
            arrays = list(arrays)
            devices = [a.device for a in arrays]
            if devices != self.list_device():
                raise ValueError(f"parameter '{self.name}' lives on {self.list_device()}, and "
                                 f'the arrays given are on {devices}')
            arrays = dict(zip(devices, arrays))
        self._replace(arrays)

    def data(self, device=None):
        """The copy on `device`. With one device, None means that one; with several, cpu(0)."""
        copies = self._copies()
        if device is None:
            if len(copies) == 1:
                return next(iter(copies.values()))
            device = cpu()
        try:
            return copies[device]
        except KeyError:
            first = self._devices[0]
            raise RuntimeError(
                f"parameter '{self.name}' was not initialized on {device}; it was only "
                f'initialized on {list(copies)}: use one of those (data({first}), or an input '
                f'copied with x.copyto({first})), or initialize on {device} too') from None

    def list_device(self):
        """The devices this parameter has a copy on, in the order initialize() was given."""
        if self._devices is None:
            raise RuntimeError(f"parameter '{self.name}' is on no device yet: call "
                               'net.initialize(device=...) first')
        return list(self._devices)

    def list_data(self):
        """Every device's copy, in the order of list_device()."""
        return list(self._copies().values())

    def grad(self, device=None):
        return self.data(device).grad

    def list_grad(self):
        return [d.grad for d in self.list_data()]

    def set_data(self, value):
        for array in self._copies().values():
            array[:] = value if array.device == value.device else value.copyto(array.device)

    def _copies(self):
        """{device: copy}, or a clear error while the value is not drawn yet."""
        if self._data is None:
            raise DeferredInitializationError(
                f"parameter '{self.name}' has no value yet: call net.initialize() and run one "
                'batch through the net so that its shape is known (or, sharded by ZeRO stage 3, '
                'it is whole only inside a step: Zero.weights() gathers it)')
        return self._data

    def __repr__(self):
        return f'Parameter {self.name} (shape={self.shape})'


class ParameterDict(collections.OrderedDict):
    """Parameters by dotted name (`Block.collect_params()`), with MXNet's `zero_grad()`."""

    def zero_grad(self):
        """Every parameter's gradients back to zeros: the start of a step that accumulates
        (grad_req 'add')."""
        for param in self.values():
            param.zero_grad()


def _device_list(device):
    """initialize()'s `device` as a list: one Device, a list of distinct ones, or None (cpu)."""
    devices = list(device) if isinstance(device, (list, tuple)) else [device or cpu()]
    if not devices or not all(isinstance(d, Device) for d in devices):
        raise TypeError(f'device must be a Device or a list of them, not {device!r}')
    if len(set(devices)) < len(devices):
        raise ValueError(f'the devices {devices} name one device twice, but a parameter keeps '
                         'one copy a device; for two virtual devices on one machine use '
                         '[d2l.cpu(0), d2l.cpu(1)]')
    return devices
