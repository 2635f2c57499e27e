"""Tests of d2lperf.comm.flat_sum: a group of arrays summed over devices through one flat buffer
a device gives every device the sum, the same on each, and the buffers are made once."""
import numpy
import pytest
from hypothesis import given

import d2lperf as d2l
from d2lperf import comm, np, npx, profiler
from strategies import checks
from strategies.comm import gradient_groups

pytestmark = [pytest.mark.usefixtures('fresh_engine'),
              pytest.mark.chapter('data_parallel_at_scale', 'parallel_layouts')]


def on_devices(groups):
    """`groups[i][d][k]` as an NDArray on cpu(d + 1)."""
    return [[[np.array(host, device=d2l.cpu(d + 1)) for host in arrays]
             for d, arrays in enumerate(group)] for group in groups]


@checks(60)
@given(groups=gradient_groups())
def test_every_device_gets_the_sum_of_its_group(groups):
    arrays = on_devices(groups)
    summed = comm.FlatBufferSum(arrays)
    for index, group in enumerate(arrays):
        summed.sum(index, group)
    for hosts, group in zip(groups, arrays):
        for k in range(len(hosts[0])):
            expected = numpy.sum([host[k] for host in hosts], axis=0, dtype=numpy.float32)
            first = group[0][k].asnumpy()
            numpy.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-4)
            for copies in group[1:]:          # every copy the same sum, to the bit
                numpy.testing.assert_array_equal(copies[k].asnumpy(), first)


def test_a_group_of_several_sums_as_the_allreduce_of_its_concatenation():
    """Packing moves the values and nothing else: the sums are those of one allreduce of the
    arrays laid end to end, to the bit, on three devices (where the ring's order of additions
    shows)."""
    rng = numpy.random.default_rng(0)
    hosts = [[rng.standard_normal(shape).astype('float32') for shape in ((3, 5), (7,), ())]
             for _ in range(3)]
    arrays = on_devices([hosts])[0]
    comm.FlatBufferSum([arrays]).sum(0, arrays)
    flats = [np.array(numpy.concatenate([h.reshape(-1) for h in host]), device=d2l.cpu(d + 1))
             for d, host in enumerate(hosts)]
    whole = comm.allreduce(flats)[0].asnumpy()
    numpy.testing.assert_array_equal(
        numpy.concatenate([a.asnumpy().reshape(-1) for a in arrays[2]]), whole)


def test_the_buffers_are_made_once_and_a_group_of_one_needs_none():
    groups = on_devices([[[numpy.ones((4, 4), 'float32'), numpy.ones(4, 'float32')]] * 2,
                         [[numpy.ones(8, 'float32')]] * 2])
    summed = comm.FlatBufferSum(groups)
    assert summed.buffers[1] is None
    assert [b.shape for b in summed.buffers[0]] == [(20,), (20,)]
    assert [b.device for b in summed.buffers[0]] == [d2l.cpu(1), d2l.cpu(2)]
    packed = []
    for _ in range(2):
        with profiler.profile() as records:
            summed.sum(0, groups[0])
            npx.waitall()
        packed.append({v for r in records if r.name.endswith(' pack') for v in r.writes})
    assert packed[0] == packed[1] == {b.var.id for b in summed.buffers[0]}
    assert groups[0][1][0].asnumpy()[0, 0] == 4.0      # summed twice: 1 + 1, then 2 + 2


def test_the_buffers_are_counted_as_the_kind_given():
    device = d2l.cpu(3)
    before = d2l.device.memory(device).by_kind['gradients']
    group = [[np.ones((6,), device=device), np.ones((2,), device=device)]]
    summed = comm.FlatBufferSum([group])
    assert d2l.device.memory(device).by_kind['gradients'] - before == 8 * 4
    del summed
