"""SGD with momentum and weight decay, and Adam, against the same rules written in NumPy."""
import sys

import numpy
import pytest
from hypothesis import given, settings, strategies as st

import d2lperf as d2l
from d2lperf import np, optimizer


def numpy_sgd(weight, grads, lr, momentum, wd, rescale):
    velocity = numpy.zeros_like(weight)
    for grad in grads:
        g = rescale * grad + wd * weight
        velocity = momentum * velocity - lr * g
        weight = weight + velocity
    return weight


@settings(max_examples=25, deadline=None)
@given(lr=st.floats(0, 1), momentum=st.sampled_from([0.0, 0.5, 0.9]),
       wd=st.sampled_from([0.0, 1e-3]), rescale=st.sampled_from([1.0, 1 / 8]),
       steps=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_sgd_follows_mxnets_rule(lr, momentum, wd, rescale, steps, seed):
    rng = numpy.random.default_rng(seed)
    weight0 = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) for _ in range(steps)]
    sgd = optimizer.SGD(learning_rate=lr, momentum=momentum, wd=wd, rescale_grad=rescale)
    weight = np.array(weight0, dtype=numpy.float64)
    for grad in grads:
        sgd.update('w', weight, np.array(grad, dtype=numpy.float64))
    expected = numpy_sgd(weight0, grads, lr, momentum, wd, rescale)
    numpy.testing.assert_allclose(weight.asnumpy(), expected, rtol=1e-12, atol=1e-12)
    assert set(sgd.get_states()) == ({'w'} if momentum else set())


def test_states_round_trip_as_plain_arrays_on_their_device():
    sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9)
    weight = np.ones((2,), device=d2l.cpu(1))
    sgd.update(7, weight, np.ones((2,), device=d2l.cpu(1)))
    states = sgd.get_states()
    assert isinstance(states[7], numpy.ndarray)
    numpy.testing.assert_allclose(states[7], [-0.1, -0.1], rtol=1e-6)
    fresh = optimizer.SGD(learning_rate=0.1, momentum=0.9)
    fresh.set_states(states, lambda key: d2l.cpu(1))
    assert fresh.states[7].device == d2l.cpu(1)
    numpy.testing.assert_allclose(fresh.states[7].asnumpy(), states[7])


@pytest.mark.parametrize('params, words', [
    ({'learning_rate': -1}, 'learning_rate'), ({'momentum': 1.0}, 'below 1'),
    ({'wd': 'x'}, 'wd'), ({'learning_rate': float('nan')}, 'finite.*learning_rate.*nan'),
    ({'momentum': float('nan')}, 'finite.*momentum'), ({'wd': float('inf')}, 'finite.*wd.*inf'),
    ({'rescale_grad': float('-inf')}, 'finite.*rescale_grad')])
def test_bad_hyperparameters_are_named(params, words):
    with pytest.raises(ValueError, match=words):
        optimizer.SGD(**params)


def test_momentum_states_need_momentum():
    with pytest.raises(ValueError, match='momentum=0'):
        optimizer.SGD().set_states({'w': numpy.zeros(2)}, lambda key: d2l.cpu())


def test_create_names_what_it_offers():
    assert isinstance(optimizer.create('sgd', learning_rate=0.5), optimizer.SGD)
    assert isinstance(optimizer.create('adam', learning_rate=0.5), optimizer.Adam)
    with pytest.raises(ValueError, match=r"'adagrad'.*\['adam', 'sgd'\]"):
        optimizer.create('adagrad')


def float16_sgd(weight, grads, lr, momentum, wd):
    """MXNet's rule in float16, rounded after every operation as d2lperf's engine computes it."""
    half = numpy.float16
    velocity = numpy.zeros_like(weight)
    for grad in grads:
        g = grad + half(wd) * weight
        velocity = velocity * half(momentum) - half(lr) * g
        weight = weight + velocity
    return weight, velocity


@pytest.mark.filterwarnings('ignore:.*multi_precision=True')     # MXNet's warning, expected
def test_sgd_updates_float16_weights_in_float16():
    rng = numpy.random.default_rng(3)
    weight0 = rng.normal(size=(5,)).astype(numpy.float16)
    grads = [rng.normal(size=(5,)).astype(numpy.float16) for _ in range(3)]
    sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)
    weight = np.array(weight0)
    for grad in grads:
        sgd.update('w', weight, np.array(grad))
    expected, velocity = float16_sgd(weight0, grads, 0.1, 0.9, 0.01)
    assert weight.dtype == numpy.float16 and sgd.get_states()['w'].dtype == numpy.float16
    numpy.testing.assert_array_equal(weight.asnumpy(), expected)
    numpy.testing.assert_array_equal(sgd.get_states()['w'], velocity)
    fresh = optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)
    fresh.set_states(sgd.get_states(), lambda key: d2l.cpu())
    assert fresh.states['w'].dtype == numpy.float16


# -- Adam ------------------------------------------------------------------------------------

