"""Tests of d2lperf.engine.freed_memory: a large block freed by one step is reused by the next,
without a page fault per page (counted by the kernel, not timed); and the setting is made
once, when the engine starts, never by importing d2lperf."""
import os
import pathlib
import resource
import subprocess
import sys
import threading

import numpy
import pytest

from d2lperf.engine import freed_memory

MIB = 2**20
# Under 64 MiB: glibc's heap for a thread of its own is at most that, and a block as large is
# mapped afresh each time on such a thread (see the module's docstring and the test below).
BLOCK = 48 * MIB
ROOT = pathlib.Path(__file__).resolve().parents[1]


def faults_while(work):
    """Minor page faults (a page the kernel had to map in) of the calling thread during work()."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def one_step():
    block = numpy.empty(BLOCK, numpy.uint8)
    block.fill(1)                # touch every page
    del block


@pytest.mark.skipif(not freed_memory.keep_freed_memory(), reason='needs glibc (mallopt)')
def test_a_freed_block_is_reused_without_page_faults_on_any_thread():
    pages = BLOCK // resource.getpagesize()
    counts = []

    def steps():
        one_step()                              # the first step maps its pages in
        counts.append(faults_while(one_step))   # the second reuses them
    worker = threading.Thread(target=steps)     # as the engine's workers allocate
    worker.start()
    worker.join()
    steps()
    assert all(count < pages / 100 for count in counts), (counts, pages)


def test_asking_twice_gives_the_same_answer():
    assert freed_memory.keep_freed_memory() == freed_memory.keep_freed_memory()


@pytest.mark.skipif(not freed_memory.keep_freed_memory(), reason='needs glibc (mallopt)')
def test_while_measuring_freed_blocks_go_back_and_after_it_they_are_kept_again():
    pages = BLOCK // resource.getpagesize()
    one_step()
    with freed_memory.returning_freed_memory():
        returned = faults_while(one_step)         # unmapped when freed: every page is new
    one_step()
    kept = faults_while(one_step)
    # A fault a page, or one a 2 MiB huge page where the kernel backs malloc's large blocks
    # with them (transparent huge pages: 33 faults for 64 MiB on a GPU machine).
    assert returned > BLOCK // (2 * MIB) // 2 and kept < returned / 10, (returned, kept, pages)


THREADS_FIRST = '''
import resource, sys, threading
import numpy
def faults_while(work):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
def one_step():
    block = numpy.empty({block}, numpy.uint8)
    block.fill(1)
# Threads that allocate before the setting, as CUDA's do once CuPy is used: glibc then fixes
# its arena count, and each later thread gets a heap of its own.
def allocate():
    for _ in range(1000):
        [bytearray(1000) for _ in range(100)]
early = [threading.Thread(target=allocate) for _ in range(4)]
[thread.start() for thread in early]
[thread.join() for thread in early]
from d2lperf.engine import freed_memory
assert freed_memory.keep_freed_memory()
counts = []
def steps():
    one_step()
    counts.append(faults_while(one_step))
for _ in range(3):
    worker = threading.Thread(target=steps)
    worker.start()
    worker.join()
print(*counts)
'''


@pytest.mark.skipif(not freed_memory.keep_freed_memory(), reason='needs glibc (mallopt)')
def test_blocks_under_64_mib_are_kept_on_threads_started_after_others_allocated():
    """On a GPU machine, the engine's workers start after CUDA's threads have allocated, and
    get heaps of their own: blocks under 64 MiB are still kept there (a 64 MiB block was
    not, 544 faults a step on an H200 machine)."""
    done = subprocess.run([sys.executable, '-c', THREADS_FIRST.format(block=BLOCK)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    counts = [int(count) for count in done.stdout.split()]
    assert all(count < BLOCK // resource.getpagesize() / 100 for count in counts), counts


MALLOPT_CALLS = '''
import ctypes, sys
calls = []
load = ctypes.CDLL

class Recorded:
    """The C library, with every mallopt call counted on its way through."""
    def __init__(self, *args, **kwargs):
        self.library = load(*args, **kwargs)
    def __getattr__(self, name):
        real = getattr(self.library, name)
        if name != 'mallopt':
            return real
        def mallopt(option, value):
            calls.append(option)
            return real(option, value)
        return mallopt

ctypes.CDLL = Recorded
import d2lperf as d2l
print('import', len(calls), d2l.engine.freed_memory.kept)
d2l.np.ones(3).wait_to_read()
print('start', len(calls), d2l.engine.freed_memory.kept)
d2l.np.ones(3, device=d2l.cpu(1)).wait_to_read()
(d2l.np.ones(3) + 1).wait_to_read()
print('later', len(calls))
'''


@pytest.mark.parametrize('engine', ['threaded', 'naive'])
def test_import_leaves_malloc_alone_and_the_engine_start_sets_it_once(engine):
    env = dict(os.environ, D2LPERF_ENGINE=engine, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, '-c', MALLOPT_CALLS], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == 'import 0 None'                      # importing changed nothing
    kept = freed_memory.keep_freed_memory()
    if kept:                                                # glibc: three settings, once
        assert lines[1:] == ['start 3 True', 'later 3']
    else:
        assert lines[1].startswith('start') and lines[1].endswith('False')
