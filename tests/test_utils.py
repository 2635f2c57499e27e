"""Tests of d2lperf.utils: timers read a fake clock where they can; real-time checks use loose
bounds only (a sleep lasts at least its time)."""
import re
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


# -- Animator ----------------------------------------------------------------------------------

class FakeHandle:
    def __init__(self, shown):
        self.shown = shown

    def update(self, image):
        self.shown.append(('update', image))


@pytest.fixture
def notebook(monkeypatch):
    """Pretend to run in IPython; collect what the Animator displays."""
    IPython = pytest.importorskip('IPython', reason='the Animator displays through IPython')
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython, 'get_ipython', lambda: object())

    def display(image, display_id=False):
        assert display_id is True
        shown.append(('display', image))
        return FakeHandle(shown)
    monkeypatch.setattr(IPython.display, 'display', display)
    return shown


def test_animator_keeps_every_point_and_draws_each_line():
    animator = d2l.Animator(xlabel='epoch', legend=['train', 'test'], xlim=[1, 3])
    for epoch in (1, 2, 3):
        animator.add(epoch, (0.1 * epoch, np.array(0.2 * epoch)))
    assert animator.X == [[1, 2, 3]] * 2 and animator.Y[1] == pytest.approx([0.2, 0.4, 0.6])
    lines = animator.axes[0].get_lines()
    assert [list(line.get_xdata()) for line in lines] == [[1, 2, 3]] * 2
    assert list(lines[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3])
    assert animator.axes[0].get_xlabel() == 'epoch' and animator.axes[0].get_xlim() == (1, 3)
    assert [t.get_text() for t in animator.axes[0].get_legend().get_texts()] == ['train', 'test']


def test_animator_skips_missing_points_and_refuses_a_changed_line_count():
    animator = d2l.Animator()
    animator.add(1, (0.5, None))
    animator.add([2, 2], [0.4, 0.3])
    assert animator.X == [[1, 2], [2]] and animator.Y == [[0.5, 0.4], [0.3]]
    with pytest.raises(ValueError, match='2 lines; add.. got 3 x and 3 y'):
        animator.add(3, (1, 2, 3))


def test_animator_displays_once_then_updates_that_display(notebook):
    animator = d2l.Animator()
    for epoch in range(3):
        animator.add(epoch, 0.5)
    assert [kind for kind, _ in notebook] == ['display', 'update', 'update']
    from IPython.display import SVG
    final = texts(SVG(animator.svg()).data)
    assert texts(notebook[-1][1].data) == final != texts(notebook[0][1].data)


def texts(svg):
    """The texts matplotlib draws (tick labels, legend), which it names in SVG comments."""
    return re.findall(r'<!-- (.*?) -->', svg)


def test_animator_leaves_one_final_figure_in_an_executed_notebook():
    nbformat = pytest.importorskip('nbformat')
    nbclient = pytest.importorskip('nbclient')
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        'import d2lperf as d2l\n'
        'animator = d2l.Animator(xlabel="epoch", legend=["acc"])\n'
        'for epoch in (1, 2, 3):\n'
        '    animator.add(epoch, 0.1 * epoch)\n'
        'print("trained")',
        'from IPython.display import SVG\n'
        'print(SVG(animator.svg()).data, end="")')])
    nbclient.NotebookClient(notebook, timeout=60, kernel_name='python3').execute()
    outputs, final = notebook.cells[0].outputs, notebook.cells[1].outputs[0].text
    images = [o for o in outputs if o.output_type == 'display_data']
    assert len(images) == 1
    assert '3.0' in texts(final) and texts(images[0].data['image/svg+xml']) == texts(final)
    assert [o.get('text') for o in outputs if o.output_type == 'stream'] == ['trained\n']


def test_animator_outside_a_notebook_displays_nothing(capsys):
    d2l.Animator().add(1, 0.5)
    assert capsys.readouterr().out == ''