def numpy_adam(weight, grads, lr, beta1, beta2, epsilon, wd, rescale):
    """MXNet's Adam: the bias correction folded into the rate of each step."""
    mean, var = numpy.zeros_like(weight), numpy.zeros_like(weight)
    for t, grad in enumerate(grads, start=1):
        g = rescale * grad + wd * weight
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g * g
        rate = lr * numpy.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        weight = weight - rate * mean / (numpy.sqrt(var) + epsilon)
    return weight, mean, var


@settings(max_examples=25, deadline=None)
@given(lr=st.floats(1e-4, 0.1), betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9)]),
       wd=st.sampled_from([0.0, 1e-3]), rescale=st.sampled_from([1.0, 1 / 8]),
       steps=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_adam_follows_mxnets_rule(lr, betas, wd, rescale, steps, seed):
    rng = numpy.random.default_rng(seed)
    weight0 = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) for _ in range(steps)]
    adam = optimizer.Adam(learning_rate=lr, beta1=betas[0], beta2=betas[1], wd=wd,
                          rescale_grad=rescale)
    weight = np.array(weight0, dtype=numpy.float64)
    for grad in grads:
        adam.update('w', weight, np.array(grad, dtype=numpy.float64))
    expected, mean, var = numpy_adam(weight0, grads, lr, *betas, 1e-8, wd, rescale)
    numpy.testing.assert_allclose(weight.asnumpy(), expected, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(adam.states['w'][0].asnumpy(), mean, rtol=1e-12)
    assert adam.counts == {'w': steps}


def test_adams_defaults_are_mxnets():
    adam = optimizer.Adam()
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.epsilon, adam.wd) == (
        0.001, 0.9, 0.999, 1e-8, 0.0)


def test_adam_states_round_trip_through_a_store_with_their_step_counts(tmp_path):
    """Saved after two steps and loaded into a fresh store and optimizer, the third step is
    the one an unbroken run takes: the step count (the bias correction) travels with mean and
    var."""
    grad = np.array(numpy.arange(6, dtype=numpy.float32).reshape(2, 3))

    def store_at(weight):
        store = d2l.kvstore.create('local')
        store.set_optimizer(optimizer.Adam(learning_rate=0.1))
        store.init('w', weight)
        return store

    def pulled(store):
        out = np.zeros((2, 3), dtype=numpy.float32)
        store.pull('w', out=out)
        return out

    unbroken, broken = store_at(np.ones((2, 3))), store_at(np.ones((2, 3)))
    for _ in range(2):
        unbroken.push('w', grad)
        broken.push('w', grad)
    path = str(tmp_path / 'adam.states')
    broken.save_optimizer_states(path)
    resumed = store_at(pulled(broken))
    resumed.load_optimizer_states(path)
    unbroken.push('w', grad)
    resumed.push('w', grad)
    numpy.testing.assert_array_equal(pulled(resumed).asnumpy(), pulled(unbroken).asnumpy())
    assert resumed.optimizer.counts['w'] == 3      # counted as the update ran


@pytest.mark.parametrize('params, words', [
    ({'beta1': 1.0}, 'beta1 below 1'), ({'beta2': 1.5}, 'beta2 below 1'),
    ({'epsilon': -1e-8}, 'Adam needs a finite number >= 0 for epsilon'),
    ({'learning_rate': float('nan')}, 'Adam needs a finite.*learning_rate')])
def test_bad_adam_settings_are_named(params, words):
    with pytest.raises(ValueError, match=words):
        optimizer.Adam(**params)


def test_states_that_adam_did_not_save_are_refused_and_nothing_is_lost():
    adam = optimizer.Adam()
    weight = np.ones((2,))
    adam.update('v', weight, np.ones((2,)))
    before = adam.get_states()
    with pytest.raises(ValueError, match="key 'w' is not \\[t, mean..., var...\\]"):
        adam.set_states({'v': before['v'], 'w': numpy.zeros(4)}, lambda key: d2l.cpu())
    after = adam.get_states()
    assert set(after) == {'v'} and adam.counts == {'v': 1}
    numpy.testing.assert_array_equal(after['v'], before['v'])


def test_the_trainer_runs_adam_on_every_copy():
    net = d2l.nn.Dense(2)
    net.initialize(d2l.nn.init.Constant(0.5), device=[d2l.cpu(0), d2l.cpu(1)])
    trainer = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.1})
    xs = [np.ones((4, 3), device=d) for d in (d2l.cpu(0), d2l.cpu(1))]
    with d2l.autograd.record():
        losses = [net(x).sum() for x in xs]
    for loss in losses:
        loss.backward()
    trainer.step(8)
    copies = [p.data(d).asnumpy() for p in net.collect_params().values()
              for d in (d2l.cpu(0), d2l.cpu(1))]
    numpy.testing.assert_array_equal(copies[0], copies[1])
    # Adam's first step moves every weight by the learning rate, whatever its gradient
    numpy.testing.assert_allclose(copies[0], 0.5 - 0.1, rtol=1e-5)


@pytest.mark.parametrize('name, params, op', [
    ('sgd', {'learning_rate': 0.1}, 'sgd_update'),
    ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}, 'sgd_update'),
    ('adam', {'learning_rate': 0.1, 'wd': 1e-3}, 'adam_update')])
