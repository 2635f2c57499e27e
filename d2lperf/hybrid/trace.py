"""Tracing: run `forward` once on symbols, and keep the operations it performs as a graph.

A `Symbol` stands in for an array: it knows its shape, dtype and device and nothing else.
Every d2lperf operation goes through `ndarray.apply`, which hands any call that involves a
symbol to the symbol's `apply_op`: instead of computing, the tracer appends a node to the
graph and returns a new symbol. Whatever needs a *value* (`asnumpy`, `item`, `if x > 0:`)
or mutates one (`x += 1`) cannot be traced, and says so. Taught in "Compilers and
Interpreters".
"""
import inspect

import numpy

from ..device import cpu
from ..np.multiarray import ArrayMethods, NDArray, check_basic_key
from ..np.tape import Tracing, tracing
from .graph import Graph, Node


class TraceError(RuntimeError):
    """Something in a hybridized `forward` needs values, which do not exist while tracing."""


class Spec:
    """A placeholder's type: what a symbol knows about the array it stands for."""

    def __init__(self, shape, dtype='float32', device=None):
        self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
        self.device = device or cpu()


LEAVE_IMPERATIVE = 'or leave this block imperative (call net.hybridize(False))'


class Symbol(ArrayMethods):
    """A traced value: shape, dtype and device, but no data.

    Arithmetic, reductions and reshaping are the array's own methods (`ArrayMethods`): each
    ends in `apply`, which sends it back here as a graph node. Every other method of NDArray
    is defined below, to work or to say why it cannot while tracing."""

    __slots__ = ('node', 'tracer')
    __array_ufunc__ = None          # `2.0 * x` must reach our __rmul__, not NumPy's

    def __init__(self, node, tracer):
        self.node, self.tracer = node, tracer

    shape = property(lambda self: self.node.shape)
    dtype = property(lambda self: self.node.dtype)
    device = property(lambda self: self.tracer.device)

    def apply_op(self, name, inputs, attrs):
        """`ndarray.apply` calls this for any operation with a symbol among its inputs."""
        return self.tracer.call(name, inputs, attrs)

    def __repr__(self):
        return f'<Symbol {self.node.name}: {self.node.type}>'

    __str__ = __repr__

    def __getitem__(self, key):
        return self.tracer.call('getitem', (self,), {'key': check_basic_key(key)})

    # -- what cannot be traced: each says why, and what to do instead ------------------------
    def _needs_value(self, what):
        raise TraceError(
            f'{what} needs the value of {self!r}, but while a hybridized forward is traced '
            'its values do not exist yet: only shape and dtype are known. Compute with d2lperf '
            f'operations only, move {what} out of forward (apply it to the output), '
            f'{LEAVE_IMPERATIVE}.')

    def _control_flow(self, *_):
        raise TraceError(
            f'Python control flow (if, while, and/or, bool()) on the traced value {self!r}: '
            'while tracing there is no value to decide with, and the compiled program would '
            'keep one branch forever. Choose elementwise with np.where(cond, a, b), branch on '
            f'shapes (they are known while tracing), {LEAVE_IMPERATIVE}.')

    def _in_place(self, *_):
        raise TraceError(
            f'in-place update of the traced value {self!r}: a compiled graph only computes new '
            'values and never changes old ones (other names may share this one). Write '
            '`x = x + y` instead of `x += y`, and build arrays with np.concatenate or np.where '
            f'instead of assigning into slices, {LEAVE_IMPERATIVE}.')

    def asnumpy(self):
        self._needs_value('asnumpy()')

    def item(self):
        self._needs_value('item()')

    def wait_to_read(self):
        self._needs_value('wait_to_read()')

    def __array__(self, *_, **__):
        self._needs_value('converting to a NumPy array')

    def __float__(self):
        self._needs_value('float()')

    def __int__(self):
        self._needs_value('int()')

    def __index__(self):
        self._needs_value('using it as an index')

    def copyto(self, device):
        raise TraceError(f'copyto({device}) of the traced value {self!r}: a hybridized block '
                         'runs on one device; move its inputs before the call, '
                         f'{LEAVE_IMPERATIVE}.')

    def attach_grad(self):
        raise TraceError('attach_grad() inside a hybridized forward: attach gradients to the '
                         'block\'s inputs or parameters outside of it')

    def backward(self, *_, **__):
        raise TraceError('backward() inside a hybridized forward: call it on the block\'s '
                         'output, after the call returns')

    __bool__ = _control_flow
    __iadd__ = __isub__ = __imul__ = __itruediv__ = __setitem__ = _in_place


