"""ZeRO and Buckets at the edges of a step: a unit the loss does not reach, a step interrupted
in backward, a hybridized net under stage 3, and fewer losses than devices. Each is compared
with one device's step, as `test_data_parallel.py` compares a whole step."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, nn, np
from d2lperf.data_parallel import Buckets, Zero

rng = numpy.random.default_rng(0)
X = np.array(rng.standard_normal((24, 8)).astype('float32'))
y = np.array(rng.integers(0, 10, 24))
loss = d2l.SoftmaxCrossEntropyLoss()
DEVICES = [d2l.cpu(1), d2l.cpu(2), d2l.cpu(3)]
OPTIMIZERS = [('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.1}),
              ('adam', {'learning_rate': 0.01, 'wd': 0.1})]


def mlp(devices):
    net = nn.HybridSequential()
    net.add(nn.Dense(16, in_units=8, activation='relu'), nn.Dense(10, in_units=16))
    np.random.seed(0)
    net.initialize(init=d2l.nn.init.Normal(sigma=0.1), device=devices)
    return net


def one_device(forward, optimizer, steps):
    """The weights after `steps` steps on one device with the whole batch."""
    net = mlp([d2l.cpu(1)])
    strategy = Buckets(net.collect_params(), *optimizer)
    inputs, labels = X.copyto(d2l.cpu(1)), y.copyto(d2l.cpu(1))
    for _ in range(steps):
        strategy.step(lambda: [forward(net, inputs, labels)], 24)
    return strategy.weights()


def assert_weights_equal(found, expected):
    assert found.keys() == expected.keys()
    for key in expected:
        numpy.testing.assert_allclose(found[key], expected[key], atol=1e-6, rtol=0, err_msg=key)


# -- a unit the loss does not reach --------------------------------------------------------------
def first_unit_only(net, a, b):
    return (net[0](a) ** 2).sum()


def second_unit_unused(net, a, b):
    hidden = net[0](a)
    net[1](hidden)                     # run forward, but its output is not in the loss
    return (hidden ** 2).sum()


def with_a_zero_gradient(net, a, b):
    """One device's reference: the second unit reached, with a gradient of exactly zero."""
    hidden = net[0](a)
    return (hidden ** 2).sum() + 0 * net[1](hidden).sum()


@pytest.mark.parametrize('optimizer', OPTIMIZERS, ids=['momentum', 'adam'])
@pytest.mark.parametrize('forward', [first_unit_only, second_unit_unused])
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_a_unit_the_loss_does_not_reach_gets_zero_gradients(engine_kind, stage, forward,
                                                            optimizer):
    """DDP's find_unused_parameters: such a unit's gradient is zero, and the step is one
    device's step with a zero gradient there (weight decay still moves it)."""
    net = mlp(DEVICES)
    strategy = Zero(net, stage, *optimizer)
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    for _ in range(3):
        strategy.step(lambda: [forward(net, a, b) for a, b in zip(X_parts, y_parts)], 24)
    expected = one_device(with_a_zero_gradient, optimizer, 3)
    assert_weights_equal(strategy.weights(), expected)
    untouched = mlp([d2l.cpu(1)]).collect_params()['1.weight'].data().asnumpy()
    assert numpy.abs(expected['1.weight'] - untouched).max() > 1e-4      # weight decay moved it


@pytest.mark.parametrize('name', ['ZeRO 1', 'ZeRO 2', 'ZeRO 3', 'Buckets',
                                  'Buckets after backward'])
