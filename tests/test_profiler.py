"""The profiler: records of what ran where and when, the Chrome trace, the timeline.

It reads the engine's own trace, so it is tested through real engine operations; the
arithmetic (busy time, overlap, GPU event alignment) is also tested on records made by hand.
"""
import json
import os
import threading
import types

import matplotlib
import pytest

import d2lperf as d2l
from d2lperf import engine, np, npx, profiler

matplotlib.use('Agg')
pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)


def fake(name, worker, start, end, lane='compute', device=CPU0, reads=(), writes=()):
    """A record as the engine would make one, without running anything."""
    return types.SimpleNamespace(name=name, worker=worker, start=start, end=end, lane=lane,
                                 device=device, reads=list(reads), writes=list(writes),
                                 events=None)


# -- recording ---------------------------------------------------------------------------------

def test_start_and_stop_record_every_operation_with_its_worker_and_times():
    x = np.ones((3, 3), device=CPU1)
    x.wait_to_read()
    profiler.start()
    y = x * 2
    z = y.copyto(CPU0) + 1
    records = profiler.stop()
    assert [(r.name, str(r.device), r.worker) for r in records] == [
        ('multiply', 'cpu(1)', 'cpu(1) compute'), ('copyto', 'cpu(0)', 'cpu(0) copy in'),
        ('add', 'cpu(0)', 'cpu(0) compute')]
    assert all(r.start <= r.end for r in records)
    assert records[0].end <= records[1].start <= records[1].end <= records[2].start
    assert z.asnumpy().tolist() == [[3.0] * 3] * 3


def test_the_context_manager_fills_its_list_and_stop_waits_for_the_work():
    gate = threading.Event()
    with profiler.profile() as records:
        engine.push(gate.wait, [], [engine.Var()], CPU0, 'slow')
        threading.Timer(0.05, gate.set).start()
    assert [r.name for r in records] == ['slow']
    assert records[0].end - records[0].start >= 0.04


def test_nothing_is_recorded_when_the_profiler_is_off():
    with profiler.profile():
        np.ones(2)
    assert engine.current().recording is None
    x = np.ones(2) + 1
    x.wait_to_read()
    with profiler.profile() as records:
        pass
    assert records == []


def test_the_profiler_records_through_the_engine_trace():
    records = profiler.start()
    try:
        assert engine.current().recording is records
        np.ones(2).wait_to_read()
    finally:
        assert profiler.stop() == records
    assert all(isinstance(r, engine.OpRecord) for r in records) and len(records) == 1


def test_the_naive_engine_is_profiled_on_the_caller():
    engine.use('naive')
    with profiler.profile() as records:
        (np.ones(2, device=CPU1) + 1).asnumpy()
    assert {r.worker for r in records} == {'caller'}
    assert all(r.start <= r.end for r in records)


def test_reading_a_profile_before_recording_one_says_what_to_do(monkeypatch):
    monkeypatch.setattr(profiler.records, '_last', [])
    with pytest.raises(ValueError, match='profiler.start'):
        profiler.plot()


# -- reading a profile -------------------------------------------------------------------------

def test_busy_time_merges_overlapping_intervals():
    assert profiler.busy_time([(0, 2), (1, 3), (5, 6)]) == 4
    assert profiler.busy_time([]) == 0


def test_overlap_is_the_time_both_workers_were_busy():
    records = [fake('a', 'cpu(0) compute', 0, 4), fake('b', 'cpu(1) compute', 1, 2),
               fake('c', 'cpu(1) compute', 3, 6)]
    assert profiler.overlap(records, 'cpu(0) compute', 'cpu(1) compute') == 2
    assert profiler.overlap(records, 'cpu(0) compute', 'nobody') == 0


def test_summary_counts_operations_and_busy_time_per_worker(capsys):
    records = [fake('a', 'w0', 0, 1), fake('b', 'w0', 1, 2), fake('c', 'w1', 0, 4)]
    table = profiler.summary(records)
    assert table['span'] == 4 and table['workers'] == {'w0': (2, 2), 'w1': (1, 4)}
    assert 'w0' in capsys.readouterr().out


# -- the Chrome trace --------------------------------------------------------------------------

def test_the_trace_json_has_what_perfetto_needs(tmp_path):
    a = np.ones((4, 4), device=CPU1)
    with profiler.profile() as records:
        b = (a @ a).copyto(CPU0)
        c = b * 2
    path = profiler.dump(tmp_path / 'trace.json', records)
    trace = json.loads(path.read_text())
    events = trace['traceEvents']
    complete = [e for e in events if e['ph'] == 'X']
    assert [e['name'] for e in complete] == ['matmul', 'copyto', 'multiply']
    for e in complete:
        assert {'name', 'cat', 'ph', 'ts', 'dur', 'pid', 'tid', 'args'} <= set(e)
        assert e['ts'] >= 0 and e['dur'] >= 0
        assert isinstance(e['pid'], int) and isinstance(e['tid'], int)
    assert min(e['ts'] for e in complete) == 0
    names = {(e['name'], e['args']['name']) for e in events if e['ph'] == 'M'}
    assert {('process_name', 'cpu(0)'), ('process_name', 'cpu(1)'),
            ('thread_name', 'cpu(1) compute'), ('thread_name', 'cpu(0) copy in'),
            ('thread_name', 'cpu(0) compute')} == names
    threads = {(e['pid'], e['tid']) for e in complete}
    assert len(threads) == 3                      # one track per worker
    assert complete[1]['args']['reads'] == records[0].writes
    assert c.asnumpy().sum() == 4 * 4 * 4 * 2


