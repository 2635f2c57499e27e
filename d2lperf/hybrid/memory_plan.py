"""The compiled program's memory plan: which buffer each of its values is written into.

The generated code computes into buffers allocated once, when the program is compiled, not
on every call. A buffer is reused as soon as every value stored in it is dead (its lifetime
does not overlap the next value's), and an elementwise step writes over its input when that
input dies at this very step (in place). Outputs get a fresh array on every call: the caller
keeps them. Values an operation allocates by itself (a sum, say) are "owned"; reshapes and
transposes are views that keep their source's buffer alive, and a buffer read through a
view in a step is never written over in that step. An output that may share memory with a
buffer, an argument or another output is copied (`codegen.outputs_to_copy`,
`aliased_outputs`). Taught in "Compilers and Interpreters".
"""
import math

from ..ops import REGISTRY
from .graph import ARGUMENT_KINDS

NEVER = math.inf


# Ops NumPy and CuPy can also compute into a given array (`out=`, `copyto`): planned into
# buffers under static_alloc only. On a GPU a program with them is still not captured as a
# CUDA graph (`gpu.allocating_ops`): CuPy's reductions may take scratch memory of their own.
STATIC_OUT_FORMS = {'sum', 'mean', 'max', 'argmax', 'copy', 'astype', 'broadcast_to', 'getitem'}


def writes_into(node, static_alloc=False):
    """Can the generated code compute this node into a buffer it is given (`out=`)?"""
    if node.kind == 'fused':
        return True
    if node.op == 'dot':
        return all(1 <= x.ndim <= 2 for x in node.inputs)
    if static_alloc and node.op in STATIC_OUT_FORMS:
        return node.op != 'getitem' or is_basic_index(node.attrs['key'])
    return node.op_kind in ('elementwise', 'compare', 'contraction') or node.op == 'concatenate'


