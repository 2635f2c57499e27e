"""Tests of data parallelism by hand (comm's get_params, optimizer/by_hand.py) and of the test
accuracy (data.py's evaluate_accuracy_gpu(s)): two devices, each with half of every batch, must train to the
same parameters as one device with the whole batch."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, nn, np, npx

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)
STEPS, BATCH, FEATURES, HIDDEN, CLASSES = 5, 8, 6, 16, 3


def problem(seed=0):
    """Five batches of a small classification problem and an MLP's first parameters."""
    rng = numpy.random.default_rng(seed)
    batches = [(rng.normal(size=(BATCH, FEATURES)).astype(numpy.float32),
                rng.integers(0, CLASSES, BATCH)) for _ in range(STEPS)]
    shapes = [(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, CLASSES), (CLASSES,)]
    params = [rng.normal(scale=0.5, size=s).astype(numpy.float32) for s in shapes]
    return batches, params


def mlp(X, params):
    W1, b1, W2, b2 = params
    return np.dot(npx.relu(np.dot(X, W1) + b1), W2) + b2


def train_from_scratch(devices, lr=0.5):
    """The source's train_batch: split, forward and backward per device, allreduce, sgd."""
    batches, host_params = problem()
    params = [np.array(p) for p in host_params]
    device_params = [d2l.get_params(params, d) for d in devices]
    loss = d2l.SoftmaxCrossEntropyLoss()
    for X, y in batches:
        X_shards, y_shards = d2l.split_batch(np.array(X), np.array(y), devices)
        with autograd.record():
            losses = [loss(mlp(X_shard, W), y_shard)
                      for X_shard, y_shard, W in zip(X_shards, y_shards, device_params)]
        for value in losses:
            value.backward()
        for i in range(len(params)):
            d2l.allreduce([W[i].grad for W in device_params])
        for W in device_params:
            d2l.sgd(W, lr, X.shape[0])
    return [[p.asnumpy() for p in W] for W in device_params]


def block_mlp(host_params, devices, hybridize):
    net = nn.HybridSequential()
    net.add(nn.Dense(HIDDEN, activation='relu'), nn.Dense(CLASSES))
    net.initialize(device=devices)
    net(np.zeros((1, FEATURES), device=devices[0]))           # learn the input size
    for param, value in zip(net.collect_params().values(), host_params):
        param.set_data(np.array(value.T if value.ndim == 2 else value, device=devices[0]))
    return net.hybridize(hybridize)


def train_with_trainer(devices, hybridize, lr=0.5):
    batches, host_params = problem()
    net = block_mlp(host_params, devices, hybridize)
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': lr}, kvstore='device')
    loss = d2l.SoftmaxCrossEntropyLoss()
    for X, y in batches:
        X_shards, y_shards = d2l.split_batch(np.array(X), np.array(y), devices)
        with autograd.record():
            losses = [loss(net(X_shard), y_shard) for X_shard, y_shard in zip(X_shards, y_shards)]
        for value in losses:
            value.backward()
        trainer.step(X.shape[0])
    return [[p.asnumpy() for p in param.list_data()] for param in net.collect_params().values()]


def assert_close(got, want):
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# -- data parallelism --------------------------------------------------------------------------

def test_two_devices_from_scratch_train_like_one():
    (alone,), (first, second) = train_from_scratch([CPU0]), train_from_scratch([CPU0, CPU1])
    assert_close(first, alone)
    for a, b in zip(first, second):
        numpy.testing.assert_array_equal(a, b)      # the copies never drift apart
    assert not numpy.allclose(alone[0], problem()[1][0])     # and training moved them


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_two_devices_with_the_trainer_train_like_one(hybridize):
    alone = train_with_trainer([CPU0], hybridize)
    both = train_with_trainer([CPU0, CPU1], hybridize)
    for (single,), (first, second) in zip(alone, both):
        numpy.testing.assert_allclose(first, single, rtol=1e-5, atol=1e-5)
        numpy.testing.assert_array_equal(first, second)


