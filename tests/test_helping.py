"""Tests of helping waits: a thread that waits for a result runs the ready work itself.

A lane's thread is kept asleep (its wake-ups held back) so that only the waiter can run what is
queued there: which thread ran an operation is then certain, with no race and no sleep. The
property tests with helping on and off are in test_ndarray.py.
"""
import contextlib
import threading

import pytest

import d2lperf as d2l
from d2lperf import engine
from d2lperf.device import slow_down
from d2lperf.engine.lanes import COMPUTE
from d2lperf.engine.workers import running_device
from conftest import run_with_timeout

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)
EARLY = 0.05     # how long a wrong engine gets to run an operation too early


class HeldWakeups:
    """Stands in for a worker's wake-up queue: keeps the wake-ups instead of waking it."""

    def __init__(self):
        self.held = []

    def put(self, item):
        self.held.append(item)


@contextlib.contextmanager
def lane_asleep(device, lane=COMPUTE):
    """While inside, `device`'s lane thread sleeps through what is queued on it; afterwards it
    gets every wake-up it missed."""
    engine.push(lambda: None, [], [], device, 'start the lane', lane)
    engine.wait_all()
    worker = engine.current().workers.lanes[device, lane]
    real, worker.wakeups = worker.wakeups, HeldWakeups()
    try:
        yield worker
    finally:
        held, worker.wakeups = worker.wakeups.held, real
        for item in held:
            real.put(item)


def wait(var, then=lambda: None):
    """`engine.wait_for(var)`, then `then()`, on a thread named 'waiter'; fails rather than
    hangs. The error the wait raised, if any, is raised here."""
    raised = []

    def run():
        try:
            engine.wait_for(var)
            then()
        except engine.OperationError as error:
            raised.append(error)
    waiter = threading.Thread(target=run, name='waiter', daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), 'the waiter never finished: nobody ran what it waits for'
    if raised:
        raise raised[0]


def logged(log, name):
    def run():
        log.append((name, threading.current_thread().name, running_device()))
    return run


def boom():
    raise ZeroDivisionError('boom')


def test_a_waiter_runs_a_ready_operation_itself_and_it_is_recorded_on_its_lane():
    var, log = engine.Var(), []
    records = engine.start_recording()
    with lane_asleep(CPU1):
        engine.push(logged(log, 'write'), [], [var], CPU1, 'write')
        wait(var)
        assert log == [('write', 'waiter', CPU1)]
    engine.stop_recording()
    record, = [r for r in records if r.name == 'write']
    assert (record.worker, record.helped) == ('cpu(1) compute', 'waiter')


def test_the_waiter_runs_on_its_own_device_again_after_helping():
    var, seen = engine.Var(), []
    with lane_asleep(CPU1):
        engine.push(lambda: seen.append(running_device()), [], [var], CPU1, 'write')
        wait(var, then=lambda: seen.append(running_device()))
    assert seen == [CPU1, CPU0]


def test_a_waiter_runs_the_lane_in_order_and_stops_at_what_it_waits_for():
    first, second, third, log = engine.Var(), engine.Var(), engine.Var(), []
    with lane_asleep(CPU0):
        for name, var in (('first', first), ('second', second), ('third', third)):
            engine.push(logged(log, name), [], [var], CPU0, name)
        wait(second)
        assert [name for name, *_ in log] == ['first', 'second']
    engine.wait_all()
    assert [name for name, *_ in log] == ['first', 'second', 'third']
    assert log[2][1] == 'd2lperf-cpu(0) compute'      # the lane's thread, once woken


def test_a_waiter_does_not_run_an_operation_whose_dependencies_are_not_met():
    source, target, gate, seen = engine.Var(), engine.Var(), threading.Event(), []
    engine.push(lambda: gate.wait(10), [], [source], CPU1, 'slow')
    engine.push(lambda: seen.append(gate.is_set()), [source], [target], CPU0, 'dependent')
    waiter = threading.Thread(target=engine.wait_for, args=(target,))
    waiter.start()
    waiter.join(EARLY)
    assert seen == [] and waiter.is_alive()
    gate.set()
    waiter.join(10)
    assert seen == [True] and not waiter.is_alive()


def test_running_a_chain_wakes_the_lane_once():
    """A waiter that runs a chain of operations, each made ready by the last one's completion,
    wakes the lane's thread only for the chain's first, ready when pushed (10 wake-ups before
    this rule): each would be a system call, and a thread taking the interpreter from the one
    that runs the chain. One more may come from the lane's thread, which may still be letting
    its lane go after `lane_asleep`'s first operation (`Worker.run_queued`)."""
    x = d2l.np.zeros((2,))
    x.wait_to_read()
    with lane_asleep(CPU0) as worker:
        for _ in range(10):
            x = x + 1
        x.wait_to_read()
        assert len(worker.wakeups.held) <= 2, worker.wakeups.held
    assert x.asnumpy().tolist() == [10, 10]


