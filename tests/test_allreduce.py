"""Tests of d2lperf.comm's allreduce: every algorithm against NumPy, its schedule, its
operations' names and order in a profile, its asynchrony, and its refusals."""
import threading

import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import comm, engine, np, profiler
from d2lperf.comm import schedules
from conftest import run_with_timeout
from strategies import checks
from strategies.comm import ALGORITHMS, MAX_DEVICES, REDUCTION_OPS, allreduce_cases

pytestmark = pytest.mark.usefixtures('fresh_engine')

NUMPY_REDUCTIONS = {'sum': numpy.sum, 'max': numpy.max, 'min': numpy.min, 'prod': numpy.prod}


def on_devices(hosts):
    """One NDArray a virtual device cpu(1) ... cpu(n), as the chapters' try_devices gives."""
    return [np.array(h, device=d2l.cpu(i + 1)) for i, h in enumerate(hosts)]


def expected(hosts, op):
    return NUMPY_REDUCTIONS[op](numpy.stack(hosts), axis=0).astype(hosts[0].dtype)


@checks(120)
@given(case=allreduce_cases())
def test_every_algorithm_agrees_with_numpy(case):
    hosts, algorithm, op = case
    arrays = on_devices(hosts)
    assert comm.allreduce(arrays, algorithm, op) == arrays
    results = [a.asnumpy() for a in arrays]
    tolerance = 1e-5 if hosts[0].dtype == numpy.float32 else 1e-12
    for result, array in zip(results, arrays):
        assert result.shape == hosts[0].shape and result.dtype == hosts[0].dtype
        numpy.testing.assert_allclose(result, expected(hosts, op), rtol=tolerance, atol=tolerance)
    for result in results[1:]:           # every device ends with the very same bits
        numpy.testing.assert_array_equal(result, results[0])


@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_each_algorithm_under_both_engines(algorithm, engine_kind):
    hosts = [numpy.arange(10, dtype=numpy.float64) * (i + 1) for i in range(5)]
    arrays = comm.allreduce(on_devices(hosts), algorithm)
    for array in arrays:
        numpy.testing.assert_array_equal(array.asnumpy(), numpy.arange(10) * 15.0)


def test_arrays_that_are_not_contiguous_are_reduced_in_place():
    arrays = [np.array(numpy.arange(6.0).reshape(2, 3), device=d2l.cpu(i)).T for i in (1, 2)]
    comm.allreduce(arrays, 'ring')
    for array in arrays:
        numpy.testing.assert_array_equal(array.asnumpy(), 2 * numpy.arange(6.0).reshape(2, 3).T)


# -- schedules ---------------------------------------------------------------------------------