def test_trainer_and_scratch_agree():
    scratch = train_from_scratch([CPU0, CPU1])[0]
    trained = [copies[0] for copies in train_with_trainer([CPU0, CPU1], hybridize=False)]
    assert_close([w.T if w.ndim == 2 else w for w in trained], scratch)


# -- the pieces ------------------------------------------------------------------------------

def test_get_params_copies_with_zero_gradients():
    params = [np.array([[1.0, 2.0]]), np.zeros(3)]
    copies = d2l.get_params(params, CPU1)
    for original, copy in zip(params, copies):
        assert copy is not original and copy.device == CPU1
        numpy.testing.assert_array_equal(copy.asnumpy(), original.asnumpy())
        numpy.testing.assert_array_equal(copy.grad.asnumpy(), numpy.zeros(original.shape))
    assert params[0].grad is None                    # the originals are left alone


def test_sgd_steps_against_the_summed_gradient():
    (w,) = d2l.get_params([np.array([1.0, 2.0])], CPU0)
    with autograd.record():
        loss = (w * w).sum()                        # gradient 2w
    loss.backward()
    d2l.sgd([w], lr=0.5, batch_size=2)
    numpy.testing.assert_allclose(w.asnumpy(), [1.0 - 0.5, 2.0 - 1.0])


def test_sgd_by_hand_lives_with_the_update_rules():
    """d2l.sgd is an update rule written by hand (optimizer/by_hand.py), not a way of summing
    gradients over replicas (data_parallel/)."""
    assert d2l.sgd is d2l.optimizer.by_hand.sgd
    assert 'sgd' not in vars(d2l.data_parallel)


def test_sgd_needs_gradients():
    with pytest.raises(ValueError, match=r'shape \(2,\) has no gradient.*attach_grad'):
        d2l.sgd([np.ones(2)], 0.1, 1)


def test_accuracy_counts_right_predictions():
    scores = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert d2l.accuracy(scores, np.array([1, 0, 0])) == 2.0
    assert d2l.accuracy(np.array([1, 1, 0]), np.array([1, 0, 0])) == 2.0
    assert isinstance(d2l.accuracy(scores, np.array([1, 1, 1])), float)
    with pytest.raises(ValueError, match=r'3 predictions for labels of shape \(2,\)'):
        d2l.accuracy(scores, np.array([1, 0]))


class Batches:
    """A re-iterable list of (X, y) batches, like a data iterator."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return ((np.array(X), np.array(y)) for X, y in self.batches)


def test_evaluate_accuracy_on_one_device_and_on_two_agree():
    batches, host_params = problem()
    test_iter = Batches(batches[:3])
    net = block_mlp(host_params, [CPU0, CPU1], hybridize=False)
    expected = numpy.mean([(mlp_numpy(X, host_params).argmax(1) == y).mean()
                           for X, y in batches[:3]])
    assert d2l.evaluate_accuracy_gpu(net, test_iter) == pytest.approx(expected)
    assert d2l.evaluate_accuracy_gpus(net, test_iter) == pytest.approx(expected)
    params = [np.array(p, device=CPU1) for p in host_params]
    assert d2l.evaluate_accuracy_gpu(lambda X: mlp(X, params), test_iter, CPU1) == \
        pytest.approx(expected)


def mlp_numpy(X, params):
    W1, b1, W2, b2 = params
    return numpy.maximum(X @ W1 + b1, 0) @ W2 + b2


def test_evaluating_a_function_needs_a_device():
    with pytest.raises(TypeError, match='pass device='):
        d2l.evaluate_accuracy_gpu(lambda X: X, Batches([]))
    with pytest.raises(TypeError, match='no parameters'):
        d2l.evaluate_accuracy_gpus(lambda X: X, Batches([]))
    with pytest.raises(ValueError, match='no examples'):
        d2l.evaluate_accuracy_gpu(lambda X: X, Batches([]), CPU0)
