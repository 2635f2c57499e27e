"""A stand-in for CuPy, so that the engine's GPU paths run on machines without a GPU.

It is NumPy underneath: arrays are `FakeArray`s (NumPy arrays that, like CuPy's, must be
fetched with `get()`), "kernels" run at once on the calling thread, streams and events record
host times. It checks the plumbing (which lane and stream runs what, events between streams,
copies in and out, the profiler's event times), not CUDA's semantics.
"""
import threading
import time
import types

import numpy


class FakeArray(numpy.ndarray):
    """Device memory: NumPy values that the host reaches only through `get()`."""

    def get(self, stream=None):
        return numpy.array(self)

    @property
    def data(self):
        return FakePointer(self)


class FakePointer:
    def __init__(self, array):
        self.array = array

    def copy_from_device_async(self, source, size, stream=None):
        self.array.reshape(-1)[...] = source.array.reshape(-1)


def on_device(value):
    if isinstance(value, numpy.ndarray):
        return value.view(FakeArray)
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v) for v in value)
    if isinstance(value, numpy.generic):
        return numpy.asarray(value).view(FakeArray)
    return value


class FakeEvent:
    def __init__(self):
        self.time, self.waited_for_by = None, []

    @property
    def done(self):
        return self.time is not None

    def synchronize(self):
        assert self.time is not None, 'synchronized an event never recorded'


class FakeStream:
    """Records every event and wait, so that tests can see which stream did what."""

    def __init__(self, null=False, non_blocking=False):
        self.device_id = _local.__dict__.get('device', 0)
        self.log = []

    def use(self):
        _local.stream = self
        return self

    def record(self, event=None):
        event = event or FakeEvent()
        event.time = time.perf_counter()
        self.log.append(('record', event))
        return event

    def wait_event(self, event):
        self.log.append(('wait', event))
        event.waited_for_by.append(self)

    def synchronize(self):
        self.log.append(('synchronize', None))


class FakeDevice:
    def __init__(self, index):
        self.index = index

    def use(self):
        _local.device = self.index

    def __enter__(self):
        self.previous = _local.__dict__.get('device', 0)
        _local.device = self.index

    def __exit__(self, *exc_info):
        _local.device = self.previous


_local = threading.local()
_null = FakeStream(null=True)


class FakeRandom:
    def __init__(self, seed=None):
        self.rng = numpy.random.default_rng(seed)

    def random(self, shape, dtype=numpy.float64):
        return on_device(self.rng.random(shape, dtype=dtype))

    def standard_normal(self, shape, dtype=numpy.float64):
        return on_device(self.rng.standard_normal(shape, dtype=dtype))


def make_module(gpus=2):
    """A module object that answers to `import cupy`."""
    cupy = types.ModuleType('cupy')

    def wrapped(name):
        function = getattr(numpy, name)
        if isinstance(function, type) or not callable(function):
            return function
        return lambda *args, **kwargs: on_device(function(*args, **kwargs))
    cupy.__getattr__ = wrapped
    cupy.ndarray = FakeArray
    cupy.asarray = cupy.array = lambda a, dtype=None: numpy.array(a, dtype=dtype).view(FakeArray)
    cupy.random = types.SimpleNamespace(
        default_rng=FakeRandom, random=lambda shape: on_device(numpy.random.random(shape)))
    cupy.cuda = types.SimpleNamespace(
        Device=FakeDevice, Stream=FakeStream, Event=FakeEvent,
        get_current_stream=lambda: _local.__dict__.get('stream', _null),
        get_elapsed_time=lambda first, second: (second.time - first.time) * 1e3,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: gpus))
    return cupy
