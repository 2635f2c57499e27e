"""Reverse-mode automatic differentiation on asynchronous arrays.

Inside `record()`, every operation on an array that needs a gradient leaves a
`tape.TapeNode` (its op, inputs and attributes) on its output. `backward()` walks those
nodes from the head in reverse topological order and pushes, for each, one engine operation
that runs the op's `vjp` rule: the backward pass is as asynchronous as the forward one.

`record(train_mode=True)` also says that layers train (dropout drops, batch norm uses the
batch's statistics); `predict_mode()` and `train_mode()` change only that, `pause()` only
the recording, as in Gluon. A hybridized block records ONE node whose rule walks its own
graph (`hybrid.graph.gradients`); that walk differs from the one here because it runs
inside a single engine operation, on raw arrays, over nodes already in order.

A leaf's `.grad` is replaced by its gradient, or added to where the leaf's grad_req is 'add'
(MXNet's `mark_variables`; a Parameter sets it on its arrays): micro-batches accumulate there.

`checkpoint(block, *inputs)` trades time for memory (recomputation, Chen et al. 2016): its
forward keeps no node inside the block, so only the inputs stay for backward, which runs the
block again, recorded, and walks that graph before going on. `on_backward(array, callback)`
is the walk's hook: a call made just before the backward pass of whatever computed `array`.
`backward_together(heads)` walks several devices' backward passes side by side, one array of
each in turn, so that a collective in the backward pass (`collective`, `reduce_in_backward`:
tensor parallelism's all-reduces and all-gathers) finds every device's gradient at once.
"""
import contextlib
import weakref

from . import engine
from .device import label
from .ops import differentiable
from .np.multiarray import NDArray, alias, filled_like
from .np.tape import TAPE, TapeNode, modes, needs_grad, register_backward


def record(train_mode=True):
    """Record operations for `backward()` inside this block; layers train unless told not to."""
    return modes(True, train_mode)


def pause(train_mode=False):
    """Stop recording inside a `record()` block (for metrics, say)."""
    return modes(False, train_mode)


def train_mode():
    """Layers behave as in training inside this block (recording is left as it is)."""
    return modes(None, True)


def predict_mode():
    """Layers behave as in prediction inside this block (recording is left as it is)."""
    return modes(None, False)


def is_recording():
    return TAPE.recording


def is_training():
    """True inside `record()` (unless train_mode=False) or `train_mode()`; False outside."""
    return TAPE.training


class Recompute:
    """The tape's step for a checkpointed call: the block to run again in backward, and
    whether it ran in training mode (so that batch norm recomputes with the same statistics)."""

    __slots__ = ('name', 'block', 'training')

    def __init__(self, block, training):
        self.name, self.block, self.training = 'checkpoint', block, training

    def walk(self, out, g, grads, on_gradient):
        """Run the block again, recorded, from detached copies of its inputs, and walk that
        graph: the block's parameters get their `.grad` there, its inputs through the copies."""
        # The engine frees an array only once the operations reading it are done: without this
        # wait for the segments above, the walk would run ahead and every segment's recomputed
        # activations would be held at once, as without checkpoints.
        g.wait_to_read()
        inputs = out.node.inputs
        copies = [detached(x) if type(x) is NDArray else x for x in inputs]
        with modes(True, self.training):
            again = self.block(*copies)
        walk_segment(again, g, grads, on_gradient)
        for x, copy in zip(inputs, copies):
            if type(x) is NDArray and copy.grad is not None:
                add_gradient(grads, x, label(copy.grad, 'temporaries'))   # not a leaf's


def walk_segment(head, g, grads, on_gradient):
    """The walk of a segment run again, inside the walk around it, sharing its record of the
    leaves written so far (`step` adds to those). A leaf written already by an earlier segment
    starts from its `.grad` here instead, so that one used in several segments ends with their
    sum added in the order of the walk without checkpoints, bit for bit."""
    order = topological_order(head)
    segment = {id(head): g, WRITTEN: grads[WRITTEN], SEEDED: set()}
    for array in order:
        if array.node is None and wrote(grads, array):
            segment[id(array)] = array.grad
            segment[SEEDED].add(id(array))
    for array in reversed(order):
        g = segment.pop(id(array), None)
        if g is not None:
            step(array, g, segment, False, on_gradient)


