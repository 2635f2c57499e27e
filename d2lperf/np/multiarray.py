"""NDArray: a NumPy-like array whose every operation is one push to the engine.

An operation returns at once with a new NDArray whose shape and dtype are already known
(inferred from the inputs), while the engine computes its values in the background. Only
what needs the values waits for them: `wait_to_read`, `asnumpy`, `item`, `print`, `float`,
`bool`. Taught in "Asynchronous Computation".
"""
import functools
import math
import numbers

import numpy

from .. import engine
from ..device import Device, Held, cpu, label, transfer
from ..ops import REGISTRY, as_array, differentiable, index_shape
from .tape import TAPE, TapeNode, needs_grad


class ArrayMethods:
    """What an array computes from its shape and dtype alone: metadata, and the operators and
    methods that each end in one `apply`. NDArray has them, and so does the compiler's stand-in
    for an array while it traces (`hybrid.trace.Symbol`), where `apply` records a graph node
    instead of pushing an operation."""

    __slots__ = ()
    __hash__ = object.__hash__

    def apply_op(self, name, inputs, attrs):
        """Take an operation that `apply` finds this array among the inputs of, where it is
        not an NDArray: the compiler's stand-in records it as a graph node. An NDArray never
        gets here: `apply` pushes its operations."""
        raise NotImplementedError(f'{type(self).__name__} takes no operations')

    # -- metadata: known at push time, never blocks --------------------------------------
    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(numpy.prod(self.shape))

    def __len__(self):
        if not self.shape:
            raise TypeError('len() of a 0-d array')
        return self.shape[0]

    # -- arithmetic -----------------------------------------------------------------------
    def __add__(self, other): return apply('add', self, other)
    def __radd__(self, other): return apply('add', other, self)
    def __sub__(self, other): return apply('subtract', self, other)
    def __rsub__(self, other): return apply('subtract', other, self)
    def __mul__(self, other): return apply('multiply', self, other)
    def __rmul__(self, other): return apply('multiply', other, self)
    def __truediv__(self, other): return apply('divide', self, other)
    def __rtruediv__(self, other): return apply('divide', other, self)
    def __pow__(self, other): return apply('power', self, other)
    def __rpow__(self, other): return apply('power', other, self)
    def __matmul__(self, other): return apply('matmul', self, other)
    def __rmatmul__(self, other): return apply('matmul', other, self)
    def __neg__(self): return apply('negative', self)
    def __abs__(self): return apply('abs', self)
    def __gt__(self, other): return apply('greater', self, other)
    def __lt__(self, other): return apply('less', self, other)
    def __ge__(self, other): return apply('greater_equal', self, other)
    def __le__(self, other): return apply('less_equal', self, other)
    def __eq__(self, other): return apply('equal', self, other)
    def __ne__(self, other): return apply('not_equal', self, other)
    # -- methods --------------------------------------------------------------------------
    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return apply('reshape', self, shape=tuple(shape))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return apply('transpose', self, axes=tuple(axes) if axes else None)

    @property
    def T(self):
        return apply('transpose', self, axes=None)

    def sum(self, axis=None, keepdims=False): return apply('sum', self, axis=axis, keepdims=keepdims)
    def mean(self, axis=None, keepdims=False): return apply('mean', self, axis=axis, keepdims=keepdims)
    def max(self, axis=None, keepdims=False): return apply('max', self, axis=axis, keepdims=keepdims)
    def argmax(self, axis=None): return apply('argmax', self, axis=axis)
    def exp(self): return apply('exp', self)
    def log(self): return apply('log', self)
    def astype(self, dtype): return apply('astype', self, dtype=numpy.dtype(dtype).name)
    def copy(self): return apply('copy', self)