def test_a_unit_reached_on_some_devices_or_none_gets_zeros_there(engine_kind, name):
    """Three steps: every device reaches the second unit, then only the first device, then
    none. A device that did not reach it adds zeros to the sum, never its last step's gradient
    (which Buckets summed and applied again): one device's steps on the same parts."""
    optimizer = OPTIMIZERS[0]
    net = mlp(DEVICES)
    strategy = strategies(optimizer)[name](net)
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    steps = [[plain] * 3, [plain, first_unit_only, first_unit_only], [first_unit_only] * 3]
    for forwards in steps:
        strategy.step(lambda: [f(net, a, b) for f, a, b in zip(forwards, X_parts, y_parts)], 24)
    reference = mlp([d2l.cpu(1)])
    one = Buckets(reference.collect_params(), *optimizer)
    parts = [(a.copyto(d2l.cpu(1)), b.copyto(d2l.cpu(1))) for a, b in zip(X_parts, y_parts)]
    for forwards in steps[:-1] + [[with_a_zero_gradient] * 3]:
        one.step(lambda: [sum(f(reference, a, b).sum() for f, (a, b) in zip(forwards, parts))],
                 24)
    assert_weights_equal(strategy.weights(), one.weights())


# -- a step interrupted in backward ---------------------------------------------------------------
def plain(net, a, b):
    return loss(net(a), b)


def interrupted_on(call):
    """A forward whose backward raises KeyboardInterrupt at the `call`-th hook it reaches (one a
    device's pass), between the two units; None once it has raised."""
    calls = []

    def hook():
        calls.append(None)
        if len(calls) == call:
            raise KeyboardInterrupt

    def forward(net, a, b):
        return loss(net[1](autograd.on_backward(net[0](a), hook)), b)
    return forward


@pytest.mark.parametrize('sync', [True, False])
@pytest.mark.parametrize('call', [1, len(DEVICES)])
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_an_interrupted_step_leaves_nothing_for_the_next(engine_kind, stage, call, sync):
    """Ctrl-C in the middle of backward, then one clean step: the weights are one clean step's,
    as if the interrupted one had never started (its gradients, kept or sent, are dropped)."""
    optimizer = OPTIMIZERS[0]
    net = mlp(DEVICES)
    strategy = Zero(net, stage, *optimizer)
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    interrupted = interrupted_on(call)
    with pytest.raises(KeyboardInterrupt):
        strategy.accumulate(lambda: [interrupted(net, a, b) for a, b in zip(X_parts, y_parts)],
                            sync=sync)
    strategy.step(lambda: [plain(net, a, b) for a, b in zip(X_parts, y_parts)], 24)
    assert_weights_equal(strategy.weights(), one_device(plain, optimizer, 1))


# -- one loss a device ----------------------------------------------------------------------------
def strategies(optimizer=('sgd', {})):
    return {'ZeRO 1': lambda net: Zero(net, 1, *optimizer),
            'ZeRO 2': lambda net: Zero(net, 2, *optimizer),
            'ZeRO 3': lambda net: Zero(net, 3, *optimizer),
            'Buckets': lambda net: Buckets(net.collect_params(), *optimizer, cap_bytes=600),
            'Buckets after backward': lambda net: Buckets(net.collect_params(), *optimizer,
                                                          overlap=False)}


@pytest.mark.parametrize('count', [2, 4])
@pytest.mark.parametrize('name', list(strategies()))
def test_a_step_takes_one_loss_a_device(engine_kind, name, count):
    """Fewer losses than devices would train on part of the batch; more would not fit. Either
    is refused, naming both counts, and the weights stay as they were; a good step then
    trains as one device."""
    net = mlp(DEVICES)
    strategy = strategies()[name](net)
    before = strategy.weights()
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    pairs = list(zip(X_parts, y_parts))
    pairs = pairs[:count] if count < len(DEVICES) else pairs + pairs[:1]
    with pytest.raises(ValueError, match=f'{count} losses.*{len(DEVICES)} devices'):
        strategy.step(lambda: [plain(net, a, b) for a, b in pairs], 24)
    assert_weights_equal(strategy.weights(), before)
    strategy.step(lambda: [plain(net, a, b) for a, b in zip(X_parts, y_parts)], 24)
    assert_weights_equal(strategy.weights(), one_device(plain, ('sgd', {}), 1))


