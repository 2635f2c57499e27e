"""Tests of NDArray, d2lperf.np and d2lperf.ops: values, shapes, dtypes, devices, ordering.

The ordering property runs random programs (reads, writes, in-place updates, slice
assignments, views by indexing, reshape and transpose and writes through them, copies
across cpu(0) and cpu(1); `strategies.programs`) once on d2lperf and once sequentially
on NumPy, and compares every array element for element only at the end, so the engine is
free to reorder whatever it may.
"""
import queue
import threading
import time

import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import engine, np, npx, ops
from d2lperf.engine import workers
from d2lperf.np.multiarray import NDArray, apply
from conftest import run_in_subprocess, run_with_timeout
from strategies import checks
from strategies.ops import OP_CASES
from strategies.programs import D2LBackend, Interpreter, NumpyBackend, programs

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)
EARLY = 0.05


TWO_CPUS = D2LBackend([CPU0, CPU1])


def assert_same_results(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        if isinstance(want, tuple):                  # ('raised', the failed operation)
            assert got == want
        else:
            numpy.testing.assert_array_equal(got, want, strict=True)


# -- the ordering property ------------------------------------------------------------------

@pytest.mark.filterwarnings('ignore::RuntimeWarning')     # overflow in long product chains
@checks(50)
@given(program=programs())
def test_programs_match_sequential_numpy(engine_kind, program):
    expected = Interpreter(NumpyBackend()).run(program)
    assert_same_results(Interpreter(TWO_CPUS).run(program), expected)


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@checks(15)
@given(program=programs())
def test_both_engines_agree(fresh_engine, program):
    results = {}
    for kind in ('naive', 'threaded'):
        engine.use(kind)
        results[kind] = Interpreter(TWO_CPUS).run(program)
    assert_same_results(results['threaded'], results['naive'])


class LateWakeups:
    """A lane's wake-ups, each handed over half a millisecond late: a waiter then usually
    finds several operations queued and runs them itself, as on a busy machine."""

    def __init__(self):
        self.queue = real_simple_queue()

    def put(self, item):
        self.queue.put(item)

    def get(self):
        item = self.queue.get()
        time.sleep(0.0005)
        return item


real_simple_queue = queue.SimpleQueue


@pytest.fixture
def late_lanes(fresh_engine, monkeypatch):
    """A fresh threaded engine whose lanes wake late (see LateWakeups)."""
    monkeypatch.setattr(workers.queue, 'SimpleQueue', LateWakeups)
    engine.use('threaded')
    yield
    engine.use('threaded')


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@checks(30)
@given(program=programs())
def test_programs_match_sequential_numpy_when_waiters_help(late_lanes, program):
    expected = Interpreter(NumpyBackend()).run(program)
    assert_same_results(Interpreter(TWO_CPUS).run(program), expected)


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@checks(30)
@given(program=programs(failures=True))
def test_helping_waits_change_no_value_and_no_error(late_lanes, program):
    """Waits that run the work themselves give the values, and raise the errors at the very
    reads, that waits which sleep until a worker has done it give."""
    results = {}
    for helping in (True, False):
        engine.set_helping(helping)
        results[helping] = Interpreter(TWO_CPUS, failures=True).run(program)
        try:
            engine.wait_all()
        except engine.OperationError:
            pass
    engine.set_helping(True)
    assert_same_results(results[True], results[False])


def test_a_view_shares_its_base():
    x = np.array(numpy.arange(12.0).reshape(4, 3))
    v = x[1:3]
    v += 1
    row = x[0]
    row[:] = -1
    expected = numpy.arange(12.0).reshape(4, 3)
    expected[1:3] += 1
    expected[0] = -1
    numpy.testing.assert_array_equal(x.asnumpy(), expected)
    numpy.testing.assert_array_equal(v.asnumpy(), expected[1:3])


def test_a_copy_keeps_the_values_it_was_made_from():
    x = np.ones((2, 2))
    on_other, same = x.copyto(CPU1), x.copy()
    x += 1
    assert on_other.device == CPU1 and on_other.asnumpy().tolist() == [[1, 1], [1, 1]]
    assert same.asnumpy().tolist() == [[1, 1], [1, 1]] and x.asnumpy().tolist() == [[2, 2], [2, 2]]


ALIASED = {
    'x += x': lambda x: x.__iadd__(x),
    'x[0:2] = x[2:4]': lambda x: x.__setitem__(slice(0, 2), x[2:4]),
    'v = x[0:2]; v += x[3]': lambda x: x[0:2].__iadd__(x[3]),
    'x *= x[0]': lambda x: x.__imul__(x[0]),
}


def test_updates_that_read_their_own_target():
    """Run in a fresh interpreter: a deadlock would leave this process's engine stuck."""
    out = run_in_subprocess("""
        import os, threading, numpy
        from d2lperf import np
        statements = %r
        hung = []
        for statement in statements:
            def run():
                x = np.array(numpy.arange(12.0).reshape(4, 3))
                exec(statement)
                x.asnumpy()
            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(0.5)
            if thread.is_alive():
                hung.append(statement)
        print(hung, flush=True)
        os._exit(0)
    """ % ['x += x', 'x[0:2] = x[2:4]', 'v = x[0:2]; v += x[3]', 'x *= x[0]'])
    assert out.strip() == '[]', f'these statements deadlock: {out.strip()}'


@pytest.mark.parametrize('statement', sorted(ALIASED))
def test_updates_that_read_their_own_target_are_right_under_the_naive_engine(statement):
    engine.use('naive')
    x, expected = np.array(numpy.arange(12.0).reshape(4, 3)), numpy.arange(12.0).reshape(4, 3)
    ALIASED[statement](x)
    ALIASED[statement](expected)
    numpy.testing.assert_array_equal(x.asnumpy(), expected)


@pytest.mark.parametrize('update', ['s += 1', 's[...] = 7'])
def test_in_place_updates_on_a_reduction_result(update):
    s = np.ones((2, 3)).sum()
    exec(update)
    assert s.item() in (7.0, 7)


def test_in_place_update_on_an_element():
    x = np.ones((4, 3))
    v = x[1, 2]
    v += 1
    assert v.item() == 2.0


# -- every op: infer says what compute makes --------------------------------------------------

def test_every_registered_op_has_cases():
    assert sorted(OP_CASES) == sorted(ops.REGISTRY), 'give a new op a strategy in strategies/ops.py'


def to_device(x):
    return np.array(x) if isinstance(x, numpy.ndarray) else x


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@pytest.mark.parametrize('name', sorted(OP_CASES))
@checks(30)
@given(data=st.data())
def test_infer_gives_the_shape_and_dtype_compute_makes(name, data):
    inputs, attrs = data.draw(OP_CASES[name])
    op = ops.REGISTRY[name]
    shape, dtype = op.infer(*inputs, **attrs)
    result = numpy.asarray(op.compute(numpy, *inputs, **attrs))
    assert (tuple(shape), numpy.dtype(dtype)) == (result.shape, result.dtype)
    out = apply(name, *map(to_device, inputs), **attrs)        # the push path, with its cache
    assert (out.shape, out.dtype) == (result.shape, result.dtype)
    values = out.asnumpy()
    if op.kind != 'random':
        numpy.testing.assert_array_equal(values, result, strict=True)


BAD_SHAPES = {
    'add': (lambda: np.ones((2, 3)) + np.ones((4,)), ValueError, 'broadcast|mismatch'),
    'matmul': (lambda: np.ones((2, 3)) @ np.ones((2, 3)), ValueError, 'not aligned'),
    'matmul_scalar': (lambda: np.ones((2, 3)) @ 2, ValueError, 'at least one dimension'),
    'dot': (lambda: np.dot(np.ones((2, 3)), np.ones((2,))), ValueError, 'not aligned'),
    'dot_nd': (lambda: np.dot(np.ones((2, 3, 4)), np.ones((3,))), ValueError, 'not aligned'),
    'reshape': (lambda: np.ones((2, 3)).reshape(4, 2), ValueError, 'cannot reshape'),
    'reshape_two_unknowns': (lambda: np.ones((2, 3)).reshape(-1, -1), ValueError, 'one dimension'),
    'broadcast_to': (lambda: np.broadcast_to(np.ones((2, 3)), (3, 2)), ValueError, 'broadcast'),
    'concatenate': (lambda: np.concatenate([np.ones((2, 3)), np.ones((2, 4))]), ValueError,
                    'equal other dimensions'),
    'pick': (lambda: npx.pick(np.ones((2, 3)), np.zeros((3,))), ValueError, 'one index per row'),
    'fully_connected': (lambda: npx.fully_connected(np.ones((2, 4)), np.ones((5, 3)),
                                                    np.ones((5,))), ValueError, '3 features'),
    'fully_connected_bias': (lambda: npx.fully_connected(np.ones((2, 3)), np.ones((5, 3)),
                                                         np.ones((4,))), ValueError, 'bias'),
    'sum_axis': (lambda: np.ones((2, 3)).sum(axis=2), ValueError, 'out of range'),
    'transpose_axes': (lambda: np.ones((2, 3)).transpose(0, 0), ValueError, 'permutation'),
    'iadd_grows': (lambda: np.ones((3,)).__iadd__(np.ones((2, 3))), ValueError, 'cannot store'),
    'iadd_int_float': (lambda: np.ones((3,), dtype='int32').__iadd__(1.5), ValueError,
                       'cannot store'),
    'setitem_out_of_range': (lambda: np.ones((4,)).__setitem__(5, 1.0), IndexError, 'out of'),
    'fancy_index': (lambda: np.ones((4,))[np.zeros((2,), dtype='int32')], IndexError,
                    'basic indexes'),
    'numpy_input': (lambda: np.ones((2,)) + numpy.ones(2), TypeError, 'np.array'),
}


@pytest.mark.parametrize('case', sorted(BAD_SHAPES))
def test_bad_inputs_raise_at_push_time(engine_kind, case):
    call, error, message = BAD_SHAPES[case]
    with pytest.raises(error, match=message):
        call()
    engine.wait_all()                       # the engine never saw the bad operation


# -- devices --------------------------------------------------------------------------------

NO_GPU = pytest.mark.skipif(d2l.num_gpus() > 0, reason='checks the fallback on a machine '
                            'without a GPU')


def test_devices():
    assert CPU0 != CPU1 and d2l.cpu() == CPU0 and hash(d2l.cpu(1)) == hash(CPU1)
    assert repr(CPU1) == 'cpu(1)' and d2l.gpu(1) != CPU1
    with pytest.raises(ValueError, match="'tpu'"):
        d2l.Device('tpu')


@NO_GPU
def test_without_a_gpu_everything_falls_back_to_cpu0():
    assert d2l.num_gpus() == 0
    assert d2l.try_gpu() == CPU0 and d2l.try_gpu(3) == CPU0
    assert d2l.try_all_gpus() == [CPU0]


@NO_GPU
def test_a_gpu_without_cupy_says_what_to_install():
    with pytest.raises(RuntimeError, match='CuPy'):
        np.ones((2,), device=d2l.gpu(0))


@pytest.mark.parametrize('mix', [
    lambda a, b: a + b,
    lambda a, b: a.__iadd__(b),
    lambda a, b: a.__setitem__(slice(None), b),
    lambda a, b: np.concatenate([a, b]),
], ids=['add', 'iadd', 'setitem', 'concatenate'])
def test_mixing_devices_names_both_and_copyto(mix):
    with pytest.raises(ValueError, match=r'cpu\(0\).*cpu\(1\).*copyto'):
        mix(np.ones((2,)), np.ones((2,), device=CPU1))


def test_arrays_live_where_they_are_made():
    x = np.ones((2,), device=CPU1)
    assert x.device == CPU1 and (x * 2).device == CPU1 and x.copyto(CPU0).device == CPU0
    assert (x.copyto(CPU0) + np.ones((2,))).asnumpy().tolist() == [2.0, 2.0]


# -- creating arrays ------------------------------------------------------------------------

@pytest.mark.parametrize('dtype', ['int32', 'int64', 'float64', 'float16', 'bool'])
def test_array_of_numpy_keeps_its_dtype(dtype):
    host = numpy.arange(6).reshape(2, 3).astype(dtype)
    x = np.array(host)
    assert x.dtype == host.dtype and x.asnumpy().dtype == host.dtype
    numpy.testing.assert_array_equal(x.asnumpy(), host)


def test_array_of_python_values():
    assert np.array([1.5, 2.5]).dtype == numpy.float32
    assert np.array([[1.0], [2.0]]).asnumpy().dtype == numpy.float32
    assert np.array([1, 2]).dtype == numpy.array([1, 2]).dtype
    assert np.array([1, 2], dtype='float64').asnumpy().dtype == numpy.float64


def test_array_copies_what_it_is_given():
    host = numpy.ones(3)
    x = np.array(host)
    host[:] = 5
    y = np.array(x, device=CPU1)
    x += 1
    assert x.asnumpy().tolist() == [2.0] * 3 and y.asnumpy().tolist() == [1.0] * 3
    assert y.device == CPU1


def test_creation_functions():
    assert np.zeros((2, 3)).asnumpy().tolist() == [[0.0] * 3] * 2
    assert np.ones(3).shape == (3,) and np.ones(3).dtype == numpy.float32
    assert np.full((2,), 7, dtype='int32').asnumpy().tolist() == [7, 7]
    assert np.arange(5).asnumpy().tolist() == [0, 1, 2, 3, 4]
    assert np.arange(1, 2, 0.25).asnumpy().tolist() == [1.0, 1.25, 1.5, 1.75]
    assert np.arange(0, 1, 0.1).shape == numpy.arange(0, 1, 0.1).shape
    x = np.full((2,), 3.0, dtype='float64', device=CPU1)
    assert np.ones_like(x).device == CPU1 and np.zeros_like(x).dtype == numpy.float64


def test_random_draws_repeat_after_seed():
    def draw():
        return (np.random.normal(1.0, 2.0, size=(50,)).asnumpy(),
                np.random.uniform(-1, 3, size=(50,), device=CPU1).asnumpy())
    np.random.seed(7)
    first = draw()
    np.random.seed(7)
    second = draw()
    np.random.seed(8)
    third = draw()
    for a, b, c in zip(first, second, third):
        numpy.testing.assert_array_equal(a, b)
        assert not numpy.array_equal(a, c) and a.dtype == numpy.float32
    assert first[1].min() >= -1 and first[1].max() < 3


# -- metadata without waiting, blockers that wait ---------------------------------------------

def hold(x, value):
    """Push a slow write of `value` into x; returns the gate that lets it finish."""
    gate = threading.Event()

    def write():
        gate.wait(10)
        x.data[...] = value
    engine.push(write, [], [x.var], x.device, 'slow_write')
    return gate


def test_shape_and_dtype_are_known_without_waiting():
    x = np.ones((2, 3))
    gate = hold(x, 5)
    try:
        meta = run_with_timeout(lambda: (x.shape, x.dtype, x.ndim, x.size, len(x), x.device,
                                         (x + 1).shape, x.T.shape, x.sum(axis=0).dtype,
                                         (x @ x.T).shape, x[1:].shape, x.reshape(3, 2).shape), 5)
    finally:
        gate.set()
    assert meta == ((2, 3), numpy.float32, 2, 6, 2, CPU0, (2, 3), (3, 2), numpy.float32,
                    (2, 2), (1, 3), (3, 2))
    assert x.asnumpy().tolist() == [[5.0] * 3] * 2


BLOCKERS = {
    'repr': (repr, 'array(5., dtype=float32)'), 'str': (str, 'array(5., dtype=float32)'),
    'asnumpy': (lambda x: x.asnumpy().item(), 5.0), 'item': (lambda x: x.item(), 5.0),
    'float': (float, 5.0), 'int': (int, 5), 'bool': (bool, True),
    'numpy': (lambda x: numpy.asarray(x).item(), 5.0),
    'wait_to_read': (lambda x: x.wait_to_read().data.item(), 5.0),
}


@pytest.mark.parametrize('blocker', sorted(BLOCKERS))
def test_blockers_wait_for_the_value(blocker):
    call, expected = BLOCKERS[blocker]
    x = np.zeros(())
    gate = hold(x, 5)
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=call(x)), daemon=True)
    thread.start()
    time.sleep(EARLY)
    blocked = thread.is_alive()
    gate.set()
    thread.join(5)
    assert blocked and result['value'] == expected


