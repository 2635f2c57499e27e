"""On a GPU: fused chains become one CUDA kernel each, and the program is replayed as a CUDA graph.

The generated code is the same as on a CPU, with CuPy as the array module, except that each
fused node becomes ONE kernel: a dense layer with its bias and activation is one
warp-per-output kernel (`dense_kernel`), any other elementwise chain one `ElementwiseKernel`.
Neither calls cuBLAS, which CuPy refuses while a stream is being captured, so a program with
fixed shapes can be captured once as a CUDA graph and replayed: one launch per call instead
of one per operation. Each faster variant is checked against plain CuPy on its first call and
dropped, with a note saying why, if it fails or disagrees. Taught in "Compilers and
Interpreters"; this module imports CuPy only when a GPU is used.
"""
import numpy

from ..device import cupy_module
from ..ops import REGISTRY
from .codegen import generate, is_plain_number
from .graph import Node
from .memory_plan import plan_memory, writes_into

C_TYPES = {numpy.dtype('float32'): 'float', numpy.dtype('float64'): 'double'}
DENSE_ROWS = 64         # up to this batch, a dense layer is our own kernel (no cuBLAS)
WARP = 32


def c_statements(steps, operand, ctype):
    """C statements computing a chain of elementwise steps; `operand(x)` names one input."""
    names, lines = {}, []
    for i, step in enumerate(steps):
        args = []
        for x in step.inputs:
            if isinstance(x, Node):
                args.append(names.get(x) or operand(x))
            elif is_plain_number(x):
                args.append(f'({ctype}){float(x)!r}')
            else:
                return None                 # NaN or infinity: leave it to CuPy
        c_expr = REGISTRY[step.op].c_expr
        if c_expr is None:
            return None                     # an op without a C form: leave it to CuPy
        expression = c_expr.format(t=ctype, a=args[0], b=args[-1])
        lines.append(f'{ctype} t{i} = {expression};')
        names[step] = f't{i}'
    return lines, f't{len(steps) - 1}'


def side_operands(steps, node, out, w, running=None):
    """The arrays a chain reads besides its running value and `out`; None if dtypes differ."""
    inside = set(steps)
    operands = [x for x in dict.fromkeys(x for s in steps for x in s.input_nodes())
                if x not in inside and x is not running and w.names.get(x) != out]
    return None if any(x.dtype != node.dtype for x in operands) else operands


def elementwise_kernel(w, node, out, steps, running=None):
    """One ElementwiseKernel computing `steps` into `out`; `running` already lives in `out`."""
    ctype = C_TYPES.get(node.dtype)
    operands = side_operands(steps, node, out, w, running) if ctype else None
    if operands is None:
        return None
    names = {x: f'e{i}' for i, x in enumerate(operands)}
    code = c_statements(steps, lambda x: names.get(x, 'y'), ctype)   # y: out, read in place
    if code is None:
        return None
    lines, result = code
    inputs = ', '.join(f'{node.dtype.name} {names[x]}' for x in operands)
    operation = ' '.join(lines + [f'y = {result};'])
    kernel = cupy_module().ElementwiseKernel(inputs, f'{node.dtype.name} y', operation,
                                       f'd2lperf_fused_{len(w.kernels)}')
    name = w.bind(kernel, 'kernel')
    w.kernels.append((name, f'ElementwiseKernel({inputs!r}, "{node.dtype.name} y", '
                            f'{operation!r})'))
    return [f'{name}({"".join(w.expr(x) + ", " for x in operands)}{out})']


def matmul_then_kernel(w, node, out):
    """cuBLAS for the product (fast for big batches), then the rest as one kernel."""
    first, f = node.body[0], w.function
    a = [w.expr(x) for x in first.inputs]
    steps = node.body[1:]
    if first.op == 'fully_connected':
        product = [f'{f("matmul")}({a[0]}, {a[1]}.T, out={out})']
        steps = [Node('bias', 'call', 'add', [first, first.inputs[2]], shape=first.shape,
                      dtype=first.dtype)] + steps
    else:
        product = [f'{f(first.op)}({a[0]}, {a[1]}, out={out})']
    tail = elementwise_kernel(w, node, out, steps, running=first)
    return None if tail is None else product + tail


DENSE_SOURCE = r'''
extern "C" __global__ void {name}(const {t}* x, const {t}* w, const {t}* bias, {params}
                                  {t}* y, int rows, int k, int n) {{
    // one warp per output y[i, j]: its 32 lanes read x[i, :] and w[j, :] side by side
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= rows * n) return;
    int i = warp / n, j = warp % n;
    {t} acc = 0;
    for (int t = lane; t < k; t += 32) acc += x[i * k + t] * w[j * k + t];
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffff, acc, offset);
    if (lane != 0) return;
    {t} t_fc = acc + bias[j];
    {body}
    y[warp] = {result};
}}
'''