class HeldVar(Held, engine.Var):
    """The engine variable of an array that owns its memory, and so holds its bytes on the
    device's ledger (`device.Held`); a view gets its base's variable, so it is never counted
    twice."""

    __slots__ = Held.FIELDS

    def __init__(self, device, nbytes):
        # Each base by name, not a cooperative super().__init__: on Python 3.11 that costs
        # about 100 ns more per array, and every operation makes one. The bytes first: a
        # Ctrl-C that lands between the two then leaves a variable that gives back what it
        # holds when freed, where one with the engine's fields alone had no `counted`.
        self.hold(device, nbytes)
        engine.Var.__init__(self)


class NDArray(ArrayMethods):
    """An asynchronous array on one device.

    `data` is the device's array (NumPy or CuPy) holding the values: the engine fills it in,
    so only code running as an engine operation may read it. `node` is how autograd recorded
    this array (a `tape.TapeNode`, or None); `grad` its gradient buffer, after `attach_grad`.
    """

    __slots__ = ('data', 'var', 'shape', 'dtype', 'device', 'node', 'grad', '__weakref__')
    __array_ufunc__ = None          # make NumPy defer to our operators: `2.0 * x` stays async

    def __init__(self, shape, dtype, device, var=None):
        """`shape` a tuple and `dtype` a numpy.dtype: pushes are hot, so nothing is converted
        (and math.prod, not numpy.prod, counts the bytes). A view passes its base's `var`."""
        self.shape, self.dtype, self.device = shape, dtype, device
        self.var = var if var is not None else HeldVar(device, math.prod(shape) * dtype.itemsize)
        self.data = None
        self.node = None
        self.grad = None

    # -- blockers: everything that needs the values waits for them -----------------------
    def wait_to_read(self):
        """Block until this array's value is computed."""
        engine.wait_for(self.var)
        return self

    def asnumpy(self):
        """A NumPy copy of the values (waits for them)."""
        engine.wait_for(self.var)
        return self.data.get() if self.device.kind == 'gpu' else numpy.array(self.data)

    def item(self):
        return self.asnumpy().item()

    def __array__(self, dtype=None, copy=None):
        return self.asnumpy() if dtype is None else self.asnumpy().astype(dtype)

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        if self.size != 1:
            raise ValueError(f'the truth value of an array of shape {self.shape} is ambiguous; '
                             'use .any() or .all() on .asnumpy()')
        return bool(self.item())

    def __repr__(self):
        text = repr(self.asnumpy())
        return text if self.device == cpu() else f'{text[:-1]}, device={self.device})'

    __str__ = __repr__

    # -- in place: the array keeps its variable, and the engine orders the write ---------
    def __iadd__(self, other): return update_in_place(self, 'add', other)
    def __isub__(self, other): return update_in_place(self, 'subtract', other)
    def __imul__(self, other): return update_in_place(self, 'multiply', other)
    def __itruediv__(self, other): return update_in_place(self, 'divide', other)

    def copyto(self, device):
        """A copy of this array on `device`: one engine operation reading self, writing the copy."""
        return copy_to_device(self, device)

    def __getitem__(self, key):
        return view(self, key)

    # -- autograd: the buffer is made here; the reverse walk, above this module, is reached
    # through the tape (`TAPE.walk`), which autograd fills in when it is imported.
    def attach_grad(self):
        """Give this array a gradient buffer, `.grad`, that `backward()` writes into.

        The buffer starts as zeros made fresh (not `self * 0`, which is NaN where the array is
        infinite), and is a real array even for a 0-d one, so that backward can write into it.
        """
        if not differentiable(self.dtype):
            raise TypeError(f'only floating arrays can have gradients, not {self.dtype}')
        self.grad = label(filled_like(self, 0), 'gradients')
        return self

    def backward(self, head_grad=None, retain_graph=False, on_gradient=None):
        """Gradients of this array (summed, if it is not a scalar) into every `.grad`."""
        TAPE.walk(self, head_grad, retain_graph, on_gradient)

    def __setitem__(self, key, value):
        assign(self, key, value)


PYTHON_SCALARS = (float, int, bool)     # the common case, told apart without ABC machinery


