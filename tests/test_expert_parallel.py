"""Expert parallelism on virtual devices: with no token dropped, the outputs and every
gradient equal one device's; the capacity factor's effect on the dropped share, the padding
and the bytes each all-to-all moves, against their formulas."""
import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, comm, np, npx, profiler
from d2lperf.model_parallel import expert_parallel
from d2lperf.nn.moe import MoE, capacity
from strategies import checks
from model_parallel_helpers import devices

pytestmark = pytest.mark.usefixtures('fresh_engine')

HIDDEN, HOME = 8, d2l.cpu(0)


def made(experts, top_k, factor, seed=0):
    moe = MoE(HIDDEN, experts, top_k, factor).initialize(device=HOME)
    rng = numpy.random.default_rng(seed)
    for param in moe.collect_params().values():
        param.set_data(np.array(rng.normal(0, 0.5, param.shape).astype('float32'),
                                device=HOME))
    return moe


def one_device(moe, host):
    x = np.array(host, device=HOME)
    x.attach_grad()
    with autograd.record():
        out = moe(x)
        loss = (out * out).sum()
    loss.backward()
    return out.asnumpy(), x.grad.asnumpy()


def split(ep, host, n):
    xs = [np.array(part, device=d) for part, d in zip(numpy.split(host, n), ep.devices)]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        outs = ep(xs)
        losses = [(out * out).sum() for out in outs]
    ep.backward(losses)
    ep.finish_gradients()
    return (numpy.concatenate([o.asnumpy() for o in outs]),
            numpy.concatenate([x.grad.asnumpy() for x in xs]))


@pytest.mark.parametrize('n, experts, top_k', [(1, 2, 1), (2, 2, 1), (2, 4, 2), (4, 4, 1),
                                               (4, 8, 2)])
def test_with_no_token_dropped_it_equals_one_device(n, experts, top_k):
    equals_one_device(devices(n), experts, top_k)


@pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')
def test_over_a_gpu_and_the_host_it_equals_one_device():
    # Not on tests/fakes/cupy.py: its ufuncs have no `.at`, which embedding's gradient calls.
    equals_one_device([d2l.gpu(0), d2l.cpu(1)], 4, 2)


@checks(10)
@given(n=st.sampled_from([1, 2, 4]), top_k=st.integers(1, 2), each=st.integers(1, 6),
       seed=st.integers(0, 2 ** 16))
def test_any_draw_with_room_for_every_token_equals_one_device(n, top_k, each, seed):
    equals_one_device(devices(n), 4, top_k, each * n, seed)


def equals_one_device(places, experts, top_k, tokens=None, seed=0):
    n = len(places)
    tokens = tokens or 8 * n
    moe = made(experts, top_k, factor=experts / top_k, seed=seed)   # room for every token
    host = numpy.random.default_rng(seed + 1).normal(size=(tokens, HIDDEN)).astype('float32')
    want, want_dx = one_device(moe, host)
    assert moe.dropped == 0
    ep = expert_parallel(moe, places)
    got, dx = split(ep, host, n)
    assert ep.dropped == 0
    numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    local = experts // n
    for e, whole in enumerate(moe.experts):
        rank = ep.ranks[e // local]
        mine = rank.experts[e % local]
        for a, b in zip(mine.collect_params().values(), whole.collect_params().values()):
            assert a.data().device == rank.device
            numpy.testing.assert_allclose(a.grad().asnumpy(), b.grad().asnumpy(),
                                          rtol=1e-5, atol=1e-5)
    for rank in ep.ranks:                    # summed over the devices, as data parallelism
        for a, b in zip(rank.router.collect_params().values(),
                        moe.router.collect_params().values()):
            numpy.testing.assert_allclose(a.grad().asnumpy(), b.grad().asnumpy(),
                                          rtol=1e-5, atol=1e-5)


def steered(experts, factor, balanced):
    """A router that sends token t to expert t mod E (balanced) or every token to expert 0:
    its weights read the first E features, the tokens are one-hot in them."""
    moe = made(experts, 1, factor)
    weight = numpy.zeros((experts, HIDDEN), numpy.float32)
    weight[:, :experts] = 10 * numpy.eye(experts)
    bias = numpy.zeros(experts, numpy.float32) if balanced else 100 * numpy.eye(experts)[0]
    moe.router.weight.set_data(np.array(weight, device=HOME))
    moe.router.bias.set_data(np.array(bias.astype(numpy.float32), device=HOME))
    return moe


def one_hot_tokens(tokens, experts):
    host = numpy.zeros((tokens, HIDDEN), numpy.float32)
    host[numpy.arange(tokens), numpy.arange(tokens) % experts] = 1
    return host


@pytest.mark.parametrize('factor', [0.5, 1.0, 1.25, 2.0])
@pytest.mark.parametrize('balanced', [True, False])
def test_the_capacity_factors_effect_against_its_formulas(factor, balanced):
    """Each device routes T tokens to E experts of capacity C = ⌈T / E · factor⌉: balanced,
    an expert gets T/E and drops max(0, T/E - C), the buffer pads max(0, C - T/E) rows an
    expert; all to expert 0, it drops T - C (if positive) and pads the other experts' rows.
    Each all-to-all sends (n - 1)/n of the E · C · hiddens buffer from every device: two
    forward (there and back), two again backward."""
    n, experts, tokens = 2, 4, 16
    rows = capacity(tokens, experts, 1, factor)
    moe = steered(experts, factor, balanced)
    ep = expert_parallel(moe, devices(n))
    xs = [np.array(one_hot_tokens(tokens, experts), device=d) for d in ep.devices]
    for x in xs:
        x.attach_grad()
    npx.waitall()
    with profiler.profile() as records:
        with autograd.record():
            outs = ep(xs)
            losses = [(out * out).sum() for out in outs]
        npx.waitall()
        forward = len(records)
        ep.backward(losses)
        npx.waitall()
    per_expert = [tokens // experts] * experts if balanced else [tokens] + [0] * (experts - 1)
    dropped = sum(max(0, m - rows) for m in per_expert)
    padding = sum(max(0, rows - m) for m in per_expert)
    assert ep.dropped == n * dropped
    assert ep.dropped / (n * tokens) == pytest.approx(
        max(0.0, 1 - factor) if balanced else max(0, tokens - rows) / tokens)
    for rank in ep.ranks:
        assert rank.dropped == dropped
    routing = ep.ranks[0].route(xs[0])
    assert (routing.slot_token == tokens).sum() == padding
    buffer_bytes = experts * rows * HIDDEN * 4
    for part in (records[:forward], records[forward:]):
        sends = [m for m in comm.transfers_in(part) if m['action'] == 'send']
        for device in ep.devices:
            sent = sum(m['bytes'] for m in sends if m['source'] == device)
            assert sent == 2 * (n - 1) * buffer_bytes // n          # there and back
    kept = numpy.zeros((n, tokens), bool)
    for d in range(n):
        out = outs[d].asnumpy()
        kept[d] = numpy.abs(out).sum(axis=1) > 0
    assert (~kept).sum() == ep.dropped


def test_bad_splits_are_refused():
    moe = made(3, 1, 1.0)
    with pytest.raises(ValueError, match='divides 3'):
        expert_parallel(moe, devices(2))
    ep = expert_parallel(made(2, 1, 1.0), devices(2))
    with pytest.raises(ValueError, match='same number of tokens'):
        ep([np.ones((4, HIDDEN), device=d2l.cpu(1)), np.ones((2, HIDDEN), device=d2l.cpu(2))])
