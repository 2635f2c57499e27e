"""Tests of nn.MoE: one expert is the GPT's MLP; with room for every token it equals a loop
over tokens, values and gradients; over capacity, the dropped choices and their zero outputs
follow the capacity's formula; the load-balancing loss is Switch's, and its gradient and the
gates' match finite differences."""
import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, np, npx
from d2lperf.nn.moe import MoE, capacity, route
from strategies import checks

pytestmark = pytest.mark.usefixtures('fresh_engine')

HIDDEN = 8


def made(num_experts, top_k, capacity_factor, seed=0, dtype='float32'):
    numpy.random.seed(seed)
    moe = MoE(HIDDEN, num_experts, top_k, capacity_factor)
    moe.initialize()
    rng = numpy.random.default_rng(seed)
    for param in moe.collect_params().values():       # router biases too: no ties
        param.set_data(np.array(rng.normal(0, 0.5, param.shape).astype(dtype)))
    return moe.cast(dtype)


def inputs(tokens, seed=1, dtype='float32'):
    return numpy.random.default_rng(seed).normal(size=(tokens, HIDDEN)).astype(dtype)


def run(block, host):
    """Output, and the gradients of sum(out²) for the input and every parameter."""
    x = np.array(host)
    x.attach_grad()
    with autograd.record():
        out = block(x)
        loss = (out * out).sum()
    loss.backward()
    grads = {name: p.grad().asnumpy() for name, p in block.collect_params().items()}
    return out.asnumpy(), x.grad.asnumpy(), grads


def loop_reference(moe, host):
    """Each token on its own: its router probabilities, its top-k experts, their outputs
    weighted by the (renormalized) probabilities; every choice kept."""
    x = np.array(host)
    x.attach_grad()
    with autograd.record():
        rows = []
        for t in range(host.shape[0]):
            token = x[t:t + 1]
            probs = npx.softmax(moe.router(token))
            order = numpy.argsort(-probs.asnumpy()[0], kind='stable')[:moe.top_k]
            gates = [probs[0, int(e)] for e in order]
            total = sum(gates[1:], gates[0]) if moe.top_k > 1 else 1
            rows.append(sum(moe.experts[int(e)](token) * (g / total)
                            for e, g in zip(order, gates)))
        out = np.concatenate(rows)
        loss = (out * out).sum()
    loss.backward()
    grads = {name: p.grad().asnumpy() for name, p in moe.collect_params().items()}
    return out.asnumpy(), x.grad.asnumpy(), grads


def test_capacity_is_the_formula():
    assert capacity(8, 4, 1, 1.25) == 3            # ⌈2.5⌉
    assert capacity(10, 1, 1, 1.1) == 11           # not 12 from 11.000000000000002
    assert capacity(12, 4, 2, 1.0) == 6


def test_one_expert_is_the_gpts_mlp():
    moe = made(1, 1, 1.0)
    mlp = d2l.nn.MLP(HIDDEN)
    mlp.initialize()
    for mine, theirs in zip(mlp.collect_params().values(), moe.expert0.collect_params().values()):
        mine.set_data(theirs.data().copy())
    host = inputs(6)
    out, dx, grads = run(moe, host)
    want, want_dx, want_grads = run(mlp, host)
    assert moe.dropped == 0
    numpy.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    numpy.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        numpy.testing.assert_allclose(grads[f'expert0.{name}'], grad, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_array_equal(grads['router.weight'], 0)    # one expert: p = 1


@checks(15)
@given(experts=st.integers(1, 4), top_k=st.integers(1, 2), tokens=st.integers(1, 9),
       seed=st.integers(0, 2 ** 16))
def test_with_room_for_every_token_it_equals_a_loop_over_tokens(experts, top_k, tokens, seed):
    top_k = min(top_k, experts)
    moe = made(experts, top_k, capacity_factor=experts / top_k, seed=seed)  # rows = tokens
    host = inputs(tokens, seed + 1)
    out, dx, grads = run(moe, host)
    assert moe.dropped == 0
    want, want_dx, want_grads = loop_reference(moe, host)
    numpy.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-5)
    for name, grad in want_grads.items():
        numpy.testing.assert_allclose(grads[name], grad, rtol=1e-4, atol=1e-5, err_msg=name)


