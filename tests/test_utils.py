"""Tests of d2lperf.utils: timers read a fake clock where they can; real-time checks use loose
bounds only (a sleep lasts at least its time)."""
import time

import pytest

import d2lperf as d2l
from d2lperf import engine, np, utils


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
    outer = d2l.Timer()
    with d2l.Benchmark('sleep') as bench:
        done = engine.Var()
        engine.push(lambda: time.sleep(0.05), [], [done], d2l.cpu(), 'sleep')
        engine.wait_for(done)                  # the block includes the work it waited for
    total = outer.stop()
    assert 0.05 <= bench.seconds <= total
    assert capsys.readouterr().out == f'sleep: {bench.seconds:.4f} sec\n'


def test_median_seconds_warms_up_then_times_batches_of_calls():
    calls, times = [], iter([0.5, 1.0, 3.0, 2.0, 7.0])

    def fake_clock(run, count):
        for _ in range(count):
            run()
        return next(times) * count
    seconds = utils.median_seconds(lambda: calls.append(1), repeats=3, min_seconds=1.0,
                                   time_calls=fake_clock)
    # warm-up (1 call), 1 call measured 0.5 s < 1 s, 2 calls reach 1 s; then 3 batches of 2
    assert len(calls) == 1 + 1 + 2 + 3 * 2
    assert seconds == 3.0                         # the median of 3.0, 2.0 and 7.0 per call


def test_median_seconds_times_a_dict_round_robin():
    order = []
    medians = utils.median_seconds({'a': lambda: order.append('a'),
                                    'b': lambda: order.append('b')}, repeats=2, min_seconds=0)
    assert set(medians) == {'a', 'b'} and all(t >= 0 for t in medians.values())
    assert order[-4:] == ['a', 'b', 'a', 'b']     # after each one's warm-up and calibration


def test_median_seconds_on_the_real_clock():
    seconds = utils.median_seconds(lambda: time.sleep(0.002), repeats=3, min_seconds=0)
    assert 0.002 <= seconds < 1.0


def test_atomic_write_replaces_whole_files_or_leaves_the_old_one(tmp_path):
    path = tmp_path / 'deep' / 'file.bin'
    utils.atomic_write(path, lambda f: f.write(b'first'))
    assert path.read_bytes() == b'first'

    def half_then_crash(file):
        file.write(b'half')
        raise OSError('disk full')
    with pytest.raises(OSError, match='disk full'):
        utils.atomic_write(path, half_then_crash)
    assert path.read_bytes() == b'first'
    assert sorted(p.name for p in path.parent.iterdir()) == ['file.bin']    # no leftovers
    utils.atomic_write(str(path), lambda f: f.write(b'second'))
    assert path.read_bytes() == b'second'


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