@checks(40)
@given(size=st.integers(0, 100), count=st.integers(1, MAX_DEVICES))
def test_chunks_cover_the_array_and_differ_by_at_most_one(size, count):
    bounds = schedules.chunk_bounds(size, count)
    lengths = [stop - start for start, stop in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == size and sum(lengths) == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(lengths) - min(lengths) <= 1


def sent_by_each(plan):
    """Chunks each device sends in a schedule (one chunk = 1 / plan.chunks of the data)."""
    counts = [0] * plan.parties
    for step in plan.steps:
        for move in step.transfers:
            counts[move.source] += 1
    return counts


@pytest.mark.parametrize('n', range(1, MAX_DEVICES + 1))
def test_ring_sends_two_n_minus_one_over_n_of_the_data_from_every_device(n):
    for algorithm in ('ring', 'ring2'):
        plan = schedules.schedule(algorithm, n)
        assert len(plan.steps) == 2 * (n - 1)
        assert [c / plan.chunks for c in sent_by_each(plan)] == [2 * (n - 1) / n] * n
    naive = schedules.schedule('naive', n)
    assert sent_by_each(naive) == [n - 1] + [1] * (n - 1)       # the first device: all of it


@pytest.mark.parametrize('n', [2, 3, 5, 8])
def test_tree_takes_two_log2_n_rounds(n):
    plan = schedules.schedule('tree', n)
    assert len(plan.steps) == 2 * (n - 1).bit_length()
    assert sum(len(step.transfers) for step in plan.steps) == 2 * (n - 1)


# -- the operations in a profile ---------------------------------------------------------------

def test_a_profile_shows_each_chunk_moving_round_the_ring():
    n = 4
    arrays = on_devices([numpy.ones(4000, dtype=numpy.float32)] * n)
    with profiler.profile() as records:
        comm.allreduce(arrays, 'ring')
    moves = comm.transfers_in(records)
    sends = [m for m in moves if m['action'] == 'send']
    sums = {(m['phase'], m['step'], m['chunk'], m['target']): m for m in moves
            if m['action'] == 'sum'}
    assert len(sends) == 2 * (n - 1) * n and len(sums) == (n - 1) * n
    assert {m['algorithm'] for m in moves} == {'ring'}
    for send in sends:
        assert send['worker'] == f"{send['target']} copy in"
        if send['phase'] == 'reduce-scatter' and send['step'] > 1:
            # the chunk it sends is the one this device summed one step before
            before = sums['reduce-scatter', send['step'] - 1, send['chunk'], send['source']]
            assert before['end'] <= send['start']


def test_allreduce_returns_at_once_and_independent_work_goes_on():
    gate = threading.Event()
    arrays = on_devices([numpy.full(8, i, dtype=numpy.float32) for i in range(1, 4)])
    engine.push(gate.wait, [], [arrays[0].var], d2l.cpu(1), 'slow gradient')
    comm.allreduce(arrays, 'ring')                       # must not wait for the gradient
    other = np.ones(3, device=d2l.cpu(2)) * 7
    assert run_with_timeout(other.asnumpy, 10).tolist() == [7, 7, 7]
    assert not gate.is_set()
    gate.set()
    numpy.testing.assert_array_equal(arrays[2].asnumpy(), numpy.full(8, 6))


# -- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize('arrays, words', [
    (lambda: [np.ones(3), np.ones(4, device=d2l.cpu(1))], r'one shape and dtype.*\[3\].*\[4\]'),
    (lambda: [np.ones(3), np.ones(3, dtype='float64', device=d2l.cpu(1))], 'float32.*float64'),
    (lambda: [], 'at least one array'),
])
def test_mismatched_arrays_are_refused(arrays, words):
    with pytest.raises(ValueError, match=words):
        comm.allreduce(arrays())


def test_unknown_names_and_repeated_arrays_are_refused():
    arrays = on_devices([numpy.ones(2)] * 2)
    with pytest.raises(ValueError, match=r"algorithm 'butterfly'.*'ring2'"):
        comm.allreduce(arrays, 'butterfly')
    with pytest.raises(ValueError, match=r"op='mean'.*'prod'"):
        comm.allreduce(arrays, op='mean')
    with pytest.raises(ValueError, match='same array'):
        comm.allreduce([arrays[0], arrays[0][:]])
    with pytest.raises(TypeError, match='d2l.np.array'):
        comm.allreduce([numpy.ones(2), numpy.ones(2)])
    assert set(comm.REDUCTIONS) == set(REDUCTION_OPS)


def test_the_source_allreduce_is_what_d2l_exports():
    assert d2l.allreduce is comm.allreduce_on_first


# -- GPUs --------------------------------------------------------------------------------------

@pytest.mark.skipif(d2l.num_gpus() < 2, reason='needs CuPy and two GPUs')
@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_every_algorithm_on_gpus(algorithm):
    hosts = [numpy.random.default_rng(i).random(1001, dtype=numpy.float32) for i in range(2)]
    arrays = [np.array(h, device=d2l.gpu(i)) for i, h in enumerate(hosts)]
    comm.allreduce(arrays, algorithm)
    for array in arrays:
        numpy.testing.assert_allclose(array.asnumpy(), hosts[0] + hosts[1], rtol=1e-6)


# -- the two halves: reduce-scatter and all-gather ----------------------------------------------

