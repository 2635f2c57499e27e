"""Microbenchmarks beyond one core's memory: coherence between cores, storage, the network.

The second half of what the chapter "Hardware" measures; `d2lperf.hardware` has the memory
hierarchy, vectorization and arithmetic. The same conventions hold: plain rows whose numeric
columns name their unit, medians after a warm-up, sizes from `workload`.
"""
import mmap
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from multiprocessing import shared_memory

import numpy
import psutil

from .memory_hierarchy import CACHE_LINE_BYTES
from ..utils import workload


# --- Coherence: two cores writing to one cache line ---------------------------------------

FALSE_SHARING_LAYOUTS = (('alone', None), ('same cache line', 8),
                         ('different cache lines', 2 * CACHE_LINE_BYTES))


def _increment_counters(memory_name, worker, increments, barrier):
    """Child process: add 1 to this worker's float64 counter, once per layout."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else []
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[worker]})   # keep the two workers on different CPUs
    memory = shared_memory.SharedMemory(name=memory_name)
    words = numpy.ndarray((memory.size // 8,), numpy.float64, buffer=memory.buf)
    try:
        for layout, (_, distance) in enumerate(FALSE_SHARING_LAYOUTS):
            active = worker == 0 or distance is not None
            counter = numpy.full(increments, 0 if worker == 0 else (distance or 0) // 8, numpy.intp)
            barrier.wait()
            if active:
                start = time.perf_counter()
                numpy.add.at(words, counter, 1.0)   # unbuffered: load, add, store, repeat
                words[256 + 2 * layout + worker] = time.perf_counter() - start
            barrier.wait()
    finally:
        del words
        memory.close()


def false_sharing(increments=None):
    """ns per increment when two processes each update their own counter: alone, with the
    counters 8 bytes apart (one cache line), and 128 bytes apart (separate lines).

    Processes, not threads, so that both cores run at once (`numpy.add.at` keeps the GIL)."""
    increments = increments or workload(2 ** 22, 2 ** 20)
    context = multiprocessing.get_context('spawn')
    memory = shared_memory.SharedMemory(create=True, size=mmap.PAGESIZE)
    try:
        words = numpy.ndarray((memory.size // 8,), numpy.float64, buffer=memory.buf)
        words[:] = 0
        barrier = context.Barrier(2, timeout=120)   # a dead worker cannot hang the other
        workers = [context.Process(target=_increment_counters,
                                   args=(memory.name, worker, increments, barrier))
                   for worker in (0, 1)]
        for process in workers:
            process.start()
        for process in workers:
            process.join()
        if any(process.exitcode != 0 for process in workers):
            raise RuntimeError('a false-sharing worker process failed')
        rows = _false_sharing_rows(words, increments)
        del words
    finally:
        memory.close()
        memory.unlink()
    return rows


def _false_sharing_rows(words, increments):
    expected = {0: increments * len(FALSE_SHARING_LAYOUTS)}
    expected.update({d // 8: increments for _, d in FALSE_SHARING_LAYOUTS if d})
    if any(words[index] != count for index, count in expected.items()):
        raise RuntimeError('lost increments: the counters do not add up')
    rows = []
    for layout, (name, distance) in enumerate(FALSE_SHARING_LAYOUTS):
        times = words[256 + 2 * layout: 256 + 2 * layout + (1 if distance is None else 2)]
        rows.append({'layout': name, 'processes': len(times),
                     'ns_per_increment': float(times.mean()) / increments * 1e9})
    return rows


# --- Storage ------------------------------------------------------------------------------

SEQUENTIAL_BLOCK = 2 ** 20


def filesystem_of(path):
    """The type of the file system holding `path` ('ext4', 'apfs', 'tmpfs', ...)."""
    path = os.path.realpath(path)
    mounts = [p for p in psutil.disk_partitions(all=True)
              if path == p.mountpoint or path.startswith(p.mountpoint.rstrip(os.sep) + os.sep)]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else 'unknown'


def _write_random_file(path, size, seed):
    """Random bytes, so that no compressing or deduplicating layer can shortcut the reads."""
    rng = numpy.random.default_rng(seed)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(0, size, SEQUENTIAL_BLOCK):
            os.write(fd, rng.bytes(SEQUENTIAL_BLOCK))
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_uncached(path):
    """A read-only descriptor, and how the page cache is kept out of the measurement."""
    if hasattr(os, 'O_DIRECT'):
        fd = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            _read_at(fd, mmap.mmap(-1, mmap.PAGESIZE), mmap.PAGESIZE, 0)  # may refuse here
            return fd, 'bypassed (O_DIRECT)'
        except OSError:
            if fd is not None:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, 'posix_fadvise'):
        return fd, 'evicted before each pass (posix_fadvise DONTNEED)'
    return fd, 'not bypassed: the figures may be memory speed'


def _read_at(fd, buffer, size, offset):
    if hasattr(os, 'preadv'):
        return os.preadv(fd, [memoryview(buffer)[:size]], offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return len(os.read(fd, size))


def _timed_reads(fd, offsets, block, how, repeats):
    buffer = mmap.mmap(-1, max(block, mmap.PAGESIZE))   # page-aligned, as O_DIRECT requires
    samples = []
    for _ in range(repeats):
        if how.startswith('evicted'):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for offset in offsets:
            _read_at(fd, buffer, block, offset)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def storage_reads(file_bytes=None, block_bytes=4096, random_reads=None, directory=None,
                  repeats=3, seed=0):
    """Sequential (1 MiB blocks) and random (`block_bytes`, a multiple of 4 KiB) reads of a
    fresh temporary file, with the page cache bypassed where the system allows it (see the
    `page_cache` column; a `tmpfs` folder is memory, whatever the column says)."""
    if block_bytes % 4096:
        raise ValueError('block_bytes must be a multiple of 4096 (O_DIRECT alignment)')
    file_bytes = file_bytes or workload(2 ** 30, 2 ** 25)
    random_reads = random_reads or workload(20000, 1000)
    rng = numpy.random.default_rng(seed)
    with tempfile.TemporaryDirectory(dir=directory) as folder:
        path = os.path.join(folder, 'd2lperf-storage.bin')
        _write_random_file(path, file_bytes, seed)
        fd, how = _open_uncached(path)
        try:
            plans = {'sequential': (range(0, file_bytes, SEQUENTIAL_BLOCK), SEQUENTIAL_BLOCK),
                     'random': (block_bytes * rng.integers(0, file_bytes // block_bytes,
                                                           random_reads), block_bytes)}
            rows = []
            for pattern, (offsets, block) in plans.items():
                offsets = [int(offset) for offset in offsets]
                seconds = _timed_reads(fd, offsets, block, how, repeats)
                rows.append({'pattern': pattern, 'block_bytes': block, 'reads': len(offsets),
                             'seconds': seconds, 'mb_per_s': block * len(offsets) / seconds / 1e6,
                             'us_per_read': seconds / len(offsets) * 1e6, 'page_cache': how,
                             'filesystem': filesystem_of(folder)})
        finally:
            os.close(fd)
    return rows


# --- Network: messages through this machine's own TCP stack -------------------------------

def _receive_exactly(connection, view):
    while len(view):
        received = connection.recv_into(view)
        if not received:
            raise ConnectionError('the other end closed the connection')
        view = view[received:]


def _acknowledge_messages(server, schedule):
    connection, _ = server.accept()
    with connection:
        connection.settimeout(30)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = memoryview(bytearray(max(schedule)))
        for size in schedule:
            _receive_exactly(connection, buffer[:size])
            connection.sendall(b'k')


def loopback_messages(sizes_bytes=None, repeats=None):
    """Seconds to send one message over TCP to 127.0.0.1 and get a 1-byte acknowledgment.

    No wire is involved: what this measures is the per-message cost of the protocol stack
    and the copies through the kernel, which every real network adds to its own."""
    sizes_bytes = sizes_bytes or [1, 2 ** 10, 2 ** 14, 2 ** 17, 2 ** 20, workload(2 ** 24, 2 ** 22)]
    repeats = repeats or workload(50, 15)
    schedule = [size for size in sizes_bytes for _ in range(repeats + 1)]  # first: warm-up
    payload, acknowledgment = memoryview(bytes(max(sizes_bytes))), memoryview(bytearray(1))
    with socket.create_server(('127.0.0.1', 0)) as server:
        server.settimeout(30)
        receiver = threading.Thread(target=_acknowledge_messages, args=(server, schedule),
                                    daemon=True)
        receiver.start()
        with socket.create_connection(server.getsockname(), timeout=30) as connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for size in schedule:
                start = time.perf_counter()
                connection.sendall(payload[:size])
                _receive_exactly(connection, acknowledgment)
                times.append(time.perf_counter() - start)
        receiver.join()
    rows = []
    for k, size in enumerate(sizes_bytes):
        seconds = statistics.median(times[k * (repeats + 1) + 1:(k + 1) * (repeats + 1)])
        rows.append({'message_bytes': size, 'seconds': seconds,
                     'us_per_message': seconds * 1e6, 'gb_per_s': size / seconds / 1e9})
    return rows


def latency_and_bandwidth(rows):
    """Fit `time = latency + size / bandwidth` through the smallest and largest message."""
    small, large = rows[0], rows[-1]
    bandwidth = (large['message_bytes'] - small['message_bytes']) / (
        large['seconds'] - small['seconds'])
    return {'latency_seconds': small['seconds'], 'bandwidth_gb_per_s': bandwidth / 1e9}
