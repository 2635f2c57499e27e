"""Running compiled programs: one engine push per call, a cache per input signature.

`CompiledFunction` is what `hybridize()` puts in front of a block's `forward`: on a call it
looks up the program compiled for these input shapes, dtypes and device (tracing and
compiling on a miss), and pushes the whole program to the engine as ONE operation that reads
the inputs and parameters and writes the outputs. Python's per-op cost is paid once per call,
not once per layer. Under `autograd.record()` the program records one tape node whose
backward runs the graph's own gradient rules. Whether it records, and whether layers train,
are part of the signature: dropout traces to a different graph in training. Taught in
"Compilers and Interpreters".
"""
import math
import operator
from time import perf_counter

from .. import engine
from ..np.multiarray import HeldVar, NDArray
from ..ops import REGISTRY, Op
from ..np.tape import TAPE, TapeNode
from .codegen import generate
from .graph import Node, evaluate, gradients
from .memory_plan import aliased_outputs, plan_memory
from .passes import fuse_elementwise, simplify
from .trace import trace


# Below a thread hand-off on the course's 2-core VM: benchmarks/engine.py's round trip
# through a queue to a worker and back measured 20 to 60 µs there, depending on the load.
SHORT_SECONDS = 50e-6
DATA, VAR = operator.attrgetter('data'), operator.attrgetter('var')   # no frame per array


def build_program(graph, plan, device):
    """Generated code for `device`: NumPy source on a CPU, fused CuPy kernels on a GPU."""
    if device.kind == 'gpu':
        from . import gpu                   # CuPy is imported only when a GPU is used
        return gpu.build_program(graph, plan, device)
    return generate(graph, plan, device.xp)


class ParameterTypesChanged(Exception):
    """A parameter was given arrays of another shape or dtype (`net.cast('float64')`): the
    program planned for the old ones must be compiled again."""


class Executable:
    """One compiled forward: the graph at every stage, the memory plan and the program.

    `param_arrays()` returns the parameters' current arrays, in the graph's order;
    `static_alloc` plans the reductions, copies and slices into buffers too."""

    def __init__(self, traced, device, param_arrays, recording, name='hybrid_forward',
                 static_alloc=False):
        self.traced, self.device, self.name = traced, device, name
        self.param_arrays, self.recording = param_arrays, recording
        self.simplified = simplify(traced)      # one op per node: export and autograd use it
        self.graph = fuse_elementwise(self.simplified)
        self.param_types = [(n.shape, n.dtype) for n in self.simplified.params]
        if recording:
            self.aliased = aliased_outputs(self.simplified)
        else:
            self.plan = plan_memory(self.graph, static_alloc=static_alloc)
            self.program = build_program(self.graph, self.plan, device)
            self.runner = self.program.runner
        self.workspace = engine.Var()           # orders the calls that share its buffers
        # The shorter of the last two runs' times (unknown until it runs), for `push` to
        # choose by: one run slowed down by the machine (a page fault, the garbage collector,
        # another process) does not send the next call to the lane's thread.
        self.seconds = self.last_seconds = float('inf')
        self.output_types = [(n.shape, n.dtype) for n in self.simplified.outputs]
        self.output_bytes = [(shape, dtype, math.prod(shape) * dtype.itemsize)
                             for shape, dtype in self.output_types]      # counted once, here
        self._params, self._param_vars, self._written_vars = None, [], []
        self.written = updated_params(self.simplified)
        single = len(self.output_types) == 1 and not traced.returns_tuple
        self.run = self.run_recorded if recording else self.run_one if single else self.run_many

    def params(self):
        """The parameters' arrays; their engine variables re-read when they are new arrays,
        and ParameterTypesChanged raised if those are not of the types the program was
        planned for."""
        params = self.param_arrays()
        if params is not self._params:
            if [(p.shape, p.dtype) for p in params] != self.param_types:
                raise ParameterTypesChanged(self.name)
            self._params = params
            self._param_vars = [p.var for i, p in enumerate(params) if i not in self.written]
            self._written_vars = [params[i].var for i in self.written]
        return params

    def pack(self, outputs):
        return tuple(outputs) if self.traced.returns_tuple else outputs[0]

    def run_one(self, args):
        """The hot path: one output array, one engine push for the whole program, every step
        inlined (at batch 1 a call costs about 1.5 times the program, and every frame shows:
        `params` and `timed_run` are written out here, and the output's bytes were counted
        once, at compile time)."""
        params = self.param_arrays()
        arrays, runner = args + (params if params is self._params else self.params()), self.runner
        shape, dtype, nbytes = self.output_bytes[0]
        out = NDArray(shape, dtype, self.device, HeldVar(self.device, nbytes))

        def run():
            start = perf_counter()
            out.data = runner(*map(DATA, arrays))[0]
            seconds = perf_counter() - start
            self.seconds = seconds if seconds < self.last_seconds else self.last_seconds
            self.last_seconds = seconds
        push = engine.push_short if self.seconds < SHORT_SECONDS else engine.push
        push(run, [*map(VAR, args), *self._param_vars],
             [out.var, self.workspace, *self._written_vars], self.device, self.name)
        return out

    def run_many(self, args):
        arrays = args + self.params()
        device = self.device
        outs = [NDArray(s, d, device, HeldVar(device, n)) for s, d, n in self.output_bytes]

        def run():
            for out, value in zip(outs, self.timed_run(arrays)):
                out.data = value
        self.push(run, [a.var for a in args] + self._param_vars,
                  [o.var for o in outs] + [self.workspace] + self._written_vars)
        return self.pack(outs)

    def timed_run(self, arrays):
        """The program's outputs, and how long it took, for `push` to choose by."""
        start = perf_counter()
        outputs = self.runner(*map(DATA, arrays))
        seconds = perf_counter() - start
        self.seconds = seconds if seconds < self.last_seconds else self.last_seconds
        self.last_seconds = seconds
        return outputs

    def push(self, run, reads, writes):
        """One engine operation for the call. A program that took less than a thread hand-off
        in one of its last two runs runs on the caller's thread where the lane is idle
        (`engine.push_short`): at batch 1 the caller waits for it next (an inference loop),
        and waking the lane's thread would cost more than the program. A longer one (a large
        batch, with BLAS threads of its own) is handed to the lane, and the caller goes on
        meanwhile."""
        push = engine.push_short if self.seconds < SHORT_SECONDS else engine.push
        push(run, reads, writes, self.device, self.name)

    def run_recorded(self, args):
        """Forward through the reference interpreter, keeping every value for backward."""
        arrays = args + self.params()
        graph, xp, saved = self.simplified, self.device.xp, {}
        outs = [NDArray(s, d, self.device) for s, d in self.output_types]
        aliased = self.aliased

        def run():
            results, saved['values'] = evaluate(graph, xp, [a.data for a in arrays], keep=True)
            for out, value, shared in zip(outs, results, aliased):
                out.data = value.copy() if shared else value       # each output its own
        engine.push(run, [a.var for a in args] + self._param_vars,
                    [o.var for o in outs] + self._written_vars, self.device,
                    f'{self.name}_recorded')
        for index, out in enumerate(outs):
            out.node = TapeNode(self.graph_op(saved, index), arrays, {})
        return self.pack(outs)

    def graph_op(self, saved, index):
        """The whole graph as one operation giving output `index`, for the tape: its vjp runs
        the graph's gradient rules on the values that the recorded call kept in `saved`."""
        graph, output_type = self.simplified, self.output_types[index]

        def compute(xp, *inputs):
            return evaluate(graph, xp, inputs)[index]

        def vjp(xp, g, out, *inputs, needs):
            return gradients(graph, xp, saved['values'], graph.outputs[index], g, needs)
        return Op(self.name, compute, lambda *inputs: output_type, vjp, partial_vjp=True)