@checks(40)
@given(experts=st.integers(1, 6), top_k=st.integers(1, 2), tokens=st.integers(1, 30),
       factor=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]), seed=st.integers(0, 2 ** 16))
def test_choices_over_capacity_are_dropped_first_choices_first(experts, top_k, tokens, factor,
                                                               seed):
    top_k = min(top_k, experts)
    probs = numpy.random.default_rng(seed).dirichlet(numpy.ones(experts), size=tokens)
    rows = capacity(tokens, experts, top_k, factor)
    choices, slot_token, token_slot, dropped, first_share = route(probs, top_k, rows)
    # first choices fill each expert before any second choice: count what each rank keeps
    free = numpy.full(experts, rows)
    expected_dropped = 0
    for rank in range(top_k):
        wanted = numpy.bincount(choices[:, rank], minlength=experts)
        expected_dropped += numpy.maximum(wanted - free, 0).sum()
        free = numpy.maximum(free - wanted, 0)
    assert dropped == expected_dropped
    assert (slot_token < tokens).sum() == tokens * top_k - dropped       # the rest: padding
    kept = token_slot < experts * rows
    assert (slot_token[token_slot[kept]] == numpy.nonzero(kept)[0]).all()
    assert ((token_slot[kept] // rows) == choices[kept]).all()
    # within a rank, an expert keeps its earliest tokens
    for e in range(experts):
        mine = numpy.nonzero(choices[:, 0] == e)[0]
        assert kept[mine, 0].tolist() == sorted(kept[mine, 0].tolist(), reverse=True)
    numpy.testing.assert_allclose(first_share, numpy.bincount(choices[:, 0],
                                                              minlength=experts) / tokens)


def test_a_dropped_token_gets_zero_and_the_others_their_experts():
    moe = made(2, 1, capacity_factor=0.5)          # room for a quarter of the tokens each
    host = inputs(8)
    out, _, _ = run(moe, host)
    want, _, _ = loop_reference(moe, host)
    rows = capacity(8, 2, 1, 0.5)
    choices = route(npx.softmax(moe.router(np.array(host))).asnumpy(), 1, rows)[0][:, 0]
    kept = numpy.zeros(8, bool)
    for e in range(2):
        kept[numpy.nonzero(choices == e)[0][:rows]] = True
    assert moe.dropped == 8 - kept.sum() > 0
    numpy.testing.assert_array_equal(out[~kept], 0)
    numpy.testing.assert_allclose(out[kept], want[kept], rtol=1e-5, atol=1e-6)


def test_the_aux_loss_is_switchs():
    moe = made(4, 2, 1.0)
    host = inputs(16)
    moe(np.array(host))
    probs = npx.softmax(moe.router(np.array(host))).asnumpy()
    first = numpy.bincount(probs.argmax(axis=1), minlength=4) / 16
    assert float(moe.aux_loss.asnumpy()) == pytest.approx(4 * (first * probs.mean(0)).sum(),
                                                          rel=1e-6)
    uniform = made(4, 1, 1.0)
    uniform.router.weight.set_data(np.zeros((4, HIDDEN)))
    uniform.router.bias.set_data(np.zeros(4))
    uniform(np.array(host))
    assert float(uniform.aux_loss.asnumpy()) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize('top_k', [1, 2])
def test_the_router_gradient_matches_finite_differences(top_k):
    """The gates' and the aux loss's gradients, in float64, against central differences of
    sum(out²) + aux_loss in the router's weights (small steps change no choice)."""
    moe = made(3, top_k, 3.0, dtype='float64')
    host = inputs(5, dtype='float64')

    def loss():
        out = moe(np.array(host))
        return float(((out * out).sum() + moe.aux_loss).asnumpy())
    with autograd.record():
        out = moe(np.array(host))
        total = (out * out).sum() + moe.aux_loss
    total.backward()
    grad = moe.router.weight.grad().asnumpy()
    weight = moe.router.weight.data().asnumpy()
    eps = 1e-6
    for index in [(0, 0), (1, 3), (2, 7)]:
        for sign in (1, -1):
            moved = weight.copy()
            moved[index] += sign * eps
            moe.router.weight.set_data(np.array(moved))
            if sign == 1:
                up = loss()
            else:
                down = loss()
        moe.router.weight.set_data(np.array(weight))
        assert (up - down) / (2 * eps) == pytest.approx(grad[index], rel=1e-5, abs=1e-8)


@pytest.mark.parametrize('kwargs, message', [
    (dict(num_experts=0), 'num_experts'),
    (dict(num_experts=2, top_k=3), 'top_k'),
    (dict(num_experts=1, top_k=2), 'top_k'),
    (dict(num_experts=2, capacity_factor=0), 'capacity_factor'),
])
def test_bad_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(HIDDEN, **kwargs)


# -- the GPT with mixtures (nn.GPT(..., num_experts, top_k, moe_every)) ---------------------------

def test_the_gpt_makes_every_moe_every_th_layer_a_mixture():
    net = d2l.nn.GPT(50, 5, 16, 2, 8, num_experts=4, top_k=2, moe_every=2)
    kinds = [type(layer.mlp).__name__ for layer in net.children()[1:-1]]
    assert kinds == ['MLP', 'MoE', 'MLP', 'MoE', 'MLP']
    assert [(m.num_experts, m.top_k) for m in net.mixtures()] == [(4, 2), (4, 2)]
    again = d2l.nn.GPT(*net.config)                  # config makes the same model
    assert [type(layer.mlp).__name__ for layer in again.children()[1:-1]] == kinds
    assert d2l.nn.GPT(50, 3, 16, 2, 8).mixtures() == []
    every = d2l.nn.GPT(50, 3, 16, 2, 8, num_experts=2, moe_every=1)
    assert len(every.mixtures()) == 3


def test_the_gpt_with_mixtures_learns_and_its_routers_learn_from_the_aux_loss():
    """Cross-entropy plus α times the mixtures' load-balancing losses: every router and every
    expert that took a token gets a gradient, and a few Adam steps lower the loss."""
    numpy.random.seed(0)
    net = d2l.nn.GPT(20, 2, 16, 2, 8, num_experts=4, top_k=2, moe_every=1)
    net.initialize()
    rng = numpy.random.default_rng(0)
    tokens, labels = (np.array(rng.integers(0, 20, (4, 8))) for _ in range(2))
    trainer = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 1e-2})
    loss_fn, losses = d2l.nn.SoftmaxCrossEntropyLoss(), []
    for _ in range(8):
        with autograd.record():
            loss = loss_fn(net(tokens), labels).mean()
            total = loss + 0.01 * sum(m.aux_loss for m in net.mixtures())
        total.backward()
        if not losses:
            for moe in net.mixtures():
                assert numpy.abs(moe.router.weight.grad().asnumpy()).max() > 0
                used = [e for e, expert in enumerate(moe.experts)
                        if numpy.abs(expert.hidden.weight.grad().asnumpy()).max() > 0]
                assert used, 'no expert took a token'
        trainer.step(1)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize('kwargs, message', [
    (dict(num_experts=-1), 'num_experts'), (dict(num_experts=2.5), 'num_experts'),
    (dict(num_experts=2, moe_every=0), 'moe_every'), (dict(num_experts=2, top_k=3), 'top_k')])
def test_a_gpt_with_bad_expert_settings_is_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        d2l.nn.GPT(50, 2, 16, 2, 8, **kwargs)


def test_a_gpt_with_mixtures_refuses_to_be_traced_naming_the_routers_read_back():
    net = d2l.nn.GPT(20, 2, 16, 2, 8, num_experts=4)
    net.initialize()
    tokens = np.array(numpy.zeros((2, 8), 'int64'))
    expected = net(tokens).asnumpy()
    net.hybridize()
    with pytest.raises(d2l.hybrid.TraceError, match='asnumpy'):
        net(tokens)
    net.hybridize(False)
    assert numpy.array_equal(net(tokens).asnumpy(), expected)
