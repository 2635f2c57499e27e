"""Tests of d2lperf.engine, driven directly with Vars and Python closures.

Orderings are checked with gates (threading.Event) rather than timings: a slow operation
waits on a gate, a wrong engine gets a moment to run the dependent operation early, and the
recorded log says which ran first. No test measures time: that two devices overlap is shown by
two operations that can only finish together.
"""
import threading
import time

import pytest

import d2lperf as d2l
from d2lperf import engine, np
from conftest import run_in_subprocess, run_with_timeout

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)
DEVICE_PAIRS = pytest.mark.parametrize('first, second', [(CPU0, CPU1), (CPU1, CPU0), (CPU0, CPU0)],
                                       ids=['cpu0-cpu1', 'cpu1-cpu0', 'same-device'])
EARLY = 0.05     # how long a wrong engine gets to run a dependent operation too early


def gated(gate, fn):
    """An operation that waits for `gate` before doing `fn`: slow until the test says go."""
    def run():
        if not gate.wait(10):
            raise TimeoutError('the gate was never opened')
        fn()
    return run


def boom():
    raise ZeroDivisionError('boom')


# -- RAW, WAR, WAW ---------------------------------------------------------------------------

@DEVICE_PAIRS
def test_read_after_write_sees_the_written_value(first, second):
    var, box, seen, gate = engine.Var(), {'value': 0}, [], threading.Event()
    engine.push(gated(gate, lambda: box.update(value=1)), [], [var], first, 'slow_write')
    engine.push(lambda: seen.append(box['value']), [var], [], second, 'read')
    time.sleep(EARLY)
    assert seen == []
    gate.set()
    engine.wait_all()
    assert seen == [1]


@DEVICE_PAIRS
def test_write_after_read_waits_for_the_reader(first, second):
    var, box, seen, gate = engine.Var(), {'value': 1}, [], threading.Event()
    engine.push(gated(gate, lambda: seen.append(box['value'])), [var], [], first, 'slow_read')
    engine.push(lambda: box.update(value=2), [], [var], second, 'write')
    time.sleep(EARLY)
    assert box['value'] == 1
    gate.set()
    engine.wait_all()
    assert seen == [1] and box['value'] == 2


@DEVICE_PAIRS
def test_write_after_write_keeps_the_last_value(first, second):
    var, log, gate = engine.Var(), [], threading.Event()
    engine.push(gated(gate, lambda: log.append('first')), [], [var], first, 'slow_write')
    engine.push(lambda: log.append('second'), [], [var], second, 'fast_write')
    time.sleep(EARLY)
    assert log == []
    gate.set()
    engine.wait_for(var)
    assert log == ['first', 'second']


def test_a_chain_across_devices_runs_in_program_order():
    var, log, count = engine.Var(), [], 51          # every third operation reads, the rest write
    for i in range(count):
        reads, writes = ([var], []) if i % 3 == 1 else ([], [var])
        engine.push(lambda i=i: log.append(i), reads, writes, (CPU0, CPU1)[i % 2], f'op{i}')
    engine.wait_all()
    assert [i for i in log if i % 3 != 1] == [i for i in range(count) if i % 3 != 1]
    for i in range(1, count, 3):                    # each read between its two writes
        assert log.index(i - 1) < log.index(i) < log.index(i + 1)


def test_operations_on_one_device_run_in_push_order():
    log = []
    for i in range(20):
        engine.push(lambda i=i: log.append(i), [], [engine.Var()], CPU0, f'op{i}')
    engine.wait_all()
    assert log == list(range(20))


def test_readers_of_one_var_run_together_on_two_devices():
    """Each reader waits for the other: they finish only if the engine lets both in at once."""
    var, barrier, outs = engine.Var(), threading.Barrier(2, timeout=5), [engine.Var(), engine.Var()]
    engine.push(lambda: None, [], [var], CPU0, 'write')
    for out, device in zip(outs, (CPU0, CPU1)):
        engine.push(barrier.wait, [var], [out], device, 'reader')
    for out in outs:
        engine.wait_for(out)