def test_a_step_is_one_operation_a_parameter(name, params, op):
    """MXNet's fused update operators: the rule runs as one engine operation on each weight,
    not a push for each of its terms (a dozen for Adam)."""
    net = d2l.nn.Dense(2, in_units=3)
    net.initialize(d2l.nn.init.Constant(0.5))
    trainer = d2l.Trainer(net.collect_params(), name, params, kvstore=None)
    with d2l.autograd.record():
        loss = net(np.ones((4, 3))).sum()
    loss.backward()
    trainer.step(4)                          # the first step makes the states
    d2l.npx.waitall()
    with d2l.profiler.profile() as records:
        trainer.step(4)
        d2l.npx.waitall()
    assert [r.name for r in records] == [op, op]        # the weight's and the bias's


@pytest.mark.parametrize('make', [lambda: optimizer.SGD(learning_rate=0.3, momentum=0.5, wd=0.1),
                                  lambda: optimizer.Adam(learning_rate=0.2, beta1=0.8,
                                                         multi_precision=True)])
def test_rescaled_is_a_fresh_optimizer_with_the_same_settings_and_its_own_scale(make):
    """What a Trainer hands a store that updates: the rule and settings of its own optimizer
    (a learning rate changed since included), the step's scale, no state; the original keeps
    the user's rescale_grad."""
    original = make()
    original.learning_rate = 0.05
    copy = original.rescaled(0.125)
    assert type(copy) is type(original) and copy.rescale_grad == 0.125
    assert original.rescale_grad == 1.0 and copy.states == {} and copy is not original
    for name in original.setting_names + ('multi_precision',):
        assert getattr(copy, name) == getattr(original, name), name


# -- on a GPU: one kernel a parameter --------------------------------------------------------

UPDATES = [('sgd', {'learning_rate': 0.1}),
           ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}),
           ('adam', {'learning_rate': 0.1, 'wd': 1e-3})]


def trained_weights(name, params, device, dtype, steps=3):
    """A Dense layer's weights after `steps` Trainer steps on `device`, from the same start."""
    net = d2l.nn.Dense(3, in_units=4)
    net.initialize(device=device)
    net.cast(dtype)
    rng = numpy.random.default_rng(1)
    for param in net.collect_params().values():
        param.set_data(np.array(rng.normal(size=param.shape), dtype=dtype, device=device))
    trainer = d2l.Trainer(net.collect_params(), name, dict(params), kvstore=None)
    x = np.array(numpy.random.default_rng(0).normal(size=(5, 4)), dtype=dtype, device=device)
    for _ in range(steps):
        with d2l.autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(5)
    return [p.data(device).asnumpy() for p in net.collect_params().values()]


@pytest.mark.parametrize('dtype, rtol', [('float32', 1e-5), ('float64', 1e-12)])
@pytest.mark.parametrize('name, params', UPDATES)
def test_on_a_gpu_each_update_is_one_kernel_with_the_numpy_rules_values(
        fake_gpus, monkeypatch, name, params, dtype, rtol):
    """MXNet's fused update kernels: one launch a parameter reads the gradient, the weight and
    its states once and writes them once, where the array operations launch a dozen kernels
    (Adam) and allocate temporaries; the weights agree with the NumPy rule's on the CPU."""
    want = trained_weights(name, params, d2l.cpu(), dtype)
    launched = []
    cupy = sys.modules['cupy']
    launch = cupy.launch

    def counted(function, *args, **kwargs):
        launched.append(function)
        return launch(function, *args, **kwargs)
    monkeypatch.setattr(cupy, 'launch', counted)
    got = trained_weights(name, params, d2l.gpu(0), dtype)
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=rtol, atol=rtol)
    kernels_run = [getattr(f, '__self__', None) for f in launched]
    updates = [k for k in kernels_run if k is not None and 'update' in k.name]
    assert len(updates) == 3 * 2                    # 3 steps, the weight's and the bias's


def test_float16_weights_on_a_gpu_keep_the_array_operations(fake_gpus):
    """The kernels are written for float32 and float64; other dtypes keep the rule as array
    operations, which CuPy runs in their own type."""
    from d2lperf.optimizer import kernels
    cupy = sys.modules['cupy']
    assert kernels.fits(cupy, cupy.zeros(2, 'float32'))
    assert not kernels.fits(cupy, cupy.zeros(2, 'float16'))
    assert not kernels.fits(numpy, numpy.zeros(2, 'float32'))


@pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')
@pytest.mark.parametrize('dtype, rtol', [('float32', 1e-5), ('float64', 1e-12)])
@pytest.mark.parametrize('name, params', UPDATES)
def test_on_a_real_gpu_the_kernels_give_the_numpy_rules_values(name, params, dtype, rtol):
    """The kernels compiled by CUDA, not read by the fake: the same weights as on the CPU."""
    want = trained_weights(name, params, d2l.cpu(), dtype)
    got = trained_weights(name, params, d2l.gpu(0), dtype)
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=rtol, atol=rtol)
