"""The engine's Python per operation, counted: a regression in its cost shows as more calls.

Time per operation moves by tens of percent on a shared machine; the calls an operation makes
do not. `sys.setprofile` sees every call of a Python function and of a C function, on this
thread, and the lane's thread is kept asleep (its wake-ups noted, not sent), so that this
thread runs the operation too, as a waiting thread does (`ThreadedEngine.wait_for`). The
bounds are the counts last measured (benchmarks/RESULTS.md, "The engine's Python per
operation", then "Fewer calls an operation": 35 and 35 before it, 30 and 31 after) plus a
margin of three calls: a change may add a check, but not a layer of functions on every
operation's way. The third push of the three finds the lane's wake-up on its way, as pushes
made faster than the lane runs them do (`Worker.woken`), and sends none.
"""
import contextlib
import sys
import types

import pytest

import d2lperf as d2l
from d2lperf import autograd, engine, np
from d2lperf.engine import COMPUTE

pytestmark = pytest.mark.usefixtures('fresh_engine')

PUSH_CALLS, RUN_AND_WAIT_CALLS, RECORDING_CALLS = 30, 31, 8     # measured; see above
MARGIN = 3


@contextlib.contextmanager
def lane_asleep():
    """cpu(0)'s lane thread, on a threaded engine, sleeps through the block; what it missed
    runs after."""
    engine.use('threaded')              # whatever D2LPERF_ENGINE says
    engine.push(lambda: None, [], [], d2l.cpu(), 'start the lane')
    engine.wait_all()
    worker = engine.current().workers.lanes[d2l.cpu(), COMPUTE]
    held = []
    real, worker.wakeups = worker.wakeups, types.SimpleNamespace(put=held.append)  # a C call,
    try:                                                         # as SimpleQueue.put is
        yield held
    finally:
        worker.wakeups = real
        for item in held:
            real.put(item)


def calls_of(fn):
    """The calls `fn()` makes on this thread, by name, in order."""
    calls = []

    def note(frame, event, arg):
        if event == 'call':
            calls.append(frame.f_code.co_name)
        elif event == 'c_call':
            calls.append(arg.__name__)
    sys.setprofile(note)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[:-1]                       # setprofile(None) itself


def push_and_wait_calls(x):
    """(calls of `y = x + 1`, calls of `y.wait_to_read()`), the third of three in a row."""
    with lane_asleep():
        for _ in range(3):
            y = [None]
            push = calls_of(lambda: y.__setitem__(0, x + 1))
            wait = calls_of(y[0].wait_to_read)
    assert y[0].asnumpy().tolist() == [[2.0, 2.0]]
    return push, wait


def test_one_operation_pushes_and_runs_in_few_calls():
    push, wait = push_and_wait_calls(np.ones((1, 2)))
    assert 'execute' in wait, 'the waiting thread ran the operation'
    assert len(push) <= PUSH_CALLS + MARGIN, push
    assert len(wait) <= RUN_AND_WAIT_CALLS + MARGIN, wait


def test_recording_for_autograd_adds_few_calls():
    x = np.ones((1, 2))
    x.attach_grad()
    plain, _ = push_and_wait_calls(x)
    with autograd.record():
        recorded, _ = push_and_wait_calls(x)
    assert len(recorded) - len(plain) <= RECORDING_CALLS + MARGIN, recorded



def test_pushes_while_a_wake_up_is_on_its_way_send_no_other():
    """Ten operations pushed to a sleeping lane wake it once (ten times before `Worker.woken`):
    each wake-up is a call here, and one more on the lane's thread, which takes it off."""
    x = np.ones((1, 2))
    with lane_asleep() as wakeups:
        ys = [x + 1 for _ in range(10)]
        assert len(wakeups) == 1, wakeups
    assert [y.asnumpy().tolist() for y in ys] == [[[2.0, 2.0]]] * 10
