"""Code generation: the optimized graph becomes Python source calling the array module.

Each step calls NumPy (or CuPy) directly, writing into the buffer the memory plan gave it
(`out=`), so a call of the compiled program runs no tracer, no graph walk and no per-op
dispatch: just the calls a person would write by hand. The source is compiled with Python's
own `compile()`. Every name in it is generated here (`x0`, `p1`, `buf0`, `v7`); values that
come from a graph (attributes, scalars, constants) enter only as numbers known to be safe or
as objects bound in the program's namespace, never as text. Taught in "Compilers and
Interpreters".
"""
import itertools
import linecache
import math

from ..ops import REGISTRY, as_array
from .graph import ARGUMENT_KINDS
from .memory_plan import writes_into

_programs = itertools.count()


def is_plain_number(x):
    return type(x) in (bool, int) or (type(x) is float and math.isfinite(x))


def is_plain_attr(x):
    """Attribute values that can be written as Python literals: numbers, None, tuples, slices."""
    if x is None or x is Ellipsis or is_plain_number(x):
        return True
    if isinstance(x, tuple):
        return all(map(is_plain_attr, x))
    if isinstance(x, slice):
        return all(map(is_plain_attr, (x.start, x.stop, x.step)))
    return False


class Writer:
    """The state of one generation: lines written so far, names given, objects bound."""

    def __init__(self, xp, static_alloc=False):
        self.xp, self.lines, self.names = xp, [], {}
        self.namespace = {'xp': xp}
        self.counts = itertools.count()
        self.kernels = []           # (name, source) of the GPU kernels a fuser made
        self.static_alloc = static_alloc    # the plan's: which ops write into its buffers

    def bind(self, value, stem):
        """Put an object into the program's namespace under a new name, and return the name."""
        name = f'{stem}{next(self.counts)}'
        self.namespace[name] = value
        return name

    def function(self, name):
        """The array module's function `name` (one of ours: never a name read from a file)."""
        self.namespace.setdefault(name, getattr(self.xp, name))
        return name

    def dtype(self, dtype):
        """A dtype by its NumPy name (`float32`), bound to the dtype object itself."""
        name = dtype.name
        if not name.isidentifier() or self.namespace.get(name, dtype) != dtype:
            return self.bind(dtype, 'dtype')
        self.namespace[name] = dtype
        return name

    def operation(self, name):
        """A registered op's compute function, bound once as `<name>_op`."""
        key = f'{name}_op' if name.isidentifier() else self.bind(None, 'op')
        self.namespace[key] = REGISTRY[name].compute
        return key

    def literal(self, x):
        return repr(x) if is_plain_attr(x) else self.bind(x, 'k')

    def expr(self, x):
        return self.names[x] if x in self.names else self.literal(x)

    def emit(self, line):
        self.lines.append('    ' + line)


def emit_into(w, node, out):
    """The lines that compute one call node into the existing array named `out`."""
    a, op, f = [w.expr(x) for x in node.inputs], node.op, w.function
    if REGISTRY[op].ufunc:
        return [f'{f(REGISTRY[op].ufunc)}({", ".join(a)}, out={out})']
    if op == 'relu':
        return [f'{f("maximum")}({a[0]}, 0, out={out})']
    if op == 'sigmoid':                 # 1 / (1 + exp(-a)), one step at a time, in place
        return [f'{f("negative")}({a[0]}, out={out})', f'{f("exp")}({out}, out={out})',
                f'{f("add")}({out}, 1, out={out})', f'{f("divide")}(1, {out}, out={out})']
    if node.op_kind in ('elementwise', 'compare'):      # no ufunc: compute, then store
        return [f'{out}[...] = {w.operation(op)}(xp, {", ".join(a)})']
    if op == 'fully_connected':
        return [f'{f("matmul")}({a[0]}, {a[1]}.T, out={out})',
                f'{f("add")}({out}, {a[2]}, out={out})']
    if op in ('matmul', 'dot'):
        return [f'{f(op)}({a[0]}, {a[1]}, out={out})']
    if op == 'concatenate':
        return [f'{f(op)}(({", ".join(a)},), axis={w.literal(node.attrs.get("axis", 0))}, '
                f'out={out})']
    return emit_static_into(w, node, a, out)


def emit_static_into(w, node, a, out):
    """The out= forms of the ops planned into buffers only under static_alloc."""
    op, attrs, f = node.op, node.attrs, w.function
    if op in ('sum', 'mean', 'max', 'argmax'):
        axis = attrs.get('axis')
        axis = f'axis={w.literal(tuple(axis) if isinstance(axis, list) else axis)}'
        dtype = f', dtype={w.dtype(node.dtype)}' if op in ('sum', 'mean') else ''
        keepdims = '' if op == 'argmax' else f', keepdims={attrs.get("keepdims", False)!r}'
        return [f'{f(op)}({a[0]}, {axis}{dtype}{keepdims}, out={out})']
    if op in ('copy', 'astype'):
        return [f'{f("copyto")}({out}, {a[0]}, casting="unsafe")']
    if op == 'broadcast_to':
        return [f'{f("copyto")}({out}, {f(op)}({a[0]}, {w.literal(tuple(attrs["shape"]))}))']
    if op == 'getitem':
        return [f'{f("copyto")}({out}, {a[0]}[{w.literal(attrs["key"])}])']
    raise AssertionError(f'no out= form for {op}')