def test_independent_operations_on_two_devices_run_together():
    """Each operation sets its own event, then waits for the other's: both finish only if they
    run at the same time (an engine that ran them one after the other raises at the wait)."""
    events = [threading.Event(), threading.Event()]

    def meet(mine, theirs):
        mine.set()
        if not theirs.wait(10):
            raise TimeoutError('the other device never ran its operation alongside this one')
    outs = [engine.Var(), engine.Var()]
    for out, device, (mine, theirs) in zip(outs, (CPU0, CPU1), (events, events[::-1])):
        engine.push(lambda mine=mine, theirs=theirs: meet(mine, theirs), [], [out], device,
                    'meet')
    for out in outs:
        engine.wait_for(out)


# -- waiting --------------------------------------------------------------------------------

def test_wait_for_returns_after_the_last_writer():
    var, log = engine.Var(), []
    for i in range(3):
        engine.push(lambda i=i: (time.sleep(0.02), log.append(('write', i))), [], [var],
                    (CPU0, CPU1)[i % 2], 'write')
        engine.push(lambda i=i: log.append(('read', i)), [var], [], CPU1, 'read')
    engine.wait_for(var)
    assert [e for e in log if e[0] == 'write'] == [('write', 0), ('write', 1), ('write', 2)]


def test_wait_for_does_not_wait_for_other_vars():
    busy, idle, gate = engine.Var(), engine.Var(), threading.Event()
    engine.push(gated(gate, lambda: None), [], [busy], CPU0, 'blocked')
    engine.push(lambda: None, [], [idle], CPU1, 'quick')
    try:
        run_with_timeout(lambda: engine.wait_for(idle), 5)
    finally:
        gate.set()
    engine.wait_for(busy)


def test_wait_to_write_waits_for_the_readers_too():
    var, log = engine.Var(), []
    engine.push(lambda: log.append('write'), [], [var], CPU0, 'write')
    for device in (CPU0, CPU1):
        engine.push(lambda: (time.sleep(0.05), log.append('read')), [var], [], device, 'read')
    engine.wait_to_write(var)
    assert log == ['write', 'read', 'read']
    later = []
    engine.push(lambda: later.append('read'), [var], [], CPU1, 'read')   # the var is free again
    engine.wait_for(var)
    engine.wait_all()
    assert later == ['read']


def test_wait_for_an_untouched_var_returns_at_once():
    run_with_timeout(lambda: engine.wait_for(engine.Var()), 5)


def test_push_returns_while_a_long_operation_runs():
    var, gate, done = engine.Var(), threading.Event(), threading.Event()
    run_with_timeout(lambda: engine.push(gated(gate, done.set), [], [var], CPU0, 'long'), 5)
    run_with_timeout(lambda: engine.push(done.is_set, [var], [engine.Var()], CPU1, 'next'), 5)
    assert not done.is_set()
    assert engine.in_flight() == 2
    gate.set()
    engine.wait_all()
    assert done.is_set() and engine.in_flight() == 0


def test_wait_all_waits_for_every_device():
    log = []
    for i in range(10):
        engine.push(lambda i=i: (time.sleep(0.005), log.append(i)), [], [engine.Var()],
                    (CPU0, CPU1)[i % 2], 'op')
    engine.wait_all()
    assert sorted(log) == list(range(10))


# -- failures -------------------------------------------------------------------------------

def test_a_failed_operation_marks_what_it_writes():
    failed, consumer_out, ran = engine.Var(), engine.Var(), []
    engine.push(boom, [], [failed], CPU0, 'explode')
    engine.push(lambda: ran.append(1), [failed], [consumer_out], CPU1, 'consumer')
    with pytest.raises(engine.OperationError, match=r"'explode'.*ZeroDivisionError: boom") as first:
        engine.wait_for(failed)
    assert first.value.op_name == 'explode'
    with pytest.raises(engine.OperationError) as second:
        engine.wait_for(consumer_out)
    assert second.value is first.value and ran == []      # the same error; never ran


def test_wait_all_raises_once_then_the_engine_keeps_working():
    engine.push(boom, [], [engine.Var()], CPU0, 'explode')
    engine.push(boom, [], [engine.Var()], CPU1, 'explode_again')
    with pytest.raises(engine.OperationError, match='explode'):
        engine.wait_all()
    engine.wait_all()                                     # nothing left to raise
    var, box = engine.Var(), []
    engine.push(lambda: box.append(6 * 7), [], [var], CPU0, 'fine')
    engine.wait_for(var)
    assert box == [42]


