"""Reverse-mode automatic differentiation on asynchronous arrays.

Inside `record()`, every operation on an array that needs a gradient remembers its op and
inputs on its output. `backward()` walks that graph from the head in reverse topological
order and pushes, for each node, one engine operation that runs the op's `vjp` rule: the
backward pass is as asynchronous as the forward one.
"""
import contextlib

from . import engine
from .ndarray import TAPE, NDArray, create


@contextlib.contextmanager
def record():
    """Record operations for `backward()` inside this block."""
    previous, TAPE.recording = TAPE.recording, True
    try:
        yield
    finally:
        TAPE.recording = previous


@contextlib.contextmanager
def pause():
    """Stop recording inside a `record()` block (for metrics, say)."""
    previous, TAPE.recording = TAPE.recording, False
    try:
        yield
    finally:
        TAPE.recording = previous


def is_recording():
    return TAPE.recording


def attach_grad(self):
    """Give this array a gradient buffer, `.grad`, that `backward()` writes into.

    The buffer starts as zeros made fresh (not `self * 0`, which is NaN where self is
    infinite), and is a real array even for a 0-d self, so that backward can write into it.
    """
    if self.dtype.kind != 'f':
        raise TypeError(f'only floating arrays can have gradients, not {self.dtype}')
    self.grad = _filled(self, 0)
    return self


def _filled(like, value):
    return create(like.shape, like.dtype, like.device,
                  lambda xp, shape, dtype: xp.full(shape, value, dtype), 'full')


def _topological_order(head):
    """Every recorded array the head depends on, inputs before the arrays they produce."""
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
        if array._node is not None:
            stack.extend((x, False) for x in array._node[1]
                         if type(x) is NDArray and id(x) not in seen)
    return order


def _needs_grad(x):
    return type(x) is NDArray and (x._node is not None or x.grad is not None)


def _push_vjp(out, g, grads):
    """One engine operation: the gradients of `out`'s inputs from the gradient `g` of `out`."""
    op, inputs, attrs = out._node
    targets = [NDArray(x.shape, x.dtype, x.device) if _needs_grad(x) and x.dtype.kind == 'f'
               else None for x in inputs]
    xp, vjp = out.device.xp, op.vjp
    if vjp is None:
        raise RuntimeError(f"operation '{op.name}' has no gradient; call it outside record()")

    def run():
        values = vjp(xp, g._data, out._data,
                     *[x._data if type(x) is NDArray else x for x in inputs], **attrs)
        for target, value in zip(targets, values):
            if target is not None:
                target._data = xp.asarray(value, dtype=target.dtype).reshape(target.shape)
    arrays = [x for x in inputs if type(x) is NDArray]
    written = [t for t in targets if t is not None]
    engine.push(run, [g.var, out.var] + [x.var for x in arrays], [t.var for t in written],
                out.device, f'{op.name}_backward')
    for x, target in zip(inputs, targets):
        if target is not None:
            grads[id(x)] = target if id(x) not in grads else grads[id(x)] + target


def backward(head, head_grad=None, retain_graph=False):
    """Gradients of `head` (summed, if it is not a scalar) into every attached `.grad`."""
    if head._node is None:
        raise RuntimeError('nothing to differentiate: compute the head inside autograd.record() '
                           'from arrays that called attach_grad()')
    with pause():
        grads = {id(head): head_grad if head_grad is not None else _filled(head, 1)}
        for array in reversed(_topological_order(head)):
            g = grads.pop(id(array), None)
            if g is None:
                continue
            if array._node is not None:
                _push_vjp(array, g, grads)
                if not retain_graph:
                    array._node = None
            elif array.grad is not None:
                array.grad[...] = g          # `...`, not `:`, so that a 0-d leaf works too


NDArray.attach_grad = attach_grad
NDArray.backward = backward
