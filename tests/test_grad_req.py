"""grad_req, MXNet's: 'write' (each backward pass replaces `.grad`), 'add' (backward passes add
into `.grad` until `zero_grad()`), 'null' (no gradient), on arrays (`autograd.mark_variables`),
on parameters and on a net's parameter collection."""
import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, nn, np
from strategies import checks

pytestmark = pytest.mark.usefixtures('fresh_engine')


def dense():
    layer = nn.Dense(3, in_units=4)
    np.random.seed(0)
    layer.initialize(init=nn.init.Normal(sigma=0.5))
    return layer


def backward(layer, x):
    with autograd.record():
        loss = (layer(x) * layer(x)).sum()
    loss.backward()


def grads(layer):
    return {name: p.grad().asnumpy() for name, p in layer.collect_params().items()}


def test_add_accumulates_over_backward_calls_and_zero_grad_resets():
    layer, x = dense(), np.random.normal(0, 1, size=(2, 4))
    backward(layer, x)
    once = grads(layer)
    layer.weight.grad_req = 'add'
    layer.bias.grad_req = 'add'
    backward(layer, x)
    twice = grads(layer)
    for name in once:
        numpy.testing.assert_array_equal(twice[name], once[name] + once[name])
    layer.collect_params().zero_grad()
    assert all(not g.any() for g in grads(layer).values())
    backward(layer, x)
    for name in once:
        numpy.testing.assert_array_equal(grads(layer)[name], once[name])
    layer.weight.zero_grad()
    assert not layer.weight.grad().asnumpy().any() and layer.bias.grad().asnumpy().any()


def test_write_replaces_the_gradient_of_the_pass_before():
    layer, x = dense(), np.random.normal(0, 1, size=(2, 4))
    backward(layer, x)
    once = grads(layer)
    backward(layer, x)
    for name, g in grads(layer).items():
        numpy.testing.assert_array_equal(g, once[name])


def test_null_gets_no_gradient_and_back_to_write_starts_from_zeros():
    layer, x = dense(), np.random.normal(0, 1, size=(2, 4))
    layer.bias.grad_req = 'null'
    assert layer.bias.grad() is None
    backward(layer, x)
    assert layer.bias.grad() is None and layer.weight.grad().asnumpy().any()
    layer.bias.grad_req = 'write'
    assert layer.bias.grad().asnumpy().tolist() == [0.0, 0.0, 0.0]


def test_a_bad_grad_req_is_named():
    with pytest.raises(ValueError, match="'write', 'add' or 'null'"):
        nn.Parameter('w', (2,), grad_req='sum')
    layer = dense()
    with pytest.raises(ValueError, match="'write', 'add' or 'null'"):
        layer.weight.grad_req = 'accumulate'


def test_grad_req_is_kept_when_the_parameter_moves_or_is_cast():
    layer, x = dense(), np.random.normal(0, 1, size=(2, 4))
    layer.weight.grad_req = 'add'
    layer.cast('float64')
    backward(layer, x.astype('float64'))
    once = layer.weight.grad().asnumpy()
    backward(layer, x.astype('float64'))
    numpy.testing.assert_array_equal(layer.weight.grad().asnumpy(), once + once)


def test_mark_variables_on_arrays():
    x, y = np.array([1.0, 2.0]), np.array([1.0, 2.0])
    autograd.mark_variables([x, y], [np.zeros(2), np.zeros(2)], grad_reqs=['add', 'write'])
    assert autograd.grad_req(x) == 'add' and autograd.grad_req(y) == 'write'
    for _ in range(3):
        with autograd.record():
            z = (x * y * 3.0).sum()
        z.backward()
    assert x.grad.asnumpy().tolist() == [9.0, 18.0] and y.grad.asnumpy().tolist() == [3.0, 6.0]
    assert autograd.grad_req(np.array([1.0])) == 'null'
    with pytest.raises(ValueError, match='one gradient a variable'):
        autograd.mark_variables([x], [])


