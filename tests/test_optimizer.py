"""SGD with momentum and weight decay against the same rule written in NumPy."""
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
    with pytest.raises(ValueError, match="'adam'.*sgd"):
        optimizer.create('adam')


def float16_sgd(weight, grads, lr, momentum, wd):
    """MXNet's rule in float16, rounded after every operation as d2lperf's engine computes it."""
    half = numpy.float16
    velocity = numpy.zeros_like(weight)
    for grad in grads:
        g = grad + half(wd) * weight
        velocity = velocity * half(momentum) - half(lr) * g
        weight = weight + velocity
    return weight, velocity


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