def is_basic_index(key):
    """An index that NumPy answers with a view (integers, slices, None, ...): copied into a
    buffer, it allocates nothing; an array of indices would make a copy first."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(type(k) in (int, slice, type(None), type(Ellipsis)) for k in keys)


def first_step(node):
    return node.body[0] if node.kind == 'fused' else node


class Slot:
    """Where one or more values live: a workspace buffer, a fresh output, or an owned array."""

    def __init__(self, kind, name, shape, dtype, free_at):
        self.kind, self.name, self.shape, self.dtype = kind, name, shape, dtype
        self.free_at = free_at          # index of the last step that reads it

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


class MemoryPlan:
    def __init__(self, graph, static_alloc=False):
        self.graph, self.static_alloc = graph, static_alloc
        self.slots = {}         # node -> Slot it is written into (or, for a view, read from)
        self.in_place = {}      # node -> the input whose slot it overwrites
        self.buffers = []       # the workspace: Slots allocated once per compiled program

    def __str__(self):
        values = [n for n in self.graph.nodes if n in self.slots]
        size = sum(b.nbytes for b in self.buffers)
        lines = [f'memory plan: {plural(len(values), "value")} in '
                 f'{plural(len(self.buffers), "workspace buffer")} ({size / 1024:.1f} KiB), '
                 f'{len(self.in_place)} written in place']
        for node in values:
            slot, note = self.slots[node], ''
            if node in self.in_place:
                note = f'  (in place of {self.in_place[node]!r})'
            elif node.op_kind == 'view':
                note = '  (a view)'
            where = {'buffer': slot.name, 'fresh': 'new array per call',
                     'owned': 'allocated by the op'}[slot.kind]
            lines.append(f'  {node!r:<22} {node.type:<18} -> {where}{note}')
        if self.static_alloc:
            lines.append('still allocated per call: the outputs'
                         + ''.join(f', inside {op}' for op in self.allocating()))
        return '\n'.join(lines)

    __repr__ = __str__

    def allocating(self):
        """The ops that allocate when the program runs, besides its outputs: those computed by
        their own function (a convolution's im2col columns and result, a softmax), and the
        elementwise steps without a ufunc, whose result is computed and then stored."""
        steps = [m for n in self.slots for m in (n.body if n.kind == 'fused' else [n])]
        return sorted({n.op for n in steps if n.op_kind != 'view' and (
            not writes_into(n, self.static_alloc) or
            (n.op_kind in ('elementwise', 'compare') and not REGISTRY[n.op].ufunc
             and n.op not in ('relu', 'sigmoid')))})


def plural(count, noun):
    return f'{count} {noun}' + ('' if count == 1 else 's')


def last_uses(graph):
    """For each node, the index of the last step that reads it (outputs: never dead)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = dict(order)
    for node in graph.nodes:
        for x in node.input_nodes():
            last[x] = max(last[x], order[node])
    for node in graph.outputs:
        last[node] = NEVER
    return last


def _in_place_source(node, index, plan):
    """An input of `node` that dies at `node` and has its shape and dtype, or None.

    Its buffer must be read through no other name in this step: a view of it (`a.T` in
    `a * 2 + a.T`) read later in a fused chain would see the values written over it."""
    step = first_step(node)
    if step.op_kind != 'elementwise':
        return None
    later = [x for m in (node.body[1:] if node.kind == 'fused' else ()) for x in m.inputs]
    for x in step.input_nodes():
        slot = plan.slots.get(x)
        if (slot is not None and slot.kind != 'fresh' and slot.free_at <= index
                and x.shape == node.shape and x.dtype == node.dtype and x not in later
                and x.op_kind != 'view' and not _read_elsewhere(node, x, slot, plan)):
            return x
    return None


def _read_elsewhere(node, x, slot, plan):
    """Does `node` read `slot` through some input other than `x` (a view sharing it)?"""
    steps = node.body if node.kind == 'fused' else [node]
    return any(plan.slots.get(y) is slot for step in steps for y in step.input_nodes()
               if y is not x)


def viewed_value(node):
    """The value `node` is a view of (following views of views), or `node` itself."""
    while node.kind == 'call' and node.op_kind == 'view':
        node = node.inputs[0]
    return node


def aliased_outputs(graph):
    """For each output, whether it may share memory with an argument or an earlier output
    (`return x.T`, `return y, y.reshape(-1)`): the reference interpreter returns NumPy's
    views as they are, so a caller that hands out arrays must copy these."""
    seen, aliased = set(), []
    for node in graph.outputs:
        root = viewed_value(node)
        aliased.append(root.kind in ARGUMENT_KINDS or root in seen)
        seen.add(root)
    return aliased


def _free_buffer(plan, node, index):
    for slot in plan.buffers:
        if slot.free_at < index and slot.shape == node.shape and slot.dtype == node.dtype:
            return slot
    slot = Slot('buffer', f'buf{len(plan.buffers)}', node.shape, node.dtype, -1)
    plan.buffers.append(slot)
    return slot


def plan_memory(graph, static_outputs=False, static_alloc=False):
    """Give every computed value a slot; reuse dead buffers; overwrite dying inputs in place.

    With `static_outputs`, outputs too go into workspace buffers (for CUDA-graph replay); with
    `static_alloc`, the ops in STATIC_OUT_FORMS write into buffers as well."""
    plan, last, outputs = MemoryPlan(graph, static_alloc), last_uses(graph), set(graph.outputs)
    for index, node in enumerate(graph.nodes):
        if node.kind in ARGUMENT_KINDS or node.kind == 'constant':
            continue
        name = f'v{index}'
        if node.op_kind == 'view':
            source = plan.slots.get(node.inputs[0])
            if source is not None:                  # a view keeps its source's slot alive
                source.free_at = max(source.free_at, last[node])
                plan.slots[node] = source
            continue
        if not writes_into(node, static_alloc):
            plan.slots[node] = Slot('owned', name, node.shape, node.dtype, last[node])
        elif node in outputs and not static_outputs:
            plan.slots[node] = Slot('fresh', name, node.shape, node.dtype, NEVER)
        elif (source := _in_place_source(node, index, plan)) is not None:
            plan.in_place[node] = source
            plan.slots[node] = plan.slots[source]
            plan.slots[node].free_at = last[node]
        else:
            plan.slots[node] = _free_buffer(plan, node, index)
            plan.slots[node].free_at = last[node]
    return plan
