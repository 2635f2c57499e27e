"""Tests of d2lperf.hardware (machine, memory, compute, io, gpu) at tiny sizes.

They check values, never speed: every figure is positive, finite and carries its unit in
its column name; the pointer chase is one dependent cycle over every node; FLOP and byte
counts agree with a hand computation.
"""
import math
import os
import sys
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import hardware, utils
from d2lperf.hardware import memory_hierarchy

pytestmark = pytest.mark.serial          # loads, busy cores and bandwidths, read from the machine
from fakes import cupy as fake_cupy

UNIT_WORDS = {'bytes', 'seconds', 'ns', 'us', 'gb', 'mb', 'gflop', 'tflop', 'flop', 'mhz',
              'bits', 'error'}
COUNTS = {'n', 'nodes', 'steps', 'reads', 'flops', 'launches', 'processes'}


def names_a_unit(column):
    return column in COUNTS or bool(UNIT_WORDS & set(column.split('_')))


def assert_rows_have_units(rows, expected_rows=None):
    """Every numeric cell is positive and finite, and its column names its unit."""
    assert rows, 'a measurement returned an empty table'
    if expected_rows is not None:
        assert len(rows) == expected_rows
    for row in rows:
        assert list(row) == list(rows[0])
        for key, value in row.items():
            if isinstance(value, (int, float, np.integer, np.floating)):
                assert names_a_unit(key), key
                assert math.isfinite(value) and value > 0, (key, value)


def test_system_summary_reports_cpu_memory_and_caches():
    summary = hardware.system_summary()
    assert summary['logical_cpus'] >= 1 and summary['memory_bytes'] > 0
    assert isinstance(summary['cpu_model'], str) and summary['cpu_model']
    assert all(isinstance(size, int) and size > 0 for size in summary['caches_bytes'].values())
    assert isinstance(summary['gpus'], list)


def test_median_seconds_warms_up_then_times_batches():
    calls = []
    seconds = hardware.median_seconds(lambda: calls.append(1), repeats=3, min_seconds=1e-4)
    assert 0 < seconds < 1e-3
    assert len(calls) > 3   # a warm-up call, then batches of many calls
    assert hardware.median_seconds is utils.median_seconds   # one timer for everything


@pytest.mark.parametrize('n', [1, 100, memory_hierarchy.TRIAD_BLOCK + 5])
def test_stream_kernels_compute_copy_and_triad(n):
    for name, expected in (('copy', 1.0), ('triad', 1.0 + 3.0 * 2.0)):
        run, out = hardware.stream_kernel(name, n)
        run()
        np.testing.assert_array_equal(out, np.full(n, expected))