# -- a unit used in two checkpointed segments ------------------------------------------------
def tied_net(devices):
    net = nn.HybridSequential()
    net.add(nn.Dense(8, in_units=8, activation='relu'), nn.Dense(10, in_units=8))
    np.random.seed(0)
    net.initialize(init=d2l.nn.init.Normal(sigma=0.3), device=devices)
    return net


def twice_checkpointed(net, a, b):
    hidden = autograd.checkpoint(net[0], autograd.checkpoint(net[0], a))
    return loss(net[1](hidden), b)


def twice_plain(net, a, b):
    return loss(net[1](net[0](net[0](a))), b)


def test_a_unit_in_two_checkpointed_segments_sums_after_backward_as_one_device(engine_kind):
    net = tied_net(DEVICES)
    strategy = Buckets(net.collect_params(), overlap=False)
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    strategy.step(lambda: [twice_checkpointed(net, a, b) for a, b in zip(X_parts, y_parts)], 24)
    reference = tied_net([d2l.cpu(1)])
    one = Buckets(reference.collect_params())
    one.step(lambda: [twice_plain(reference, X.copyto(d2l.cpu(1)), y.copyto(d2l.cpu(1)))], 24)
    assert_weights_equal(strategy.weights(), one.weights())


@pytest.mark.parametrize('name', ['ZeRO 1', 'ZeRO 2', 'ZeRO 3', 'Buckets'])
def test_a_unit_in_two_checkpointed_segments_is_refused_where_sums_start_in_backward(
        engine_kind, name):
    """Each segment's walk gives the unit a gradient, the first before the second is made: a
    sum started from the first would miss the second, so the step is refused (DDP's rule) and
    the weights are left as they were."""
    net = tied_net(DEVICES)
    strategy = strategies()[name](net)
    before = strategy.weights()
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    with pytest.raises(RuntimeError, match='second gradient in one backward pass'):
        strategy.step(lambda: [twice_checkpointed(net, a, b)
                               for a, b in zip(X_parts, y_parts)], 24)
    d2l.npx.waitall()
    assert_weights_equal(strategy.weights(), before)


# -- a hybridized net ---------------------------------------------------------------------------
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_a_hybridized_net_trains_as_one_device(engine_kind, stage):
    """MXNet's users hybridize everything. Stages 1 and 2 run the compiled net; stage 3 gathers
    each unit just before its forward and its backward, which one compiled graph would run
    past, so `Zero(net, 3)` runs the net imperatively."""
    optimizer = OPTIMIZERS[0]
    net = mlp(DEVICES)
    net.hybridize()
    strategy = Zero(net, stage, *optimizer)
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    for _ in range(2):
        strategy.step(lambda: [plain(net, a, b) for a, b in zip(X_parts, y_parts)], 24)
    assert_weights_equal(strategy.weights(), one_device(plain, optimizer, 2))


def test_hybridizing_after_zero_three_is_refused_at_the_first_forward(engine_kind):
    """Hybridized after `Zero(net, 3)` took it, the net is refused as it is traced, naming the
    fix, and the step leaves the weights as they were; with the fix it trains as one device."""
    optimizer = OPTIMIZERS[0]
    net = mlp(DEVICES)
    strategy = Zero(net, 3, *optimizer)
    before = strategy.weights()
    net.hybridize()
    X_parts, y_parts = d2l.split_batch(X, y, DEVICES)
    forward = lambda: [plain(net, a, b) for a, b in zip(X_parts, y_parts)]
    with pytest.raises(d2l.hybrid.TraceError, match=r'call net\.hybridize\(False\)'):
        strategy.step(forward, 24)
    assert_weights_equal(strategy.weights(), before)
    net.hybridize(False)
    strategy.step(forward, 24)
    assert_weights_equal(strategy.weights(), one_device(plain, optimizer, 1))