HALF_ALGORITHMS = ('ring', 'split')


@checks(120)
@given(case=allreduce_cases(), algorithm=st.sampled_from(HALF_ALGORITHMS),
       dtype=st.sampled_from(['float32', 'float64', 'int32', 'int64']))
def test_reduce_scatter_leaves_each_device_the_reduction_of_its_chunk(case, algorithm, dtype):
    hosts, _, op = case
    hosts = [h.astype(dtype) for h in hosts]
    arrays = on_devices(hosts)
    shards = comm.reduce_scatter(arrays, algorithm, op)
    whole = expected(hosts, op).reshape(-1)
    bounds = comm.chunk_bounds(whole.size, len(hosts))
    assert len(shards) == len(hosts)
    for shard, array, (start, stop) in zip(shards, arrays, bounds):
        assert shard.device == array.device and shard.shape == (stop - start,)
        tolerance = 1e-5 if dtype == 'float32' else 1e-12
        numpy.testing.assert_allclose(shard.asnumpy(), whole[start:stop], rtol=tolerance,
                                      atol=tolerance)


@checks(120)
@given(case=allreduce_cases(), algorithm=st.sampled_from(HALF_ALGORITHMS),
       dtype=st.sampled_from(['float32', 'float64', 'int32', 'int64']))
def test_all_gather_gives_every_device_every_shard(case, algorithm, dtype):
    hosts, _, _ = case
    hosts = [h.astype(dtype) for h in hosts]
    arrays = on_devices(hosts)
    bounds = comm.chunk_bounds(hosts[0].size, len(hosts))
    gathered = numpy.concatenate([h.reshape(-1)[start:stop]
                                  for h, (start, stop) in zip(hosts, bounds)])
    assert comm.all_gather(arrays, algorithm) == arrays
    for array in arrays:
        numpy.testing.assert_array_equal(array.asnumpy().reshape(-1), gathered, strict=True)


@checks(40)
@given(case=allreduce_cases(), algorithm=st.sampled_from(HALF_ALGORITHMS))
def test_the_two_halves_make_the_allreduce(case, algorithm):
    """Split's halves are its allreduce, bit for bit. The ring's allreduce leaves chunk i + 1 on
    device i, its halves chunk i, so each chunk is summed in another order: equal to rounding,
    and every device still ends with the same bits."""
    hosts, _, op = case
    halves, whole = on_devices(hosts), on_devices(hosts)
    comm.reduce_scatter(halves, algorithm, op)
    comm.all_gather(halves, algorithm)
    comm.allreduce(whole, algorithm, op)
    results = [a.asnumpy() for a in halves]
    for result, b in zip(results, whole):
        if algorithm == 'split':
            numpy.testing.assert_array_equal(result, b.asnumpy())
        else:
            tolerance = 1e-5 if result.dtype == numpy.float32 else 1e-12
            numpy.testing.assert_allclose(result, b.asnumpy(), rtol=tolerance, atol=tolerance)
        numpy.testing.assert_array_equal(result, results[0])


@pytest.mark.parametrize('n', [2, 3, 4, 8])
def test_each_half_of_the_ring_sends_n_minus_one_over_n_of_the_data(n):
    for collective in ('reduce-scatter', 'all-gather'):
        plan = schedules.half(collective, 'ring', n)
        assert len(plan.steps) == n - 1
        assert sent_by_each(plan) == [n - 1] * n


def test_halves_of_other_algorithms_and_bad_counts_are_refused():
    arrays = on_devices([numpy.ones(4, numpy.float32)] * 2)
    with pytest.raises(ValueError, match=r"reduce-scatter runs by \['ring', 'split'\], not 'tree'"):
        comm.reduce_scatter(arrays, 'tree')
    with pytest.raises(ValueError, match='all-gather needs at least one device, not 0'):
        schedules.half('all-gather', 'ring', 0)
    with pytest.raises(ValueError, match='reduce_scatter needs at least one array'):
        comm.reduce_scatter([])