def test_memory_bandwidth_counts_stream_bytes():
    rows = hardware.memory_bandwidth([2 ** 16], repeats=2)
    assert_rows_have_units(rows, expected_rows=2)
    copy, triad = rows
    assert copy['bytes_counted'] == 16 * (2 ** 16 // 16)   # read b, write a: 8 + 8 bytes
    assert triad['bytes_counted'] == 24 * (2 ** 16 // 24)  # read b and c, write a


def test_chase_cycle_visits_every_node_once():
    nodes = hardware.chase_cycle(1000, seed=3)
    start, seen, node = nodes[0], [], nodes[0]
    for _ in range(len(nodes)):
        seen.append(id(node))
        node = hardware.walk(node, 1)
    assert node is start                            # one cycle of length n ...
    assert sorted(seen) == sorted(map(id, nodes))   # ... through every node
    assert hardware.walk(start, len(nodes)) is start
    memory_hierarchy.unlink(nodes)
    assert all(node.next is None for node in nodes)


class RecordingNode:
    """A node whose `next` logs which object it was read from."""

    def __init__(self, log):
        self.log, self.successor = log, None

    @property
    def next(self):
        self.log.append(self)
        return self.successor


@pytest.mark.parametrize('steps', [1, memory_hierarchy.HOP, 2 * memory_hierarchy.HOP + 7])
def test_walk_reads_each_address_from_the_previous_load(steps):
    log = []
    nodes = [RecordingNode(log) for _ in range(50)]
    for node, successor in zip(nodes, nodes[1:] + nodes[:1]):
        node.successor = successor
    end = hardware.walk(nodes[0], steps)
    # the k-th read is made on the object the (k-1)-th read returned, and on nothing else
    assert log == [nodes[k % 50] for k in range(steps)]
    assert end is nodes[steps % 50]


def test_pointer_chase_rows():
    rows = hardware.pointer_chase([2 ** 12, 2 ** 16], steps=2048, repeats=2)
    assert_rows_have_units(rows, expected_rows=2)
    stride = memory_hierarchy.bytes_per_node(hardware.chase_cycle(64))
    assert stride >= sys.getsizeof(memory_hierarchy.ChaseNode())
    for row, size in zip(rows, [2 ** 12, 2 ** 16]):
        assert size - stride < row['working_set_bytes'] <= size


def test_read_orders_read_the_same_data():
    orders = memory_hierarchy.read_orders(64)
    np.testing.assert_array_equal(orders['sequential'], np.arange(64))
    np.testing.assert_array_equal(np.sort(orders['random']), np.arange(64))   # a permutation


def test_read_patterns_rows():
    rows = hardware.read_patterns([2 ** 16], repeats=2)
    assert_rows_have_units(rows, expected_rows=2)
    assert [row['reads'] for row in rows] == [2 ** 13, 2 ** 13]


@pytest.mark.parametrize('n, flops', [(1, 1), (2, 12), (3, 45)])
def test_matmul_flop_count_by_hand(n, flops):
    # each of the n^2 entries is n products and n - 1 additions
    assert hardware.compute.matmul_flops_count(n) == flops


def test_kernel_counts_by_hand():
    assert hardware.kernel_counts('vector add', 4) == (4, 3 * 4 * 8)
    assert hardware.kernel_counts('triad', 4) == (8, 3 * 4 * 8)
    assert hardware.kernel_counts('dot', 4) == (7, 2 * 4 * 8)
    assert hardware.kernel_counts('matvec', 4) == (4 * 7, (16 + 4 + 4) * 8)
    assert hardware.kernel_counts('matmul', 4) == (16 * 7, 3 * 16 * 8)
    assert hardware.kernel_counts('matmul', 4, itemsize=4) == (16 * 7, 3 * 16 * 4)


@given(st.integers(1, 10 ** 6))
def test_matmul_intensity_grows_with_size(n):
    flops, moved = hardware.kernel_counts('matmul', n)
    assert flops / moved == pytest.approx((2 * n - 1) / 24)


def test_three_matmuls_agree():
    a, b = np.random.default_rng(0).random((2, 5, 5))
    np.testing.assert_allclose(hardware.compute.matmul_python(a.tolist(), b.tolist()), a @ b)
    np.testing.assert_allclose(hardware.compute.matmul_broadcast(a, b), a @ b)


def test_vectorization_rows():
    rows = hardware.vectorization(n=8, repeats=2)
    assert_rows_have_units(rows, expected_rows=3)
    assert {row['flops'] for row in rows} == {hardware.compute.matmul_flops_count(8)}


def test_matmul_flops_rows():
    rows = hardware.matmul_flops([16, 32], dtypes=('float32', 'float64'), repeats=2)
    assert_rows_have_units(rows, expected_rows=4)


def test_roofline_kernels_rows():
    sizes = {'vector add': 1000, 'triad': 1000, 'dot': 1000, 'matvec': 30, 'matmul': 30}
    rows = hardware.roofline_kernels(sizes, repeats=2)
    assert_rows_have_units(rows, expected_rows=5)
    for row in rows:
        assert (row['flops'], row['bytes']) == hardware.kernel_counts(row['kernel'], row['n'])


def test_roofline_bound_and_prediction():
    np.testing.assert_allclose(hardware.roofline_bound([0.1, 1, 100], 50.0, 20.0),
                               [2.0, 20.0, 50.0])
    # 1 GFLOP at 50 GFLOP/s beats 1 GB at 20 GB/s: memory decides, 50 ms
    assert hardware.predict_seconds(1e9, 1e9, 50.0, 20.0) == pytest.approx(0.05)
    assert hardware.predict_seconds(1e11, 1e9, 50.0, 20.0) == pytest.approx(2.0)


def test_false_sharing_rows():
    rows = hardware.io.false_sharing(increments=20000)
    assert_rows_have_units(rows, expected_rows=3)
    assert [row['processes'] for row in rows] == [1, 2, 2]


def test_storage_reads_rows(tmp_path):
    rows = hardware.io.storage_reads(file_bytes=2 ** 22, random_reads=50, directory=tmp_path,
                                  repeats=2)
    assert_rows_have_units(rows, expected_rows=2)
    assert rows[0]['reads'] == 4 and rows[1]['reads'] == 50
    assert all(row['page_cache'] for row in rows)
    assert os.listdir(tmp_path) == []   # the temporary file is gone


def test_loopback_messages_and_fit():
    rows = hardware.io.loopback_messages([1, 2 ** 12, 2 ** 16], repeats=3)
    assert_rows_have_units(rows, expected_rows=3)
    fit = hardware.io.latency_and_bandwidth(rows)
    assert fit['latency_seconds'] > 0


def test_print_table(capsys):
    hardware.print_table([{'name': 'a', 'value_ns': 1.5}, {'name': 'bb', 'value_ns': 20.0}])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and 'value_ns' in lines[0]
    hardware.print_table([])
    assert 'empty' in capsys.readouterr().out


def test_gemm_passes_row_major_operands_in_cublas_order():
    cp = fake_cupy.make_module()
    rng = np.random.default_rng(0)
    a, b = (cp.asarray(rng.random((5, 5), dtype=np.float32)) for _ in range(2))
    c = cp.zeros((5, 5), np.float32)
    hardware.gpu.gemm(cp, a, b, c, hardware.gpu.CUDA_R_32F, hardware.gpu.CUBLAS_COMPUTE_32F)
    np.testing.assert_allclose(c, np.asarray(a) @ np.asarray(b), rtol=1e-5)
    assert cp.cuda.cublas.pointer_mode == 5   # the handle's pointer mode is restored


NO_GPU = hardware.gpu.cupy_or_none() is None
GPU_MEASUREMENTS = [hardware.gpu.gpu_memory_bandwidth, hardware.gpu.host_device_copies,
                    hardware.gpu.kernel_launch_latency, hardware.gpu.gpu_matmul_flops]


@pytest.mark.skipif(not NO_GPU, reason='a GPU is present')
@pytest.mark.parametrize('measure', GPU_MEASUREMENTS)
def test_gpu_measurements_without_gpu_return_empty_tables(measure, capsys):
    assert measure() == []
    assert 'No GPU found' in capsys.readouterr().out
    assert hardware.gpu.gpu_summary() == []


@pytest.mark.skipif(NO_GPU, reason='needs a GPU')
def test_gpu_measurements_with_gpu():
    assert all(gpu['multiprocessors'] > 0 for gpu in hardware.gpu.gpu_summary())
    assert_rows_have_units(hardware.gpu.gpu_memory_bandwidth([2 ** 22], repeats=2))
    assert_rows_have_units(hardware.gpu.host_device_copies([2 ** 16], repeats=2))
    assert_rows_have_units(hardware.gpu.kernel_launch_latency(launches=50))
    rows = hardware.gpu.gpu_matmul_flops(n=256, repeats=2)
    assert_rows_have_units(rows)
    tolerance = {'float32': 1e-5, 'tf32': 5e-3, 'float16': 5e-3, 'bfloat16': 3e-2}
    for row in rows:
        assert row['max_relative_error'] < tolerance[row['mode']]


# --- load_by_others -------------------------------------------------------------------------

def test_load_by_others_is_what_all_cores_did_less_what_this_process_did():
    before = hardware.machine.CpuTimes(busy_seconds=10.0, own_seconds=2.0, wall_seconds=100.0)
    after = hardware.machine.CpuTimes(busy_seconds=13.0, own_seconds=3.0, wall_seconds=102.0)
    assert hardware.load_by_others(before, after) == pytest.approx(1.0)   # (3 - 1) / 2 s
    ours_only = after._replace(busy_seconds=11.0)
    assert hardware.load_by_others(before, ours_only) == 0.0


def test_load_by_others_sees_a_busy_process_and_describe_load_names_it():
    import subprocess
    busy = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    try:
        import time
        time.sleep(0.3)                     # let it start
        before = hardware.cpu_times()
        time.sleep(1.0)
        after = hardware.cpu_times()
    finally:
        busy.kill()
        busy.wait()
    load = hardware.load_by_others(before, after)
    assert 0.3 < load <= os.cpu_count() + 0.1, load
    assert f'{load:.2f} of the' in hardware.describe_load(load)
    assert hardware.describe_load(0.1, cores=2).startswith('the cause is unknown')


def test_a_child_that_has_ended_is_counted_as_this_process():
    import subprocess
    before = hardware.cpu_times()
    subprocess.run([sys.executable, '-c', 'import time\nt = time.process_time()\n'
                    'while time.process_time() - t < 0.5: pass'], check=True)
    after = hardware.cpu_times()
    assert after.own_seconds - before.own_seconds >= 0.45


# --- BLAS threads and a busy core -----------------------------------------------------------

def test_threads_by_size_times_both_thread_counts():
    rows = hardware.threads_by_size([32, 64], repeats=1)
    assert [r['n'] for r in rows] == [32, 64]
    assert all(r['one_thread_seconds'] > 0 and r['every_thread_seconds'] > 0 for r in rows)
    assert all(r['threads'] == hardware.blas_threads() for r in rows)


def test_under_load_the_package_leaves_the_busy_core_to_its_owner():
    from d2lperf import engine
    rows = hardware.products_under_load(n=64, products=5, repeats=1)
    assert [r['load'] for r in rows] == ['as found', 'one more core busy']
    assert all(r[k] > 0 for r in rows for k in r if k.endswith('_seconds'))
    cores = engine._engine.workers.cores
    with hardware.busy_core():
        deadline = time.perf_counter() + 10
        while cores.others < 0.6 and time.perf_counter() < deadline:
            (d2l.np.ones((64, 64)) @ d2l.np.ones((64, 64))).wait_to_read()
            time.sleep(0.05)
    assert cores.others >= 0.6, cores.others            # another program's core, seen
    if cores.limit == cores.cores > 1:
        assert cores.current <= cores.cores - 1, (cores.current, cores.cores)
        assert d2l.engine.blas_thread_changes() >= 1
