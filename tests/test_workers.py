"""Several devices side by side: copy lanes, dependencies across devices, BLAS thread division.

Random programs spread over `cpu(0)`, `cpu(1)` (and `gpu(0)` where there is one), with
copies between them, must give what sequential NumPy gives, and the engine's trace of such a
program must respect every dependency: no operation starts before the operations it depends
on have ended. Overlap is checked with gates, not timings: an operation held on one worker
must not stop an independent one on another worker.
"""
import re
import threading
import time

import numpy
import pytest
from hypothesis import given

import d2lperf as d2l
from d2lperf import autograd, device as device_module, engine, np
from d2lperf.engine import blas as blas_module
from d2lperf.engine.blas import SharedCores
from d2lperf.engine.lanes import COMPUTE, COPY_IN, COPY_OUT, copy_lane
from fakes import cupy as fake_cupy
from conftest import run_with_timeout
from strategies import checks
from strategies.programs import D2LBackend, Interpreter, NumpyBackend, programs

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)
DEVICES = [CPU0, CPU1] + ([d2l.gpu(0)] if d2l.num_gpus() else [])
needs_gpu = pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')
SHAPE = (4, 4)


# -- random multi-device programs (tests/strategies/programs.py) ----------------------------------------

def assert_same_as_numpy(program, devices=DEVICES):
    """The program on d2lperf's devices gives what sequential NumPy gives (GPU products may
    differ from NumPy's in the last bits)."""
    expected = Interpreter(NumpyBackend()).run(program)
    got = run_with_timeout(lambda: Interpreter(D2LBackend(devices)).run(program), 60)
    assert len(got) == len(expected)
    for value, want in zip(got, expected):
        numpy.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-9)


@pytest.mark.filterwarnings('ignore::RuntimeWarning')     # overflow in long product chains
@checks(40)
@given(program=programs(len(DEVICES)))
def test_multi_device_programs_match_sequential_numpy(program):
    assert_same_as_numpy(program)


def conflicts(earlier, later):
    """True if `later` must wait for `earlier`: they share a variable and one of them writes it."""
    return bool(set(earlier.writes) & set(later.reads + later.writes)
                or set(earlier.reads) & set(later.writes))


def assert_trace_respects_dependencies(records):
    for i, later in enumerate(records):
        for earlier in records[:i]:
            if conflicts(earlier, later):
                assert earlier.end <= later.start, (
                    f'{later.name} on {later.worker} started {later.start - earlier.end:.2e} s '
                    f'before {earlier.name} on {earlier.worker} ended')


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@checks(25)
@given(program=programs(len(DEVICES)))
def test_the_trace_of_a_program_respects_every_dependency(program):
    with d2l.profiler.profile() as records:
        Interpreter(D2LBackend(DEVICES)).run(program)
    assert records and all(r.start <= r.end for r in records)
    assert_trace_respects_dependencies(records)


def test_a_dependency_check_would_catch_a_violation():
    with d2l.profiler.profile() as records:
        x = np.ones(SHAPE)
        (x + 1).wait_to_read()
    first, second = records
    first.end = second.start + 1e-3
    with pytest.raises(AssertionError, match='started'):
        assert_trace_respects_dependencies(records)


# -- where copies run, and what overlaps --------------------------------------------------------

def test_copies_run_on_a_copy_lane_of_the_target_cpu_device():
    assert copy_lane(CPU1, CPU0) == (CPU0, COPY_IN)
    assert copy_lane(d2l.gpu(0), CPU0) == (d2l.gpu(0), COPY_OUT)
    assert copy_lane(CPU0, d2l.gpu(1)) == (d2l.gpu(1), COPY_IN)
    assert copy_lane(d2l.gpu(0), d2l.gpu(1)) == (d2l.gpu(0), COPY_OUT)
    x = np.ones(SHAPE, device=CPU1)
    with d2l.profiler.profile() as records:
        y = x.copyto(CPU0)
        z = y + 1
    assert [(r.name, r.worker) for r in records] == [('copyto', 'cpu(0) copy in'),
                                                     ('add', 'cpu(0) compute')]
    assert z.asnumpy().tolist() == [[2.0] * 4] * 4