def updated_params(graph):
    """Positions among the graph's parameters of those an op updates in place (batch
    normalization's running statistics): the call writes them, so the engine orders it."""
    written = {node.inputs[i] for node in graph.nodes if node.kind == 'call'
               for i in REGISTRY[node.op].writes}
    return {k for k, param in enumerate(graph.params) if param in written}


def apply_graph(graph, values, apply):
    """Run `graph` one `apply(op, ...)` at a time: values for its arguments and constants in."""
    for node in graph.nodes:
        if node.kind == 'call':
            values[node] = apply(node.op, *[values[x] if isinstance(x, Node) else x
                                            for x in node.inputs], **node.attrs)
    results = [values[n] for n in graph.outputs]
    return tuple(results) if graph.returns_tuple else results[0]


def _signature(args):
    """The cache key of a call with several inputs (a one-input call's is built inline)."""
    return (tuple((a.shape, a.dtype) for a in args), args[0].device, TAPE.recording,
            TAPE.training)


class CompiledFunction:
    """`forward`, traced and compiled once per input signature, then run from the cache.

    The cache key is what a program is specialized to: the inputs' shapes and dtypes, their
    device, and whether the call records for autograd and trains. The parameters' arrays are
    arguments of the program, read afresh when a parameter is given new ones; a program whose
    parameters come back with another shape or dtype is compiled again in its place.
    `compiles` counts the traces. `params()` returns the block's parameters by name (objects
    with `.data(device)`); `param_arrays(params, device)` makes the function each call uses
    to read their arrays. `static_alloc`: see `Executable`."""

    def __init__(self, forward, params, name, param_arrays, static_alloc=False):
        self.forward, self.params, self.name = forward, params, name
        self.make_param_arrays, self.static_alloc = param_arrays, static_alloc
        self.cache, self.last, self.compiles = {}, None, 0

    def run(self, args):
        """Run the program compiled for `args`' signature, compiling it first on a miss."""
        if len(args) == 1:
            x = args[0]
            key = (x.shape, x.dtype, x.device, TAPE.recording, TAPE.training)
        else:
            key = _signature(args)
        executable = self.cache.get(key)
        if executable is None:
            executable = self.cache[key] = self.compile(args)
        self.last = executable
        try:
            return executable.run(args)
        except ParameterTypesChanged:           # raised before anything was pushed
            del self.cache[key]
            return self.run(args)

    def compile(self, args):
        names = ['data'] if len(args) == 1 else [f'data{i}' for i in range(len(args))]
        graph = trace(self.forward, args, names, self.param_name)
        params, device = self.params(), args[0].device
        param_arrays = self.make_param_arrays([params[n.name] for n in graph.params], device)
        self.compiles += 1
        return Executable(graph, device, param_arrays, TAPE.recording, self.name,
                          self.static_alloc)

    def param_name(self, array):
        """The name of the parameter whose value on `array`'s device is `array`, or None."""
        for name, param in self.params().items():
            try:
                if param.data(array.device) is array:
                    return name
            except (RuntimeError, ValueError):     # not initialized yet, or not on that device
                continue
        return None
