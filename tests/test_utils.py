"""Tests of d2lperf.utils: timers read a fake clock, so no test depends on real time."""
import pytest

import d2lperf as d2l
from d2lperf import np, utils


@pytest.fixture
def clock(monkeypatch):
    """Make time.perf_counter return 10, 11.5, 13, 16.25, ... as the test asks for them."""
    ticks = iter([10.0, 11.5, 13.0, 16.25, 20.0, 20.5])
    monkeypatch.setattr(utils.time, 'perf_counter', lambda: next(ticks))


def test_timer_records_each_interval(clock):
    timer = d2l.Timer()                          # starts at 10
    assert timer.stop() == 1.5
    timer.start()                                # 13
    assert timer.stop() == 3.25
    assert timer.times == [1.5, 3.25]
    assert timer.sum() == 4.75 and timer.avg() == 2.375
    assert timer.cumsum() == [1.5, 4.75]


def test_benchmark_prints_its_description_and_seconds(clock, capsys):
    with d2l.Benchmark('Matrix product') as bench:
        pass
    assert capsys.readouterr().out == 'Matrix product: 1.5000 sec\n'
    assert bench.seconds == 1.5
    with d2l.Benchmark():
        pass
    assert capsys.readouterr().out == 'Done: 3.2500 sec\n'


def test_benchmark_measures_real_time_too(capsys):
    with d2l.Benchmark('sum') as bench:
        np.ones((10,)).sum().wait_to_read()
    assert bench.seconds >= 0
    assert capsys.readouterr().out.startswith('sum: ')


@pytest.mark.parametrize('value, quick', [('1', True), ('yes', True), ('0', False), ('', False),
                                          ('false', False), ('False', False), (None, False)])
def test_workload_follows_d2lperf_quick(monkeypatch, value, quick):
    if value is None:
        monkeypatch.delenv('D2LPERF_QUICK', raising=False)
    else:
        monkeypatch.setenv('D2LPERF_QUICK', value)
    assert d2l.quick_mode() is quick
    assert d2l.workload(full=1000, quick=10) == (10 if quick else 1000)


def test_accumulator_sums_numbers_and_arrays():
    acc = d2l.Accumulator(2)
    acc.add(1, 2.5)
    acc.add(np.array(3.0), np.ones(()).sum())
    assert (acc[0], acc[1]) == (4.0, 3.5)
    acc.reset()
    assert acc.data == [0.0, 0.0]