def emit_call(w, node, name):
    """`name = op(...)` for an operation that allocates its own result."""
    function = w.operation(node.op)
    args = [w.expr(x) for x in node.inputs]
    attrs = [f'{k}={w.literal(v)}' for k, v in node.attrs.items() if k.isidentifier()]
    call = f'{function}(xp, {", ".join(args + attrs)})'
    if not node.shape:                          # NumPy returns 0-d results as scalars
        w.namespace['as_array'] = as_array
        call = f'as_array(xp, {call})'
    w.emit(f'{name} = {call}')


def emit_node(w, index, node, slot, fused_kernel):
    if node.op_kind == 'view' or not writes_into(node, w.static_alloc):
        w.names[node] = f'v{index}'
        emit_call(w, node, w.names[node])
        return
    out = slot.name
    if slot.kind == 'fresh' and out not in w.names.values():
        w.emit(f'{out} = {w.function("empty")}({node.shape!r}, {w.dtype(node.dtype)})')
    lines = fused_kernel(w, node, out) if fused_kernel and node.kind == 'fused' else None
    if lines is None:
        lines = []
        for step in (node.body if node.kind == 'fused' else [node]):
            lines += emit_into(w, step, out)
            w.names[step] = out
    for line in lines:
        w.emit(line)
    w.names[node] = out


class Program:
    """Generated source, its namespace (buffers, constants, functions) and the compiled function.

    `runner` is what a call runs: `fn` itself, unless a back end chooses among variants of
    it (on a GPU, `gpu.VerifiedRunner`, whose `name` and `notes` say which runs and why)."""

    def __init__(self, source, namespace, header, kernels=(), runner=None):
        self.source, self.namespace, self.header = source, namespace, header
        self.kernels = list(kernels)
        filename = f'<d2lperf-hybrid-{next(_programs)}>'
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, 'exec'), namespace)
        self.fn = namespace['forward']
        self.runner = runner or self.fn

    def __str__(self):
        runner = self.runner
        status = '' if runner is self.fn else (
            f'# running: {runner.name or "not yet chosen (first call pending)"}\n'
            + ''.join(f'# note: {note}\n' for note in runner.notes))
        kernels = ''.join(f'\n# {name}:\n' + ''.join(f'#   {line}\n' for line in
                                                       source.strip().splitlines())
                          for name, source in self.kernels)
        return status + self.header + self.source + kernels

    __repr__ = __str__


def generate(graph, plan, xp, fused_kernel=None, copy_outputs=True):
    """Python source for `graph` under `plan`, calling the array module `xp`.

    `fused_kernel(writer, node, out)` may emit a fused node as one kernel (on a GPU); an
    output kept in a workspace buffer is copied unless `copy_outputs` is False."""
    w = Writer(xp, plan.static_alloc)
    arguments = []
    for node in graph.arguments:
        kind = 'x' if node.kind == 'input' else 'p'
        w.names[node] = f'{kind}{sum(a.startswith(kind) for a in arguments)}'
        arguments.append(w.names[node])
    for node in graph.nodes:
        if node.kind == 'constant':
            w.names[node] = w.bind(xp.asarray(node.value), 'c')
    for slot in plan.buffers:
        w.namespace[slot.name] = xp.empty(slot.shape, slot.dtype)
    for index, node in enumerate(graph.nodes):
        if node.kind not in ARGUMENT_KINDS and node.kind != 'constant':
            emit_node(w, index, node, plan.slots.get(node), fused_kernel)
    results = [w.names[n] + ('.copy()' if copy else '')
               for n, copy in zip(graph.outputs, outputs_to_copy(graph, plan, copy_outputs))]
    w.emit(f'return ({", ".join(results)},)')
    source = f'def forward({", ".join(arguments)}):\n' + '\n'.join(w.lines) + '\n'
    return Program(source, w.namespace, describe(graph, arguments, plan), w.kernels)


def outputs_to_copy(graph, plan, copy_outputs=True):
    """Which outputs the program must copy: every output is an array of its own, which the
    caller may keep and write into. One kept in a workspace buffer (or a view of one) would
    be overwritten by the next call; one that is an argument, a constant or a view of them
    would share their memory; one whose slot an earlier output already returns (`y, y` or
    `y, y.T`) would share that output's."""
    copies, returned = [], []
    for node in graph.outputs:
        slot = plan.slots.get(node)
        shared = slot is None or slot.kind == 'buffer' or any(s is slot for s in returned)
        copies.append(copy_outputs and shared)
        returned.append(slot)
    return copies


def describe(graph, arguments, plan):
    """Comment lines for the reader: which argument is which (not part of the compiled code)."""
    pairs = [f'{a} = {n!r}' for a, n in zip(arguments, graph.arguments)]
    lines, line = [], '# arguments:'
    for pair in pairs:
        if len(line) + len(pair) > 86:
            lines.append(line + ',')
            line = '#  '
        line += f' {pair}' if line.endswith((':', '  ')) else f', {pair}'
    lines.append(line)
    buffers = ', '.join(f'{b.name} {b.dtype}{list(b.shape)}' for b in plan.buffers)
    lines.append(f'# workspace: {buffers or "none"}')
    return '\n'.join(lines) + '\n'