def dense_kernel(w, node, out):
    """fully_connected and its elementwise tail as one kernel, for a small batch."""
    fc, tail = node.body[0], node.body[1:]
    x, weight, bias = fc.inputs
    ctype = C_TYPES.get(node.dtype)
    if (not ctype or not all(isinstance(v, Node) and v.dtype == node.dtype for v in fc.inputs)
            or x.ndim != 2 or weight.ndim != 2 or bias.shape != (weight.shape[0],)
            or x.shape[0] > DENSE_ROWS):
        return None
    rows, n = node.shape
    operands = side_operands(tail, node, out, w, running=fc)
    if operands is None or any(v.shape not in ((rows, n), (n,), (1, n)) for v in operands):
        return None
    names = {v: f'e{i}[{"warp" if v.shape == (rows, n) else "j"}]'
             for i, v in enumerate(operands)}
    names[fc] = 't_fc'
    code = c_statements(tail, names.get, ctype)
    if code is None:
        return None
    lines, result = code
    name = f'd2lperf_dense_{len(w.kernels)}'
    source = DENSE_SOURCE.format(name=name, t=ctype, body='\n    '.join(lines), result=result,
                                 params=''.join(f'const {ctype}* e{i}, '
                                                for i in range(len(operands))))
    kernel = w.bind(cupy_module().RawKernel(source, name), 'kernel')
    w.kernels.append((kernel, source))
    contiguous = w.function('ascontiguousarray')
    args = [w.expr(v) if v.kind == 'param' else f'{contiguous}({w.expr(v)})'
            for v in [x, weight, bias] + operands]
    blocks = (rows * n * WARP + 255) // 256
    return [f'{kernel}(({blocks},), (256,), ({", ".join(args)}, {out}, numpy.int32({rows}), '
            f'numpy.int32({weight.shape[1]}), numpy.int32({n})))']


def fused_kernel(w, node, out):
    """Lines that run a fused node as one kernel, or None to fall back to one call per step."""
    w.namespace.setdefault('numpy', numpy)
    first = node.body[0]
    if first.op_kind == 'elementwise':
        return elementwise_kernel(w, node, out, node.body)
    if first.op == 'fully_connected':
        return dense_kernel(w, node, out) or matmul_then_kernel(w, node, out)
    return matmul_then_kernel(w, node, out)


class GraphReplay:
    """Run a program as a CUDA graph: inputs copied into fixed buffers, outputs copied out."""

    def __init__(self, fn, num_inputs):
        self.fn, self.num_inputs, self.graph = fn, num_inputs, None
        self.captures = 0       # a new parameter array means a new capture: the graph reads
                                # the arrays it was captured with, by address

    def __call__(self, *arrays):
        cupy = cupy_module()
        params = arrays[self.num_inputs:]
        if self.graph is None or any(a is not b for a, b in zip(params, self.params)):
            self.capture(arrays)
        for static, x in zip(self.inputs, arrays[:self.num_inputs]):
            cupy.copyto(static, x)
        self.graph.launch(cupy.cuda.get_current_stream())
        return tuple(out.copy() for out in self.outputs)

    def capture(self, arrays):
        stream = cupy_module().cuda.get_current_stream()
        if stream.ptr == 0:
            raise RuntimeError('the legacy default stream cannot be captured')
        self.inputs = [x.copy() for x in arrays[:self.num_inputs]]
        self.params = arrays[self.num_inputs:]
        self.outputs = self.fn(*self.inputs, *self.params)   # warm up: compile every kernel
        stream.begin_capture()
        try:
            self.fn(*self.inputs, *self.params)
        finally:
            graph = stream.end_capture()        # leaves capture mode even after a failure
        self.graph = graph
        self.captures += 1


class VerifiedRunner:
    """The fastest variant that agrees with plain CuPy on the first call; notes say why not."""

    def __init__(self, plain, candidates):
        self.plain, self.candidates, self.chosen, self.notes = plain, candidates, None, []
        self.name = None

    def __call__(self, *arrays):
        if self.chosen is not None:
            return self.chosen(*arrays)
        cupy, reference = cupy_module(), self.plain(*arrays)
        for name, candidate in self.candidates:
            try:
                result = candidate(*arrays)
                if all(bool(cupy.allclose(r, c, rtol=1e-4, atol=1e-6, equal_nan=True))
                       for r, c in zip(reference, result)):
                    self.chosen, self.name = candidate, name
                    return result
                self.notes.append(f'{name}: results differ from plain CuPy, not used')
            except Exception as err:            # noqa: BLE001 - any failure: use the next one
                self.notes.append(f'{name}: {type(err).__name__}: {err}')
        self.chosen, self.name = self.plain, 'plain CuPy'
        return reference


# CuPy's reductions may take scratch memory of their own (CUB's temporary storage) even when
# given `out=`: a program with one is not captured, static_alloc or not.
REDUCTIONS = {'sum', 'mean', 'max', 'argmax'}


def allocating_ops(graph, static_alloc=False):
    """Only a program that allocates nothing can be a CUDA graph: memory allocated while
    capturing would be freed by Python yet written by every replay. Under static_alloc the
    copies, casts and slices write into buffers (`copyto`), so they no longer stand in the
    way."""
    return sorted({n.op for n in graph.nodes if n.kind == 'call' and (
        not writes_into(n, static_alloc) or n.op in REDUCTIONS)})


def build_program(graph, plan, device):
    """Plain CuPy code, fused kernels, and a CUDA graph of them; the runner picks one."""
    cupy = cupy_module()
    with cupy.cuda.Device(device.index):
        plain = generate(graph, plan, cupy)
        fused = generate(graph, plan, cupy, fused_kernel=fused_kernel)
        allocating = allocating_ops(graph, plan.static_alloc)
        candidates = [('fused kernels', fused.fn)]
        if not allocating:
            static_plan = plan_memory(graph, static_outputs=True, static_alloc=plan.static_alloc)
            static = generate(graph, static_plan, cupy, fused_kernel=fused_kernel,
                              copy_outputs=False)
            candidates.insert(0, ('CUDA graph', GraphReplay(static.fn, len(graph.inputs))))
    fused.runner = VerifiedRunner(plain.fn, candidates)
    if allocating:
        fused.runner.notes.append(f'CUDA graph: not captured, {", ".join(allocating)} '
                                  'allocate memory while they run')
    return fused
