"""Tests of d2lperf.comm.all_to_all: the transpose of the (sender, receiver) grid against
NumPy, its traffic read from the engine's records against (n - 1)/n of each array, and its
α-β cost against the pairwise exchange's formula."""
import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import comm, np, npx, profiler
from d2lperf.comm import cost, schedules
from d2lperf.comm.all_to_all import bytes_each_sends
from strategies import checks

pytestmark = pytest.mark.usefixtures('fresh_engine')


def on_devices(hosts):
    return [np.array(h, device=d2l.cpu(i + 1)) for i, h in enumerate(hosts)]


def transposed(hosts):
    """Result j: chunk j of every host array, sender by sender."""
    n = len(hosts)
    chunks = [numpy.split(h, n) for h in hosts]
    return [numpy.concatenate([chunks[i][j] for i in range(n)]) for j in range(n)]


@checks(30)
@given(n=st.integers(1, 5), rows=st.integers(0, 3), width=st.integers(1, 3),
       dtype=st.sampled_from([numpy.float32, numpy.float64, numpy.int64]))
def test_result_j_is_chunk_j_of_every_array(n, rows, width, dtype):
    hosts = [(numpy.arange(n * rows * width) + 1000 * i).astype(dtype).reshape(n * rows, width)
             for i in range(n)]
    arrays = on_devices(hosts)
    outs = comm.all_to_all(arrays)
    for out, array, want, host in zip(outs, arrays, transposed(hosts), hosts):
        assert out.device == array.device and out.dtype == dtype
        numpy.testing.assert_array_equal(out.asnumpy(), want)
        numpy.testing.assert_array_equal(array.asnumpy(), host)       # left as they were


def test_twice_is_the_identity():
    hosts = [numpy.random.default_rng(i).normal(size=(6, 2)) for i in range(3)]
    back = comm.all_to_all(comm.all_to_all(on_devices(hosts)))
    for out, host in zip(back, hosts):
        numpy.testing.assert_array_equal(out.asnumpy(), host)


@pytest.mark.parametrize('n', [1, 2, 5, 8])
def test_each_step_of_the_pairwise_exchange_keeps_every_link_busy_once(n):
    plan = schedules.pairwise_exchange(n)
    assert len(plan.steps) == n - 1
    for step in plan.steps:
        assert sorted(t.source for t in step.transfers) == list(range(n))
        assert sorted(t.target for t in step.transfers) == list(range(n))
        assert all(t.chunk == t.target != t.source for t in step.transfers)
    pairs = {(t.source, t.target) for step in plan.steps for t in step.transfers}
    assert len(pairs) == n * (n - 1)                    # every ordered pair once


@pytest.mark.parametrize('n', [2, 3, 4, 8])
def test_the_bytes_each_device_sends_equal_the_formula(n):
    rows, width = 4 * n, 5
    arrays = on_devices([numpy.ones((rows, width), numpy.float32)] * n)
    npx.waitall()
    with profiler.profile() as records:
        comm.all_to_all(arrays)
        npx.waitall()
    size = rows * width * 4
    moves = comm.transfers_in(records)
    sends = [m for m in moves if m['action'] == 'send']
    for device in (d2l.cpu(i + 1) for i in range(n)):
        sent = sum(m['bytes'] for m in sends if m['source'] == device)
        assert sent == bytes_each_sends(size, n) == (n - 1) * size // n
        assert {m['target'] for m in sends if m['source'] == device} == \
            {d2l.cpu(i + 1) for i in range(n)} - {device}
    assert comm.bytes_sent(records, 'all-to-all') == n * bytes_each_sends(size, n)
    assert len([m for m in moves if m['action'] == 'keep']) == n


@pytest.mark.parametrize('n', [2, 4, 8])
def test_the_cost_on_a_switch_is_the_pairwise_exchanges(n):
    size, topology = 64e6, cost.pcie_server(devices=n)
    expected = (n - 1) * (topology.alpha + size / n / topology.port)
    assert cost.all_to_all_time(size, topology) == pytest.approx(expected, rel=1e-12)
    # it moves (n - 1)/n of the array through each port, as a reduce-scatter does
    assert cost.all_to_all_time(size, topology) == pytest.approx(
        cost.half_time('reduce-scatter', 'ring', size, topology), rel=1e-12)


def test_on_a_ring_the_far_chunks_share_links():
    n, size = 8, 64e6
    ring = cost.nvlink_ring(devices=n, alpha=0)
    # step s sends every chunk min(s, n - s) links: the links carry sum of those hops each
    hops = sum(min(s, n - s) for s in range(1, n))
    assert cost.all_to_all_time(size, ring) == pytest.approx(hops * size / n / ring.ring)


@pytest.mark.parametrize('bad, message', [
    ([numpy.ones(3), numpy.ones(3)], 'equal chunks'),
    ([numpy.ones(2), numpy.ones(4)], 'one shape'),
])
def test_bad_input_is_refused_with_the_fix(bad, message):
    with pytest.raises(ValueError, match=message):
        comm.all_to_all(on_devices(bad))


def gpus_and_host_agree():
    """Two GPUs and a CPU: sends into a GPU land in a buffer, then its own stream places them;
    sends into the CPU copy straight into it."""
    places = [d2l.gpu(0), d2l.gpu(1), d2l.cpu(1)]
    hosts = [numpy.arange(12.0).reshape(6, 2) + 100 * i for i in range(3)]
    outs = comm.all_to_all([np.array(h, device=d) for h, d in zip(hosts, places)])
    for out, place, want in zip(outs, places, transposed(hosts)):
        assert out.device == place
        numpy.testing.assert_array_equal(out.asnumpy(), want)


def test_on_fake_gpus_and_the_host(fake_gpus):
    gpus_and_host_agree()


@pytest.mark.skipif(d2l.num_gpus() < 2, reason='needs two GPUs and CuPy')
def test_on_gpus_and_the_host():
    gpus_and_host_agree()


def test_under_both_engines(engine_kind):
    hosts = [numpy.arange(8.0).reshape(4, 2) * (i + 1) for i in range(4)]
    for out, want in zip(comm.all_to_all(on_devices(hosts)), transposed(hosts)):
        numpy.testing.assert_array_equal(out.asnumpy(), want)
