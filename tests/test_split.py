"""Tests of d2lperf.comm: splitting a batch among devices and the simple allreduce."""
import numpy
import pytest
from hypothesis import given

import d2lperf as d2l
from d2lperf import comm, np
from strategies import checks
from strategies.comm import (DEVICES, arrays_to_reduce, batches_to_split, exact_work_loads,
                             work_loads)

pytestmark = [pytest.mark.usefixtures('fresh_engine'),
              pytest.mark.chapter('multiple_gpus', 'multiple_gpus_concise')]

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)


def host_batch(count, features=3):
    return numpy.arange(count * features, dtype=numpy.float32).reshape(count, features)


# -- split_and_load ----------------------------------------------------------------------------

def test_split_and_load_gives_each_device_its_rows():
    data = np.arange(20).reshape(4, 5)
    first, second = d2l.split_and_load(data, [CPU0, CPU1])
    assert (first.device, second.device) == (CPU0, CPU1)
    numpy.testing.assert_array_equal(first.asnumpy(), numpy.arange(10).reshape(2, 5))
    numpy.testing.assert_array_equal(second.asnumpy(), numpy.arange(10, 20).reshape(2, 5))


@checks(30)
@given(case=batches_to_split())
def test_uneven_split_gives_the_first_devices_one_more(case):
    count, devices = case
    host = host_batch(count)
    slices = d2l.split_and_load(np.array(host), devices, even_split=False)
    sizes = [len(s) for s in slices]
    assert [s.device for s in slices] == devices
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    numpy.testing.assert_array_equal(numpy.concatenate([s.asnumpy() for s in slices]), host)


def test_split_and_load_copies_rather_than_aliases():
    data = np.array(host_batch(4))
    first, _ = d2l.split_and_load(data, [CPU0, CPU1])
    first += 100
    numpy.testing.assert_array_equal(data.asnumpy(), host_batch(4))


def test_split_and_load_takes_numpy_arrays_and_a_single_device():
    (only,) = d2l.split_and_load(host_batch(3), CPU1)
    assert only.device == CPU1
    numpy.testing.assert_array_equal(only.asnumpy(), host_batch(3))


@pytest.mark.parametrize('count, weights, sizes', [
    (8, [3, 1], [6, 2]),
    (5, [1, 1], [2, 3]),            # 2.5 rounds to 2 (halves to even); the last takes the rest
    (7, [1, 1], [4, 3]),            # 3.5 rounds to 4 twice: the overshoot comes off the last
    (10, [1, 1, 1], [3, 3, 4]),
])
def test_work_load_rounding_follows_mxnet(count, weights, sizes):
    assert comm.slice_sizes(count, len(weights), False, weights) == sizes
    slices = d2l.split_and_load(host_batch(count), DEVICES[:len(weights)], even_split=False,
                                work_load_list=weights)
    assert [len(s) for s in slices] == sizes


@checks(40)
@given(case=work_loads())
def test_work_load_split_covers_the_batch(case):
    count, weights = case
    sizes = comm.slice_sizes(count, len(weights), False, weights)
    shares = [round(count * w / sum(weights)) for w in weights]
    assert sum(sizes) == count and min(sizes) >= 1
    assert all(size <= share for size, share in zip(sizes[:-1], shares))


@checks(30)
@given(case=exact_work_loads())
def test_exact_proportions_split_exactly(case):
    count, weights = case
    assert comm.slice_sizes(count, len(weights), True, weights) == \
        [count // sum(weights) * w for w in weights]


@pytest.mark.parametrize('call, message', [
    (lambda: d2l.split_and_load(host_batch(3), DEVICES), r'batch of 3 examples among 4 devices'),
    (lambda: d2l.split_and_load(host_batch(5), [CPU0, CPU1]),
     r'5 examples does not divide evenly among 2 devices.*even_split=False'),
    (lambda: d2l.split_and_load(host_batch(4), [CPU0, CPU1], work_load_list=[1, 1, 2]),
     r'3 weights for 2 devices'),
    (lambda: d2l.split_and_load(host_batch(4), [CPU0, CPU1], work_load_list=[1, 0]),
     r'positive weights'),
    (lambda: d2l.split_and_load(host_batch(5), [CPU0, CPU1], work_load_list=[2, 1]),
     r'5 examples does not divide in the proportions \[2, 1\].*even_split=False'),
    (lambda: d2l.split_and_load(host_batch(3), [CPU0, CPU1], even_split=False,
                                work_load_list=[10, 1]), r'without examples.*sizes \[3, 0\]'),
    (lambda: d2l.split_and_load(host_batch(4), []), r'non-empty list of Devices'),
    (lambda: d2l.split_and_load(host_batch(4), ['cpu']), r'non-empty list of Devices'),
    (lambda: d2l.split_and_load(np.array(1.0), [CPU0]), r'batch axis'),
    (lambda: d2l.split_batch(np.array(host_batch(4)), np.arange(3), [CPU0, CPU1]),
     r'X has 4 examples but y has 3 labels'),
], ids=['too-few-examples', 'uneven', 'weights-per-device', 'zero-weight', 'inexact-weights',
        'empty-slice', 'no-devices', 'not-devices', 'no-batch-axis', 'X-y-lengths'])
def test_bad_splits_say_which_sizes(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_split_batch_splits_features_and_labels_alike():
    X, y = np.array(host_batch(5)), np.arange(5)
    X_shards, y_shards = d2l.split_batch(X, y, [CPU0, CPU1])
    assert [len(s) for s in X_shards] == [len(s) for s in y_shards] == [3, 2]
    for X_shard, y_shard, device in zip(X_shards, y_shards, [CPU0, CPU1]):
        assert X_shard.device == y_shard.device == device
        numpy.testing.assert_array_equal(X_shard.asnumpy()[:, 0], 3 * y_shard.asnumpy())


# -- allreduce ---------------------------------------------------------------------------------

def test_allreduce_as_in_the_source(engine_kind):
    data = [np.ones((1, 2), device=d2l.cpu(i)) * (i + 1) for i in range(2)]
    before = list(data)
    d2l.allreduce(data)
    assert all(a is b for a, b in zip(data, before))                # in place
    assert [d.asnumpy().tolist() for d in data] == [[[3.0, 3.0]]] * 2
    assert [d.device for d in data] == [CPU0, CPU1]


@checks(30)
@given(hosts=arrays_to_reduce())
def test_allreduce_gives_every_device_the_sum(hosts):
    data = [np.array(h, device=DEVICES[i]) for i, h in enumerate(hosts)]
    d2l.allreduce(data)
    expected = hosts[0].copy()
    for h in hosts[1:]:
        expected += h                                   # the same order of additions
    for array in data:
        numpy.testing.assert_array_equal(array.asnumpy(), expected)


def test_allreduce_of_one_array_leaves_it_alone():
    (only,) = d2l.allreduce([np.full((2,), 4.0)])
    assert only.asnumpy().tolist() == [4.0, 4.0]


def test_allreduce_refuses_arrays_of_different_shapes():
    with pytest.raises(ValueError, match=r'\(2,\) on cpu\(0\) and \(3,\) on cpu\(1\)'):
        d2l.allreduce([np.ones(2), np.ones(3, device=CPU1)])
    with pytest.raises(ValueError, match='at least one'):
        d2l.allreduce([])