@checks(max_examples=20)
@given(calls=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_k_backward_calls_with_add_equal_the_sum_of_k_writes(calls, seed):
    """Each 'write' pass's gradient, summed in the order of the passes, is bit for bit what
    'add' holds after the same passes."""
    layer = dense()
    rng = numpy.random.default_rng(seed)
    xs = [np.array(rng.standard_normal((2, 4)).astype('float32')) for _ in range(calls)]
    written = []
    for x in xs:
        backward(layer, x)
        written.append(grads(layer))
    layer.collect_params().zero_grad()
    for param in layer.collect_params().values():
        param.grad_req = 'add'
    for x in xs:
        backward(layer, x)
    for name, g in grads(layer).items():
        total = numpy.zeros_like(g)
        for w in written:
            total = total + w[name]
        numpy.testing.assert_array_equal(g, total, err_msg=name)


def test_add_adds_in_place_and_zero_grad_gives_a_fresh_buffer():
    """'add' is MXNet's kAddTo: the buffer stays, so a step that accumulates holds no third
    array of a gradient's size; zero_grad() leaves an array someone kept from before as it was."""
    layer, x = dense(), np.random.normal(0, 1, size=(2, 4))
    layer.weight.grad_req = 'add'
    buffer = layer.weight.grad()
    backward(layer, x)
    assert layer.weight.grad() is buffer
    kept = buffer.asnumpy()
    layer.weight.zero_grad()
    assert layer.weight.grad() is not buffer
    numpy.testing.assert_array_equal(buffer.asnumpy(), kept)


def test_a_hybridized_net_accumulates_too():
    """A compiled net records one node whose rule gives every parameter's gradient; the walk
    writes or adds them as for any leaf."""
    net = nn.HybridSequential()
    net.add(nn.Dense(3, in_units=4))
    np.random.seed(0)
    net.initialize()
    net.hybridize()
    x = np.random.normal(0, 1, size=(2, 4))

    def step():
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
    step()
    once = grads(net)
    for param in net.collect_params().values():
        param.grad_req = 'add'
    step()
    step()
    for name, g in grads(net).items():
        numpy.testing.assert_array_equal(g, once[name] + once[name] + once[name])


def test_a_pipeline_step_cut_short_by_ctrl_c_leaves_no_parameter_adding(monkeypatch):
    """A Ctrl-C while a pipeline step readies its sums (here: at the third gradient it
    zeroes) must leave no parameter adding into the next steps: each later step's gradients
    are that step's alone."""
    from d2lperf.model_parallel import parallel_gpt
    from d2lperf.np.multiarray import NDArray
    rng = numpy.random.default_rng(0)
    tokens, labels = (np.array(rng.integers(0, 20, (4, 8))) for _ in range(2))
    loss = d2l.SoftmaxCrossEntropyLoss()

    def split():
        np.random.seed(0)
        net = nn.GPT(20, 2, 16, 4, 8)
        net.initialize(device=d2l.cpu(0))
        return parallel_gpt(net, [d2l.cpu(1), d2l.cpu(2)], 1, 1, 2, '1f1b')
    cut, clean = split(), split()
    calls, attach_grad = [], NDArray.attach_grad

    def interrupted(array):
        calls.append(array)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return attach_grad(array)
    monkeypatch.setattr(NDArray, 'attach_grad', interrupted)
    with pytest.raises(KeyboardInterrupt):
        cut.forward_backward(tokens, labels, loss, 2)
    monkeypatch.undo()
    for _ in range(2):
        cut.forward_backward(tokens, labels, loss, 2)
    clean.forward_backward(tokens, labels, loss, 2)
    for a, b in zip(cut.collect_params().values(), clean.collect_params().values()):
        assert a.grad_req == 'write'
        numpy.testing.assert_array_equal(a.grad().asnumpy(), b.grad().asnumpy())