def test_a_write_into_a_failed_variable_fails_with_the_same_error():
    var = engine.Var()
    engine.push(boom, [], [var], CPU0, 'explode')
    with pytest.raises(engine.OperationError):
        engine.wait_for(var)
    ran = []
    engine.push(lambda: ran.append('rewrite'), [], [var], CPU1, 'rewrite')
    out = engine.Var()
    engine.push(lambda: ran.append('reader'), [var], [out], CPU0, 'reader')
    with pytest.raises(engine.OperationError, match="'explode'"):
        engine.wait_for(out)
    with pytest.raises(engine.OperationError, match="'explode'"):
        engine.wait_for(var)
    assert ran == []
    engine.wait_all()             # the one failure was shown at the waits: not raised again


def test_errors_travel_along_a_chain_of_dependencies():
    vars_ = [engine.Var() for _ in range(5)]
    ran = []
    engine.push(boom, [], [vars_[0]], CPU0, 'explode')
    for i in range(1, 5):
        engine.push(lambda i=i: ran.append(i), [vars_[i - 1]], [vars_[i]], (CPU0, CPU1)[i % 2],
                    f'step{i}')
    with pytest.raises(engine.OperationError, match='explode'):
        engine.wait_for(vars_[-1])
    assert ran == []


def test_naive_engine_raises_at_push():
    engine.use('naive')
    failed, ran = engine.Var(), []
    with pytest.raises(engine.OperationError, match="'explode'"):
        engine.push(boom, [], [failed], CPU0, 'explode')
    with pytest.raises(engine.OperationError, match="'explode'"):
        engine.push(lambda: ran.append(1), [failed], [engine.Var()], CPU1, 'consumer')
    assert ran == []
    with pytest.raises(engine.OperationError, match="'explode'"):
        engine.wait_for(failed)
    engine.wait_all()
    with pytest.raises(engine.OperationError, match="'explode'"):
        engine.push(lambda: ran.append(2), [], [failed], CPU0, 'rewrite')
    assert ran == []


def test_naive_engine_runs_each_operation_at_once():
    engine.use('naive')
    log = []
    engine.push(lambda: log.append('ran'), [], [engine.Var()], CPU1, 'op')
    assert log == ['ran'] and engine.in_flight() == 0


# -- stress ---------------------------------------------------------------------------------

def many_small_operations(count):
    """count operations: chains of x + 1 and in-place += 1 on both devices, then one sum."""
    x, y = np.zeros((2,)), np.zeros((2,), device=CPU1)
    quarter = count // 4
    for _ in range(quarter):
        x = x + 1
        y += 1
    for _ in range(quarter):
        x += 1
        y = y + 1
    return (x + y.copyto(CPU0)).asnumpy(), 4 * quarter


@pytest.mark.parametrize('limit', [None, 8])
def test_a_hundred_thousand_operations_finish(limit):
    engine.set_max_in_flight(limit)
    total, count = run_with_timeout(lambda: many_small_operations(100_000), 180)
    assert total.tolist() == [count, count]


def test_many_vars_read_together_finish():
    var, outs = engine.Var(), [engine.Var() for _ in range(2000)]
    engine.push(lambda: time.sleep(0.01), [], [var], CPU0, 'write')
    for i, out in enumerate(outs):
        engine.push(lambda: None, [var, var], [out], (CPU0, CPU1)[i % 2], 'read_twice')
    run_with_timeout(engine.wait_all, 60)


# -- bounding operations in flight ----------------------------------------------------------

@pytest.mark.parametrize('bound', [1, 3, 8])
def test_in_flight_never_exceeds_the_bound(bound):
    engine.set_max_in_flight(bound)
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(engine.in_flight())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for i in range(40):
            var = engine.Var()
            engine.push(lambda: time.sleep(0.002), [], [var], (CPU0, CPU1)[i % 2], 'nap')
            samples.append(engine.in_flight())
        engine.wait_all()
    finally:
        stop.set()
        sampler.join()
    assert max(samples) <= bound
    assert max(samples) == bound                  # the bound was reached: the test means something


def test_push_blocks_at_the_bound_until_an_operation_finishes():
    engine.set_max_in_flight(1)
    gate, pushed = threading.Event(), threading.Event()
    engine.push(gated(gate, lambda: None), [], [engine.Var()], CPU0, 'blocked')
    pusher = threading.Thread(target=lambda: (engine.push(lambda: None, [], [engine.Var()], CPU1,
                                                          'second'), pushed.set()), daemon=True)
    pusher.start()
    time.sleep(EARLY)
    assert not pushed.is_set()
    gate.set()
    assert pushed.wait(5)
    pusher.join(5)
    engine.wait_all()


