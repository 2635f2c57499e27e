"""Tests of d2lperf.nn and d2lperf.Trainer, run imperatively, against NumPy by hand."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, nn, np

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)
RNG = numpy.random.default_rng(1)


def host(*shape):
    return RNG.uniform(-1, 1, shape).astype(numpy.float32)


def mlp():
    net = nn.Sequential()
    net.add(nn.Dense(4, activation='relu'), nn.Dense(2))
    return net


# -- layers and parameters ----------------------------------------------------------------------

def test_dense_learns_its_input_size_from_the_first_batch():
    net = mlp()
    net.initialize()
    assert net[0].weight.shape == (4, 0)
    with pytest.raises(nn.DeferredInitializationError, match='initialize'):
        net[0].weight.data()
    y = net(np.array(host(5, 3)))
    assert y.shape == (5, 2) and y.asnumpy().shape == (5, 2)
    assert net[0].weight.shape == (4, 3) and net[1].weight.shape == (2, 4)
    weight = net[0].weight.data().asnumpy()
    assert weight.dtype == numpy.float32 and numpy.abs(weight).max() <= 0.07
    assert net[0].bias.data().asnumpy().tolist() == [0.0] * 4


def test_dense_computes_relu_of_x_w_transposed_plus_b():
    layer = nn.Dense(3, activation='relu', in_units=2)
    layer.initialize(init=nn.init.Normal(1.0))
    layer.bias.set_data(np.array([0.5, -0.5, 0.0]))
    x = host(4, 2)
    w, b = layer.weight.data().asnumpy(), layer.bias.data().asnumpy()
    numpy.testing.assert_allclose(layer(np.array(x)).asnumpy(), numpy.maximum(x @ w.T + b, 0),
                                  rtol=1e-6)


def test_collect_params_names_every_parameter_by_its_path():
    class Net(nn.Block):
        def __init__(self):
            super().__init__()
            self.body = mlp()
            self.head = nn.Dense(1)

        def forward(self, x):
            return self.head(self.body(x))
    params = Net().collect_params()
    assert list(params) == ['body.0.weight', 'body.0.bias', 'body.1.weight', 'body.1.bias',
                            'head.weight', 'head.bias']
    assert all(isinstance(p, nn.Parameter) for p in params.values())


def test_initialize_on_another_device():
    net = mlp()
    net.initialize(device=CPU1)
    y = net(np.array(host(2, 3), device=CPU1))
    assert y.device == CPU1
    assert all(p.data().device == CPU1 for p in net.collect_params().values())
    with pytest.raises(RuntimeError, match=r'not initialized on cpu\(0\).*only initialized on '
                                           r'\[cpu\(1\)\]'):
        net(np.array(host(2, 3)))


def test_initialize_on_two_devices_copies_the_same_values():
    layer = nn.Dense(2, in_units=3)
    layer.initialize(device=[CPU0, CPU1])
    first, second = layer.weight.list_data()
    assert (first.device, second.device) == (CPU0, CPU1)
    numpy.testing.assert_array_equal(first.asnumpy(), second.asnumpy())


def test_deferred_initialize_on_two_devices_draws_once():
    net = mlp()
    net.initialize(init=nn.init.Normal(1.0), device=[CPU0, CPU1])
    net(np.array(host(2, 3), device=CPU1))          # shapes learnt on the second device
    for param in net.collect_params().values():
        first, second = param.list_data()
        assert param.list_device() == [CPU0, CPU1] and first.device == CPU0
        assert first.asnumpy().tobytes() == second.asnumpy().tobytes()     # bit-identical
        assert [g.device for g in param.list_grad()] == [CPU0, CPU1]


def test_data_follows_mxnets_device_rule():
    alone, pair, apart = (nn.Dense(2, in_units=3) for _ in range(3))
    alone.initialize(device=CPU1)
    pair.initialize(device=[CPU1, CPU0])
    apart.initialize(device=[CPU1, d2l.cpu(2)])
    assert alone.weight.data().device == CPU1               # one device: that one
    assert pair.weight.data().device == CPU0                # several: None means cpu(0)
    assert pair.weight.data(CPU1) is pair.weight.list_data()[0]
    with pytest.raises(RuntimeError, match=r"'weight' was not initialized on cpu\(0\); it was "
                                           r'only initialized on \[cpu\(1\), cpu\(2\)\]'):
        apart.weight.data()
    with pytest.raises(RuntimeError, match=r'not initialized on cpu\(3\)'):
        pair.weight.grad(d2l.cpu(3))


def test_a_device_named_twice_is_refused():
    with pytest.raises(ValueError, match=r'name one device twice.*cpu\(0\), d2l.cpu\(1\)'):
        mlp().initialize(device=[CPU0, CPU0])


def test_list_device_before_initialize():
    with pytest.raises(RuntimeError, match='initialize'):
        nn.Dense(2).weight.list_device()


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_a_block_computes_with_the_copies_on_its_inputs_device(hybridize):
    net = nn.HybridSequential()
    net.add(nn.Dense(2, in_units=3))
    net.initialize(init=nn.init.Constant(1.0), device=[CPU0, CPU1])
    net.hybridize(hybridize)
    x = host(1, 3)
    net(np.array(x, device=CPU1)).wait_to_read()       # compile for cpu(1) before the change
    net[0].weight.data(CPU1)[:] = 2.0                   # only the copy on cpu(1) changes
    y0, y1 = net(np.array(x)), net(np.array(x, device=CPU1))
    assert (y0.device, y1.device) == (CPU0, CPU1)
    numpy.testing.assert_allclose(y0.asnumpy(), [[x.sum()] * 2], rtol=1e-6)
    numpy.testing.assert_allclose(y1.asnumpy(), [[2 * x.sum()] * 2], rtol=1e-6)


@pytest.mark.parametrize('init, check', [
    (nn.init.Constant(0.5), lambda w: (w == 0.5).all()),
    (nn.init.Uniform(0.2), lambda w: (numpy.abs(w) <= 0.2).all() and w.std() > 0),
    (nn.init.Normal(0.01), lambda w: numpy.abs(w).max() < 0.1 and w.std() > 0),
    (nn.init.Xavier(), lambda w: (numpy.abs(w) <= numpy.sqrt(6 / (30 + 20))).all()),
], ids=['constant', 'uniform', 'normal', 'xavier'])
def test_initializers(init, check):
    layer = nn.Dense(20, in_units=30)
    layer.initialize(init=init)
    assert check(layer.weight.data().asnumpy())


def test_initialize_again_only_when_forced():
    layer = nn.Dense(2, in_units=2)
    layer.initialize(init=nn.init.Constant(1.0))
    layer.initialize(init=nn.init.Constant(2.0))
    assert layer.weight.data().asnumpy().tolist() == [[1.0, 1.0]] * 2
    layer.initialize(init=nn.init.Constant(2.0), force_reinit=True)
    assert layer.weight.data().asnumpy().tolist() == [[2.0, 2.0]] * 2


def test_repr_shows_the_layers():
    net = mlp()
    assert 'Dense(None -> 4, relu)' in repr(net) and 'Dense(None -> 2, linear)' in repr(net)


# -- losses ---------------------------------------------------------------------------------------

def test_l2_loss_equals_numpy():
    pred, label = host(4, 3), host(4, 3)
    got = d2l.L2Loss()(np.array(pred), np.array(label)).asnumpy()
    numpy.testing.assert_allclose(got, ((pred - label) ** 2 / 2).mean(axis=1), rtol=1e-6)
    column = d2l.L2Loss()(np.array(pred[:, :1]), np.array(label[:, 0])).asnumpy()
    numpy.testing.assert_allclose(column, (pred[:, 0] - label[:, 0]) ** 2 / 2, rtol=1e-6)
    assert nn.L2Loss is d2l.L2Loss


def test_softmax_cross_entropy_equals_numpy():
    pred, label = host(5, 4) * 3, numpy.array([0, 3, 1, 1, 2])
    got = d2l.SoftmaxCrossEntropyLoss()(np.array(pred), np.array(label)).asnumpy()
    shifted = pred - pred.max(axis=1, keepdims=True)
    log_softmax = shifted - numpy.log(numpy.exp(shifted).sum(axis=1, keepdims=True))
    numpy.testing.assert_allclose(got, -log_softmax[numpy.arange(5), label],
                                  rtol=1e-5)


def test_softmax_cross_entropy_is_stable_for_large_scores():
    pred = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    loss = d2l.SoftmaxCrossEntropyLoss()(pred, np.array([0, 0])).asnumpy()
    assert loss.tolist() == [0.0, 1000.0]


# -- training ---------------------------------------------------------------------------------

def test_sgd_step_equals_the_update_by_hand():
    layer = nn.Dense(2, in_units=3)
    layer.initialize(init=nn.init.Normal(0.5))
    x, y = host(4, 3), host(4, 2)
    w, b = layer.weight.data().asnumpy(), layer.bias.data().asnumpy()
    with autograd.record():
        loss = d2l.L2Loss()(layer(np.array(x)), np.array(y))
    loss.backward()
    residual = (x @ w.T + b - y) / 2                  # d/dpred of mean over 2 outputs of r²/2
    grad_w, grad_b = residual.T @ x, residual.sum(axis=0)
    numpy.testing.assert_allclose(layer.weight.grad().asnumpy(), grad_w, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(layer.bias.grad().asnumpy(), grad_b, rtol=1e-5, atol=1e-6)
    d2l.Trainer(layer.collect_params(), 'sgd', {'learning_rate': 0.3}).step(4)
    numpy.testing.assert_allclose(layer.weight.data().asnumpy(), w - 0.3 / 4 * grad_w, rtol=1e-5,
                                  atol=1e-6)
    numpy.testing.assert_allclose(layer.bias.data().asnumpy(), b - 0.3 / 4 * grad_b, rtol=1e-5,
                                  atol=1e-6)


def test_sgd_sums_the_gradients_of_every_device_copy():
    layer = nn.Dense(1, in_units=2)
    layer.initialize(init=nn.init.Constant(1.0), device=[CPU0, CPU1])
    for device, scale in ((CPU0, 1.0), (CPU1, 2.0)):
        with autograd.record():
            out = layer(np.array([[scale, scale]], device=device)).sum()
        out.backward()
    d2l.Trainer(layer.collect_params(), 'sgd', {'learning_rate': 1.0}).step(1)
    assert layer.weight.data(CPU0).asnumpy().tolist() == [[-2.0, -2.0]]      # 1 - (1 + 2)
    assert layer.weight.data(CPU1).asnumpy().tolist() == [[-2.0, -2.0]]
    assert layer.bias.data(CPU0).item() == layer.bias.data(CPU1).item() == -2.0


def test_a_tiny_regression_trains():
    features = host(64, 3)
    labels = features @ numpy.array([[2.0], [-3.4], [1.0]], dtype=numpy.float32) + 4.2
    x, y = np.array(features), np.array(labels)
    net = nn.Sequential()
    net.add(nn.Dense(1))
    net.initialize(init=nn.init.Normal(0.01))
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5})
    loss = d2l.L2Loss()
    losses = []
    for _ in range(100):
        with autograd.record():
            value = loss(net(x), y)
        value.backward()
        trainer.step(64)
        losses.append(value.mean())
    first, last = losses[0].item(), losses[-1].item()
    assert last < first / 1000, (first, last)


# -- errors with clear messages ---------------------------------------------------------------

def test_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation 'gelu'.*relu"):
        nn.Dense(3, activation='gelu')


def test_unknown_optimizer():
    with pytest.raises(ValueError, match=r"unknown optimizer 'adagrad'.*\['adam', 'sgd'\]"):
        d2l.Trainer(mlp().collect_params(), 'adagrad', {'learning_rate': 0.1})


@pytest.mark.parametrize('kvstore', ['device', 'local', None])
def test_trainer_takes_the_in_process_kvstores(kvstore):
    assert d2l.Trainer(mlp().collect_params(), 'sgd', kvstore=kvstore).kvstore == kvstore


def test_unknown_kvstore():
    with pytest.raises(ValueError, match=r"unknown kvstore 'nccl'.*'local', 'device', 'dist_sync'"):
        d2l.Trainer(mlp().collect_params(), 'sgd', kvstore='nccl')
    with pytest.raises(TypeError, match="a store's name, a store or None, not 42"):
        d2l.Trainer(mlp().collect_params(), 'sgd', kvstore=42)


def test_a_store_is_known_by_its_base_not_by_its_methods():
    class LooksLikeAStore:              # the methods a store has, but not its base
        type = 'local'
        init = push = pull = staticmethod(lambda *args: None)
    with pytest.raises(TypeError, match="a store's name, a store or None"):
        d2l.Trainer(mlp().collect_params(), 'sgd', kvstore=LooksLikeAStore())


def test_trainer_takes_parameters_only():
    with pytest.raises(TypeError, match='collect_params'):
        d2l.Trainer([np.ones((2,))], 'sgd')


def test_data_before_initialize():
    layer = nn.Dense(2, in_units=3)
    with pytest.raises(nn.DeferredInitializationError, match=r"'weight'.*initialize\(\)"):
        layer.weight.data()
    with pytest.raises(nn.DeferredInitializationError, match='initialize'):
        layer(np.ones((1, 3)))


def test_a_step_before_the_first_batch_says_what_is_missing():
    net = mlp()
    net.initialize()
    with pytest.raises(nn.DeferredInitializationError, match='run one batch'):
        d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}).step(1)


def test_initialize_needs_devices():
    with pytest.raises(TypeError, match='Device'):
        mlp().initialize(device='cpu')


def test_a_block_must_define_forward():
    with pytest.raises(NotImplementedError, match='forward'):
        nn.Block()(np.ones((1,)))


# -- dropout: training against prediction, and repeatable draws ---------------------------

def dropout_output(device, hybridize=False, seed=3):
    net = nn.HybridSequential()
    net.add(nn.Dropout(0.5))
    net.hybridize(hybridize)
    np.random.seed(seed)
    with autograd.record():
        return net(np.ones((8, 16), device=device)).asnumpy()


@pytest.mark.parametrize('hybridize', [False, True])
@pytest.mark.parametrize('device', [d2l.cpu(0), d2l.cpu(1)])
def test_seeding_makes_dropout_repeatable_on_every_device(device, hybridize):
    first = dropout_output(device, hybridize)
    assert set(numpy.unique(first).tolist()) == {0.0, 2.0}
    numpy.testing.assert_array_equal(dropout_output(device, hybridize), first)
    assert not numpy.array_equal(dropout_output(device, hybridize, seed=4), first)


def test_each_device_draws_its_own_dropout_stream():
    assert not numpy.array_equal(dropout_output(d2l.cpu(0)), dropout_output(d2l.cpu(1)))


def test_dropout_follows_the_training_flag_not_the_recording_one():
    layer, x = nn.Dropout(0.5), np.ones((4, 32))
    assert layer(x) is x                                    # outside record: prediction
    with autograd.record(train_mode=False):
        assert layer(x) is x
    with autograd.record():
        with autograd.predict_mode():
            assert layer(x) is x
    with autograd.train_mode():
        assert set(numpy.unique(layer(x).asnumpy()).tolist()) == {0.0, 2.0}


def test_imperative_dropout_passes_gradients_through_its_mask():
    x = np.ones((4, 32))
    x.attach_grad()
    with autograd.record():
        y = nn.Dropout(0.5)(x)
    y.backward()                    # the mask reads x, but no gradient flows through it
    assert numpy.array_equal(x.grad.asnumpy(), y.asnumpy())


def test_a_hybridized_block_compiles_training_and_prediction_apart():
    net = nn.HybridSequential()
    net.add(nn.Dropout(0.5))
    net.hybridize()
    x = np.ones((4, 32))
    with autograd.record(train_mode=False):
        assert numpy.array_equal(net(x).asnumpy(), x.asnumpy())
    with autograd.record():
        assert set(numpy.unique(net(x).asnumpy()).tolist()) == {0.0, 2.0}
    assert [n.op for n in net.traced_graph().nodes if n.kind == 'call'] == [
        'dropout_mask', 'multiply']
    with autograd.record(train_mode=False):
        net(x)
    assert [n.kind for n in net.traced_graph().nodes] == ['input']


def test_dense_flattens_images_as_gluon_does():
    layer = nn.Dense(3)
    layer.initialize()
    x = np.ones((2, 4, 5, 5))
    assert layer(x).shape == (2, 3) and layer.weight.shape == (3, 100)
    flat = nn.Dense(3, flatten=False)
    flat.initialize()
    assert flat(x).shape == (2, 4, 5, 3)