class BackwardHook:
    """The tape's step for `on_backward`: a call, then the gradient passed on unchanged."""

    __slots__ = ('name', 'callback')

    def __init__(self, callback):
        self.name, self.callback = 'on_backward', callback

    def walk(self, out, g, grads, on_gradient):
        self.callback()
        add_gradient(grads, out.node.inputs[0], g)


class Collective:
    """The tape's step for one device's part of a collective in the backward pass: it waits
    (`backward_together`) until every device's walk has brought its gradient, then `reduce`
    runs on all of them at once (an allreduce for tensor parallelism's f), and each walk goes
    on with its own result."""

    __slots__ = ('name', 'reduce', 'arrived')

    def __init__(self, reduce, size):
        self.name, self.reduce, self.arrived = 'collective', reduce, [None] * size

    def walk(self, out, g, grads, on_gradient):
        part = out.node.attrs['part']
        self.arrived[part] = (g, grads, out.node.inputs[0])
        if any(a is None for a in self.arrived):
            return
        results = self.reduce([g for g, _, _ in self.arrived])
        for result, (_, walk_grads, x) in zip(results, self.arrived):
            add_gradient(walk_grads, x, result)
        self.arrived = [None] * len(self.arrived)


WALKED_HERE = (Recompute, BackwardHook, Collective)    # tape steps that push no vjp of their own


def checkpoint(block, *inputs):
    """`block(*inputs)`, keeping only `inputs` for backward, which computes the rest again.

    Gradients equal those without it, bit for bit, for any block whose forward draws no random
    numbers (dropout would draw new masks when it runs again), a parameter used in several
    segments included; one used in a segment and outside any gets the sum of its uses too.
    Outside `record()` it is just the call."""
    if not TAPE.recording:
        return block(*inputs)
    with pause(train_mode=TAPE.training):
        out = block(*inputs)
    if not isinstance(out, NDArray):
        raise TypeError(f'checkpoint takes a block that returns one array, not {type(out)}')
    if any(out is x for x in inputs):          # the tape must not mark an input as computed
        out = alias(out, out.shape, out.dtype, lambda data: data, 'checkpoint')
    out.node = TapeNode(Recompute(block, TAPE.training), inputs, {})
    return out


def on_backward(array, callback):
    """`array` again (sharing its memory), where the backward walk calls `callback()` as soon
    as it reaches it: before it pushes any vjp of the operations that computed `array`. ZeRO-3
    gathers a unit's weights there, just before that unit's backward reads them."""
    if not (TAPE.recording and needs_grad(array)):
        return array
    out = alias(array, array.shape, array.dtype, lambda data: data, 'on_backward')
    out.node = TapeNode(BackwardHook(callback), (array,), {})
    return out


def reduce_in_backward(arrays, reduce):
    """The arrays again (one a device, sharing their memory), where the backward walks
    (`backward_together`) meet: their gradients go through `reduce` together, one result for
    each array. Tensor parallelism's f: the identity forward, an allreduce backward."""
    if not TAPE.recording:
        return list(arrays)
    outs = [alias(x, x.shape, x.dtype, lambda data: data, 'collective') for x in arrays]
    return collective(outs, arrays, reduce)


def collective(outs, inputs, backward):
    """Record `outs[d]` as computed from `inputs[d]` by a collective run outside the tape
    (one a device): in backward, the walks meet and `backward` turns the outputs' gradients,
    all together, into the inputs' (an all-gather's backward is a reduce-scatter)."""
    if TAPE.recording and any(needs_grad(x) for x in inputs):
        step = Collective(backward, len(outs))
        for part, (out, x) in enumerate(zip(outs, inputs)):
            out.node = TapeNode(step, (x,), {'part': part})
    return outs


def add_gradient(grads, x, g):
    grads[id(x)] = g if id(x) not in grads else grads[id(x)] + g


def detached(x):
    """An array sharing x's memory but not its history; a buffer, so that backward reaches it,
    where x needs a gradient."""
    copy = alias(x, x.shape, x.dtype, lambda data: data, 'detach')
    if needs_grad(x) and differentiable(x.dtype):
        copy.grad = filled_like(x, 0)
    return copy


def topological_order(head):
    """Every recorded array the head depends on, inputs before the arrays they produce.

    An array's leaves (parameters) are visited after its recorded inputs, so that in reverse
    each leaf comes right after its last consumer: its gradient is final as early as it can be,
    and a trainer can start summing it over devices while backpropagation goes on.
    """
    order, seen, stack = [], set(), [(head, False)]
    while stack:
        array, expanded = stack.pop()
        if expanded:
            order.append(array)
            continue
        if id(array) in seen:
            continue
        seen.add(id(array))
        stack.append((array, True))
        if array.node is not None:
            inputs = [x for x in array.node.inputs if type(x) is NDArray and id(x) not in seen]
            stack.extend((x, False) for x in sorted(inputs, key=lambda x: x.node is not None))
    return order


