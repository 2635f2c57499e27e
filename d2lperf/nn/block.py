"""Blocks: the layers and networks a model is built from, as in Gluon.

A Block registers the child blocks and parameters assigned to it as attributes, so
`collect_params()` finds every parameter by walking the tree. `forward` is ordinary Python
on asynchronous arrays ("imperative"). A HybridBlock can also be compiled: after
`hybridize()`, its next call traces `forward` into a graph and every later call runs the
generated program as one engine operation ("Compilers and Interpreters").
"""
import collections

from .. import autograd, hybrid, np
from ..np import extension as npx
from ..device import cpu
from ..np.multiarray import NDArray, apply
from .init import Initializer, Zero
from .parameter import Parameter, ParameterDict


class Block:
    _hooks = None                  # (pre-forward hooks, post-forward hooks) once one is added

    def __init__(self):
        object.__setattr__(self, '_children', collections.OrderedDict())
        object.__setattr__(self, '_params', collections.OrderedDict())

    def __setattr__(self, name, value):
        if isinstance(value, Block):
            self._children[name] = value
        elif isinstance(value, Parameter):
            self._params[name] = value
        object.__setattr__(self, name, value)

    def children(self):
        """The blocks assigned to this one, in the order they were assigned (PyTorch's name):
        FSDP and ZeRO-3 shard a net by them."""
        return list(self._children.values())

    def collect_params(self, prefix=''):
        """Every parameter of this block and its children, by dotted name."""
        params = ParameterDict((prefix + n, p) for n, p in self._params.items())
        for name, child in self._children.items():
            params.update(child.collect_params(f'{prefix}{name}.'))
        return params

    def initialize(self, init=None, device=None, force_reinit=False):
        """Draw every parameter's first values on `device` (one Device or a list of them)."""
        for param in self.collect_params().values():
            param.initialize(init=init, device=device, force_reinit=force_reinit)
        return self

    def reset_device(self, device):
        """Every parameter of this block and its children moved to `device` (Gluon's name)."""
        for param in self.collect_params().values():
            param.reset_device(device)
        return self

    def cast(self, dtype):
        """Every parameter of this block and its children in `dtype` (Gluon's Block.cast):
        `net.cast('float16')` halves the bytes of weights and gradients ("Memory")."""
        for param in self.collect_params().values():
            param.cast(dtype)
        return self

    def __call__(self, *args):
        if self._hooks is not None:
            return self._call_hooked(self.forward, args)
        return self.forward(*args)

    # -- hooks (Gluon's names): what ZeRO-3 and FSDP need around each unit's forward --------
    def register_forward_pre_hook(self, hook):
        """Call `hook(block, args)` before every forward of this block; returns a handle
        whose `detach()` removes it."""
        return self._add_hook(0, hook)

    def register_forward_hook(self, hook):
        """Call `hook(block, args, output)` after every forward; a hook that returns something
        other than None replaces the output (PyTorch's rule; Gluon ignores it)."""
        return self._add_hook(1, hook)

    def _add_hook(self, when, hook):
        if self._hooks is None:
            object.__setattr__(self, '_hooks', ([], []))
        self._hooks[when].append(hook)
        return HookHandle(self._hooks[when], hook)

    def _call_hooked(self, run, args):
        for hook in list(self._hooks[0]):
            hook(self, args)
        out = run(*args)
        for hook in list(self._hooks[1]):
            replaced = hook(self, args, out)
            out = out if replaced is None else replaced
        return out

    def hybridize(self, active=True, static_alloc=False, static_shape=False):
        """Compile every HybridBlock inside this block (a plain Block itself stays imperative).

        MXNet's flags. `static_alloc` plans every value an op can write into a given array
        into buffers allocated once, so that a call allocates its outputs and little else.
        `static_shape` (which needs `static_alloc`, as in MXNet) declares that input shapes
        stay the same; here every program is compiled for its input shapes anyway (a new
        shape is a new program, planned afresh), so it adds nothing to `static_alloc` yet."""
        if static_shape and not static_alloc:
            raise ValueError('static_shape=True needs static_alloc=True (as in MXNet): '
                             'call hybridize(static_alloc=True, static_shape=True)')
        for child in self._children.values():
            child.hybridize(active, static_alloc, static_shape)
        return self

    def forward(self, *args):
        raise NotImplementedError(f'{type(self).__name__} must define forward(self, x)')

    def __repr__(self):
        lines = [f'  ({name}): {child!r}'.replace('\n', '\n  ')
                 for name, child in self._children.items()]
        return f'{type(self).__name__}(\n' + '\n'.join(lines) + '\n)' if lines else \
            f'{type(self).__name__}()'


