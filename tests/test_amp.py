"""Mixed precision: multi_precision's float32 master weights, Block.cast, the dynamic loss
scaler (amp), and bfloat16 arrays on NumPy."""
import gc
import warnings

import ml_dtypes
import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import amp, autograd, device, engine, nn, np, optimizer
from strategies import checks

HALF, BF16 = numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16)


# -- multi_precision ----------------------------------------------------------------------------

def numpy_sgd(weight, grads, lr, momentum, wd):
    velocity = numpy.zeros_like(weight)
    for grad in grads:
        velocity = momentum * velocity - lr * (grad + wd * weight)
        weight = weight + velocity
    return weight


def numpy_adam(weight, grads, lr, beta1=0.9, beta2=0.999, epsilon=1e-8):
    mean, var = numpy.zeros_like(weight), numpy.zeros_like(weight)
    for t, g in enumerate(grads, start=1):
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g * g
        rate = lr * numpy.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        weight = weight - rate * mean / (numpy.sqrt(var) + epsilon)
    return weight


def low_precision_run(opt, dtype=HALF, steps=4, seed=0):
    """(weight, master) after `steps` updates of a low-precision weight, and the float32
    reference of the master, from the same (low-precision) gradients."""
    rng = numpy.random.default_rng(seed)
    weight0 = rng.normal(size=(3, 5)).astype(dtype)
    grads = [rng.normal(size=(3, 5)).astype(dtype) for _ in range(steps)]
    weight = np.array(weight0)
    for grad in grads:
        opt.update('w', weight, np.array(grad))
    start, as32 = weight0.astype(numpy.float32), [g.astype(numpy.float32) for g in grads]
    return weight, opt.masters['w'], start, as32


@pytest.mark.parametrize('dtype', [HALF, BF16])
def test_multi_precision_sgd_steps_a_float32_master(dtype):
    sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3, multi_precision=True)
    weight, master, start, grads = low_precision_run(sgd, dtype)
    assert master.dtype == numpy.float32 and sgd.states['w'].dtype == numpy.float32
    numpy.testing.assert_allclose(master.asnumpy(), numpy_sgd(start, grads, 0.1, 0.9, 1e-3),
                                  rtol=1e-6, atol=1e-6)
    assert weight.dtype == dtype
    numpy.testing.assert_array_equal(weight.asnumpy(), master.asnumpy().astype(dtype))


@pytest.mark.parametrize('dtype', [HALF, BF16])
def test_multi_precision_adam_steps_a_float32_master(dtype):
    adam = optimizer.Adam(learning_rate=0.01, multi_precision=True)
    weight, master, start, grads = low_precision_run(adam, dtype)
    assert all(state.dtype == numpy.float32 for state in adam.states['w'])
    numpy.testing.assert_allclose(master.asnumpy(), numpy_adam(start, grads, 0.01),
                                  rtol=1e-6, atol=1e-6)
    numpy.testing.assert_array_equal(weight.asnumpy(), master.asnumpy().astype(dtype))


def test_multi_precision_leaves_a_float32_weight_alone():
    sgd = optimizer.SGD(learning_rate=0.5, multi_precision=True)
    weight = np.ones((2,))
    sgd.update(0, weight, np.ones((2,)))
    assert sgd.masters == {} and weight.asnumpy().tolist() == [0.5, 0.5]


@pytest.mark.filterwarnings('ignore:.*multi_precision=True')  # the loss it warns of, shown
@pytest.mark.parametrize('name', ['sgd', 'adam'])
def test_a_small_update_vanishes_in_float16_and_accumulates_in_the_master(name):
    """1 - 1e-4 rounds back to 1 in float16 (its spacing below 1 is 2^-11, 4.9e-4): without a
    master every step is lost; with one, ten steps move the weight by 1e-3."""
    settings = {'learning_rate': 1e-4} | ({'epsilon': 0.0} if name == 'adam' else {})
    plain = optimizer.create(name, **settings)
    mixed = optimizer.create(name, multi_precision=True, **settings)
    kept, moved = np.ones((1,), HALF), np.ones((1,), HALF)
    for _ in range(10):
        plain.update(0, kept, np.ones((1,), HALF))
        mixed.update(0, moved, np.ones((1,), HALF))
    assert kept.asnumpy().tolist() == [1.0]
    numpy.testing.assert_allclose(mixed.masters[0].asnumpy(), [1 - 1e-3], rtol=1e-6)
    assert moved.asnumpy().tolist() == [numpy.float16(1 - 1e-3)] != [1.0]


