"""The tape: what autograd records while operations run, and the two flags that steer it.

Inside `autograd.record()`, every operation whose inputs need a gradient leaves a `TapeNode`
on its output array (`array.node`): the op, the inputs and the attributes it ran with. The
nodes, linked through their inputs, are the graph that `autograd.backward` walks in
reverse. `TAPE.recording` says whether to leave nodes; `TAPE.training` whether layers such
as dropout behave as in training or as in prediction. Both are set only by autograd's
context managers. The tape lives apart from autograd.py so that the array (multiarray.py),
which records, need not import autograd, which sits above it: `TAPE.walk` is autograd's
`backward`, and `NDArray.backward` calls it. The two modules together are all of reverse mode.

The layers above fill the tape in through the three functions declared for it here, never by
writing its fields (tests/test_layering.py checks): autograd hands in its walk
(`register_backward`, once, when it is imported) and sets the flags (`modes`); the compiler
hands in its tracer for the time of a trace (`tracing`).

A node keeps its inputs alive until the graph is freed, for backward to read: the memory they
hold counts as activations from then on (`device.memory`).
"""
import contextlib

from ..device import Held


class TapeNode:
    """How one recorded array was computed: `op(*inputs, **attrs)`."""

    __slots__ = ('op', 'inputs', 'attrs')

    def __init__(self, op, inputs, attrs):
        self.op, self.inputs, self.attrs = op, tuple(inputs), attrs
        keep_for_backward(self.inputs)

    def __repr__(self):
        return f'TapeNode({self.op.name}, {len(self.inputs)} inputs)'


class TapeState:
    """Whether operations are recorded for autograd, whether layers are training, the
    reverse walk (`walk(head, head_grad, retain_graph, on_gradient)`) that autograd provides,
    and the compiler's tracer while it traces a forward (`hybrid.trace`), which takes every
    operation that reads a parameter, even one with no traced input (`w[:n]`)."""

    __slots__ = ('recording', 'training', 'walk', 'tracer')

    def __init__(self):
        self.recording, self.training, self.walk, self.tracer = False, False, None, None


TAPE = TapeState()


def register_backward(walk):
    """Autograd's reverse walk, handed in once as autograd is imported: `NDArray.backward`,
    a layer below it, calls `walk(head, head_grad, retain_graph, on_gradient)`."""
    TAPE.walk = walk


@contextlib.contextmanager
def modes(recording, training):
    """Set the tape's flags (None: leave one as it is) inside the block, then restore them:
    autograd's `record`, `pause`, `train_mode` and `predict_mode`."""
    previous = TAPE.recording, TAPE.training
    if recording is not None:
        TAPE.recording = recording
    if training is not None:
        TAPE.training = training
    try:
        yield
    finally:
        TAPE.recording, TAPE.training = previous


class Tracing:
    """What `tracing` takes: the compiler's tracer (`hybrid.trace.Tracer`), declared here, below
    the compiler, because every operation of the array asks it whether to take a call."""

    def reads_a_parameter(self, arrays):
        """Whether an operation on these NDArrays belongs in the traced graph."""
        raise NotImplementedError

    def call(self, name, inputs, attrs):
        """Record the operation `name(*inputs, **attrs)`; return what stands for its output."""
        raise NotImplementedError


@contextlib.contextmanager
def tracing(tracer):
    """Inside the block, every operation on NDArrays that reads a parameter goes to `tracer`
    (a `Tracing`), not to the engine; the tracer in force before comes back after."""
    if not isinstance(tracer, Tracing):
        raise TypeError(f'tracing takes a Tracing (the compiler\'s tracer), not {tracer!r}')
    outer, TAPE.tracer = TAPE.tracer, tracer
    try:
        yield
    finally:
        TAPE.tracer = outer


def keep_for_backward(inputs):
    """A node keeps its inputs until the graph is freed: an array that held temporaries now
    holds activations (weights, gradients and optimizer state keep their kind)."""
    for x in inputs:
        var = getattr(x, 'var', None)           # a scalar input has none
        if isinstance(var, Held) and var.kind == 'temporaries':
            var.label('activations')


def needs_grad(array):
    """True for an array that backward must reach: recorded, or holding a gradient buffer."""
    return array.node is not None or array.grad is not None
