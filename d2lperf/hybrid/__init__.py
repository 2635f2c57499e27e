"""`d2lperf.hybrid`: a small compiler for imperative forward functions.

The pipeline, one module each (taught in "Compilers and Interpreters"):

    trace.py        run forward once on Symbols (shape, dtype, device; no data) -> Graph
    graph.py        the IR: typed nodes in A-normal form; `print(graph)`; a reference
                    interpreter
    passes.py       fold_constants, eliminate_common_subexpressions, eliminate_dead_code,
                    fuse_elementwise: each takes a graph and returns a new one
    memory_plan.py  plan_memory: the compiled program's workspace, a buffer per value,
                    reused once dead, or written in place
    codegen.py      Python source calling NumPy/CuPy with out= buffers, compiled with compile()
    gpu.py          on a GPU: fused CUDA kernels and CUDA-graph replay
    runtime.py      a cache per input signature; each call is ONE engine push; autograd
    serialize.py    export to JSON + .npz, and a validating loader

For example, `relu(x @ w.T + b)` traces to

    graph(%x: float32[1, 4], %w: float32[3, 4], %b: float32[3]):
        %transpose0: float32[4, 3] = transpose(%w, axes=None)
        %matmul0: float32[1, 3] = matmul(%x, %transpose0)
        %add0: float32[1, 3] = add(%matmul0, %b)
        %relu0: float32[1, 3] = relu(%add0)
        return %relu0

fusion makes the last three nodes one step, and the generated code reads

    def forward(x0, x1, x2):
        v3 = transpose_op(xp, x1, axes=None)
        v4 = empty((1, 3), float32)
        matmul(x0, v3, out=v4)
        add(v4, x2, out=v4)
        maximum(v4, 0, out=v4)
        return (v4,)
"""
from .graph import Graph, Node, evaluate, gradients
from .memory_plan import MemoryPlan, plan_memory
from .passes import (bind, eliminate_common_subexpressions, eliminate_dead_code,
                     fold_constants, fuse_elementwise, optimize, simplify)
from .codegen import Program, generate
from .runtime import CompiledFunction, Executable, apply_graph
from .serialize import FORMAT_VERSION, load, save
from .trace import Spec, Symbol, TraceError, trace

__all__ = ['Graph', 'Node', 'evaluate', 'gradients', 'MemoryPlan', 'plan_memory', 'bind',
           'eliminate_common_subexpressions', 'eliminate_dead_code', 'fold_constants',
           'fuse_elementwise', 'optimize', 'simplify', 'Program', 'generate',
           'CompiledFunction', 'Executable', 'apply_graph', 'FORMAT_VERSION', 'load', 'save',
           'Spec',
           'Symbol', 'TraceError', 'trace']