def held(gate):
    """An operation that runs until `gate` opens (or fails after 10 s)."""
    def run():
        if not gate.wait(10):
            raise TimeoutError('the gate was never opened')
    return run


@pytest.mark.parametrize('device, lane', [(CPU1, COMPUTE), (CPU0, COPY_IN), (CPU1, COPY_IN)])
def test_work_on_another_lane_goes_on_while_cpu0_compute_is_held(device, lane):
    gate, done = threading.Event(), threading.Event()
    engine.push(held(gate), [], [engine.Var()], CPU0, 'held')
    engine.push(done.set, [], [engine.Var()], device, 'independent', lane)
    try:
        assert done.wait(5), f'{device} {lane} waited for the held cpu(0) compute lane'
    finally:
        gate.set()
    engine.wait_all()


def test_one_lane_runs_in_order():
    gate, log = threading.Event(), []
    engine.push(held(gate), [], [engine.Var()], CPU0, 'held')
    engine.push(lambda: log.append('after'), [], [engine.Var()], CPU0, 'queued')
    assert not log
    gate.set()
    engine.wait_all()
    assert log == ['after']


def test_a_copy_overlaps_computation_that_does_not_read_it():
    gate = threading.Event()
    source = np.ones(SHAPE, device=CPU1)
    source.wait_to_read()
    engine.push(held(gate), [], [engine.Var()], CPU0, 'held')   # cpu(0) is computing
    copied = source.copyto(CPU0)
    try:
        assert run_with_timeout(copied.asnumpy, 5).sum() == 16
    finally:
        gate.set()
    engine.wait_all()


def test_computation_that_reads_a_copy_waits_for_it():
    gate = threading.Event()
    source = np.ones(SHAPE, device=CPU1)
    engine.push(held(gate), [], [source.var], CPU1, 'slow write')
    with d2l.profiler.profile() as records:
        result = source.copyto(CPU0) * 3
        threading.Timer(0.05, gate.set).start()
    assert result.asnumpy().tolist() == [[3.0] * 4] * 4
    copy, multiply = records
    assert copy.end <= multiply.start


# -- mixing devices -------------------------------------------------------------------------------

def test_mixing_devices_says_which_inputs_and_how_to_move_them():
    with pytest.raises(ValueError) as error:
        np.ones(SHAPE) @ np.ones(SHAPE, device=CPU1)
    message = str(error.value)
    assert "'matmul'" in message and 'input 0 on cpu(0)' in message
    assert 'input 1 on cpu(1)' in message and 'copyto(d2l.cpu(0))' in message


def test_copyto_refuses_what_is_not_a_device():
    with pytest.raises(TypeError, match='Device'):
        np.ones(SHAPE).copyto('cpu1')


# -- BLAS threads shared by busy CPU devices ------------------------------------------------------

class FakeBlas:
    def __init__(self, threads):
        self.threads, self.history = threads, []

    def get_num_threads(self):
        return self.threads

    def set_num_threads(self, threads):
        self.threads = threads
        self.history.append(threads)


def shared(cores, threads):
    blas = FakeBlas(threads)
    return SharedCores(cores, controllers=[blas]), blas


@pytest.mark.parametrize('cores, threads, busy, expected', [
    (2, 2, 2, 1), (4, 4, 2, 2), (4, 4, 3, 1), (8, 8, 4, 2), (8, 3, 2, 3), (1, 1, 2, 1)])
def test_busy_devices_divide_the_threads_and_give_them_back(cores, threads, busy, expected):
    shared_cores, blas = shared(cores, threads)
    shared_cores.enter()
    assert blas.threads == threads               # one busy device keeps every thread
    for _ in range(busy - 1):
        shared_cores.enter()
    assert blas.threads == expected
    for _ in range(busy):
        shared_cores.leave()
    assert blas.threads == threads and shared_cores.busy == 0


def test_the_division_lasts_until_no_device_is_busy():
    shared_cores, blas = shared(2, 2)
    shared_cores.enter()
    shared_cores.enter()
    shared_cores.leave()                 # one device waits for its next operation
    assert blas.threads == 1             # the other's products do not get every thread
    shared_cores.enter()
    shared_cores.leave()
    shared_cores.leave()
    assert blas.threads == 2 and blas.history == [1, 2]