# -- states, saved and loaded ---------------------------------------------------------------------

def after_a_save(opt, make, steps_before=2):
    """The weight of an unbroken run of three steps, and of one saved (as .npz would hold it)
    and resumed by a fresh optimizer after `steps_before`."""
    grad = np.array(numpy.linspace(-1, 1, 6).reshape(2, 3).astype(HALF))
    unbroken, broken = np.ones((2, 3), HALF), np.ones((2, 3), HALF)
    for _ in range(steps_before):
        opt.update('w', broken, grad)
    states = opt.get_states()
    fresh = make()
    fresh.set_states({k: numpy.array(v) for k, v in states.items()}, lambda key: d2l.cpu())
    fresh.update('w', broken, grad)
    reference = make()
    for _ in range(steps_before + 1):
        reference.update('w', unbroken, grad)
    return states, fresh, reference, broken, unbroken


@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_sgd_saves_the_master_under_its_momentum(momentum):
    def make():
        return optimizer.SGD(learning_rate=0.1, momentum=momentum, multi_precision=True)
    states, fresh, reference, broken, unbroken = after_a_save(make(), make)
    rows = 2 if momentum else 1
    assert states['w'].shape == (rows, 2, 3) and states['w'].dtype == numpy.float32
    numpy.testing.assert_array_equal(fresh.masters['w'].asnumpy(),
                                     reference.masters['w'].asnumpy())
    numpy.testing.assert_array_equal(broken.asnumpy(), unbroken.asnumpy())


def test_adam_saves_the_master_after_mean_and_var():
    def make():
        return optimizer.Adam(learning_rate=0.1, multi_precision=True)
    states, fresh, reference, broken, unbroken = after_a_save(make(), make)
    assert states['w'].shape == (1 + 3 * 6,) and states['w'][0] == 2
    numpy.testing.assert_array_equal(fresh.masters['w'].asnumpy(),
                                     reference.masters['w'].asnumpy())
    numpy.testing.assert_array_equal(broken.asnumpy(), unbroken.asnumpy())


def test_a_store_saves_and_loads_master_weights(tmp_path):
    """Through a store's .npz: the state's shape the store checks on loading has the master."""
    def store():
        kv = d2l.kvstore.create('local')
        kv.set_optimizer(optimizer.Adam(learning_rate=0.1, multi_precision=True))
        kv.init(3, np.ones((4,), HALF))
        return kv
    saved, loaded = store(), store()
    saved.push(3, np.array(numpy.full(4, 0.5, HALF)))
    path = str(tmp_path / 'states.npz')
    saved.save_optimizer_states(path)
    assert numpy.load(path)['int:3'].shape == (1 + 3 * 4,)
    loaded.load_optimizer_states(path)
    loaded.push(3, np.array(numpy.full(4, 0.5, HALF)))       # restores, then steps
    d2l.npx.waitall()                                        # the step counts as it runs
    assert loaded.optimizer.counts[3] == 2


def test_a_state_for_another_weight_is_refused_at_its_first_update():
    sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9, multi_precision=True)
    sgd.set_states({'w': numpy.zeros((2, 5), numpy.float32)}, lambda key: d2l.cpu())
    with pytest.raises(ValueError, match="key 'w'.*needs float32\\[2, 3\\]"):
        sgd.update('w', np.ones((3,), HALF), np.ones((3,), HALF))


# -- Block.cast -----------------------------------------------------------------------------

def mlp():
    net = nn.Sequential()
    net.add(nn.Dense(16, activation='relu'), nn.Dense(3))
    return net


def test_cast_gives_every_parameter_and_gradient_the_dtype():
    net = mlp()
    net.initialize(device=[d2l.cpu(0), d2l.cpu(1)])
    net(np.ones((2, 4)))                           # the shapes, then the cast
    deferred = mlp().cast('float16')              # the cast, then the shapes
    deferred.initialize()
    deferred(np.ones((2, 4), HALF))
    for block in (net.cast('float16'), deferred):
        for param in block.collect_params().values():
            assert {a.dtype for a in param.list_data() + param.list_grad()} == {HALF}


