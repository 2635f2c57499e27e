"""A stand-in for CuPy, so that every GPU path of d2lperf runs on machines without a GPU.

It is NumPy underneath. Arrays are `FakeArray`s: NumPy arrays that, like CuPy's, the host
reaches only through `get()`, with a device pointer (`.data.ptr`). Calls run at once on the
calling thread; streams and events record host times and who waited for whom; kernels
(`ElementwiseKernel`, `RawKernel`) run their C source through NumPy. While a stream
captures a CUDA graph, kernel launches are recorded for the graph to replay, and cuBLAS
(matmul, dot) is refused, as CuPy refuses it. `cuda.cublas.gemmEx` reads its operands
column-major through their pointers, as cuBLAS does. It checks the plumbing (lanes and
streams, events between streams, copies, graph capture, generated kernels, argument order),
not CUDA's semantics.

    fake = make_module(gpus=2)
    monkeypatch.setitem(sys.modules, 'cupy', fake)   # `import cupy` now finds it
"""
import ctypes
import re
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

    @property
    def ptr(self):
        return self.array.ctypes.data

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


# -- streams, events, devices and CUDA graphs ---------------------------------------------

class FakeEvent:
    def __init__(self):
        self.time, self.waited_for_by = None, []

    @property
    def done(self):
        return self.time is not None

    def synchronize(self):
        assert self.time is not None, 'synchronized an event never recorded'

    def record(self, stream=None):
        self.time = time.perf_counter()


class FakeGraph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream=None):
        for function, args, kwargs in self.calls:
            function(*args, **kwargs)


class FakeStream:
    """Records every event and wait, so that tests can see which stream did what."""

    def __init__(self, cupy, null=False, non_blocking=False):
        self.cupy, self.log = cupy, []
        self.ptr = 0 if null else id(self)          # the legacy default stream is 0

    def use(self):
        self.cupy.local.stream = self
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

    def begin_capture(self):
        self.cupy.captured = []

    def end_capture(self):
        calls, self.cupy.captured = self.cupy.captured, None
        return FakeGraph(calls)


class FakeDevice:
    def __init__(self, cupy, index=0):
        self.cupy, self.index = cupy, index

    def use(self):
        self.cupy.local.device = self.index

    def __enter__(self):
        self.previous = self.cupy.local.__dict__.get('device', 0)
        self.cupy.local.device = self.index

    def __exit__(self, *exc_info):
        self.cupy.local.device = self.previous


class FakeRandom:
    def __init__(self, seed=None):
        self.rng = numpy.random.default_rng(seed)

    def random(self, shape, dtype=numpy.float64):
        return on_device(self.rng.random(shape, dtype=dtype))

    def standard_normal(self, shape, dtype=numpy.float64):
        return on_device(self.rng.standard_normal(shape, dtype=dtype))

    def uniform(self, low=0.0, high=1.0, size=None, dtype=numpy.float64):
        return on_device(self.rng.uniform(low, high, size).astype(dtype))


# -- kernels: their C source run by NumPy -------------------------------------------------------

C_TO_PYTHON = [(r'\((float|double)\)', ''), (r'\b(float|double) ', ''), (r'\bmax\(', 'MAX('),
               (r'\bmin\(', 'MIN('), (r'\bfabs\(', 'ABS('), (r'\bexp\(', 'EXP('),
               (r'\blog\(', 'LOG('), (r'\bsqrt\(', 'SQRT('), (r'\btanh\(', 'TANH('),
               (r'\bpow\(', 'POW(')]
C_FUNCTIONS = {'MAX': numpy.maximum, 'MIN': numpy.minimum, 'ABS': numpy.abs, 'EXP': numpy.exp,
               'LOG': numpy.log, 'SQRT': numpy.sqrt, 'TANH': numpy.tanh, 'POW': numpy.power}


def run_c_statements(text, names):
    """Run `T t0 = ...; ...; y = ...;` with NumPy: every name is a whole (broadcast) array."""
    for pattern, replacement in C_TO_PYTHON:
        text = re.sub(pattern, replacement, text)
    scope = dict(C_FUNCTIONS, **names)
    for statement in filter(None, (s.strip() for s in text.split(';'))):
        target, expression = statement.split('=', 1)
        # Our own generated kernels, never a file's content: eval is safe here.
        scope[target.strip()] = eval(expression, {'__builtins__': {}}, scope)  # noqa: S307
    return scope


def elementwise_kernel(cupy):
    class FakeElementwiseKernel:
        def __init__(self, in_params, out_params, operation, name):
            self.inputs, self.outputs = ([p.split()[1] for p in params.split(',') if p.strip()]
                                         for params in (in_params, out_params))
            self.operation, self.name = operation, name

        def __call__(self, *args):
            cupy.launch(self.run, *args)

        def run(self, *args):
            """Outputs are read as they were before the launch and written after it, each
            element at once, as every CUDA thread reads and writes only its own."""
            inputs, outputs = args[:len(self.inputs)], args[len(self.inputs):]
            names = dict(zip(self.inputs, inputs))
            names.update((name, out.copy()) for name, out in zip(self.outputs, outputs))
            scope = run_c_statements(self.operation, names)
            for name, out in zip(self.outputs, outputs):
                out[...] = numpy.broadcast_to(scope[name], out.shape)
    return FakeElementwiseKernel