def test_an_unchanged_count_is_not_set_again():
    shared_cores, blas = shared(2, 2)
    for _ in range(3):
        shared_cores.enter()
        shared_cores.enter()
        shared_cores.leave()
        shared_cores.leave()
    assert blas.history == [1, 2] * 3


class FakeLoad:
    """cpu_times() of a machine where other programs keep `others` cores busy."""
    def __init__(self, others):
        self.others, self.busy, self.wall, self.calls = others, 0.0, None, 0

    def __call__(self):
        self.calls += 1
        wall = time.perf_counter()
        if self.wall is not None:
            self.busy += self.others * (wall - self.wall)
        self.wall = wall
        return blas_module.CpuTimes(self.busy, 0.0, wall)


@pytest.mark.parametrize('limit, cores, taken, busy, expected', [
    (2, 2, 0, 1, 2), (2, 2, 1, 1, 1), (2, 2, 3, 1, 1), (8, 8, 2, 1, 6), (8, 8, 2, 2, 3),
    (4, 8, 0, 1, 4), (8, 8, 0, 3, 2)])
def test_threads_that_fit_leave_the_cores_others_hold(limit, cores, taken, busy, expected):
    assert blas_module.threads_that_fit(limit, cores, taken, busy) == expected


@pytest.mark.parametrize('others, before, taken', [
    (0.0, 0, 0), (0.4, 0, 0), (0.6, 0, 1), (1.0, 0, 1), (3.5, 0, 3), (2.6, 0, 3),
    (0.4, 1, 1), (0.3, 1, 1), (0.2, 1, 0), (1.2, 3, 1), (2.3, 3, 3), (0.0, 3, 0)])
def test_cores_taken_counts_whole_cores_with_a_margin(others, before, taken):
    assert blas_module.cores_taken(others, before) == taken


def test_a_load_between_the_margins_does_not_flip_the_count():
    taken = 0
    for others in [0.9, 0.4, 0.6, 0.3, 0.7, 0.26]:      # our own threads squeeze theirs
        taken = blas_module.cores_taken(others, taken)
        assert taken == 1


def test_a_busy_core_takes_a_blas_thread_away_and_an_idle_one_gives_it_back(monkeypatch):
    monkeypatch.setattr(blas_module, 'SAMPLE_SECONDS', 0.0)     # read the load every time
    load = FakeLoad(others=1.0)
    shared_cores = SharedCores(2, controllers=[FakeBlas(2)], sample=load)
    blas = shared_cores.controllers[0]
    shared_cores.fit()                       # the first sample: no interval measured yet
    assert blas.threads == 2
    time.sleep(0.01)
    shared_cores.fit()                       # sampled again: one core was taken
    assert blas.threads == 1 and shared_cores.others == pytest.approx(1.0)
    assert shared_cores.changes == 1
    load.others = 0.0
    time.sleep(0.01)
    shared_cores.fit()
    assert blas.threads == 2 and blas.history == [1, 2]


def test_a_count_set_from_outside_is_the_new_limit():
    """`threadpool_limits(1)` around a one-thread benchmark row: the engine must not put the
    second thread back, and takes every thread again once the limit is lifted."""
    shared_cores, blas = shared(2, 2)
    shared_cores.apply()
    blas.threads = 1                              # threadpool_limits(1) enters
    shared_cores.enter()
    shared_cores.leave()
    assert blas.threads == 1 and shared_cores.limit == 1
    blas.threads = 2                              # ... and exits
    shared_cores.apply()
    assert blas.threads == 2 and shared_cores.limit == 2


def test_the_load_is_read_at_most_every_sample_interval():
    load = FakeLoad(others=0.0)
    shared_cores = SharedCores(2, controllers=[FakeBlas(2)], sample=load)
    for _ in range(1000):
        shared_cores.fit()
    assert load.calls == 1


