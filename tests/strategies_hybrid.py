"""Hypothesis strategies for the compiler: random networks, random programs, fake CuPy."""
import re

import numpy
from hypothesis import strategies as st

from d2lperf import np, nn
from d2lperf.ndarray import apply

ACTIVATIONS = [None, 'relu', 'sigmoid', 'tanh']


# -- random networks: Dense of random widths, activations, residual adds, concatenation ------

class Residual(nn.HybridBlock):
    """x + f(x): the width stays the same."""

    def __init__(self, units, activation):
        super().__init__()
        self.body = nn.Dense(units, activation=activation)

    def forward(self, x):
        return x + self.body(x)


class Concat(nn.HybridBlock):
    """Two Dense branches side by side, concatenated along the features."""

    def __init__(self, left, right, activation):
        super().__init__()
        self.left = nn.Dense(left, activation=activation)
        self.right = nn.Dense(right, activation=activation)

    def forward(self, x):
        return np.concatenate([self.left(x), self.right(x)], axis=-1)


layer_specs = st.one_of(
    st.tuples(st.just('dense'), st.integers(1, 12), st.sampled_from(ACTIVATIONS)),
    st.tuples(st.just('residual'), st.integers(1, 12), st.sampled_from(ACTIVATIONS)),
    st.tuples(st.just('concat'), st.tuples(st.integers(1, 6), st.integers(1, 6)),
              st.sampled_from(ACTIVATIONS)))
net_specs = st.fixed_dictionaries({
    'layers': st.lists(layer_specs, min_size=1, max_size=4),
    'batch': st.integers(1, 5), 'features': st.integers(1, 8), 'seed': st.integers(0, 2**16)})


def build_net(spec):
    """A HybridSequential from a spec; a residual block first projects to its width."""
    net = nn.HybridSequential()
    for kind, size, activation in spec['layers']:
        if kind == 'dense':
            net.add(nn.Dense(size, activation=activation))
        elif kind == 'residual':
            net.add(nn.Dense(size), Residual(size, activation))
        else:
            net.add(Concat(*size, activation))
    np.random.seed(spec['seed'])
    net.initialize()
    return net


# -- random programs: what the passes and the code generator must preserve -------------------

UNARY = ['negative', 'exp', 'tanh', 'sigmoid', 'relu', 'abs']
BINARY = ['add', 'subtract', 'multiply', 'maximum', 'minimum']


def run_instruction(values, instruction):
    """Apply one random instruction to the pool of values (all of shape (n, n))."""
    kind, i, j, scalar = instruction
    a, b = values[i % len(values)], values[j % len(values)]
    if kind in UNARY:
        return apply(kind, a)
    if kind in BINARY:
        return apply(kind, a, b)
    if kind == 'scalar':
        return apply('multiply', a, scalar)
    if kind == 'dot':
        return np.dot(a, b) * 0.25
    if kind == 'sum':
        return a.sum(axis=1, keepdims=True) + b
    if kind == 'transpose':
        return a.T
    if kind == 'reshape':
        return a.reshape(-1).reshape(a.shape)
    if kind == 'concat':
        return np.concatenate([a, b], axis=0)[:a.shape[0]]
    if kind == 'where':
        return np.where(a > b, a, b * 0.5)
    raise AssertionError(kind)


instructions = st.lists(st.tuples(
    st.sampled_from(UNARY + BINARY + ['scalar', 'dot', 'sum', 'transpose', 'reshape', 'concat',
                                      'where']),
    st.integers(0, 20), st.integers(0, 20),
    st.sampled_from([0.5, -1.0, 2.0, 3])), min_size=1, max_size=12)
programs = st.fixed_dictionaries({
    'instructions': instructions, 'size': st.integers(1, 4), 'seed': st.integers(0, 2**16),
    'outputs': st.lists(st.integers(0, 40), min_size=1, max_size=3),
    'constants': st.integers(0, 2), 'repeat': st.booleans()})