# -- the loss scaler --------------------------------------------------------------------------

def reference_scaler(overflows, scale, window):
    """The rules, as plainly as they can be written: (scale, skipped, steps) after them."""
    skipped = steps = clean = 0
    for overflowed in overflows:
        if overflowed:
            scale, skipped, clean = scale / 2, skipped + 1, 0
        else:
            steps, clean = steps + 1, clean + 1
            if clean == window:
                scale, clean = scale * 2, 0
    return scale, skipped, steps


@checks(50)
@given(overflows=st.lists(st.booleans(), max_size=40), window=st.integers(1, 5))
def test_the_scaler_halves_on_overflow_and_doubles_after_a_clean_window(overflows, window):
    scaler = amp.LossScaler(init_scale=2.0 ** 10, scale_window=window)
    for overflowed in overflows:
        scaler.update(overflowed)
    assert (scaler.loss_scale, scaler.skipped, scaler.steps) == \
        reference_scaler(overflows, 2.0 ** 10, window)


@pytest.mark.parametrize('bad', [numpy.inf, -numpy.inf, numpy.nan])
def test_overflow_is_any_inf_or_nan_and_not_a_large_sum(bad):
    big = np.array(numpy.full(1000, 60000, HALF))           # sums past float16's 65504
    assert not amp.has_overflow([big, np.ones((3,), HALF)])
    poisoned = numpy.ones(5, HALF)
    poisoned[3] = bad
    assert amp.has_overflow([big, np.array(poisoned)])
    assert amp.has_overflow([np.ones((2,), device=d2l.cpu(1)), np.array(poisoned)])


def dense_trainer(optimizer_params=None, dtype='float32'):
    net = nn.Dense(2)
    net.initialize(nn.init.Constant(0.5))
    net(np.ones((1, 3)))
    net.cast(dtype)
    return net, d2l.Trainer(net.collect_params(), 'sgd',
                            optimizer_params or {'learning_rate': 0.1})


def backward(net, trainer, x, scaled=True):
    with autograd.record():
        out = net(x).astype('float32')          # the loss in float32, as AMP computes it
        loss = (out * out).sum()
    if not scaled:
        loss.backward()
        return
    with amp.scale_loss(loss, trainer) as scaled_loss:
        scaled_loss.backward()


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
def test_a_step_with_an_overflow_is_skipped_and_the_scale_halved():
    net, trainer = dense_trainer({'learning_rate': 0.1, 'multi_precision': True}, 'float16')
    scaler = amp.init_trainer(trainer, init_scale=2.0 ** 10, scale_window=2)
    weight = net.weight.data()
    before = weight.asnumpy()
    backward(net, trainer, np.full((4, 3), 100.0, HALF))     # gradients of 1.2e5 · 2^10
    trainer.step(4)
    assert (scaler.skipped, scaler.steps, scaler.loss_scale) == (1, 0, 2.0 ** 9)
    numpy.testing.assert_array_equal(weight.asnumpy(), before)
    backward(net, trainer, np.ones((4, 3), HALF))            # gradients of 12 · 2^9
    trainer.step(4)
    assert (scaler.skipped, scaler.steps, scaler.loss_scale) == (1, 1, 2.0 ** 9)
    numpy.testing.assert_array_equal(weight.asnumpy(), numpy.full((2, 3), 0.5 - 0.1 * 12 / 4,
                                                                  HALF))


def test_the_step_divides_the_gradients_by_the_scale_it_was_computed_with():
    """A float32 net: the scaled step is the unscaled one (the scale is a power of 2, the
    division exact), doubling after its window does not touch the step it ends."""
    (plain_net, plain), (net, trainer) = dense_trainer(), dense_trainer()
    scaler = amp.init_trainer(trainer, init_scale=1024.0, scale_window=1)
    x = np.array(numpy.linspace(-1, 1, 12).reshape(4, 3).astype(numpy.float32))
    for _ in range(3):
        backward(plain_net, plain, x, scaled=False)
        plain.step(4)
        backward(net, trainer, x)
        trainer.step(4)
    assert scaler.loss_scale == 1024.0 * 2 ** 3
    numpy.testing.assert_allclose(net.weight.data().asnumpy(), plain_net.weight.data().asnumpy(),
                                  rtol=1e-6)


