"""Programs: lists of instructions over a few named arrays spread over devices, run once by
d2lperf and once by NumPy, to check the engine's ordering on one device and across several
(views and in-place writes included)."""
import math

import numpy
from hypothesis import strategies as st

from d2lperf import engine, np

# -- programs: instructions over a pool of named arrays, spread over devices ------------------

NAMES = ('a', 'b', 'c', 'd')
SHAPE = (4, 4)
VIEW_SLOTS = 3

_name = st.sampled_from(NAMES)
_slot = st.integers(0, VIEW_SLOTS - 1)
_row = st.integers(0, SHAPE[0] - 1)
_span = st.tuples(st.integers(0, SHAPE[0] - 1), st.integers(1, SHAPE[0])).map(
    lambda t: (min(t), max(t)) if t[0] != t[1] else (t[0] - 1, t[1]) if t[0] else (0, 1))
_scalar = st.sampled_from([-1.0, 0.5, 2.0, 3.0])
_update_op = st.sampled_from(['+=', '-=', '*='])
_view_shape = st.sampled_from([(16,), (2, 8), (8, 2), (2, 2, 4), (4, 4)])
_view_of_view = st.sampled_from(['T', 'flat', 'head', 'reversed'])


def programs(device_count=2, failures=False):
    """(a device index per named array, instructions): arithmetic, in-place updates, slice
    assignments, views (indexing, reshape, transpose, views of views) and updates and
    assignments through them, updates that read their own target through a view, products,
    copies between devices, and reads of values in the middle of the program (waits). With
    `failures`, also operations that fail, writing an array (only d2lperf can run those)."""
    device = st.integers(0, device_count - 1)
    failing = [st.tuples(st.just('fail'), _name)] if failures else []
    instructions = st.one_of(*failing,
        st.tuples(st.just('binary'), _name, _name, _name,
                  st.sampled_from(['add', 'subtract', 'multiply', 'maximum'])),
        st.tuples(st.just('affine'), _name, _name, _scalar, _scalar),
        st.tuples(st.just('matmul'), _name, _name, _name),
        st.tuples(st.just('tanh'), _name, _name),
        st.tuples(st.just('update'), _name, _update_op, _name),
        st.tuples(st.just('update_scalar'), _name, _update_op, _scalar),
        st.tuples(st.just('set_slice'), _name, _span, _name),
        st.tuples(st.just('set_row'), _name, _row, _scalar),
        st.tuples(st.just('set_row_from'), _name, _row, _name, _row),
        st.tuples(st.just('view'), _slot, _name, _span),
        st.tuples(st.just('row_view'), _slot, _name, _row),
        st.tuples(st.just('view_update'), _slot, _update_op, _scalar),
        st.tuples(st.just('view_update_row'), _slot, _name, _row),
        st.tuples(st.just('view_fill'), _slot, _scalar),
        st.tuples(st.just('reshape_view'), _slot, _name, _view_shape),
        st.tuples(st.just('transpose_view'), _slot, _name),
        st.tuples(st.just('view_of_view'), _slot, _slot, _view_of_view),
        st.tuples(st.just('view_update_from'), _slot, _update_op, _name),
        st.tuples(st.just('view_set_from'), _slot, _name),
        st.tuples(st.just('update_from_own_view'), _name, _update_op,
                  st.sampled_from(['T', 'reversed'])),
        st.tuples(st.just('move'), _name, _name, device),
        st.tuples(st.just('snapshot'), _name, device),
        st.tuples(st.just('snapshot_sum'), _name, st.sampled_from([None, 0, 1])),
        st.tuples(st.just('snapshot_view'), _slot),
        st.tuples(st.just('read'), _name),
        st.tuples(st.just('read_view'), _slot),
    )
    return st.tuples(st.lists(device, min_size=len(NAMES), max_size=len(NAMES)),
                     st.lists(instructions, min_size=1, max_size=30))


def initial_values(i):
    return numpy.arange(math.prod(SHAPE), dtype=numpy.float64).reshape(SHAPE) * 0.5 + 10 * i


class NumpyBackend:
    """Run a program sequentially on NumPy: the reference (devices are ignored)."""

    maximum, tanh = staticmethod(numpy.maximum), staticmethod(numpy.tanh)

    @staticmethod
    def make(values, device):
        return values.copy()

    @staticmethod
    def on(x, like):
        return x

    @staticmethod
    def move(x, device):
        return x.copy()

    @staticmethod
    def host(x):
        return numpy.asarray(x)


class D2LBackend:
    """Run a program on d2lperf: asynchronous arrays, device index i meaning `devices[i]`.

    An operation whose inputs live on different devices first copies the second one to the
    first one's device, as a program must (the engine never moves data by itself)."""

    maximum, tanh = staticmethod(np.maximum), staticmethod(np.tanh)

    def __init__(self, devices):
        self.devices = devices

    def make(self, values, device):
        return np.array(values, device=self.devices[device])

    @staticmethod
    def on(x, like):
        return x if x.device == like.device else x.copyto(like.device)

    def move(self, x, device):
        return x.copyto(self.devices[device])

    @staticmethod
    def host(x):
        return x.asnumpy()

    @staticmethod
    def fail(x):
        """Overwrite `x` by an operation that raises: `x`, its views and what is computed
        from them fail from then on, at the waits that read them."""
        def boom():
            raise ArithmeticError('made to fail')
        engine.push(boom, [], [x.var], x.device, 'made_to_fail')