def test_repr_names_a_device_other_than_the_default():
    assert repr(np.ones((2,), device=CPU1)).endswith('dtype=float32, device=cpu(1))')
    assert 'device' not in repr(np.ones((2,)))


def test_truth_of_many_values_is_ambiguous():
    with pytest.raises(ValueError, match='ambiguous'):
        bool(np.ones((2,)))


# -- arithmetic stays asynchronous ------------------------------------------------------------

@pytest.mark.parametrize('left', [2.0, 2, numpy.float64(2.0), numpy.float32(2.0)],
                         ids=['float', 'int', 'float64', 'float32'])
def test_scalars_on_the_left_give_ndarrays(left):
    x = np.array([1.0, 4.0])
    for result, expected in [(left * x, [2, 8]), (left + x, [3, 6]), (left - x, [1, -2]),
                             (left / x, [2, 0.5]), (left ** x, [2, 16])]:
        assert type(result) is NDArray                      # NumPy scalars are strongly typed:
        assert result.dtype == numpy.result_type(left, numpy.float32)   # float64(2) * x is float64
        assert result.asnumpy().tolist() == expected


def test_operators_match_numpy():
    a, b = numpy.arange(1.0, 7.0).reshape(2, 3), numpy.arange(3.0, 0.0, -1.0)
    x, y = np.array(a, dtype='float64'), np.array(b, dtype='float64')
    pairs = [(x + y, a + b), (x - y, a - b), (x * y, a * b), (x / y, a / b), (x ** y, a ** b),
             (x @ y, a @ b), (-x, -a), (abs(-x), a), (x > y, a > b), (x < y, a < b),
             (x >= y, a >= b), (x <= y, a <= b), (x == y, a == b), (x != y, a != b),
             (x.T, a.T), (x.sum(), a.sum()), (x.mean(axis=0), a.mean(axis=0)),
             (x.max(axis=1, keepdims=True), a.max(axis=1, keepdims=True)),
             (x.argmax(axis=1), a.argmax(axis=1)), (x.exp(), numpy.exp(a)), (x.log(), numpy.log(a)),
             (np.sqrt(x), numpy.sqrt(a)), (np.tanh(x), numpy.tanh(a)),
             (np.maximum(x, 3), numpy.maximum(a, 3)), (np.minimum(x, y), numpy.minimum(a, b)),
             (npx.relu(x - 3), numpy.maximum(a - 3, 0)), (x.astype('int32'), a.astype('int32')),
             (np.transpose(x, (1, 0)), a.T), (np.reshape(x, (3, 2)), a.reshape(3, 2))]
    for got, want in pairs:                # the same NumPy functions run: bit for bit equal
        numpy.testing.assert_array_equal(got.asnumpy(), numpy.asarray(want), strict=True)