def test_a_scaler_needs_the_update_on_the_devices():
    net, _ = dense_trainer()
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                          kvstore='local', update_on_kvstore=True)
    with pytest.raises(ValueError, match='update_on_kvstore=False'):
        amp.init_trainer(trainer)
    with pytest.raises(ValueError, match='init_trainer'):
        with amp.scale_loss(np.ones(()), trainer):
            pass


# -- training in float16, on one and two devices -------------------------------------------

def classification(seed=0, n=128):
    """A two-class problem no MLP solves in a few steps (the labels are 10% noise)."""
    rng = numpy.random.default_rng(seed)
    X = rng.normal(size=(n, 8)).astype(numpy.float32)
    y = (X @ rng.normal(size=(8,)) > 0).astype(numpy.int64)
    y[rng.random(n) < 0.1] ^= 1
    return X, y


def train(devices, dtype, steps=40):
    """The mean loss after `steps` of full-batch Adam, float32 or float16 with multi_precision
    and the loss scaler; the loss is computed in float32 in both."""
    X, y = classification()
    net = nn.Sequential()
    net.add(nn.Dense(32, activation='relu'), nn.Dense(2))
    np.random.seed(1)
    net.initialize(nn.init.Normal(0.1), device=devices)
    net(np.ones((1, 8), device=devices[0]))
    net.cast(dtype)
    trainer = d2l.Trainer(net.collect_params(), 'adam',
                          {'learning_rate': 0.01, 'multi_precision': dtype == 'float16'})
    scaler = amp.init_trainer(trainer) if dtype == 'float16' else None
    loss_fn = d2l.SoftmaxCrossEntropyLoss()
    Xs, ys = d2l.split_and_load(np.array(X), devices), d2l.split_and_load(np.array(y), devices)

    def losses():
        return [loss_fn(net(x.astype(dtype)).astype('float32'), t) for x, t in zip(Xs, ys)]
    taken = 0
    while taken < steps:                           # skipped steps do not count
        with autograd.record():
            each = losses()
        if scaler is None:
            for loss in each:
                loss.backward()
        else:
            with amp.scale_loss(each, trainer) as scaled:
                for loss in scaled:
                    loss.backward()
        trainer.step(len(X))
        taken = taken + 1 if scaler is None else scaler.steps
    return sum(loss.sum().item() for loss in losses()) / len(X), scaler


@pytest.mark.filterwarnings('ignore::RuntimeWarning')       # the overflows the scaler skips
@pytest.mark.parametrize('devices', [[d2l.cpu(0)], [d2l.cpu(0), d2l.cpu(1)]])
def test_float16_training_reaches_the_float32_loss(devices):
    """Within 0.005 of float32's loss after 40 updates (0.2399 and 0.2396 measured, from 0.68
    untrained): what float16 weights and activations cost, with float32 masters and a loss
    scaler that skipped its first steps (2^16 overflows the backward pass: 4 skipped)."""
    loss32, _ = train(devices, 'float32')
    loss16, scaler = train(devices, 'float16')
    assert scaler.skipped >= 1 and scaler.steps == 40
    assert loss16 == pytest.approx(loss32, abs=0.005)
    assert loss16 < train(devices, 'float32', steps=0)[0] - 0.2          # it did learn


# -- memory ---------------------------------------------------------------------------------

def test_memory_counts_float16_weights_and_float32_masters():
    where = d2l.cpu(6)
    engine.wait_all()
    gc.collect()
    before = device.memory(where).by_kind
    net = nn.Dense(10, in_units=20)
    net.initialize(device=where)
    net.cast('float16')
    trainer = d2l.Trainer(net.collect_params(), 'adam',
                          {'learning_rate': 0.1, 'multi_precision': True})
    with autograd.record():
        loss = net(np.ones((2, 20), HALF, device=where)).sum()
    loss.backward()
    trainer.step(2)
    del loss
    engine.wait_all()
    gc.collect()
    now = device.memory(where).by_kind
    params = 20 * 10 + 10
    grown = {kind: now[kind] - before[kind] for kind in now}
    assert grown['weights'] == 2 * params and grown['gradients'] == 2 * params
    assert grown['master weights'] == 4 * params and grown['optimizer state'] == 8 * params