def as_device_input(x):
    """Check one operation input: an NDArray, a Python/NumPy scalar, or a tracer (returned)."""
    if type(x) in PYTHON_SCALARS or isinstance(x, (numbers.Number, numpy.generic)):
        return None
    if isinstance(x, numpy.ndarray):
        raise TypeError('a NumPy array cannot enter a d2lperf operation directly; wrap it '
                        'with d2lperf.np.array(x, device=...) first')
    raise TypeError(f'd2lperf operations take NDArrays or scalars, not {type(x).__name__}')


def common_device(name, arrays):
    """The one device all of an operation's arrays live on; a ValueError says how to get there.

    The engine never moves data behind the program's back: a copy is an operation of its own
    (`x.copyto(device)`), which the program writes where it wants the transfer to happen.
    """
    device = arrays[0].device
    for x in arrays:
        if x.device is not device:          # one object a device (`Device`)
            where = ', '.join(f'input {j} on {a.device}' for j, a in enumerate(arrays))
            raise ValueError(
                f"operation '{name}' mixes arrays on {device} and {x.device} ({where}); "
                f'an operation runs on one device: move the data first with '
                f'x.copyto(d2l.{device}) or x.copyto(d2l.{x.device})')
    return device


_inferred = {}


def infer(op, inputs, attrs):
    """`op.infer`, remembered per input shapes and dtypes: the rules are pure, pushes are hot."""
    key = (op.name, *[(x.shape, x.dtype) if type(x) is NDArray else type(x) for x in inputs])
    if attrs:
        key += tuple(attrs.items())
    try:
        return _inferred[key]
    except KeyError:
        result = _inferred[key] = op.infer(*inputs, **attrs)
        return result
    except TypeError:                           # an unhashable attribute: just compute it
        return op.infer(*inputs, **attrs)


def apply(name, *inputs, **attrs):
    """Push one registered operation; return its output NDArray at once.

    Five steps, which every operation takes: find the array inputs (or hand the call to the
    compiler: to the stand-in among them, or to the tracer in force, `tape.tracing`), the
    one device they share, the output's shape and dtype, then push the work (a view of the
    first input, or a new array computed, with any input the op writes in place), and leave
    a node on the tape if autograd records."""
    op = REGISTRY[name]
    # The scan stays here, not in a function of its own: one more call costs 2% of a tiny
    # operation's time (benchmarks/engine.py), and this is the path every operation takes.
    arrays, fill = [], fill_from_arrays       # how the work reads its inputs (`push_compute`)
    for x in inputs:
        if type(x) is NDArray:
            arrays.append(x)
        elif type(x) in PYTHON_SCALARS:
            fill = fill_from_inputs
        elif isinstance(x, ArrayMethods):     # the compiler's stand-in: a graph node
            return x.apply_op(name, inputs, attrs)
        else:
            as_device_input(x)
            fill = fill_from_inputs
    if not arrays:
        raise TypeError(f"operation '{name}' needs at least one NDArray input")
    if TAPE.tracer is not None and TAPE.tracer.reads_a_parameter(arrays):
        return TAPE.tracer.call(name, inputs, attrs)
    device = arrays[0].device if len(arrays) == 1 else common_device(name, arrays)
    shape, dtype = infer(op, inputs, attrs)
    if op.kind == 'view':
        out = push_view(op, arrays[0], shape, dtype, attrs)
    else:
        out = NDArray(shape, dtype, device)
        if op.saves and TAPE.recording:
            attrs = dict(attrs, saved={})        # kept for the vjp on the tape (`Op.saves`)
        push_compute(op, out, inputs, arrays, attrs, fill)
    if TAPE.recording and any(map(needs_grad, arrays)):
        out.node = TapeNode(op, inputs, attrs)
    return out


def push_view(op, base, shape, dtype, attrs):
    """Push the operation that makes a view of `base` (see `alias`)."""
    compute, xp = op.compute, base.device.xp
    return alias(base, shape, dtype, lambda data: as_array(xp, compute(xp, data, **attrs)),
                 op.name)


