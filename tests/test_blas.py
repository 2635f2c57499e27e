"""BLAS threads (engine/blas.py): the spin set only where it is safe, and a fit of the thread
count that neither flips when two lanes read the load at once nor dies with its sampler."""
import os
import threading
import time
import warnings

import pytest

from conftest import run_in_subprocess
from d2lperf.engine import blas as blas_module
from d2lperf.engine.blas import SharedCores
from test_workers import FakeBlas, FakeLoad

pytestmark = pytest.mark.serial          # spins and idle threads, read from CPU time


# -- the spin of OpenBLAS's idle threads ---------------------------------------------------------

PRODUCTS_BESIDE_THE_IMPORT = """
    import threading, time
    import numpy
    products = 0
    def multiply():
        global products
        a = numpy.ones((300, 300))
        while True:
            a @ a
            products += 1
    threading.Thread(target=multiply, daemon=True).start()
    while products < 3:                   # OpenBLAS's threads are up and computing
        time.sleep(0.01)
    import d2lperf
    before = products
    time.sleep(2)
    print(products - before)
"""


def test_importing_d2lperf_leaves_the_products_of_other_threads_running(monkeypatch):
    """Restarting OpenBLAS's threads to change their spin, while another thread's product
    ran, left that product (and the import) waiting forever."""
    monkeypatch.delenv('OPENBLAS_THREAD_TIMEOUT', raising=False)
    products = int(run_in_subprocess(PRODUCTS_BESIDE_THE_IMPORT, seconds=90))
    assert products >= 10, f'{products} products of 300 × 300 in the 2 s after the import'



LOOKING_WHILE_IMPORTING = """
    import sys, threading
    import numpy
    from d2lperf.engine import blas
    importing = True
    def look():                     # what a lane does before each operation, as often as it can
        while importing:
            blas.openblas_thread_controls()
    threading.Thread(target=look, daemon=True).start()
    import scipy.special, scipy.sparse, scipy.linalg, scipy.optimize, scipy.signal, scipy.stats
    import scipy.ndimage, scipy.interpolate, scipy.spatial, scipy.integrate, scipy.io, scipy.fft
    importing = False
    print(len(blas.openblas_thread_controls()))
"""


def test_a_lane_looking_for_openblas_while_the_program_imports_never_deadlocks():
    """A lane looked for new libraries with glibc's dl_iterate_phdr, whose Python callback
    waits for the GIL under the loader's lock, while the main thread, importing an extension
    module, held the GIL and waited for that lock: a 3-rank training job hung in CI."""
    pytest.importorskip('scipy')
    assert int(run_in_subprocess(LOOKING_WHILE_IMPORTING, seconds=60)) >= 1

SPIN_CHECK = """
    import ctypes, os, subprocess, sys
    {first}
    import d2lperf, threadpoolctl
    spins = {{ctypes.CDLL(i['filepath']).openblas_thread_timeout()
              for i in threadpoolctl.threadpool_info() if i['internal_api'] == 'openblas'}}
    child = subprocess.run([sys.executable, '-c',
                            'import os; print(os.environ.get("OPENBLAS_THREAD_TIMEOUT"))'],
                           capture_output=True, text=True, check=True).stdout.strip()
    print(sorted(spins), os.environ.get('OPENBLAS_THREAD_TIMEOUT'), child)
"""


@pytest.mark.parametrize('first, chosen, expected', [
    ('', None, '[16] None None'),            # d2lperf loads NumPy: spins briefly, tells nobody
    ('import numpy', None, '[16] None None'),    # NumPy came first: its threads restarted
    ('', '8', '[8] 8 8'),                    # the user's choice, theirs to pass on
    ('import numpy', '8', '[8] 8 8')])
def test_the_spin_is_brief_whatever_came_first_and_only_for_this_process(
        first, chosen, expected, monkeypatch):
    monkeypatch.delenv('OPENBLAS_THREAD_TIMEOUT', raising=False)
    if chosen is not None:
        monkeypatch.setenv('OPENBLAS_THREAD_TIMEOUT', chosen)
    assert run_in_subprocess(SPIN_CHECK.format(first=first)).strip() == expected


IDLE_AFTER_A_PRODUCT = """
    import time
    import numpy
    a = numpy.ones((400, 400))
    a @ a
    {beside}
    import d2lperf
    burned = []
    for _ in range(7):
        a @ a
        start = time.process_time()
        time.sleep(0.3)
        burned.append(time.process_time() - start)
    print(sorted(burned)[3])
"""

SLEEPING_THREAD = 'import threading; threading.Thread(target=time.sleep, args=(5,), daemon=True).start()'


@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='threads are counted in /proc')
def test_numpy_imported_first_spins_briefly_unless_another_thread_could_be_multiplying(
        monkeypatch):
    """NumPy imported before d2lperf, as most scripts do, kept OpenBLAS's spin of a tenth of
    a second after each product (on 2 cores a LeNet step lost the second core to it). Now its
    idle threads are restarted with the brief spin, unless another thread of the process
    could be inside a product: then the spin is kept, and the CPU seconds show it."""
    monkeypatch.delenv('OPENBLAS_THREAD_TIMEOUT', raising=False)
    alone = float(run_in_subprocess(IDLE_AFTER_A_PRODUCT.format(beside=''), seconds=90))
    beside = float(run_in_subprocess(IDLE_AFTER_A_PRODUCT.format(beside=SLEEPING_THREAD),
                                     seconds=90))
    assert alone < 0.01, f'{alone:.3f} CPU seconds burned in 0.3 s after a product'
    print(f'CPU seconds burned idle in 0.3 s: {alone:.4f} restarted, {beside:.4f} kept')