class HookHandle:
    """What registering a hook returns: `detach()` takes the hook off again."""

    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook

    def detach(self):
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class CurrentArrays:
    """Some parameters' arrays on one device, read again only when a parameter has been given
    new arrays (`Parameter.replacements`): compiled code runs on every call, so it keeps the
    arrays instead of asking each parameter for them. `current_arrays` makes the function
    that compiled code calls."""

    __slots__ = ('params', 'device', 'seen', 'arrays')

    def __init__(self, params, device):
        self.params, self.device, self.seen, self.arrays = params, device, None, ()

    def read(self):
        replacements = Parameter.replacements    # before reading: a change after reads again
        if self.seen != replacements:
            self.arrays = tuple(p.data(self.device) for p in self.params)
            self.seen = replacements
        return self.arrays


def current_arrays(params, device):
    """The function that returns `params`' arrays on `device` as they are now: a bound
    method, which Python calls without the lookup an object's `__call__` costs."""
    return CurrentArrays(params, device).read


class HybridBlock(Block):
    """A block whose `forward` only uses d2lperf operations, so that it can be compiled."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, '_compiled', None)

    def hybridize(self, active=True, static_alloc=False, static_shape=False):
        """From the next call on, trace `forward` once per input shape and run compiled code
        (a fresh cache: every program compiled before is dropped). The flags: `Block`'s."""
        super().hybridize(active, static_alloc, static_shape)
        compiled = hybrid.CompiledFunction(self.forward, self.collect_params, type(self).__name__,
                                           current_arrays, static_alloc) if active else None
        object.__setattr__(self, '_compiled', compiled)
        return self

    def __call__(self, *args):
        if self._hooks is not None:
            return self._call_hooked(self._run, args)
        compiled = self._compiled             # the hot path of a compiled call: no other frame
        if compiled is not None and len(args) == 1 and type(args[0]) is NDArray:
            return compiled.run(args)
        return self._run(*args)

    def _run(self, *args):
        compiled = self._compiled
        if compiled is not None and args and all(type(x) is NDArray for x in args):
            return compiled.run(args)
        return self.forward(*args)          # imperative, or inside a parent's trace

    # -- what the compiler made of the last call -------------------------------------------
    def _executable(self, what):
        if self._compiled is None or self._compiled.last is None:
            raise RuntimeError(f'{what} needs a compiled block: call net.hybridize() and run '
                               'it once (net(x)) so that forward is traced')
        return self._compiled.last

    def traced_graph(self):
        """The graph the last trace recorded, before any pass."""
        return self._executable('traced_graph()').traced

    def optimized_graph(self):
        """The graph the generated code computes: folded, merged, pruned and fused."""
        return self._executable('optimized_graph()').graph

    def memory_plan(self):
        return self._executable('memory_plan()').plan

    def generated_code(self):
        """The Python source the last call ran, with a header naming its arguments."""
        executable = self._executable('generated_code()')
        if executable.recording:
            raise RuntimeError('the last call was recorded for autograd and ran the graph '
                               'interpreter; call the net outside autograd.record() first')
        return str(executable.program)

    def export(self, path, epoch=0):
        """Write PATH-symbol.json and PATH-EPOCH.params (e.g. models/my_mlp-0000.params)."""
        executable = self._executable('export()')
        graph = executable.simplified
        values = {n.name: n.value for n in graph.nodes if n.kind == 'constant'}
        values.update({n.name: array.asnumpy()
                       for n, array in zip(graph.params, executable.param_arrays())})
        return hybrid.save(path, graph, values, epoch)


class Sequential(Block):
    """Children run one after the other."""

    def add(self, *blocks):
        for block in blocks:
            setattr(self, str(len(self._children)), block)
        return self

    def forward(self, x):
        for block in self._children.values():
            x = block(x)
        return x

    def __getitem__(self, i):
        return list(self._children.values())[i]

    def __len__(self):
        return len(self._children)


class HybridSequential(HybridBlock, Sequential):
    """Sequential that compiles: hybridize() traces all its children into one graph."""


