"""Fixtures shared by the unit tests of d2lperf's core.

Tests of the engine leave it as they found it: the threaded engine, no bound on operations
in flight, no error waiting to surface at the next `wait_all`. `engine_kind` runs a test once
under each engine; `fake_gpus` gives a test two GPUs backed by NumPy (tests/fakes/cupy.py).

`--chapter=NAME` runs one chapter's tests: the modules marked `pytest.mark.chapter('NAME')`
(a module's `pytestmark`), the checks of its Markdown and notebook pair, and, under
`--nbval-lax`, its notebook; so an author who edits a chapter reruns what it rests on.
"""
import gc
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest

import d2lperf as d2l
from d2lperf import device as device_module, engine
from d2lperf.ops import cudnn, random as random_module
from fakes import cudnn as fake_cudnn, cupy as fake_cupy

CHAPTERS = pathlib.Path(__file__).resolve().parents[1] / 'chapters'


def pytest_addoption(parser):
    parser.addoption('--chapter', metavar='NAME',
                     help="only one chapter's tests (chapters/NAME.md): the unit tests marked "
                          'chapter(NAME), and its notebook under --nbval-lax')


def pytest_configure(config):
    """Check the chapter's name, and add its notebook to a notebook run."""
    chapter = config.getoption('chapter')
    if chapter is None:
        return
    if not (CHAPTERS / f'{chapter}.md').exists():
        names = sorted(path.stem for path in CHAPTERS.glob('*.md'))
        raise pytest.UsageError(f'--chapter {chapter}: no chapters/{chapter}.md; the chapters '
                                f'are {names}')
    if config.getoption('nbval', False) or config.getoption('nbval_lax', False):
        config.args.append(str(CHAPTERS / f'{chapter}.ipynb'))


def pytest_collection_finish(session):
    """What the imports and the collection made, out of the collector's sight (`gc.freeze`):
    the tests that count memory collect garbage after each step, and every collection, theirs
    and Python's own, then reads what the tests made rather than the whole process's objects."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    chapter = config.getoption('chapter')
    if chapter is None:
        return
    kept = [item for item in items if belongs_to(item, chapter)]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


def belongs_to(item, chapter):
    """Marked for the chapter, a cell of its notebook, or a check run once a chapter (a
    parameter named after it, as tests/test_chapters.py names them)."""
    marked = {name for mark in item.iter_markers('chapter') for name in mark.args}
    callspec = getattr(item, 'callspec', None)
    return (chapter in marked or item.path.name == f'{chapter}.ipynb'
            or (callspec is not None and callspec.id == chapter))


def drain_engine():
    """Finish every pushed operation and drop errors nobody waited for."""
    try:
        engine.wait_all()
    except engine.OperationError:
        pass


@pytest.fixture
def fresh_engine():
    """Run a test on a settled threaded engine and leave one behind."""
    drain_engine()
    yield
    drain_engine()
    engine.set_max_in_flight(None)
    if not isinstance(engine.current(), engine.ThreadedEngine):
        engine.use('threaded')


@pytest.fixture(params=['threaded', 'naive'])
def engine_kind(request, fresh_engine):
    """Run the test under the threaded engine and under the naive one."""
    engine.use(request.param)
    yield request.param
    drain_engine()
    engine.use('threaded')


def run_with_timeout(fn, seconds):
    """Call `fn` on a thread; fail (rather than hang the suite) if it is not done in time."""
    outcome = {}

    def target():
        try:
            outcome['value'] = fn()
        except BaseException as error:        # noqa: BLE001 - handed back to the test
            outcome['error'] = error
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f'still running after {seconds} s: a deadlock in the engine?')
    if 'error' in outcome:
        raise outcome['error']
    return outcome.get('value')


def run_in_subprocess(code, seconds=30):
    """Run `code` in a fresh interpreter: for programs that may deadlock the engine, which
    would otherwise leave this process's engine stuck for every later test."""
    try:
        done = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], timeout=seconds,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f'the program did not finish in {seconds} s (deadlock):\n{code}')
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two 'GPUs' backed by NumPy (tests/fakes/cupy.py), on a fresh engine, for one test."""
    if d2l.num_gpus():
        pytest.skip('a real GPU is here: the tests marked needs_gpu run instead')
    monkeypatch.setitem(sys.modules, 'cupy', fake_cupy.make_module(gpus=2))
    monkeypatch.setattr(random_module, 'generators', {})
    device_module.num_gpus.cache_clear()
    engine.use('threaded')            # workers made here (with fake streams) end with the test
    yield
    engine.use('threaded')
    device_module.num_gpus.cache_clear()


@pytest.fixture
def frontend(fake_gpus, monkeypatch):
    """The fake cuDNN frontend behind `import cudnn` (tests/fakes/cudnn.py), with d2lperf's
    cuDNN state fresh and neither TF32 switch set, for one test on the fake GPUs."""
    fake = fake_cudnn.make_module()
    monkeypatch.setitem(sys.modules, 'cudnn', fake)
    monkeypatch.setattr(cudnn, 'state', cudnn.State())
    monkeypatch.delenv('CUPY_TF32', raising=False)
    monkeypatch.delenv('NVIDIA_TF32_OVERRIDE', raising=False)
    return fake