def test_a_waiter_does_not_run_a_lane_its_thread_is_running():
    var, gate, started, log = engine.Var(), threading.Event(), threading.Event(), []
    engine.push(lambda: started.set() or gate.wait(10), [], [], CPU0, 'busy')
    assert started.wait(10)
    engine.push(logged(log, 'next'), [], [var], CPU0, 'next')
    waiter = threading.Thread(target=engine.wait_for, args=(var,), name='waiter')
    waiter.start()
    waiter.join(EARLY)
    assert log == [] and waiter.is_alive()
    gate.set()
    waiter.join(10)
    assert log == [('next', 'd2lperf-cpu(0) compute', CPU0)]


@pytest.mark.parametrize('helping', [True, False])
def test_a_failed_operation_raises_at_the_same_waits_whoever_runs_it(helping):
    engine.set_helping(helping)
    failed, after = engine.Var(), engine.Var()
    asleep = lane_asleep(CPU0) if helping else contextlib.nullcontext()
    with asleep:
        engine.push(boom, [], [failed], CPU0, 'boom')
        engine.push(lambda: None, [failed], [after], CPU0, 'reader')
        for var in (failed, after):
            with pytest.raises(engine.OperationError, match="'boom' failed: ZeroDivisionError"):
                wait(var)
    engine.wait_all()                            # shown at the waits: not raised again


def test_with_helping_off_the_lane_thread_runs_everything():
    engine.set_helping(False)
    var, log = engine.Var(), []
    engine.push(logged(log, 'write'), [], [var], CPU0, 'write')
    engine.wait_for(var)
    assert log[0][1] == 'd2lperf-cpu(0) compute'
    assert engine.set_helping(True) is False