@pytest.mark.serial                       # two timings, each disturbed by another test's load
def test_deciding_costs_far_less_than_a_small_product():
    shared_cores = SharedCores(2, controllers=[FakeBlas(2)], sample=FakeLoad(0.0))
    shared_cores.fit()
    a = numpy.ones((64, 64), numpy.float32)
    fits = products = float('inf')
    for _ in range(5):                        # best of five: the least disturbed
        start = time.perf_counter()
        for _ in range(1000):
            shared_cores.fit()
        fits = min(fits, time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(1000):
            a @ a
        products = min(products, time.perf_counter() - start)
    assert fits < products, (fits, products)


def blas_threads():
    import threadpoolctl
    return max(info['num_threads'] for info in threadpoolctl.threadpool_info()
               if info['user_api'] == 'blas')


state = []                 # division_state() as the last look saw it


def threads_seen_by_cpu1_while_cpu0_is_busy(division):
    """The BLAS thread count an operation on cpu(1) sees while cpu(0) holds a long one.

    Division is switched while both workers are idle, waiting for work: it must apply to
    the very next operations.
    """
    np.ones(2, device=CPU0).wait_to_read()
    np.ones(2, device=CPU1).wait_to_read()
    engine.wait_all()
    old = engine.set_blas_division(division)
    gate, started, seen, threads = threading.Event(), threading.Event(), threading.Event(), []
    state.clear()
    try:
        engine.push(lambda: (started.set(), held(gate)()), [], [engine.Var()], CPU0, 'busy')
        assert started.wait(5)
        engine.push(lambda: (threads.append(blas_threads()), state.append(division_state()),
                             seen.set()), [], [engine.Var()], CPU1, 'look')
        assert seen.wait(5)
    finally:
        gate.set()
        engine.wait_all()
        engine.set_blas_division(old)
    return threads[0]


def division_state():
    """What the division's count came from, read inside an operation: for a failure's
    message (on a 16-core GPU machine this test saw 4 threads where it expects 8)."""
    import threadpoolctl
    shared = engine.current().workers.cores
    libraries = [(info['filepath'].rsplit('/', 1)[-1], info['num_threads'])
                 for info in threadpoolctl.threadpool_info() if info['user_api'] == 'blas']
    return (f'busy {shared.busy}, sharing {shared.sharing}, limit {shared.limit}, taken '
            f'{shared.taken}, current {shared.current}, BLAS libraries {libraries}')


@pytest.fixture
def no_other_load(monkeypatch):
    """The engine sees no other program on the machine: its BLAS count is the division's
    alone, whatever else this machine runs meanwhile."""
    shared_cores = engine.current().workers.cores
    engine.wait_all()
    monkeypatch.setattr(shared_cores, 'sample', FakeLoad(others=0.0))
    monkeypatch.setattr(shared_cores, 'taken', 0)
    monkeypatch.setattr(shared_cores, 'last_sample', None)
    if shared_cores.limit is not None:
        shared_cores.current = None          # set it, whatever another test left in force
        shared_cores.set(shared_cores.limit)
    yield shared_cores


def test_switched_on_two_busy_cpu_devices_run_with_divided_blas_threads(no_other_load):
    before, cores = blas_threads(), engine.current().workers.cores.cores
    assert threads_seen_by_cpu1_while_cpu0_is_busy(True) == max(1, min(before, cores // 2)), (
        f'before: {before} threads; in the operation: {state[0]}')
    assert blas_threads() == before


def test_by_default_busy_devices_keep_every_blas_thread(no_other_load):
    assert engine.set_blas_division(False) is False       # the default
    before = blas_threads()
    assert threads_seen_by_cpu1_while_cpu0_is_busy(False) == before


# -- GPUs: streams per lane ------------------------------------------------------------------------

@needs_gpu
def test_gpu_copies_run_on_the_gpu_copy_streams():
    gpu = d2l.gpu(0)
    with d2l.profiler.profile() as records:
        x = np.ones(SHAPE)
        on_gpu = x.copyto(gpu)
        back = (on_gpu * 2).copyto(CPU0)
    assert back.asnumpy().tolist() == [[2.0] * 4] * 4
    workers = [r.worker for r in records]
    assert workers == ['cpu(0) compute', 'gpu(0) copy in', 'gpu(0) compute', 'gpu(0) copy out']


@needs_gpu
def test_a_gpu_copy_overlaps_a_held_cpu_and_gpu_compute_lane():
    gate, gpu = threading.Event(), d2l.gpu(0)
    source = np.ones(SHAPE, device=gpu)
    source.wait_to_read()
    engine.push(held(gate), [], [engine.Var()], gpu, 'held')
    copied = source.copyto(CPU0)
    try:
        assert run_with_timeout(copied.asnumpy, 10).sum() == 16
    finally:
        gate.set()
    engine.wait_all()



# -- the GPU paths, on a stand-in for CuPy where there is no GPU --------------------------------

FAKE_DEVICES = [CPU0, CPU1, d2l.gpu(0), d2l.gpu(1)]


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@checks(20)
@given(program=programs(len(FAKE_DEVICES)))
def test_programs_over_cpus_and_fake_gpus_match_numpy(fake_gpus, program):
    assert_same_as_numpy(program, FAKE_DEVICES)


@pytest.mark.parametrize('kind', ['threaded', 'naive'])
def test_copies_in_out_and_between_fake_gpus_use_the_right_lanes(fake_gpus, kind):
    engine.use(kind)
    host = numpy.arange(16.0).reshape(4, 4)
    gpu0, gpu1 = d2l.gpu(0), d2l.gpu(1)
    records = engine.start_recording()              # raw records: CUDA events kept
    on_gpu0 = np.array(host).copyto(gpu0) * 2
    on_gpu1 = on_gpu0.copyto(gpu1) + 1
    back = (on_gpu1 @ on_gpu1).copyto(CPU0)
    engine.stop_recording()
    expected = (host * 2 + 1) @ (host * 2 + 1)
    numpy.testing.assert_allclose(back.asnumpy(), expected)
    assert type(on_gpu1.data) is fake_cupy.FakeArray and type(back.data) is numpy.ndarray
    if kind == 'threaded':
        assert [r.worker for r in records] == [
            'cpu(0) compute', 'gpu(0) copy in', 'gpu(0) compute', 'gpu(0) copy out',
            'gpu(1) compute', 'gpu(1) compute', 'gpu(1) copy out']
        product, copy_back = records[-2], records[-1]
        assert product.events[1].waited_for_by      # the copy stream waited for the kernel
        assert copy_back.events is not None


def test_a_gpu_lane_waits_only_for_other_streams_writes(fake_gpus):
    """A kernel that reads what an earlier kernel of its own stream wrote runs after it in
    stream order: waiting for that write's event too would cost a driver call per operation.
    A lane on another stream (the copy out) still waits for it."""
    engine.use('threaded')
    x = np.ones((4,), device=d2l.gpu(0))
    y = x + 1
    y.wait_to_read()
    z = y * 2
    z.wait_to_read()
    compute = engine.current().workers.lanes[d2l.gpu(0), engine.COMPUTE].gpu.stream
    waits = [event for what, event in compute.log if what == 'wait']
    assert waits == [], 'the compute stream waited for its own events'
    numpy.testing.assert_array_equal(z.copyto(CPU0).asnumpy(), [4.0] * 4)
    copy_out = engine.current().workers.lanes[d2l.gpu(0), 'copy out'].gpu.stream
    assert [what for what, _ in copy_out.log].count('wait') >= 1


def test_fake_gpu_profiles_use_event_times_and_respect_dependencies(fake_gpus):
    x = np.ones((8, 8), device=d2l.gpu(0))
    x.wait_to_read()
    with d2l.profiler.profile() as records:
        ys = [x @ x for _ in range(3)]
        host = [y.copyto(CPU0) for y in ys]
    assert [h.asnumpy()[0, 0] for h in host] == [8.0] * 3
    assert all(r.events is None and r.start <= r.end for r in records)
    assert {r.worker for r in records} == {'gpu(0) compute', 'gpu(0) copy out'}
    assert_trace_respects_dependencies(records)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_a_conv_net_trains_the_same_on_a_fake_gpu_as_on_the_cpu(fake_gpus, hybridize):
    """Batch-innermost views (convolution, pooling, batch norm) through CuPy's names: the
    loss and every gradient match cpu(0), imperative or compiled into fused kernels."""
    x = numpy.random.default_rng(7).uniform(size=(4, 1, 8, 8)).astype('float32')
    y = numpy.array([0, 1, 2, 1])
    net = d2l.nn.HybridSequential()
    net.add(d2l.nn.Conv2D(3, kernel_size=3, padding=1, activation='relu'), d2l.nn.BatchNorm(),
            d2l.nn.MaxPool2D(2), d2l.nn.Conv2D(4, kernel_size=2), d2l.nn.Flatten(),
            d2l.nn.Dense(3))
    net.initialize(d2l.nn.init.Normal(0.5), device=[CPU0, d2l.gpu(0)])
    net.hybridize(hybridize)
    loss_fn, results = d2l.SoftmaxCrossEntropyLoss(), []
    for device in (CPU0, d2l.gpu(0)):
        with autograd.record():
            loss = loss_fn(net(np.array(x, device=device)), np.array(y, device=device)).sum()
        loss.backward()
        predicted = net(np.array(x, device=device)).asnumpy()     # compiled code, if hybridized
        results.append([loss.asnumpy(), predicted] + [p.grad(device).asnumpy()
                                           for p in net.collect_params().values()
                                           if p.grad_req != 'null'])
    for cpu, gpu in zip(*results):
        numpy.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-6)


# -- a virtual device slowed down, to stand for an unequal pair ---------------------------------

class FakeClock:
    """perf_counter and sleep of a clock that moves only when told to."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        if seconds == 0:                  # a thread yielding the GIL
            time.sleep(0)
            return
        self.slept.append(round(seconds, 9))
        self.now += seconds


class TimedOp:
    def __init__(self, clock, seconds):
        self.fn = lambda: setattr(clock, 'now', clock.now + seconds)


def test_a_slowed_device_idles_factor_minus_one_times_each_operation(monkeypatch):
    from d2lperf.engine import pace
    clock = FakeClock()
    monkeypatch.setattr(pace, 'time', clock)
    slowed, full_speed = pace.Pace(d2l.cpu(7)), pace.Pace(d2l.cpu(6))
    device_module.slow_down(d2l.cpu(7), 3)
    try:
        for _ in range(4):                      # 0.4 ms each: 0.8 ms owed after each
            slowed.run_at_speed(TimedOp(clock, 4e-4))
        full_speed.run_at_speed(TimedOp(clock, 4e-4))
    finally:
        device_module.slow_down(d2l.cpu(7), 1)
    # Owed time is paid in sleeps of a millisecond or more: after the 2nd and 4th operation.
    assert clock.slept == [1.6e-3, 1.6e-3]
    assert clock.now == pytest.approx(4 * 4e-4 * 3 + 4e-4)
    assert d2l.cpu(7) not in device_module.slowdowns


def test_a_slowed_device_computes_the_same_values():
    x = numpy.arange(12.0, dtype=numpy.float32).reshape(3, 4)
    device_module.slow_down(CPU1, 2)
    try:
        got = (np.array(x, device=CPU1) @ np.array(x.T, device=CPU1) + 1).asnumpy()
    finally:
        device_module.slow_down(CPU1, 1)
    numpy.testing.assert_array_equal(got, x @ x.T + 1)


@pytest.mark.parametrize('device, factor, message', [
    (d2l.gpu(0), 2, 'only a virtual CPU device'),
    ('cpu1', 2, 'only a virtual CPU device'),
    (d2l.cpu(1), 0.5, '1 (full speed) or more'),
    (d2l.cpu(1), float('nan'), '1 (full speed) or more'),
])
def test_slow_down_refuses_what_it_cannot_do(device, factor, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        device_module.slow_down(device, factor)


def test_an_openblas_loaded_later_gets_the_count_too(monkeypatch):
    """SciPy brings its own OpenBLAS when scikit-learn is imported after NumPy: the engine must
    set the count on it too from its next load sample, not only on the libraries it found
    first."""
    first, second = FakeBlas(2), FakeBlas(2)
    loaded = [(first,)]
    monkeypatch.setattr(blas_module, 'openblas_thread_controls', lambda: loaded[0])
    shared_cores = SharedCores(2, sample=FakeLoad(0.0))
    shared_cores.enter()
    shared_cores.enter()
    assert first.threads == 1
    loaded[0] = (first, second)
    shared_cores.last_sampled = float('-inf')          # the next operation samples the load
    shared_cores.fit()
    shared_cores.leave()
    shared_cores.leave()
    assert first.threads == 2 and second.threads == 2
    shared_cores.enter()
    shared_cores.enter()
    assert first.threads == 1 and second.threads == 1