class Interpreter:
    """Run one program on a backend; returns every array, view and snapshot it made, and
    the values read in the middle of the program, in order.

    With `failures`, what a read or an instruction raised is kept instead of failing the run,
    as ('raised', the failed operation's name), so that two engines can be compared on where
    errors rise."""

    def __init__(self, backend, failures=False):
        self.be, self.failures = backend, failures
        self.arrays, self.views, self.snapshots, self.reads = {}, {}, [], []

    def run(self, program):
        devices, body = program
        for i, (name, device) in enumerate(zip(NAMES, devices)):
            self.arrays[name] = self.be.make(initial_values(i), device)
        for instruction in body:
            self.reads += self.outcome(getattr(self, 'do_' + instruction[0]), *instruction[1:])
        return self.results()

    def results(self):
        out = list(self.reads)
        for x in [self.arrays[n] for n in NAMES] + list(self.views.values()) + self.snapshots:
            out += self.outcome(self.be.host, x)
        return out

    def outcome(self, fn, *args):
        """[what `fn(*args)` returned] where it returns something, [] where not, or, with
        failures on, [('raised', name)] where it raised."""
        try:
            result = fn(*args)
        except engine.OperationError as error:
            if not self.failures:
                raise
            return [('raised', error.op_name)]
        return [] if result is None else [result]

    # -- instructions ---------------------------------------------------------------------
    def do_binary(self, dst, x, y, op):
        a, b = self.arrays[x], self.be.on(self.arrays[y], self.arrays[x])
        result = {'add': lambda: a + b, 'subtract': lambda: a - b,
                  'multiply': lambda: a * b, 'maximum': lambda: self.be.maximum(a, b)}[op]()
        self.arrays[dst] = result

    def do_affine(self, dst, src, scale, shift):
        self.arrays[dst] = self.arrays[src] * scale + shift

    def do_matmul(self, dst, x, y):
        a = self.arrays[x]
        self.arrays[dst] = self.be.tanh(a @ self.be.on(self.arrays[y], a))

    def do_tanh(self, dst, src):
        self.arrays[dst] = self.be.tanh(self.arrays[src])

    def do_update(self, dst, op, src):
        target = self.arrays[dst]
        update_in_place(target, op, self.be.on(self.arrays[src], target))

    def do_update_scalar(self, dst, op, scalar):
        update_in_place(self.arrays[dst], op, scalar)

    def do_set_slice(self, dst, span, src):
        target = self.arrays[dst]
        start, stop = span
        target[start:stop] = self.be.on(self.arrays[src][start:stop], target)

    def do_set_row(self, dst, i, scalar):
        self.arrays[dst][i] = scalar

    def do_set_row_from(self, dst, i, src, j):
        target = self.arrays[dst]
        target[i] = self.be.on(self.arrays[src][j], target)

    def do_view(self, slot, base, span):
        self.views[slot] = self.arrays[base][span[0]:span[1]]

    def do_row_view(self, slot, base, i):
        self.views[slot] = self.arrays[base][i]

    def do_view_update(self, slot, op, scalar):
        if slot in self.views:
            update_in_place(self.views[slot], op, scalar)

    def do_view_update_row(self, slot, src, j):
        """`view += a row`, for views whose rows are as long (a row broadcasts over them)."""
        view = self.views.get(slot)
        if view is not None and view.shape[-1:] == SHAPE[1:]:
            view += self.be.on(self.arrays[src][j], view)

    def do_view_fill(self, slot, scalar):
        if slot in self.views:
            self.views[slot][:] = scalar

    def do_reshape_view(self, slot, base, shape):
        self.views[slot] = self.arrays[base].reshape(shape)

    def do_transpose_view(self, slot, base):
        self.views[slot] = self.arrays[base].T

    def do_view_of_view(self, slot, source, how):
        if source in self.views:
            self.views[slot] = view_of(self.views[source], how)

    def do_view_update_from(self, slot, op, src):
        if slot in self.views:
            view = self.views[slot]
            update_in_place(view, op, self.shaped_like(view, src))

    def do_view_set_from(self, slot, src):
        if slot in self.views:
            view = self.views[slot]
            view[...] = self.shaped_like(view, src)

    def do_update_from_own_view(self, name, op, how):
        """`x op= x.T` and the like: an update that reads memory it writes."""
        target = self.arrays[name]
        update_in_place(target, op, view_of(target, how).reshape(target.shape))

    def shaped_like(self, view, src):
        """The first values of `src`, through views of it, shaped like `view`."""
        flat = self.be.on(self.arrays[src], view).reshape(-1)
        return flat[:view.size].reshape(view.shape)

    def do_move(self, dst, src, device):
        self.arrays[dst] = self.be.move(self.arrays[src], device)

    def do_snapshot(self, src, device):
        self.snapshots.append(self.be.move(self.arrays[src], device))

    def do_snapshot_sum(self, src, axis):
        self.snapshots.append(self.arrays[src].sum(axis=axis))

    def do_snapshot_view(self, slot):
        if slot in self.views:
            self.snapshots.append(self.views[slot].copy())

    def do_read(self, name):
        """Wait for an array's values in the middle of the program (a copy, kept as it is)."""
        return numpy.array(self.be.host(self.arrays[name]))

    def do_read_view(self, slot):
        if slot in self.views:
            return numpy.array(self.be.host(self.views[slot]))

    def do_fail(self, name):
        self.be.fail(self.arrays[name])


def view_of(x, how):
    """A view of a view (or, where NumPy's layout rules say so, a copy), the same way on
    NumPy and on d2lperf."""
    if how == 'T':
        return x.T
    if how == 'flat':
        return x.reshape(-1)
    if how == 'head':
        return x[:1]
    return x.reshape(-1)[::-1]


def update_in_place(target, op, value):
    """`target op= value` in place (the augmented assignment on a local name rebinds only it)."""
    if op == '+=':
        target += value
    elif op == '-=':
        target -= value
    else:
        target *= value
