"""What an operation is: a name, three small functions, and the facts the compiler needs.

`compute(xp, *inputs, **attrs)` runs it with the device's array module (NumPy or CuPy);
`infer(*inputs, **attrs)` gives the result's shape and dtype from the inputs' shapes and
dtypes alone (so pushing never waits); `vjp(xp, g, out, *inputs, **attrs)` turns the
gradient of the output into one gradient (or None) per input, micrograd-style. Inputs are
arrays or Python scalars; `attrs` are plain, JSON-friendly values, so a graph of ops can be
exported and read back.

`kind` is what the compiler ("Compilers and Interpreters") may do with an op, and this is
the one place the kinds are defined:

    elementwise  one output value per (broadcast) input value, same dtype rules as NumPy's
                 arithmetic: may be fused into a chain and computed in place
    compare      elementwise, but the result is boolean: written into a buffer, never fused
    contraction  a product (matmul, dot, a dense layer): written into a buffer, and may head
                 a fused chain of elementwise ops, never sit inside one
    view         the result may share the input's memory (reshape, transpose): the engine
                 gives it the input's variable, the memory plan keeps the input's buffer
                 alive while it lives, and a compiled program returns a copy of it where it
                 would share memory with an argument, a workspace buffer or another output
    reduction    fewer values out than in (sum, max, ...): allocates its own result
    random       the result is not a function of the inputs: never merged, never folded
    opaque       anything else: the compiler calls `compute` as it is and never fuses it

`c_expr`, for elementwise ops, is the op as a C expression over `{a}` (and `{b}`) of C type
`{t}`: the GPU back end fuses a chain of them into one kernel.

`writes` lists the positions of inputs the op updates in place besides computing its result
(batch normalization's running statistics): the engine orders those writes like any other.

`partial_vjp` says that the vjp takes `needs=`, one bool per input, and may skip (return None
for) the gradients nobody needs: a convolution whose input is the data computes no gradient
for it. Autograd and the compiler's gradient walk both pass it.

`saves` says that `compute` takes `saved=`, a dict it fills with what its vjp would otherwise
compute again (batch normalization's batch mean and inverse deviation), and that the vjp takes
the same dict back as `saved=`: PyTorch's `ctx.save_for_backward`, MXNet's hidden outputs.
Only a run that records for autograd passes one (`apply`, the compiler's recorded run); any
other leaves it out and nothing is kept. A vjp given an empty dict (its forward failed)
computes what it needs itself.
"""
import numpy

# What the compiler may do with an op (fuse it, drop it, reorder it): not the memory ledger's
# kinds (device/ledger.py).
OP_KINDS = ('elementwise', 'compare', 'contraction', 'view', 'reduction', 'random', 'opaque')


class Op:
    """One registered operation; `ufunc` names the NumPy/CuPy ufunc that computes it into an
    existing array (`out=`), for the elementwise and comparison ops that have one."""

    __slots__ = ('name', 'compute', 'infer', 'vjp', 'kind', 'c_expr', 'ufunc', 'writes',
                 'partial_vjp', 'saves')

    def __init__(self, name, compute, infer, vjp=None, kind='opaque', c_expr=None, writes=(),
                 partial_vjp=False, saves=False):
        if kind not in OP_KINDS:
            raise ValueError(f'op {name!r}: kind must be one of {OP_KINDS}, not {kind!r}')
        if c_expr is not None and kind != 'elementwise':
            raise ValueError(f'op {name!r}: only elementwise ops have a C expression')
        self.name, self.compute, self.infer, self.vjp = name, compute, infer, vjp
        if writes and kind != 'opaque':
            raise ValueError(f'op {name!r}: only opaque ops may update their inputs')
        self.kind, self.c_expr, self.writes = kind, c_expr, tuple(writes)
        self.partial_vjp, self.saves = partial_vjp, saves
        is_ufunc = isinstance(getattr(numpy, name, None), numpy.ufunc)
        self.ufunc = name if kind in ('elementwise', 'compare') and is_ufunc else None

    def __repr__(self):
        return f'Op({self.name}, {self.kind})'


REGISTRY = {}


def defop(name, compute, infer, vjp=None, kind='opaque', c_expr=None, writes=(),
          partial_vjp=False, saves=False):
    """Register an operation under `name` (every frontend and the compiler find it there)."""
    if name in REGISTRY:
        raise ValueError(f'an op named {name!r} is already registered')
    REGISTRY[name] = Op(name, compute, infer, vjp, kind, c_expr, writes, partial_vjp, saves)
    return REGISTRY[name]


def as_array(xp, value):
    """NumPy returns scalars from 0-d operations; an array is needed to update in place."""
    return value if type(value) is xp.ndarray else xp.asarray(value)
