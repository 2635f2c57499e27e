"""Tests of d2lperf.host_memory: a large block freed by one step is reused by the next,
without a page fault per page (counted by the kernel, not timed)."""
import resource
import threading

import numpy
import pytest

from d2lperf import host_memory

MIB = 2**20


def faults_while(work):
    """Minor page faults (a page the kernel had to map in) of the calling thread during work()."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def one_step():
    block = numpy.empty(64 * MIB, numpy.uint8)
    block.fill(1)                # touch every page
    del block


@pytest.mark.skipif(not host_memory.keep_freed_memory(), reason='needs glibc (mallopt)')
def test_a_freed_block_is_reused_without_page_faults_on_any_thread():
    pages = 64 * MIB // resource.getpagesize()
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
    assert host_memory.keep_freed_memory() == host_memory.keep_freed_memory()


@pytest.mark.skipif(not host_memory.keep_freed_memory(), reason='needs glibc (mallopt)')
def test_while_measuring_freed_blocks_go_back_and_after_it_they_are_kept_again():
    pages = 64 * MIB // resource.getpagesize()
    one_step()
    with host_memory.returning_freed_memory():
        returned = faults_while(one_step)         # unmapped when freed: every page is new
    one_step()
    kept = faults_while(one_step)
    assert returned > 100 and kept < returned / 10, (returned, kept, pages)