def test_in_place_operators_update_the_same_array():
    x = np.array([1.0, 2.0])
    original = x
    x += 1
    x *= 3
    x -= 1
    x /= 2
    assert x is original and x.asnumpy().tolist() == [2.5, 4.0]


# -- failures through NDArray ------------------------------------------------------------------

def test_a_failing_operation_surfaces_with_its_name(engine_kind):
    base = np.array(numpy.array([2, 3], dtype='int32'))
    if engine_kind == 'naive':
        with pytest.raises(engine.OperationError, match="'power'.*negative"):
            base ** -1
        return
    bad = base ** -1                                       # integers to negative powers
    later = bad + 1
    with pytest.raises(engine.OperationError, match="'power'.*negative") as error:
        later.asnumpy()
    assert error.value.op_name == 'power'
    engine.wait_all()                      # shown at asnumpy: not raised again (issue 43 §2)
    assert (base + 1).asnumpy().tolist() == [3, 4]


def test_an_empty_reduction_fails_at_the_wait():
    empty = np.zeros((0, 3)).max()
    with pytest.raises(engine.OperationError, match="'max'.*zero-size"):
        empty.item()


def fail_in_place(x):
    def boom():
        raise ZeroDivisionError('boom')
    engine.push(boom, [], [x.var], x.device, 'boom')


def test_a_failed_array_fails_its_readers_and_the_error_stays():
    x = np.ones((3,))
    fail_in_place(x)
    y = x + 1
    with pytest.raises(engine.OperationError, match="'boom'"):
        y.asnumpy()
    with pytest.raises(engine.OperationError, match="'boom'"):
        y.asnumpy()                                        # asked again: still failed
    assert (np.ones((3,)) + 1).asnumpy().tolist() == [2.0] * 3   # a new array is fine


@pytest.mark.parametrize('touch', [lambda x: x.__iadd__(1), lambda x: x.__setitem__(0, 5.0),
                                   lambda x: x[1:].__iadd__(1)],
                         ids=['x += 1', 'x[0] = 5', 'x[1:] += 1'])
def test_every_write_into_a_failed_array_fails_with_the_same_error(touch):
    """A write that builds on x's values; `x[:] = 5` replaces them all, and clears the
    failure (tests/test_engine_failures.py)."""
    x = np.ones((3,))
    fail_in_place(x)
    touch(x)
    with pytest.raises(engine.OperationError, match="'boom'"):
        x.asnumpy()