ACTIVATIONS = {'relu': npx.relu, 'sigmoid': npx.sigmoid, 'tanh': np.tanh}


def activation_function(name):
    """The function an activation name stands for (None: no activation)."""
    if name is not None and name not in ACTIVATIONS:
        raise ValueError(f'unknown activation {name!r}; use one of {sorted(ACTIVATIONS)} or None')
    return ACTIVATIONS.get(name)


class Dense(HybridBlock):
    """A fully connected layer; its input size is learnt from the first batch it sees.

    As in Gluon, `flatten=True` collapses every axis of the input but the first, so that a
    Dense layer can follow a convolution directly."""

    def __init__(self, units, activation=None, in_units=0, flatten=True):
        super().__init__()
        self.units, self.act = units, activation_function(activation)
        self.activation, self.flatten = activation, flatten
        self.weight = Parameter('weight', (units, in_units))
        self.bias = Parameter('bias', (units,), init=Zero())

    def forward(self, x):
        if self.flatten and len(x.shape) > 2:
            x = x.reshape(x.shape[0], -1)
        if 0 in self.weight.shape:
            self.weight.infer_shape((self.units, x.shape[-1]))
        device = x.device
        y = npx.fully_connected(x, self.weight.data(device), self.bias.data(device))
        return self.act(y) if self.act else y

    def __repr__(self):
        return (f'Dense({self.weight.shape[1] or None} -> {self.units}, '
                f'{self.activation or "linear"})')


class Activation(HybridBlock):
    """An activation function as a layer: Activation('relu'), 'sigmoid' or 'tanh'."""

    def __init__(self, activation):
        super().__init__()
        self.activation, self.act = activation, activation_function(activation)

    def forward(self, x):
        return self.act(x)

    def __repr__(self):
        return f'Activation({self.activation})'


class Dropout(HybridBlock):
    """Zero each value with probability `rate` while training (inside autograd.record(), by
    default), drawing from the device's own generator: `np.random.seed` makes it repeatable."""

    def __init__(self, rate):
        super().__init__()
        if not 0 <= rate < 1:
            raise ValueError(f'dropout rate must be in [0, 1), not {rate}')
        self.rate = rate

    def forward(self, x):
        if not autograd.is_training() or self.rate == 0:
            return x
        return x * apply('dropout_mask', x, rate=self.rate)

    def __repr__(self):
        return f'Dropout({self.rate})'


class _Loaded(Initializer):
    """An initializer that returns the values read from a parameter file."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, device):
        return np.array(self.value, device=device)


class SymbolBlock(HybridBlock):
    """A block rebuilt from an exported graph, without the Python class that made it."""

    def __init__(self, graph, params):
        super().__init__()
        object.__setattr__(self, '_graph', graph)
        object.__setattr__(self, '_constants', {})
        self._params.update(params)

    @staticmethod
    def imports(symbol_file, input_names, param_file, device=None):
        """Load `net.export()`'s two files; the result runs compiled on `device` (default cpu)."""
        graph, values = hybrid.load(symbol_file, input_names, param_file)
        device = device or cpu()
        params = collections.OrderedDict()
        for name, value in values.items():
            params[name] = Parameter(name, value.shape, init=_Loaded(value))
            params[name].initialize(device=device)
        return SymbolBlock(graph, params).hybridize()

    def forward(self, *args):
        """Run the graph one operation at a time (with arrays, or with a tracer's symbols)."""
        graph = self._graph
        if len(args) != len(graph.inputs):
            raise TypeError(f'this block takes {len(graph.inputs)} inputs '
                            f'({[n.name for n in graph.inputs]}), got {len(args)}')
        device = args[0].device
        values = dict(zip(graph.inputs, args))
        values.update((n, self._params[n.name].data(device)) for n in graph.params)
        values.update(zip(self._constant_nodes(), self._constant_arrays(device)))
        return hybrid.apply_graph(graph, values, apply)

    def _constant_nodes(self):
        return [n for n in self._graph.nodes if n.kind == 'constant']

    def _constant_arrays(self, device):
        if device not in self._constants:
            self._constants[device] = [np.array(n.value, device=device)
                                       for n in self._constant_nodes()]
        return self._constants[device]

    def __repr__(self):
        inputs = ', '.join(f'{n.name}: {n.type}' for n in self._graph.inputs)
        return f'SymbolBlock({inputs} -> {len(self._graph.nodes)} nodes)'