# -- two lanes that read the load at once --------------------------------------------------------

class LockThatCountsArrivals:
    """The fitter's lock, telling the test each time a thread arrives at it."""
    def __init__(self, lock):
        self.lock, self.arrivals = lock, threading.Semaphore(0)

    def __enter__(self):
        self.arrivals.release()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_a_lane_that_waited_while_another_read_the_load_does_not_read_it_again():
    """Two lanes find the sample stale at once; the second, let in a few milliseconds after
    the first has read the load, would measure it over those milliseconds."""
    load = FakeLoad(others=0.0)
    shared_cores = SharedCores(2, controllers=[FakeBlas(2)], sample=load)
    held = shared_cores.lock
    shared_cores.lock = LockThatCountsArrivals(held)
    lanes = [threading.Thread(target=shared_cores.fit) for _ in range(2)]
    with held:                                    # both lanes find the sample stale ...
        for lane in lanes:
            lane.start()
        for _ in lanes:
            assert shared_cores.lock.arrivals.acquire(timeout=10)   # ... and wait for it
    for lane in lanes:
        lane.join(10)
    assert load.calls == 1


class TickedLoad:
    """cpu_times() as the OS counts them: in ticks of 10 ms, at the wall times given."""
    def __init__(self, samples):
        self.samples = iter(samples)          # (wall seconds, busy seconds of others)

    def __call__(self):
        wall, busy = next(self.samples)
        return blas_module.CpuTimes(round(busy, 2), 0.0, wall)


def test_a_load_read_over_a_few_milliseconds_is_ignored():
    """Over 5 ms a single 10 ms tick of someone else reads as two cores taken."""
    load = TickedLoad([(0.0, 0.0), (0.2, 0.0), (0.205, 0.01), (0.4, 0.01)])
    blas = FakeBlas(2)
    shared_cores = SharedCores(2, controllers=[blas], sample=load)
    for _ in range(4):
        shared_cores.last_sampled = float('-inf')     # stale each time: each fit reads
        shared_cores.fit()
    assert blas.history == [] and shared_cores.taken == 0
    assert shared_cores.others == pytest.approx(0.05)   # 10 ms over 0.2 s: kept, and small


# -- a sampler that fails ------------------------------------------------------------------------

class Refused(Exception):
    """psutil.AccessDenied, as in a container that hides /proc/stat."""


def refuse():
    raise Refused('/proc/stat')


def test_a_sampler_error_keeps_the_count_and_is_told_once(monkeypatch):
    monkeypatch.setattr(blas_module, 'SAMPLE_SECONDS', 0.0)     # read the load every time
    blas = FakeBlas(2)
    shared_cores = SharedCores(2, controllers=[blas], sample=refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(5):
            shared_cores.fit()
    assert blas.threads == 2 and blas.history == []
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert 'Refused' in str(caught[0].message) and '/proc/stat' in str(caught[0].message)


def test_a_sampler_error_is_read_again_only_every_sample_interval():
    calls = []
    shared_cores = SharedCores(2, controllers=[FakeBlas(2)],
                               sample=lambda: calls.append(1) or refuse())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for _ in range(100):
            shared_cores.fit()
    assert len(calls) == 1


OPERATIONS_WITH_A_FAILING_SAMPLER = """
    import warnings
    warnings.simplefilter('always')
    import d2lperf as d2l
    from d2lperf import engine, np
    from d2lperf.engine import blas

    def refuse():
        raise PermissionError('psutil.AccessDenied: /proc/stat')

    blas.cpu_times = refuse
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        engine.use('threaded')                    # its workers sample with `refuse`
        engine.set_blas_division(True)
        xs = [np.ones((200, 200), device=d2l.cpu(i)) for i in (0, 1)]
        for _ in range(20):
            xs = [x @ x / 200 for x in xs]
        print([float(x.sum().item()) for x in xs])
        engine.wait_all()
    print(sum('could not read' in str(w.message) for w in caught))
"""


def test_operations_on_two_busy_devices_complete_when_the_sampler_fails(monkeypatch):
    """The sampler ran in a lane's thread after it had taken an operation from its queue:
    an error there ended the thread, and the operation never completed."""
    out = run_in_subprocess(OPERATIONS_WITH_A_FAILING_SAMPLER, seconds=60).split('\n')
    assert out[0] == '[40000.0, 40000.0]' and out[1] == '1', out


# -- measured: two busy lanes on this machine, asserting only what holds under any load -----

def test_two_busy_lanes_never_count_more_cores_taken_than_the_machine_has(monkeypatch):
    """Loads read over a few milliseconds counted up to 80 cores taken on a 2-core machine,
    and flipped the thread count several times a minute."""
    import d2lperf as d2l
    from d2lperf import engine, np
    counted = []
    monkeypatch.setattr(blas_module, 'cores_taken',
                        lambda *args: counted.append(cores_taken(*args)) or counted[-1])
    cores = engine.current().workers.cores
    changes, deadline = cores.changes, time.perf_counter() + 3
    xs = [np.ones((300, 300), device=d2l.cpu(i)) for i in (0, 1)]
    while time.perf_counter() < deadline:
        for _ in range(20):
            xs = [x @ x / 300 for x in xs]
        engine.wait_all()
    print(f'{cores.changes - changes} changes of the count in 3 s, cores taken {counted}')
    assert counted and max(counted) <= os.cpu_count(), counted   # the CPUs the OS counts


cores_taken = blas_module.cores_taken