def canonical(value):
    """Attributes as hashable, JSON-friendly values: lists become tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v) for v in value)
    return value


class Tracer(Tracing):
    """Builds one graph: placeholders for the arguments, then one node per operation."""

    def __init__(self, device, param_name=None):
        self.graph, self.device = Graph(), device
        self.param_name = param_name or (lambda array: None)
        self.captured = {}      # id(NDArray) -> (array, node): arrays read from outside

    def placeholder(self, name, shape, dtype, kind='input'):
        if any(n.name == name for n in self.graph.nodes):
            raise ValueError(f'two arguments of the traced function are named {name!r}')
        return Symbol(self.graph.add(Node(name, kind, shape=shape, dtype=dtype)), self)

    def node_of(self, x):
        """The graph's view of one operation input: a node, or a Python scalar kept as is."""
        if isinstance(x, Symbol):
            if x.tracer is not self:
                raise TraceError(f'{x!r} belongs to another trace: a symbol escaped from an '
                                 'earlier forward (kept in an attribute?); use arrays instead')
            return x.node
        if isinstance(x, NDArray):
            return self.capture(x)
        if type(x) in (bool, int, float):
            return x
        if isinstance(x, numpy.generic):    # NumPy scalars have a dtype of their own: a constant
            return self.add_constant(numpy.asarray(x))
        raise TypeError(f'd2lperf operations take NDArrays or scalars, not {type(x).__name__}')

    def capture(self, array):
        """An array from outside forward: a parameter argument, or else a constant."""
        if id(array) in self.captured:
            return self.captured[id(array)][1]
        if array.device != self.device:
            raise TraceError(f'forward on {self.device} reads an array on {array.device}; '
                             f'keep every array of a hybridized block on one device')
        name = self.param_name(array)
        if name is not None:
            node = self.graph.add(Node(name, 'param', shape=array.shape, dtype=array.dtype))
        else:
            node = self.add_constant(array.asnumpy())
        self.captured[id(array)] = (array, node)
        return node

    def reads_a_parameter(self, arrays):
        """Whether an operation on these NDArrays alone reads a parameter: then it belongs in
        the graph (it must be computed from the parameter's value at every call, and carry
        its gradient), not computed once now and kept as a constant."""
        return self.param_name is not None and any(
            self.param_name(a) is not None for a in arrays if a.device == self.device)

    def add_constant(self, value):
        graph = self.graph
        return graph.add(Node(graph.fresh_name('const'), 'constant', shape=value.shape,
                              dtype=value.dtype, value=value))

    def call(self, name, inputs, attrs):
        nodes = [self.node_of(x) for x in inputs]
        attrs = {k: canonical(v) for k, v in attrs.items()}
        node = self.graph.call(name, nodes, attrs)
        return Symbol(node, self)


def trace(fn, args, names=None, param_name=None):
    """Run `fn` once on symbols shaped like `args` (NDArrays or Specs); return its graph.

    `param_name(array)` names the arrays `fn` reads that are parameters (arguments of the
    graph); every other array it reads becomes a constant."""
    if names is None:
        names = list(inspect.signature(fn).parameters)[:len(args)]
    devices = {a.device for a in args}
    if len(devices) != 1:
        raise ValueError(f'the arguments of a traced function must share one device, got '
                         f'{sorted(map(str, devices))}')
    tracer = Tracer(devices.pop(), param_name)
    symbols = [tracer.placeholder(n, a.shape, a.dtype) for n, a in zip(names, args)]
    with tracing(tracer):
        result = fn(*symbols)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    graph = tracer.graph
    graph.outputs = [tracer.node_of(r) if isinstance(r, (Symbol, NDArray)) else _not_an_array(r)
                     for r in results]
    graph.returns_tuple = isinstance(result, (tuple, list))
    return graph


def _not_an_array(value):
    raise TraceError(f'forward returned {type(value).__name__}; a hybridized forward must '
                     'return arrays (or a tuple of them)')