def test_two_threads_waiting_on_each_others_lanes_finish():
    """Each thread's result needs work queued on the other's lane: helping must not hold a lane
    while it waits, or the two would wait for each other for good."""
    def rounds():
        for _ in range(200):
            a0, a1, b0, b1, values = (engine.Var(), engine.Var(), engine.Var(), engine.Var(),
                                      {})
            engine.push(lambda: values.update(a0=1), [], [a0], CPU0, 'a0')
            engine.push(lambda: values.update(a1=2), [], [a1], CPU1, 'a1')
            engine.push(lambda: values.update(b0=values['a1'] + 1), [a1], [b0], CPU0, 'b0')
            engine.push(lambda: values.update(b1=values['a0'] + 1), [a0], [b1], CPU1, 'b1')
            threads = [threading.Thread(target=engine.wait_for, args=(var,)) for var in (b0, b1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10)
                assert not thread.is_alive(), 'two waiters deadlocked'
            assert values == {'a0': 1, 'a1': 2, 'b0': 3, 'b1': 2}
    run_with_timeout(rounds, 60)


def test_a_helped_operation_keeps_its_devices_speed():
    var = engine.Var()
    slow_down(CPU1, 3)
    try:
        with lane_asleep(CPU1):
            engine.push(lambda: sum(range(20_000)), [], [var], CPU1, 'slowed')
            wait(var)
            pace = engine.current().workers.lanes[CPU1, COMPUTE].pace
            assert pace.owed != 0.0      # the lane's Pace ran it, and kept what it owes
    finally:
        slow_down(CPU1, 1)


def test_a_helped_operation_counts_its_device_busy_for_blas_division():
    old = engine.set_blas_division(True)
    try:
        engine.push(lambda: None, [], [], CPU1, 'two devices')
        var, busy = engine.Var(), []
        cores = engine.current().workers.cores
        with lane_asleep(CPU0):
            engine.push(lambda: busy.append(cores.busy), [], [var], CPU0, 'counted')
            wait(var)
        assert busy == [1] and cores.busy == 0
    finally:
        engine.set_blas_division(old)


def test_arrays_waited_for_one_by_one_give_the_values_of_numpy():
    x = d2l.np.ones((3,))
    for i in range(50):
        x = x + 1
        assert x.asnumpy().tolist() == [i + 2.0] * 3


def test_the_naive_engine_has_nothing_to_help():
    engine.use('naive')
    assert engine.set_helping(True) is False


# -- push_short: an operation shorter than a hand-off runs on the caller where the lane idles --

def test_a_short_operation_runs_on_the_calling_thread_where_its_lane_is_idle():
    var, log = engine.Var(), []
    engine.push(lambda: None, [], [], CPU1, 'start the lane')
    engine.wait_all()
    records = engine.start_recording()
    engine.push_short(logged(log, 'short'), [], [var], CPU1, 'short')
    assert log == [('short', threading.current_thread().name, CPU1)]   # done on return
    assert var.writer is None
    engine.stop_recording()
    record, = [r for r in records if r.name == 'short']
    assert record.helped == threading.current_thread().name


def test_a_short_operation_waits_its_turn_behind_queued_work_and_dependencies():
    first, second, log = engine.Var(), engine.Var(), []
    with lane_asleep(CPU1):
        engine.push(logged(log, 'queued'), [], [first], CPU1, 'queued')
        engine.push_short(logged(log, 'short'), [first], [second], CPU1, 'short')
        assert log == []                      # not ready, and the lane has work: both wait
    engine.wait_for(second)
    assert [name for name, *_ in log] == ['queued', 'short']


def test_a_short_operation_goes_to_the_lane_with_helping_off():
    var, log = engine.Var(), []
    old = engine.set_helping(False)
    try:
        engine.push_short(logged(log, 'short'), [], [var], CPU1, 'short')
        engine.wait_for(var)
    finally:
        engine.set_helping(old)
    assert log[0][1] == 'd2lperf-cpu(1) compute'


def test_a_short_operation_run_on_the_caller_keeps_its_failure_for_the_wait():
    """Run under the engine's lock, it takes no grants: its failure still lands on what it
    writes, `wait_all` still reports it once, and the engine goes on."""
    var, after = engine.Var(), engine.Var()
    engine.push(lambda: None, [], [], CPU1, 'start the lane')
    engine.wait_all()

    def fail():
        raise ValueError('short and wrong')
    engine.push_short(fail, [], [var], CPU1, 'short')
    assert var.writer is None and isinstance(var.error, engine.OperationError)
    with pytest.raises(engine.OperationError, match='short and wrong'):
        engine.wait_for(var)
    engine.wait_all()                                 # shown at the wait: not raised again
    engine.push_short(fail, [], [engine.Var()], CPU1, 'short, unseen')
    with pytest.raises(engine.OperationError, match='short and wrong'):
        engine.wait_all()                             # never shown: raised once
    engine.push_short(lambda: None, [], [after], CPU1, 'short again')
    engine.wait_for(after)
    engine.wait_all()


def test_a_short_operation_waits_for_a_waiter_that_reads_its_variable():
    """Nothing is in flight while a waiter (an operation on no device) runs on another thread,
    yet it holds its read: a short write of that variable must not run before it is done."""
    var, log, inside, leave = engine.Var(), [], threading.Event(), threading.Event()
    engine.push(lambda: None, [], [], CPU1, 'start the lane')
    engine.wait_all()

    def reader():
        inside.set()
        leave.wait(10)
        log.append('read')
    thread = threading.Thread(target=engine.push, args=(reader, [var], [], None, 'reader'))
    thread.start()
    assert inside.wait(10) and engine.in_flight() == 0
    engine.push_short(lambda: log.append('write'), [], [var], CPU1, 'short')
    assert log == []                                  # the read is not done: not run here
    leave.set()
    thread.join(10)
    engine.wait_for(var)
    assert log == ['read', 'write']


def test_a_short_operation_is_pushed_while_another_thread_holds_the_engine():
    var, log, taken, leave = engine.Var(), [], threading.Event(), threading.Event()
    engine.push(lambda: None, [], [], CPU1, 'start the lane')
    engine.wait_all()
    eng = engine.current()

    def hold_the_engine():
        with eng.lock:
            taken.set()
            leave.wait(EARLY)
    thread = threading.Thread(target=hold_the_engine)
    thread.start()
    assert taken.wait(10)
    engine.push_short(logged(log, 'short'), [], [var], CPU1, 'short')   # waits for the lock
    thread.join(10)
    engine.wait_for(var)
    assert [name for name, *_ in log] == ['short'] and log[0][2] == CPU1


def test_a_short_operation_after_a_failure_inherits_it_and_runs_on_the_caller():
    """Once an operation has failed, a short one is executed as an `Operation`, so that it
    inherits the failure of what it reads, still on the calling thread."""
    failed, out, log = engine.Var(), engine.Var(), []
    engine.push(lambda: None, [], [], CPU1, 'start the lane')
    engine.wait_all()
    engine.push_short(boom, [], [failed], CPU1, 'boom')
    engine.push_short(logged(log, 'after'), [failed], [out], CPU1, 'after')
    assert log == [] and out.writer is None
    with pytest.raises(engine.OperationError, match='boom'):
        engine.wait_for(out)
    engine.wait_all()                                 # shown at the wait: not raised again
    engine.push_short(logged(log, 'fine'), [], [engine.Var()], CPU1, 'fine')
    assert log == [('fine', threading.current_thread().name, CPU1)]


def test_a_short_operation_keeps_a_slowed_down_devices_pace():
    """With nothing in flight the caller may run a short operation at once, but not on a
    device slowed down: its lane keeps the pace, so it runs there (or helped, at the wait)."""
    var, log = engine.Var(), []
    engine.push(lambda: None, [], [], CPU1, 'start the lane')
    engine.wait_all()
    slow_down(CPU1, 3)
    try:
        with lane_asleep(CPU1):
            engine.push_short(logged(log, 'short'), [], [var], CPU1, 'short')
            assert log == [] and var.writer is not None
    finally:
        slow_down(CPU1, 1)
    engine.wait_for(var)
    assert [name for name, *_ in log] == ['short']
