"""Tests of d2lperf.comm.cost: the MXNet edition's four numbers from its own assumptions, the
V100's NVLink as it is, the textbook costs of Thakur, Rabenseifner and Gropp (2005), and
fitting α and β to measured times."""

import numpy
import pytest
from hypothesis import given, strategies as st

from d2lperf.comm import cost
from strategies import checks
from strategies.comm import ALGORITHMS

pytestmark = pytest.mark.chapter('parameter_servers')

GRADIENTS = 160e6             # the MXNet edition's 160 MB


@pytest.mark.parametrize('algorithm, milliseconds', [('naive', 60), ('cpu', 80), ('split', 15)])
def test_the_mxnet_editions_4_gpu_pcie_server(algorithm, milliseconds):
    exact = cost.allreduce_time(algorithm, GRADIENTS, cost.pcie_server(alpha=0))
    assert exact == pytest.approx(milliseconds / 1e3, rel=1e-12)
    with_latency = cost.allreduce_time(algorithm, GRADIENTS, cost.pcie_server())
    assert exact < with_latency < 1.01 * exact


def test_the_mxnet_editions_8_v100s_from_its_18_gb_per_second():
    """Its 2 · 160 MB / (3 · 18 GB/s) ≈ 6 ms rounds the ring's (n - 1) / n to 1."""
    edition = 2 * GRADIENTS / (3 * 18e9)
    assert round(edition * 1e3) == 6
    rings = cost.p3_two_rings(bandwidth=cost.NVLINK_MXNET_EDITION, alpha=0)
    seconds = cost.allreduce_time('ring', GRADIENTS, rings)
    assert seconds == pytest.approx(edition * 7 / 8, rel=1e-12)


def test_8_v100s_on_two_nvlink_rings_at_25_gb_per_second():
    """The V100 whitepaper's 25 GB/s a link and direction: 2 · 7/8 · 160 MB / 75 GB/s."""
    assert cost.NVLINK == 25e9
    seconds = cost.allreduce_time('ring', GRADIENTS, cost.p3_two_rings(alpha=0))
    assert seconds == pytest.approx(2 * 7 / 8 * GRADIENTS / (3 * 25e9), rel=1e-12)
    assert 3.7e-3 < seconds < 3.8e-3
    with_latency = cost.allreduce_time('ring', GRADIENTS, cost.p3_two_rings())
    assert seconds < with_latency < 1.02 * seconds          # 14 steps of 3 µs
    both_ways = cost.allreduce_time('ring2', GRADIENTS, cost.p3_two_rings(alpha=0))
    assert both_ways == pytest.approx(seconds / 2)          # the MXNet edition's exercise 1


@checks(40)
@given(n=st.integers(2, 16), chunk=st.integers(0, 10 ** 8),
       alpha=st.floats(0, 1e-4), bandwidth=st.floats(1e8, 1e11))
def test_costs_on_a_switch_are_the_textbook_ones(n, chunk, alpha, bandwidth):
    switch = cost.Topology('switch', n, bandwidth, bandwidth, None, alpha)
    size, beta = n * chunk, 1 / bandwidth
    expected = {'ring': 2 * (n - 1) * (alpha + chunk * beta),
                'split': 2 * (n - 1) * (alpha + chunk * beta),
                'naive': 2 * (n - 1) * (alpha + size * beta),
                'tree': 2 * (n - 1).bit_length() * (alpha + size * beta),
                'cpu': 2 * n * (alpha + size * beta)}
    for algorithm, seconds in expected.items():
        assert cost.allreduce_time(algorithm, size, switch) == pytest.approx(seconds)


def test_a_second_ring_helps_on_nvlink_but_not_through_a_switch():
    for n in (4, 8):
        nvlink = cost.nvlink_ring(n, alpha=0)
        pcie = cost.pcie_server(n, alpha=0)
        assert cost.allreduce_time('ring2', 1e8, nvlink) == pytest.approx(
            cost.allreduce_time('ring', 1e8, nvlink) / 2)
        assert cost.allreduce_time('ring2', 1e8, pcie) == pytest.approx(
            cost.allreduce_time('ring', 1e8, pcie))
        assert min(ALGORITHMS, key=lambda a: cost.allreduce_time(a, 1e8, nvlink)) == 'ring2'


def test_the_parameter_server_is_the_bottleneck_on_ethernet():
    times = {m: cost.allreduce_time('cpu', 1e8, cost.ethernet(m)) for m in (2, 4, 8)}
    assert times[8] / times[2] == pytest.approx(4, rel=1e-3)                 # O(m)
    rings = {m: cost.allreduce_time('ring', 1e8, cost.ethernet(m)) for m in (2, 4, 8)}
    assert rings[8] / rings[2] < 2                                           # nearly flat


def test_bus_bandwidth_is_nccl_tests():
    assert cost.bus_bandwidth(1e9, 1.0, 2) == 1e9
    assert cost.bus_bandwidth(1e9, 1.0, 8) == pytest.approx(1.75e9)


@checks(40)
@given(alpha=st.floats(1e-7, 1e-3), bandwidth=st.floats(1e8, 1e11))
def test_fit_recovers_alpha_and_beta(alpha, bandwidth):
    sizes = 2.0 ** numpy.arange(10, 27, 2)
    fitted_alpha, fitted_beta = cost.fit_alpha_beta(sizes, alpha + sizes / bandwidth)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(1 / bandwidth, rel=1e-6)


def test_fit_takes_an_unresolvable_latency_as_zero():
    sizes = numpy.array([1e6, 2e6, 4e6])
    alpha, beta = cost.fit_alpha_beta(sizes, sizes * 1e-9 - 1e-5)
    assert alpha == 0 and beta == pytest.approx(1e-9, rel=0.05)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match='two different sizes'):
        cost.fit_alpha_beta([1e6, 1e6], [1e-3, 1e-3])
    with pytest.raises(ValueError, match='one time a size'):
        cost.fit_alpha_beta([1e6, 2e6], [1e-3])
    with pytest.raises(ValueError, match='unknown allreduce algorithm'):
        cost.allreduce_time('butterfly', 1e6, cost.pcie_server())
    with pytest.raises(ValueError, match='no host link'):
        cost.allreduce_time('cpu', 1e6, cost.Topology('no host', 4, 1e9, None, None, 0))


@checks(40)
@given(n=st.integers(2, 8), chunk=st.integers(1, 10**6), alpha=st.sampled_from([0.0, 1e-5]),
       bandwidth=st.sampled_from([1e9, 16e9]), algorithm=st.sampled_from(['ring', 'split']))
def test_the_halves_cost_half_an_allreduce_each(n, chunk, alpha, bandwidth, algorithm):
    """On a switch each half moves (n-1)/n of the data through every port; the ring in n-1
    messages, split in one step of n-1 messages a port: the textbook costs, and the two halves
    add up to the allreduce."""
    topology = cost.Topology('switch', n, bandwidth, bandwidth, None, alpha)
    size = n * chunk
    halves = [cost.half_time(c, algorithm, size, topology)
              for c in ('reduce-scatter', 'all-gather')]
    for seconds in halves:
        assert seconds == pytest.approx((n - 1) * (alpha + chunk / bandwidth), rel=1e-9)
    assert sum(halves) == pytest.approx(cost.allreduce_time(algorithm, size, topology), rel=1e-9)