def raw_kernel(cupy):
    class FakeRawKernel:
        """The dense kernel: x @ w.T + bias, then its epilogue statements, by NumPy."""

        def __init__(self, source, name):
            self.source = source

        def __call__(self, grid, block, args):
            cupy.launch(self.run, *args)

        def run(self, x, w, bias, *rest):
            *operands, y, rows, k, n = rest
            body = self.source.split('t_fc = acc + bias[j];')[1].split('y[warp] =')
            text = (re.sub(r'(e\d+)\[(warp|j)\]', r'\1', body[0])
                    + f'; out = {body[1].split(";")[0]}')
            names = {f'e{i}': v.reshape(-1, int(n)) if v.size == int(n) else v
                     for i, v in enumerate(operands)}
            names['t_fc'] = x @ w.T + bias
            y[...] = run_c_statements(text, names)['out']
    return FakeRawKernel


# -- cuBLAS: just gemmEx, reading column-major operands through their pointers -------------

def column_major(pointer, rows, columns, leading):
    """A float32 matrix stored column by column at `pointer` (what cuBLAS reads)."""
    flat = numpy.ctypeslib.as_array((ctypes.c_float * (leading * columns)).from_address(pointer))
    return flat.reshape(columns, leading).T[:rows]


class FakeCublasError(RuntimeError):
    pass


class FakeCublas:
    HOST_POINTER_MODE = 0
    CUDA_R_32F = 0
    CUBLASError = FakeCublasError

    def __init__(self):
        self.pointer_mode = 5                       # anything but host: gemm must set it

    def getPointerMode(self, handle):  # noqa: N802 - cuBLAS's names
        return self.pointer_mode

    def setPointerMode(self, handle, mode):  # noqa: N802
        self.pointer_mode = mode

    def gemmEx(self, handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type,  # noqa: N802
               ldb, beta, c, c_type, ldc, compute_type, algo):
        assert (transa, transb, self.pointer_mode) == (0, 0, self.HOST_POINTER_MODE)
        if {a_type, b_type, c_type} != {self.CUDA_R_32F}:
            raise FakeCublasError('CUBLAS_STATUS_NOT_SUPPORTED: the stand-in reads float32 alone')
        scale = ctypes.c_float.from_address(alpha).value
        shift = ctypes.c_float.from_address(beta).value
        out = column_major(c, m, n, ldc)
        out[...] = scale * column_major(a, m, k, lda) @ column_major(b, k, n, ldb) + shift * out


# -- the module ----------------------------------------------------------------------------

CUBLAS_CALLS = ('matmul', 'dot')
FREE_BYTES = 2**30                  # what memGetInfo says is free, of as much in all
PROPERTIES = {'major': 0, 'minor': 0, 'totalGlobalMem': FREE_BYTES, 'multiProcessorCount': 1,
              'clockRate': 0, 'memoryClockRate': 0, 'memoryBusWidth': 0, 'l2CacheSize': 0}


class FakeCupy(types.ModuleType):
    """NumPy under CuPy's names; a fresh one per `make_module`, with its own state."""

    def __init__(self, gpus):
        super().__init__('cupy')
        self.local = threading.local()              # per thread: current device and stream
        self.captured = None                        # the calls a capturing stream records
        self.ndarray = FakeArray
        self.ElementwiseKernel = elementwise_kernel(self)
        self.RawKernel = raw_kernel(self)
        self.random = types.SimpleNamespace(default_rng=FakeRandom, RandomState=FakeRandom)
        null = FakeStream(self, null=True)
        self.cuda = types.SimpleNamespace(
            Device=lambda index=0: FakeDevice(self, index),
            Stream=lambda null=False, non_blocking=False: FakeStream(self, null, non_blocking),
            Event=FakeEvent,
            get_current_stream=lambda: self.local.__dict__.get('stream', null),
            get_elapsed_time=lambda first, second: (second.time - first.time) * 1e3,
            runtime=types.SimpleNamespace(
                getDeviceCount=lambda: gpus, memGetInfo=lambda: (FREE_BYTES, FREE_BYTES),
                getDevice=lambda: self.local.__dict__.get('device', 0),
                getDeviceProperties=lambda index: dict(PROPERTIES, name=f'fake GPU {index}')),
            cublas=FakeCublas(), device=types.SimpleNamespace(get_cublas_handle=lambda: 1))

    def launch(self, function, *args, **kwargs):
        """Run now, or, while a stream captures, record for the graph to replay (as CUDA does)."""
        if self.captured is None:
            return on_device(function(*args, **kwargs))
        if getattr(function, '__name__', None) in CUBLAS_CALLS:
            raise NotImplementedError('cuBLAS is not supported during stream capture')
        self.captured.append((function, args, kwargs))
        return None

    def asarray(self, a, dtype=None):
        return numpy.array(a, dtype=dtype).view(FakeArray)

    array = asarray

    def __getattr__(self, name):
        function = getattr(numpy, name)
        if isinstance(function, type) or not callable(function):
            return function
        if isinstance(function, numpy.ufunc):
            return FakeUfunc(self, function)
        if name in CUBLAS_CALLS + ('copyto',):
            return lambda *args, **kwargs: self.launch(function, *args, **kwargs)
        return lambda *args, **kwargs: on_device(function(*args, **kwargs))


class FakeUfunc:
    """A ufunc whose calls, and whose methods' (`add.at`, `maximum.reduce`), are launches."""

    def __init__(self, cupy, ufunc):
        self.cupy, self.ufunc = cupy, ufunc

    def __call__(self, *args, **kwargs):
        return self.cupy.launch(self.ufunc, *args, **kwargs)

    def __getattr__(self, name):
        method = getattr(self.ufunc, name)
        if not callable(method):
            return method
        return lambda *args, **kwargs: self.cupy.launch(method, *args, **kwargs)


def make_module(gpus=2):
    """A fresh stand-in that answers to `import cupy` once put in sys.modules."""
    return FakeCupy(gpus)
