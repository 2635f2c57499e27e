"""Tests of the engine's state, each from a clean one: importing d2lperf leaves the process as
it was (no engine, no thread, the same environment), the first use builds one engine, a
failure is remembered once and for good, each runner keeps its own device's pace, and without
OpenBLAS large operations still run in pieces over the free cores."""
import types

import pytest

import d2lperf as d2l
from d2lperf import engine
from d2lperf.engine import blas as blas_module, pieces
from d2lperf.engine.blas import SharedCores
from conftest import run_in_subprocess
from test_workers import FakeBlas, FakeLoad

pytestmark = pytest.mark.usefixtures('fresh_engine')


# -- a fresh process -------------------------------------------------------------------------


@pytest.mark.parametrize('chosen', [None, '8'])
def test_importing_d2lperf_leaves_the_environment_as_it_was(monkeypatch, chosen):
    monkeypatch.delenv('OPENBLAS_THREAD_TIMEOUT', raising=False)
    if chosen is not None:
        monkeypatch.setenv('OPENBLAS_THREAD_TIMEOUT', chosen)
    out = run_in_subprocess("""
        import os
        before = dict(os.environ)
        import d2lperf
        print(dict(os.environ) == before)
    """)
    assert out.strip() == 'True'


def test_importing_d2lperf_builds_no_engine_and_starts_no_thread():
    out = run_in_subprocess("""
        import threading
        import d2lperf as d2l
        from d2lperf.engine import tracking
        print(d2l.engine._engine, threading.active_count(), tracking.an_operation_failed)
        (d2l.np.ones(2) + 1).wait_to_read()
        print(type(d2l.engine._engine).__name__, threading.active_count() > 1)
    """)
    assert out.split('\n')[:2] == ['None 1 False', 'ThreadedEngine True']


def test_a_failure_is_remembered_for_good_and_inherited():
    """Remembered process-wide, as the variables are: it outlives a switch of engines."""
    out = run_in_subprocess("""
        import d2lperf as d2l
        from d2lperf import engine
        from d2lperf.engine import tracking
        failed, after = engine.Var(), engine.Var()
        engine.push(lambda: 1 / 0, [], [failed], d2l.cpu(), 'boom')
        engine.push(lambda: None, [failed], [after], d2l.cpu(), 'after')
        try:
            engine.wait_for(after)
        except engine.OperationError as error:
            print(error.op_name)
        print(tracking.an_operation_failed)
        try:
            engine.wait_all()
        except engine.OperationError:
            pass
        engine.use('naive')
        try:
            engine.push(lambda: None, [failed], [engine.Var()], d2l.cpu(), 'naive after')
        except engine.OperationError as error:
            print(error.op_name)
    """)
    assert out.split() == ['boom', 'True', 'boom']


def test_threads_that_use_the_engine_first_at_once_build_one():
    out = run_in_subprocess("""
        import threading
        from d2lperf import engine
        start, seen = threading.Barrier(4), []

        def first_use():
            start.wait()
            seen.append(engine.current())
        threads = [threading.Thread(target=first_use) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(len({id(e) for e in seen}))
    """)
    assert out.strip() == '1'


# -- one owner for each piece of state -------------------------------------------------------

def test_each_engine_keeps_its_own_devices_pace():
    slow, var = d2l.cpu(5), engine.Var()
    d2l.device.slow_down(slow, 2)
    try:
        engine.push(lambda: sum(range(20_000)), [], [var], slow, 'slowed')
        engine.wait_for(var)
        lane = engine.current().workers.lanes[slow, engine.COMPUTE]
        assert lane.pace.device == slow and lane.pace.owed != 0.0
        naive = engine.use('naive')
        engine.push(lambda: None, [], [engine.Var()], slow, 'naive')
        assert naive.run_now.__self__.paces[slow].owed != lane.pace.owed
    finally:
        d2l.device.slow_down(slow, 1)


def test_a_lane_run_by_another_thread_answers_none_ran():
    var = engine.Var()
    engine.push(lambda: None, [], [var], d2l.cpu(0), 'start the lane')
    engine.wait_for(var)
    lane = engine.current().workers.lanes[d2l.cpu(0), engine.COMPUTE]
    with lane.runner:
        assert lane.run_queued() == 0


# -- BLAS without OpenBLAS (MKL, Accelerate) -------------------------------------------------

def test_without_openblas_the_count_still_fits_the_free_cores(monkeypatch):
    monkeypatch.setattr(blas_module, 'openblas_thread_controls', lambda: ())
    cores = SharedCores(4, sample=FakeLoad(0.0))
    cores.apply()
    assert cores.get() is None
    assert cores.threads_in_force() == 4
    assert cores.changes == 0                   # nothing told BLAS anything


def test_without_openblas_large_operations_still_run_in_pieces(monkeypatch):
    monkeypatch.setattr(blas_module, 'openblas_thread_controls', lambda: ())
    cores = SharedCores(4, sample=FakeLoad(0.0))
    monkeypatch.setattr(engine.current().workers, 'cores', cores)
    cores.apply()
    assert pieces.count(2 * pieces.SPLIT_BYTES) == 4
    cores.add_device(), cores.add_device(), cores.enable(True)
    cores.enter(), cores.enter()                        # two devices busy: the cores divided
    assert pieces.count(2 * pieces.SPLIT_BYTES) == 2
    cores.leave(), cores.leave()


def test_fewer_threads_set_from_outside_still_mean_fewer_pieces():
    blas = FakeBlas(4)
    cores = SharedCores(4, controllers=[blas])
    cores.apply()
    blas.threads = 1                            # threadpool_limits(1) enters
    assert cores.threads_in_force() == 1


# -- finding OpenBLAS ------------------------------------------------------------------------

@pytest.mark.parametrize('names, found', [
    (['openblas_get_num_threads', 'openblas_set_num_threads'], 'openblas_get_num_threads'),
    (['scipy_openblas_get_num_threads64_', 'scipy_openblas_set_num_threads64_'],
     'scipy_openblas_get_num_threads64_'),
    (['mkl_get_max_threads', 'mkl_set_num_threads'], None)])
def test_openblas_is_found_by_one_rule_under_every_builds_names(names, found):
    library = types.SimpleNamespace(**{name: name for name in names})
    functions = blas_module.openblas_thread_functions(library)
    assert (functions[0] if functions else None) == found


def test_openblas_is_looked_for_again_only_once_a_module_was_imported(monkeypatch):
    searches, loaded = [], [1]
    monkeypatch.setattr(blas_module, '_controls', None)
    monkeypatch.setattr(blas_module, 'modules_imported', lambda: loaded[0])
    monkeypatch.setattr(blas_module, 'find_openblas', lambda: searches.append(1) or [])
    for _ in range(3):
        blas_module.openblas_thread_controls()
    loaded[0] = 2                                       # SciPy brings its own OpenBLAS
    blas_module.openblas_thread_controls()
    assert len(searches) == 2


def test_an_openblas_that_comes_with_an_import_is_found():
    """SciPy's wheels bring an OpenBLAS of their own, beside NumPy's."""
    pytest.importorskip('scipy')
    out = run_in_subprocess("""
        from d2lperf.engine import blas
        before = len(blas.openblas_thread_controls())
        import scipy.linalg
        print(before, len(blas.openblas_thread_controls()))
    """)
    before, after = map(int, out.split())
    assert before >= 1 and after == before + 1


def test_the_naive_engine_runs_an_operation_on_one_thread():
    assert engine.use('naive').threads_per_operation() == 1