def test_dump_without_records_writes_the_last_profile(tmp_path):
    with profiler.profile():
        np.ones(2).wait_to_read()
    trace = json.loads(profiler.dump(tmp_path / 't.json').read_text())
    assert [e['name'] for e in trace['traceEvents'] if e['ph'] == 'X'] == ['ones']


def test_dump_replaces_a_trace_whole_or_leaves_the_old_one(tmp_path, monkeypatch):
    with profiler.profile():
        np.ones(2).wait_to_read()
    path = profiler.dump(tmp_path / 'trace.json')
    first = path.read_text()

    def disk_fails(descriptor):
        raise OSError('disk full')
    with profiler.profile():
        (np.ones(2) * 3).wait_to_read()
    monkeypatch.setattr(os, 'fsync', disk_fails)
    with pytest.raises(OSError, match='disk full'):
        profiler.dump(path)
    assert path.read_text() == first and json.loads(first)['traceEvents']
    assert [p.name for p in tmp_path.iterdir()] == ['trace.json']          # no leftovers


# -- the timeline ------------------------------------------------------------------------------

def test_plot_draws_one_lane_per_worker():
    x, y = np.ones((50, 50)), np.ones((50, 50), device=CPU1)
    npx.waitall()
    with profiler.profile() as records:
        (x @ x).wait_to_read()
        (y @ y).copyto(CPU0).wait_to_read()
    ax = profiler.plot(records, label_ops=True)
    labels = sorted(t.get_text() for t in ax.get_yticklabels())
    assert labels == ['cpu(0) compute', 'cpu(0) copy in', 'cpu(1) compute']
    assert len(ax.collections) == 3
    assert ax.get_xlabel() == 'time (ms)'


def test_plot_highlights_the_chosen_operations_and_names_them():
    records = [fake('a', 'cpu(0) compute', 0.0, 1e-3), fake('ring b', 'cpu(0) compute', 1e-3, 2e-3),
               fake('ring c', 'cpu(1) copy in', 0.0, 1e-3, lane='copy in')]
    ax = profiler.plot(records, highlight=('summing', lambda r: r.name.startswith('ring ')))
    colors = [tuple(c) for collection in ax.collections for c in collection.get_facecolors()]
    assert len(colors) == 3
    red = tuple(matplotlib.colors.to_rgba(profiler.timeline.HIGHLIGHT))
    assert colors.count(red) == 2
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ['compute', 'copy in', 'summing']


# -- GPU kernel times from CUDA events ------------------------------------------------------------

class Clock:
    """Fake CUDA events: each knows when (device time, seconds) it happened."""

    def __init__(self, t):
        self.t = t


def elapsed_ms(first, second):
    return (second.t - first.t) * 1e3


def test_gpu_records_get_event_times_placed_after_their_launch():
    gpu = d2l.gpu(0)
    # Kernels ran at device times 10-12 and 13-14 (device clock), launched at host times
    # 100 and 100.5: the first kernel started as soon as it was launched.
    first = fake('a', 'gpu(0) compute', 100.0, 100.1, device=gpu)
    second = fake('b', 'gpu(0) compute', 100.5, 100.6, device=gpu)
    first.events, second.events = (Clock(10), Clock(12)), (Clock(13), Clock(14))
    cpu = fake('c', 'cpu(0) compute', 101.0, 102.0)
    profiler.use_device_times([first, second, cpu], elapsed_ms)
    assert (first.start, first.end) == pytest.approx((100.0, 102.0))
    assert (second.start, second.end) == pytest.approx((103.0, 104.0))
    assert (cpu.start, cpu.end) == (101.0, 102.0) and first.events is None


def test_the_alignment_never_starts_a_kernel_before_its_launch():
    gpu = d2l.gpu(0)
    records = []
    for launch, (begin, end) in [(5.0, (0, 1)), (5.2, (1, 3)), (9.0, (3.5, 4))]:
        r = fake('k', 'gpu(0) compute', launch, launch, device=gpu)
        r.events = (Clock(begin), Clock(end))
        records.append(r)
    profiler.use_device_times(records, elapsed_ms)
    launches = [5.0, 5.2, 9.0]
    assert all(r.start >= launch - 1e-12 for r, launch in zip(records, launches))
    assert any(r.start == pytest.approx(launch) for r, launch in zip(records, launches))
    assert [r.end - r.start for r in records] == pytest.approx([1, 2, 0.5])


@pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')
def test_gpu_operations_are_timed_by_cuda_events():
    gpu = d2l.gpu(0)
    x = np.ones((2000, 2000), device=gpu)
    x.wait_to_read()
    with profiler.profile() as records:
        ys = [x @ x for _ in range(3)]
        host = ys[-1].copyto(CPU0)
    assert host.asnumpy()[0, 0] == 2000
    assert [r.worker for r in records] == ['gpu(0) compute'] * 3 + ['gpu(0) copy out']
    assert all(r.events is None and r.start <= r.end for r in records)
    products = records[:3]
    assert all(a.end <= b.start + 1e-6 for a, b in zip(products, products[1:]))
    assert records[3].start >= products[2].end - 1e-6