def program_function(spec):
    """A function of two (n, n) arrays that runs the spec's instructions; some values unused."""
    rng = numpy.random.default_rng(spec['seed'])
    constants = [rng.normal(size=(spec['size'],) * 2).astype(numpy.float32)
                 for _ in range(spec['constants'])]

    def fn(a, b):
        values = [a, b] + [np.array(c) for c in constants]
        program = spec['instructions'] * (2 if spec['repeat'] else 1)   # repeats: for CSE
        for instruction in program:
            values.append(run_instruction(values, instruction))
        results = tuple(values[2 + (k % (len(values) - 2))] for k in spec['outputs'])
        return results if len(results) > 1 else results[0]
    return fn


def program_inputs(spec):
    rng = numpy.random.default_rng(spec['seed'] + 1)
    return [rng.normal(size=(spec['size'],) * 2).astype(numpy.float32) for _ in range(2)]


# -- a stand-in for CuPy: the GPU code generator's kernels, run by NumPy ---------------------

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


CAPTURE = {'calls': None}      # while a fake stream captures: the calls it records


def launch(function, *args, **kwargs):
    """Run now, or, while capturing, record for the graph to replay (as CUDA does)."""
    if CAPTURE['calls'] is None:
        return function(*args, **kwargs)
    CAPTURE['calls'].append((function, args, kwargs))
    return None


class FakeElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name):
        self.inputs = [p.split()[1] for p in in_params.split(',') if p.strip()]
        self.operation = operation

    def __call__(self, *args):
        launch(self.run, *args)

    def run(self, *args):
        *inputs, y = args
        scope = run_c_statements(self.operation, dict(zip(self.inputs, inputs), y=y.copy()))
        y[...] = numpy.broadcast_to(scope['y'], y.shape)


class FakeRawKernel:
    """The dense kernel: x @ w.T + bias, then its epilogue statements, by NumPy."""

    def __init__(self, source, name):
        self.source = source

    def __call__(self, grid, block, args):
        launch(self.run, *args)

    def run(self, x, w, bias, *rest):
        *operands, y, rows, k, n = rest
        body = self.source.split('t_fc = acc + bias[j];')[1].split('y[warp] =')
        text = re.sub(r'(e\d+)\[(warp|j)\]', r'\1', body[0]) + f'; out = {body[1].split(";")[0]}'
        names = {f'e{i}': v.reshape(-1, int(n)) if v.size == int(n) else v
                 for i, v in enumerate(operands)}
        names['t_fc'] = x @ w.T + bias
        y[...] = run_c_statements(text, names)['out']


class FakeGraph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream=None):
        for function, args, kwargs in self.calls:
            function(*args, **kwargs)


class FakeStream:
    ptr = 1

    def begin_capture(self):
        CAPTURE['calls'] = []

    def end_capture(self):
        calls, CAPTURE['calls'] = CAPTURE['calls'], None
        return FakeGraph(calls)


class FakeCuda:
    def __init__(self):
        self.stream = FakeStream()

    def Device(self, index=0):  # noqa: N802 - CuPy's name
        import contextlib
        return contextlib.nullcontext()

    def get_current_stream(self):
        return self.stream


class FakeCupy:
    """NumPy under CuPy's names; kernels run by NumPy; a CUDA graph replays recorded calls.

    Like CuPy, it refuses cuBLAS (matmul, dot) while a stream is being captured."""

    ElementwiseKernel, RawKernel = FakeElementwiseKernel, FakeRawKernel

    def __init__(self):
        self.cuda = FakeCuda()

    def __getattr__(self, name):
        function = getattr(numpy, name)
        if name in ('matmul', 'dot'):
            def cublas(*args, **kwargs):
                if CAPTURE['calls'] is not None:
                    raise NotImplementedError('cuBLAS is not supported during stream capture')
                return function(*args, **kwargs)
            return cublas
        if isinstance(function, numpy.ufunc) or name == 'copyto':
            return lambda *args, **kwargs: launch(function, *args, **kwargs)
        return function