def push_vjp(out, g, grads):
    """One engine operation: the gradients of `out`'s inputs from the gradient `g` of `out`."""
    op, inputs, attrs = out.node.op, out.node.inputs, out.node.attrs
    if op.vjp is None:
        raise RuntimeError(f"operation '{op.name}' has no gradient; call it outside record()")
    targets = [NDArray(x.shape, x.dtype, x.device)
               if type(x) is NDArray and needs_grad(x) and differentiable(x.dtype) else None
               for x in inputs]
    xp, vjp = out.device.xp, op.vjp
    if op.partial_vjp:                          # tell the rule which gradients to skip
        attrs = dict(attrs, needs=tuple(t is not None for t in targets))
    leaves = [type(x) is NDArray and x.node is None for x in inputs]

    def run():
        read = [g.data, out.data] + [x.data if type(x) is NDArray else x for x in inputs]
        values = vjp(xp, *read, **attrs)
        found = [None if t is None else _as_gradient(xp, v, t) for t, v in zip(targets, values)]
        for index, (target, data, leaf) in enumerate(zip(targets, found, leaves)):
            if target is None:
                continue
            # A leaf's gradient becomes its `.grad`, which a store sums into in place: it must
            # not share memory with what the rule read or with another input's gradient.
            others = read + found[:index] + found[index + 1:]
            target.data = data.copy(order='K') if leaf and not _owned(data, others) else data
    arrays = [x for x in inputs if type(x) is NDArray]
    written = [t for t in targets if t is not None]
    engine.push(run, [g.var, out.var] + [x.var for x in arrays], [t.var for t in written],
                out.device, f'{op.name}_backward')
    for x, target in zip(inputs, targets):
        if target is not None:
            add_gradient(grads, x, target)


def _as_gradient(xp, value, target):
    """A rule's gradient as an array of `target`'s shape and dtype; None flows as zeros."""
    if value is None:
        return xp.zeros(target.shape, target.dtype)
    data = xp.asarray(value, dtype=target.dtype)
    return data if data.shape == target.shape else data.reshape(target.shape)


def _owned(data, others):
    """Whether `data` is memory of its own: no view, and neither one of `others` nor a view
    of it."""
    return data.base is None and all(data is not other and getattr(other, 'base', None)
                                     is not data for other in others)


def backward(head, head_grad=None, retain_graph=False, on_gradient=None):
    """Gradients of `head` (summed, if it is not a scalar) as every attached `.grad`.

    Each leaf's `.grad` becomes a new array holding its gradient (grad_req 'write'): one
    array written once, where copying into the old buffer would write it twice. With grad_req
    'add' (`mark_variables`) the gradient is added into `.grad`, in place.

    `on_gradient(array)` is called as soon as the write of `array.grad` has been pushed, while
    the rest of the backward pass is still being pushed: a trainer can start summing that
    gradient over devices right away ("Parameter Servers")."""
    with pause():
        for _ in walk(head, head_grad, retain_graph, on_gradient):
            pass


def backward_together(heads, on_gradient=None, head_grads=None):
    """The backward passes of several heads (from `head_grads`, one a head, if given), one
    array of each in turn, as the devices of a tensor-parallel layer run theirs side by side:
    a collective in the backward pass (`Collective`) then finds every device's part at once.
    The heads' graphs are alike (one network split over devices), so their walks reach each
    collective in the same turn."""
    head_grads = [None] * len(heads) if head_grads is None else head_grads
    with pause():
        walks = [walk(head, grad, False, on_gradient)
                 for head, grad in zip(heads, head_grads, strict=True)]
        while walks:
            going = [w for w in walks if next(w, None) is not None]
            if going and len(going) < len(walks):     # a collective would miss a device's part
                raise RuntimeError(f'the backward passes of {len(heads)} heads fell out of step: '
                                   f'{len(walks) - len(going)} ended while {len(going)} went '
                                   'on; their graphs must be alike (one network split over '
                                   'devices)')
            walks = going