def test_a_dependent_chain_finishes_under_a_bound_of_one():
    engine.set_max_in_flight(1)
    x = np.zeros((3,))
    for _ in range(200):
        x = x + 1
    assert run_with_timeout(x.asnumpy, 30).tolist() == [200.0] * 3


def test_set_max_in_flight_returns_the_old_bound_and_checks_it():
    assert engine.set_max_in_flight(4) is None
    assert engine.set_max_in_flight(None) == 4
    with pytest.raises(ValueError, match='positive'):
        engine.set_max_in_flight(0)


def test_no_bound_lets_every_operation_in():
    gate = threading.Event()
    for _ in range(20):
        engine.push(gated(gate, lambda: None), [], [engine.Var()], CPU0, 'held')
    assert engine.in_flight() == 20
    gate.set()
    engine.wait_all()


# -- tracing --------------------------------------------------------------------------------

def test_trace_records_the_graph_of_an_expression(engine_kind):
    with d2l.profiler.profile() as records:
        x = np.ones((2, 3))
        y = np.ones((2, 3))
        z = x * y + 2
    assert [r.name for r in records] == ['ones', 'ones', 'multiply', 'add']
    assert all(r.device == CPU0 for r in records)
    ones_x, ones_y, multiply, add = records
    assert ones_x.reads == [] and ones_x.writes == [x.var.id]
    assert ones_y.reads == [] and ones_y.writes == [y.var.id]
    assert multiply.reads == [x.var.id, y.var.id] and len(multiply.writes) == 1
    assert add.reads == multiply.writes and add.writes == [z.var.id]
    assert multiply.writes[0] not in (x.var.id, y.var.id, z.var.id)
    for record in records:
        assert record.worker is not None and record.start <= record.end
    assert z.asnumpy().tolist() == [[3.0] * 3] * 2


def test_trace_records_devices_and_only_inside_the_block():
    with d2l.profiler.profile() as records:
        x = np.ones((2,), device=CPU1)
        x.copyto(CPU0)
    np.ones((2,))
    engine.wait_all()
    assert [(r.name, r.device) for r in records] == [('ones', CPU1), ('copyto', CPU0)]
    assert records[1].reads == [x.var.id]


# -- choosing an engine ---------------------------------------------------------------------

def test_use_switches_engines_and_rejects_unknown_ones():
    assert isinstance(engine.use('naive'), engine.NaiveEngine)
    assert isinstance(engine.current(), engine.NaiveEngine)
    assert isinstance(engine.use('threaded'), engine.ThreadedEngine)
    with pytest.raises(ValueError, match="'fast'.*naive"):
        engine.use('fast')


def test_switching_engines_ends_the_old_workers():
    def engine_threads():            # the piece threads are the process's, shared by engines
        return sum(t.name.startswith('d2lperf-') and not t.name.startswith('d2lperf-piece')
                   for t in threading.enumerate())
    engine.use('threaded')
    before = engine_threads()
    for _ in range(3):
        engine.use('threaded')
        out, box = engine.Var(), []
        engine.push(lambda: box.append(1), [], [out], CPU0, 'work')
        engine.push(lambda: box.append(2), [], [engine.Var()], CPU1, 'work')
        engine.wait_all()
        assert sorted(box) == [1, 2]
    assert engine_threads() <= max(before, 2)


@pytest.mark.parametrize('env, expected', [
    ({'D2LPERF_ENGINE': 'naive'}, 'NaiveEngine None'),
    ({'D2LPERF_ENGINE': 'threaded'}, 'ThreadedEngine None'),
])
def test_the_environment_picks_the_engine(monkeypatch, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = run_in_subprocess("""
        from d2lperf import engine, np
        e = engine.current()
        print(type(e).__name__, getattr(e, 'max_in_flight', None))
        assert (np.ones(2) + 1).asnumpy().tolist() == [2.0, 2.0]
    """)
    assert out.strip() == expected


def test_an_unknown_engine_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv('D2LPERF_ENGINE', 'turbo')
    out = run_in_subprocess("""
        try:
            import d2lperf
        except ValueError as error:
            print(error)
    """)
    assert 'turbo' in out and 'naive' in out