def push_compute(op, out, inputs, arrays, attrs, fill):
    """Push the operation that computes `out`: it reads the arrays and writes `out`, and the
    inputs the op updates in place (`op.writes`), which it then does not count as reads.
    `fill` puts the result in `out`: `fill_from_inputs` where an input is a scalar, else
    `fill_from_arrays`, as `apply` found while it looked at the inputs.

    The work is a `functools.partial`, not a closure: two objects where a closure over five
    names is seven (the function, its tuple of cells, a cell per name), and the garbage
    collector walks every object of every operation still in flight (benchmarks/engine.py,
    "garbage collector"). The common case, every input an array, reads their data without
    testing each one's type."""
    run = functools.partial(fill, out, op.compute, out.device.xp, inputs, attrs)
    if op.writes:
        written = [inputs[i].var for i in op.writes]
        engine.push(run, [x.var for x in arrays if x.var not in written],
                    [out.var] + written, out.device, op.name)
    else:
        engine.push(run, [x.var for x in arrays], [out.var], out.device, op.name)


def fill_from_arrays(out, compute, xp, inputs, attrs):
    out.data = as_array(xp, compute(xp, *[x.data for x in inputs], **attrs))


def fill_from_inputs(out, compute, xp, inputs, attrs):
    out.data = as_array(xp, compute(
        xp, *[x.data if type(x) is NDArray else x for x in inputs], **attrs))


def refuse_while_recording(target, what):
    if TAPE.recording and needs_grad(target):
        raise RuntimeError(f'{what} would overwrite an array that autograd is recording; '
                           'compute a new array instead (y = x + 1), or do it outside record()')


def update_in_place(target, name, other):
    """`target op= other` as one engine operation that reads `other` and writes `target`."""
    refuse_while_recording(target, f'in-place {name}')
    shape, dtype = REGISTRY[name].infer(target, other)
    if shape != target.shape or not numpy.can_cast(dtype, target.dtype, 'same_kind'):
        raise ValueError(f'in-place {name} cannot store a {dtype}{list(shape)} result in '
                         f'a {target.dtype}{list(target.shape)} array')
    ufunc = getattr(target.device.xp, name)
    if isinstance(other, NDArray):
        common_device(name, [target, other])

        def run():
            ufunc(target.data, other.data, out=target.data)
    else:
        as_device_input(other)

        def run():
            ufunc(target.data, other, out=target.data)
    engine.push(run, reads_besides(target, other), [target.var], target.device, f'{name}_')
    return target


def reads_besides(target, source):
    """What an update of `target` reads: `source`'s variable, unless it is target's own
    (`x += x`, `x += x.T`, `v[:] = x[0]` for a view v of x): an operation never both reads
    and writes one variable, and the write already orders it. Overlapping memory is then
    NumPy's (and CuPy's) to handle: their ufuncs and assignments copy an input that overlaps
    the output before writing."""
    if isinstance(source, NDArray) and source.var is not target.var:
        return [source.var]
    return []


BASIC_INDEX = (int, numpy.integer, slice, type(None), type(Ellipsis))


def check_basic_key(key):
    for part in key if isinstance(key, tuple) else (key,):
        if not isinstance(part, BASIC_INDEX):
            raise IndexError('d2lperf arrays take basic indexes only (ints, slices, None, ...);'
                             ' for gathering by index arrays use npx.pick')
    return key


def alias(base, shape, dtype, make, name):
    """An array whose data `make(base.data)` may share base's memory: it gets base's engine
    variable, so every write through either array is ordered with every read of the other.

    Sharing is safe whether or not `make` copies (NumPy's reshape copies a non-contiguous
    array): the engine then orders a little more than it must, never less. Filling the alias
    in counts as a write of the shared variable, so that its readers, queued on that same
    variable, run only once its `data` exists."""
    out = NDArray(shape, dtype, base.device, base.var)

    def run():
        out.data = make(base.data)
    engine.push(run, [], [base.var], base.device, name)
    return out