def walk(head, head_grad, retain_graph, on_gradient):
    """The reverse walk, one array a step (a generator: `backward_together` interleaves
    several); the caller pauses recording."""
    if head.node is None:
        raise RuntimeError('nothing to differentiate: compute the head inside autograd.record() '
                           'from arrays that called attach_grad()')
    grads = {id(head): head_grad if head_grad is not None else filled_like(head, 1),
             WRITTEN: weakref.WeakValueDictionary()}  # {id(leaf): the .grad this pass wrote}
    for array in reversed(topological_order(head)):
        g = grads.pop(id(array), None)
        if g is not None:
            step(array, g, grads, retain_graph, on_gradient)
        yield array          # every array, reached or not: alike graphs' walks stay in step


def step(array, g, grads, retain_graph, on_gradient):
    """One array of the walk: push its vjp (or run its tape step), or give a leaf its `.grad`."""
    if array.node is not None:
        if type(array.node.op) in WALKED_HERE:
            array.node.op.walk(array, g, grads, on_gradient)
        else:
            push_vjp(array, g, grads)
        if not retain_graph:
            array.node = None
    elif array.grad is not None:
        # 'write': the gradient, a fresh array, becomes `.grad` rather than being copied into
        # it; an array held from an earlier `.grad` (a store's sum) keeps its values. 'add'
        # adds it into `.grad` in place (MXNet's kAddTo: no third array of its size), and so
        # does a leaf this pass reached already (a checkpointed segment's walk reaches the
        # block's parameters apart from the walk around it).
        seeded = id(array) in grads.get(SEEDED, ())        # g holds `.grad` already
        if not seeded and (wrote(grads, array) or grad_req(array) == 'add'):
            array.grad += g
        else:
            array.grad = label(g, 'gradients')
        grads[WRITTEN][id(array)] = array.grad
        if on_gradient is not None:
            on_gradient(array)


# -- grad_req, MXNet's: what backward does with a leaf's gradient ------------------------------
ADDING = weakref.WeakValueDictionary()       # {id(array): array} of the arrays set to 'add'
WRITTEN, SEEDED = 'leaves written', 'leaves seeded'    # keys of a walk's state, beside the ids


def wrote(grads, array):
    """Whether this backward pass wrote `array.grad` already, and it is still that gradient
    (a trainer that took it and left a placeholder gets a fresh write)."""
    return array.grad is not None and grads[WRITTEN].get(id(array)) is array.grad


def mark_variables(variables, gradients, grad_reqs='write'):
    """Make each array a leaf with `gradients[i]` as its `.grad` (MXNet's name), where
    backward then writes ('write': replaces it), adds ('add': until the buffer is zeroed) or
    none ('null': `.grad` None). One grad_req for all, or one a variable."""
    variables, gradients = list(variables), list(gradients)
    reqs = [grad_reqs] * len(variables) if isinstance(grad_reqs, str) else list(grad_reqs)
    if not len(variables) == len(gradients) == len(reqs):
        raise ValueError(f'{len(variables)} variables, {len(gradients)} gradients and '
                         f'{len(reqs)} grad_reqs: give one gradient a variable (and one '
                         'grad_req, or one for all)')
    for x, g, req in zip(variables, gradients, reqs):
        check_grad_req(req)
        x.grad = None if req == 'null' else label(g, 'gradients')
        if req == 'add':
            ADDING[id(x)] = x
        else:
            ADDING.pop(id(x), None)


adding_now = {}          # {id(array): array} added into for the time of `adding`


@contextlib.contextmanager
def adding(arrays):
    """For the time of the block, backward adds into the `.grad` of `arrays` (grad_req 'add'
    for them), as a pipeline step sums its micro-batches. One store on entry and one on exit,
    where setting each array's grad_req and back could be cut short by a Ctrl-C and leave some
    adding into later steps."""
    global adding_now
    before, adding_now = adding_now, {id(array): array for array in arrays}
    try:
        yield
    finally:
        adding_now = before


def grad_req(array):
    """'add' for an array marked so (or inside `adding`), 'write' for any other with a
    `.grad`, else 'null'."""
    if ADDING.get(id(array)) is array or adding_now.get(id(array)) is array:
        return 'add'
    return 'null' if array.grad is None else 'write'


def check_grad_req(req):
    if req not in ('write', 'add', 'null'):
        raise ValueError(f"grad_req must be 'write', 'add' or 'null', not {req!r}")


register_backward(backward)     # how NDArray.backward, below this module, reaches the walk
