"""Tests of the decode roofline's counts (d2lperf.inference.roofline): bytes and FLOPs of
prefill and decode against counts taken from a GPT's own parameters, and the intensities the
chapter states (about b/2 FLOP a byte for a float32 decode step, growing with the prompt)."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf.inference import roofline

pytestmark = [pytest.mark.usefixtures('fresh_engine'), pytest.mark.chapter('inference')]

SIZES = [(50, 2, 32, 4), (97, 3, 48, 2), (11, 0, 16, 1)]     # vocab, layers, width, heads


def gpt(vocab, layers, width, heads, dtype='float32'):
    net = d2l.nn.GPT(vocab, layers, width, heads, max_len=64)
    net.initialize()
    if dtype != 'float32':
        net.cast(dtype)
    return net


def counted(net, tokens):
    """(parameters a step over `tokens` tokens reads, weights a token multiplies), from the
    parameters themselves: tables by the rows looked up, matrices whole."""
    read = matmul = 0
    for name, param in net.collect_params().items():
        size = int(numpy.prod(param.shape))
        if name in ('0.position', '0.token.weight'):
            read += tokens * param.shape[1]
        else:
            read += size
            matmul += size if name.endswith('weight') and len(param.shape) == 2 else 0
    return read, matmul


@pytest.mark.parametrize('sizes', SIZES)
@pytest.mark.parametrize('dtype, itemsize', [('float32', 4), ('float64', 8)])
def test_bytes_and_flops_match_the_parameters(sizes, dtype, itemsize):
    net = gpt(*sizes, dtype=dtype)
    layers, width = sizes[1], sizes[2]
    for batch, context in [(1, 1), (3, 17), (64, 40)]:
        read, matmul = counted(net, batch)
        cache = 2 * layers * batch * context * width
        assert roofline.decode_bytes(net, batch, context) == itemsize * (read + cache)
        assert roofline.decode_flops(net, batch, context) == \
            2 * batch * matmul + 4 * layers * batch * context * width
        read, matmul = counted(net, batch * context)
        assert roofline.prefill_bytes(net, batch, context) == itemsize * (read + cache)
        assert roofline.prefill_flops(net, batch, context) == \
            2 * batch * context * matmul + 4 * layers * batch * context ** 2 * width


def test_a_decode_step_does_about_b_over_2_flop_a_byte_in_float32():
    net = gpt(96, 4, 256, 4)          # weights dominate: 12 h² ≫ 13 h
    for batch in (1, 2, 8, 32):
        assert roofline.decode_intensity(net, batch, 1) == pytest.approx(batch / 2, rel=0.03)
    # reading the cache lowers it: at 256 tokens of context the cache outweighs the weights
    assert roofline.decode_intensity(net, 32, 256) < 0.2 * roofline.decode_intensity(net, 32, 1)


def test_prefill_intensity_grows_with_the_prompt():
    net = gpt(96, 2, 64, 4)
    intensities = [roofline.prefill_intensity(net, 1, s) for s in (1, 4, 16, 64)]
    assert intensities == sorted(intensities) and intensities[-1] > 10 * intensities[0]
    assert intensities[0] == pytest.approx(roofline.decode_intensity(net, 1, 1))


def test_the_bound_is_bytes_over_bandwidth_unless_the_peak_is_lower():
    net = gpt(50, 2, 32, 4)
    seconds = roofline.decode_bytes(net, 4, 10) / 10e9
    assert roofline.decode_bound_seconds(net, 4, 10, bandwidth_gb_per_s=10) == seconds
    slow = roofline.decode_flops(net, 4, 10) / 1e6
    assert roofline.decode_bound_seconds(net, 4, 10, 10, peak_gflop_per_s=1e-3) == slow


def test_the_timed_steps_run_and_the_verdict_reads_the_floors():
    net = gpt(50, 2, 32, 4)
    roofline.decode_step(net, 3, 5)()
    roofline.prefill_step(net, 2, 6)()
    rows = [{'batch': 1, 'overhead_ms': 3, 'memory_floor_ms': 1, 'compute_floor_ms': 0.1},
            {'batch': 8, 'overhead_ms': 0.5, 'memory_floor_ms': 1, 'compute_floor_ms': 0.8},
            {'batch': 64, 'overhead_ms': 3, 'memory_floor_ms': 1, 'compute_floor_ms': 6.4}]
    assert roofline.verdict(rows) == {1: 'overhead', 8: 'bandwidth', 64: 'compute'}


def test_the_thin_copy_has_the_same_operations_and_almost_no_bytes():
    net = gpt(50, 3, 32, 4, dtype='float64')
    thin = roofline.thin_copy(net)
    assert thin.config[:2] == net.config[:2] and thin.config[3:] == net.config[3:]
    assert thin[1].attention.num_heads == 4 and roofline.itemsize(thin) == 8
    assert roofline.decode_bytes(thin, 1, 16) < roofline.decode_bytes(net, 1, 16) / 20
