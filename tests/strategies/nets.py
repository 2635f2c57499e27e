"""Hypothesis strategies for the compiler: random networks and random programs."""
import numpy
from hypothesis import strategies as st

from d2lperf import np, nn
from d2lperf.np.multiarray import apply

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


# -- tied layers in checkpointed segments: which layer each call uses, and where segments end --

tied_programs = st.fixed_dictionaries({
    'calls': st.lists(st.integers(0, 2), min_size=1, max_size=6),   # one of three layers
    'cuts': st.sets(st.integers(1, 5)),                             # a segment ends before
    'width': st.integers(1, 6), 'batch': st.integers(1, 4), 'seed': st.integers(0, 2**16)})
