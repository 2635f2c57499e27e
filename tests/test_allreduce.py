"""Tests of d2lperf.comm's allreduce: every algorithm against NumPy, its schedule, its
operations' names and order in a profile, its asynchrony, and its refusals."""
import copy
import threading

import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import comm, engine, np, npx, profiler
from d2lperf.comm import schedules
from conftest import run_with_timeout
from strategies import checks
from strategies.comm import ALGORITHMS, MAX_DEVICES, REDUCTION_OPS, allreduce_cases

pytestmark = [pytest.mark.usefixtures('fresh_engine'),
              pytest.mark.chapter('multiple_gpus', 'parameter_servers', 'data_parallel_at_scale')]

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


def ring_profile(n, size):
    arrays = on_devices([numpy.ones(size, dtype=numpy.float32)] * n)
    npx.waitall()
    with profiler.profile() as records:
        comm.allreduce(arrays, 'ring')
        npx.waitall()
    return records


def test_traffic_is_read_from_fields_not_from_names(monkeypatch):
    """Renaming a device changes what a trace shows, never the bytes counted: each device
    sends 2(n - 1)/n of its array, half of it in each phase."""
    monkeypatch.setattr(d2l.device.Device, '__repr__', lambda d: f'{d.kind}#{d.index}')
    n, size = 4, 1000
    records = ring_profile(n, size)
    assert comm.bytes_sent(records) == 2 * (n - 1) * size * 4
    assert comm.bytes_sent(records, 'reduce-scatter') == (n - 1) * size * 4
    sources = {t['source'] for t in comm.transfers_in(records)}
    assert sources == {d2l.cpu(i + 1) for i in range(n)}
    assert any('cpu#1->cpu#2' in r.name for r in records)


def test_an_operation_whose_name_only_looks_like_a_transfer_is_not_counted():
    records = ring_profile(2, 8)
    transfer = next(r for r in records if isinstance(r.name, comm.TransferName))
    impostor = copy.copy(transfer)
    impostor.name = str(transfer.name)          # the same text, no fields
    assert comm.transfers_in([impostor]) == [] and comm.bytes_sent([impostor]) == 0
    assert comm.bytes_sent([transfer]) == transfer.name.fields['bytes'] > 0


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
def test_all_gather_into_gives_every_array_every_devices_chunk(case, algorithm, dtype):
    hosts, _, _ = case
    hosts = [h.astype(dtype) for h in hosts]
    arrays = on_devices(hosts)
    bounds = comm.chunk_bounds(hosts[0].size, len(hosts))
    gathered = numpy.concatenate([h.reshape(-1)[start:stop]
                                  for h, (start, stop) in zip(hosts, bounds)])
    assert comm.all_gather_into(arrays, algorithm) == arrays
    for array in arrays:
        numpy.testing.assert_array_equal(array.asnumpy().reshape(-1), gathered, strict=True)


@checks(60)
@given(case=allreduce_cases(), algorithm=st.sampled_from(HALF_ALGORITHMS))
def test_all_gather_of_reduce_scatter_is_the_allreduce(case, algorithm):
    """The contract: shards in, whole arrays out. Split's halves are its allreduce, bit for bit.
    The ring's allreduce leaves chunk i + 1 on device i, its halves chunk i, so each chunk is
    summed in another order: equal to rounding, and every device still ends with the same
    bits. Sizes that do not divide by the device count, and 1 to 8 devices, included."""
    hosts, _, op = case
    whole = comm.allreduce(on_devices(hosts), algorithm, op)
    gathered = comm.all_gather(comm.reduce_scatter(on_devices(hosts), algorithm, op), algorithm)
    results = [a.asnumpy() for a in gathered]
    for result, b, device in zip(results, whole, [a.device for a in whole]):
        expected_values = b.asnumpy().reshape(-1)
        assert result.shape == expected_values.shape and result.dtype == expected_values.dtype
        if algorithm == 'split':
            numpy.testing.assert_array_equal(result, expected_values)
        else:
            tolerance = 1e-5 if result.dtype == numpy.float32 else 1e-12
            numpy.testing.assert_allclose(result, expected_values, rtol=tolerance,
                                          atol=tolerance)
        numpy.testing.assert_array_equal(result, results[0])
    assert [a.device for a in gathered] == [a.device for a in whole]


@pytest.mark.parametrize('algorithm', HALF_ALGORITHMS)
def test_all_gather_takes_shards_and_leaves_them_be(algorithm):
    arrays = on_devices([numpy.array([1.0, 2, 3, 4]), numpy.array([0.0, 1, 2, 3])])
    shards = comm.reduce_scatter(arrays, algorithm)
    gathered = comm.all_gather(shards, algorithm)
    assert [a.asnumpy().tolist() for a in gathered] == [[1, 3, 5, 7], [1, 3, 5, 7]]
    assert [s.asnumpy().tolist() for s in shards] == [[1, 3], [5, 7]]
    odd = comm.all_gather(on_devices([numpy.arange(3.0), numpy.arange(2.0)]), algorithm)
    assert [a.asnumpy().tolist() for a in odd] == [[0, 1, 2, 0, 1]] * 2


def test_a_shard_is_never_taken_for_a_whole_array():
    arrays = on_devices([numpy.ones((2, 3), numpy.float32)] * 2)
    shards = comm.reduce_scatter(arrays)
    with pytest.raises(ValueError, match=r'cpu\(1\) is a view of part.*all_gather\(shards\)'):
        comm.all_gather_into(shards)
    with pytest.raises(ValueError, match=r'shards, flat.*float32\[2, 3\].*all_gather_into'):
        comm.all_gather(arrays)
    with pytest.raises(ValueError, match=r'sizes \[3, 2\] .* not \[2, 3\]'):
        comm.all_gather(on_devices([numpy.ones(2), numpy.ones(3)]))
    with pytest.raises(ValueError, match='at least one shard'):
        comm.all_gather([])


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