# -- bfloat16 on NumPy ---------------------------------------------------------------------------

def test_bfloat16_arrays_add_multiply_multiply_matrices_and_sum():
    """Each result bfloat16, and what float32 gives rounded to bfloat16 (the product is
    computed in float32 by ml_dtypes and rounded once)."""
    rng = numpy.random.default_rng(0)
    a32, b32 = (rng.normal(size=(4, 4)).astype(BF16).astype(numpy.float32) for _ in range(2))
    a, b = np.array(a32).astype('bfloat16'), np.array(b32).astype('bfloat16')
    for got, expected in [(a + b, a32 + b32), (a * b, a32 * b32), (a @ b, a32 @ b32),
                          (a * 0.5 - 1, a32 * 0.5 - 1), (np.dot(a, b), None)]:
        assert got.dtype == BF16 and got.asnumpy().dtype == BF16
        if expected is not None:
            numpy.testing.assert_array_equal(got.asnumpy(), expected.astype(BF16))
    total = a.sum()
    assert total.dtype == BF16
    assert float(total.item()) == pytest.approx(float(a32.sum()), rel=2 ** -7)


def test_a_net_cast_to_bfloat16_trains_with_float32_masters():
    """bfloat16 (ml_dtypes' kind 'V', not 'f') takes gradients like any float, and needs no
    scaler: its range is float32's."""
    net = nn.Sequential()
    net.add(nn.Dense(8, in_units=4, activation='relu'), nn.Dense(3, in_units=8))
    net.initialize()
    net.cast('bfloat16')
    trainer = d2l.Trainer(net.collect_params(), 'adam',
                          {'learning_rate': 0.01, 'multi_precision': True})
    rng = numpy.random.default_rng(0)
    x = np.array(rng.random((16, 4)).astype('float32')).astype('bfloat16')
    y = np.array(numpy.arange(16) % 3)
    losses = []
    for _ in range(30):
        with autograd.record():
            loss = d2l.SoftmaxCrossEntropyLoss()(net(x).astype('float32'), y)
        loss.backward()
        trainer.step(16)
        losses.append(loss.mean().item())
    assert net[0].weight.data().dtype == ml_dtypes.bfloat16
    assert net[0].weight.grad().dtype == ml_dtypes.bfloat16
    assert losses[-1] < losses[0] - 0.02


# -- float16 without master weights: warned, as MXNet warns ---------------------------------------

def adam_steps(dtype, **settings):
    """Two Adam steps on two float16 tables whose unused rows get zero gradients (an
    embedding's rows that no token read); the weights, and the warnings given."""
    adam = optimizer.Adam(learning_rate=0.01, **settings)
    weights = [np.ones((5, 2), dtype) for _ in range(2)]
    grad = np.array(numpy.array([[0.5, -0.5]] + [[0, 0]] * 4, dtype=dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(2):
            for key, weight in enumerate(weights):
                adam.update(key, weight, grad)
    return [w.asnumpy() for w in weights], [str(w.message) for w in caught]


@pytest.mark.filterwarnings('ignore::RuntimeWarning')       # the 0 / 0 it warns of
def test_float16_adam_without_masters_is_warned_once_and_with_them_stays_finite():
    """ε = 1e-8 rounds to 0 in float16, so a row with no gradient steps by 0 / 0: NaN. MXNet
    warns of float16 updates without multi_precision; so does d2lperf, once an optimizer."""
    weights, messages = adam_steps('float16')
    assert numpy.isnan(weights[0][1:]).all() and numpy.isfinite(weights[0][0]).all()
    assert len(messages) == 1
    assert all(words in messages[0] for words in ('float16', 'epsilon', 'multi_precision=True'))
    weights, messages = adam_steps('float16', multi_precision=True)
    assert messages == [] and numpy.isfinite(weights[0]).all()
    assert weights[0][1:].tolist() == [[1, 1]] * 4
    assert adam_steps('float32')[1] == []
    assert 'bfloat16' in adam_steps(BF16)[1][0] and 'epsilon' not in adam_steps(BF16)[1][0]