def view(base, key):
    """`base[key]`: a view that shares base's memory and so its engine variable."""
    check_basic_key(key)
    if TAPE.tracer is not None and TAPE.tracer.reads_a_parameter([base]):
        return TAPE.tracer.call('getitem', (base,), {'key': key})
    element_key = key if isinstance(key, tuple) else (key,)
    if Ellipsis not in element_key:
        element_key += (Ellipsis,)      # x[1, 2, ...] is a 0-d view; x[1, 2] a copied scalar
    out = alias(base, index_shape(base.shape, base.dtype, key), base.dtype,
                lambda data: data[element_key], 'view')
    if TAPE.recording and needs_grad(base):
        out.node = TapeNode(REGISTRY['getitem'], (base,), {'key': key})
    return out


def assign(target, key, value):
    """`target[key] = value` as one engine operation; `x[:] = y` replaces all of x, so it
    clears a failure x held (`engine.push_overwrite`), as a partial write cannot."""
    check_basic_key(key)
    refuse_while_recording(target, 'item assignment')
    index_shape(target.shape, target.dtype, key)
    reads = []
    if isinstance(value, NDArray):
        common_device('setitem', [target, value])
        reads = reads_besides(target, value)

        def run():
            target.data[key] = value.data
    else:
        as_device_input(value)

        def run():
            target.data[key] = value
    push = engine.push_overwrite if overwrites(target, key, value) else engine.push
    push(run, reads, [target.var], target.device, 'setitem')


def overwrites(target, key, value):
    """Whether `target[key] = value` replaces every byte of the memory that target's variable
    stands for, from a value of its own: a key of whole slices, into an array as large as
    that memory (not a view of part of it), from a value that is not that memory."""
    parts = key if isinstance(key, tuple) else (key,)
    whole = all(part == slice(None) or part is Ellipsis for part in parts)
    return (whole and isinstance(target.var, HeldVar)
            and target.var.nbytes == target.size * target.dtype.itemsize
            and not (isinstance(value, NDArray) and value.var is target.var))


def copy_to_device(x, device, name='copyto'):
    """`x.copyto(device)`: one engine operation, on a copy lane, that reads x and writes the copy.

    It runs beside the devices' computation (see `engine.copy_lane`): whatever does not read
    the copy goes on while the data moves. `name` names it in the engine's records (comm's
    sends give a `TransferName`, so that profiles count their bytes).
    """
    if not isinstance(device, Device):
        raise TypeError(f'copyto needs a Device such as d2l.cpu(1) or d2l.gpu(0), not {device!r}')
    out = NDArray(x.shape, x.dtype, device)
    move = transfer(x.device, device)

    def run():
        out.data = move(x.data)
    where, lane = engine.copy_lane(x.device, device)
    engine.push(run, [x.var], [out.var], where, name, lane)
    return out


def from_host(host, device, name='array'):
    """An NDArray holding a copy of the NumPy array `host`."""
    out = NDArray(host.shape, host.dtype, device)

    def run():
        out.data = host if device.kind == 'cpu' else device.xp.asarray(host)
    engine.push(run, [], [out.var], device, name)
    return out


def create(shape, dtype, device, make, name):
    """An NDArray whose values `make(xp)` computes on `device` (ones, zeros, random ...)."""
    shape = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(map(int, shape))
    dtype, device = numpy.dtype(dtype), device or cpu()
    if not isinstance(device, Device):
        raise TypeError(f'device must be a Device such as d2l.cpu() or d2l.gpu(0), not {device!r}')
    out = NDArray(shape, dtype, device)
    xp = device.xp

    def run():
        out.data = make(xp, out.shape, out.dtype)
    engine.push(run, [], [out.var], device, name)
    return out


def filled_like(like, value):
    """A new array of `like`'s shape, dtype and device, every element `value`."""
    return create(like.shape, like.dtype, like.device,
                  lambda xp, shape, dtype: xp.full(shape, value, dtype), 'full')
