"""The tape's hooks: recomputation (`autograd.checkpoint`: the same gradients, bit for bit,
for less memory), `autograd.on_backward`, and blocks' forward hooks."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, nn, np

LAYERS, WIDTH, BATCH = 8, 64, 32


def deep_net(batch_norm=False):
    net = nn.Sequential()
    for _ in range(LAYERS):
        net.add(nn.Dense(WIDTH, activation='relu'))
        if batch_norm:
            net.add(nn.BatchNorm())
    net.add(nn.Dense(3))
    net.initialize()
    return net


def segments_of(net, count):
    """The net's layers in `count` consecutive runs, each called as one block."""
    layers = list(net)
    bounds = numpy.linspace(0, len(layers), count + 1).astype(int)
    return [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def run_layers(layers):
    def block(x):
        for layer in layers:
            x = layer(x)
        return x
    return block


def forward(net, x, segments):
    if not segments:
        return net(x)
    for part in segments_of(net, segments):
        x = autograd.checkpoint(run_layers(part), x)
    return x


def gradients(net, x, segments, input_grad=False):
    if input_grad:
        x.attach_grad()
    with autograd.record():
        loss = (forward(net, x, segments) ** 2).sum()
    loss.backward()
    found = {name: p.grad().asnumpy() for name, p in net.collect_params().items()
             if p.grad_req != 'null'}
    return (found, x.grad.asnumpy()) if input_grad else found


@pytest.mark.parametrize('segments', [1, 3, LAYERS + 1])
@pytest.mark.parametrize('batch_norm', [False, True])
def test_checkpointed_gradients_equal_plain_ones_bit_for_bit(segments, batch_norm):
    net = deep_net(batch_norm)
    x = np.random.normal(0, 1, size=(BATCH, 20))
    plain, plain_x = gradients(net, x, 0, input_grad=True)
    again, again_x = gradients(net, x, segments, input_grad=True)
    assert plain.keys() == again.keys()
    for name in plain:
        numpy.testing.assert_array_equal(again[name], plain[name], err_msg=name)
    numpy.testing.assert_array_equal(again_x, plain_x)


def test_a_checkpoint_outside_record_is_the_plain_call():
    net = deep_net()
    x = np.random.normal(0, 1, size=(4, 20))
    numpy.testing.assert_array_equal(forward(net, x, 2).asnumpy(), net(x).asnumpy())


def test_a_checkpoint_of_the_identity_leaves_its_input_a_leaf():
    x = np.ones((3,))
    x.attach_grad()
    with autograd.record():
        y = autograd.checkpoint(lambda a: a, x)
        loss = (y * y).sum()
    loss.backward()
    assert x.node is None
    numpy.testing.assert_array_equal(x.grad.asnumpy(), [2, 2, 2])


def test_a_block_that_returns_a_tuple_is_refused():
    with autograd.record(), pytest.raises(TypeError, match='returns one array'):
        autograd.checkpoint(lambda a: (a, a), np.ones((2,)))


def activation_peak(net, x, segments):
    """The most bytes of activations held at once while one step runs, counted by the device."""
    device = d2l.cpu()
    d2l.npx.waitall()
    d2l.device.reset_peak(device)
    base = d2l.device.memory(device).by_kind['activations']
    gradients(net, x, segments)
    d2l.npx.waitall()
    return d2l.device.memory(device).at_peak['activations'] - base


def test_checkpoints_lower_the_activation_peak():
    net = deep_net()
    x = np.random.normal(0, 1, size=(BATCH, 20))
    activation_peak(net, x, 0)        # the first step makes the parameters' gradients
    plain = activation_peak(net, x, 0)
    three = activation_peak(net, x, 3)
    layer = BATCH * WIDTH * 4
    # Without checkpoints each Dense keeps its input and its pre-activation for backward; with
    # three segments of three layers, the segments' inputs stay, plus one segment's graph while
    # it is computed again: about 3 + 2·3 layers' worth, where the walk waits for each segment.
    assert plain >= 2 * LAYERS * layer
    assert three <= 0.6 * plain, (three, plain)


def test_on_backward_calls_before_the_backward_of_what_computed_the_array():
    x, w, calls = np.ones((3,)), np.ones((3,)), []
    x.attach_grad()

    def gather():                  # ZeRO-3's case: the weights are written again right here
        calls.append('hook')
        w[:] = 5.0
    with autograd.record():
        y = autograd.on_backward(x * w, gather)
        loss = (y * 2).sum()
    assert calls == []
    loss.backward()
    assert calls == ['hook']
    numpy.testing.assert_array_equal(x.grad.asnumpy(), [10, 10, 10])


def test_on_backward_outside_record_returns_the_array_itself():
    x = np.ones((2,))
    assert autograd.on_backward(x, lambda: None) is x


@pytest.mark.parametrize('hybridize', [False, True])
def test_forward_hooks_run_around_a_block_and_may_replace_its_output(hybridize):
    net = nn.Dense(2, in_units=3)
    net.initialize()
    if hybridize:
        net.hybridize()
    seen = []
    pre = net.register_forward_pre_hook(lambda block, args: seen.append(('pre', block)))
    post = net.register_forward_hook(lambda block, args, out: out * 0)
    x = np.ones((1, 3))
    numpy.testing.assert_array_equal(net(x).asnumpy(), [[0, 0]])
    assert seen == [('pre', net)]
    pre.detach()
    post.detach()
    assert net(x).asnumpy().any() and len(seen) == 1


def test_backward_together_sums_alike_heads_and_refuses_walks_out_of_step():
    """The heads of one network split over devices walk in step; a head whose graph is longer
    or shorter would let a collective miss a device's part, so it raises instead."""
    x, y = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    x.attach_grad()
    y.attach_grad()
    with autograd.record():
        a, b = (x * 2).sum(), (y * 3).sum()
    autograd.backward_together([a, b])
    numpy.testing.assert_array_equal(x.grad.asnumpy(), [2.0, 2.0])
    numpy.testing.assert_array_equal(y.grad.asnumpy(), [3.0, 3.0])
    with autograd.record():
        a, b = (x * 2).sum(), (y * 3 * 5).sum()
    with pytest.raises(RuntimeError, match='fell out of step'):
        autograd.backward_together([a, b])
    with autograd.record():
        a = (x * 2).sum()
    with pytest.raises(ValueError):
        autograd.backward_together([a], head_grads=[None, None])
