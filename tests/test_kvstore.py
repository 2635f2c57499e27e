"""The key-value store against a plain Python model of MXNet's rules, its refusals, its saved
states, and the Trainer that goes through it."""
import numpy
import pytest
from hypothesis import given, settings, strategies as st

import d2lperf as d2l
from d2lperf import autograd, kvstore, nn, np, optimizer

DEVICES = [d2l.cpu(1), d2l.cpu(2), d2l.cpu(3)]
SHAPE = (2, 3)


class ModelStore:
    """MXNet's rules in plain NumPy: a push stores the sum, or takes an SGD step with it."""

    def __init__(self):
        self.values, self.lr = {}, None

    def init(self, key, value):
        self.values[key] = value.copy()

    def push(self, key, values):
        total = sum(values)
        if self.lr is None:
            self.values[key] = total
        else:
            self.values[key] = self.values[key] - self.lr * total


commands = st.lists(st.tuples(
    st.sampled_from(['init', 'push', 'pull', 'pushpull', 'optimizer']),
    st.sampled_from([0, 1, 'w']),
    st.integers(1, len(DEVICES)),
    st.integers(0, 2 ** 16)), min_size=1, max_size=12)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(['local', 'device']), program=commands)
def test_a_store_follows_mxnets_rules(kind, program):
    store, model = kvstore.create(kind), ModelStore()
    for command, key, copies, seed in program:
        rng = numpy.random.default_rng(seed)
        values = [rng.integers(-4, 5, SHAPE).astype(numpy.float32) for _ in range(copies)]
        arrays = [np.array(v, device=d) for v, d in zip(values, DEVICES)]
        if command == 'init':
            if key in model.values:
                with pytest.raises(ValueError, match='already initialized'):
                    store.init(key, arrays[0])
            else:
                store.init(key, arrays[0])
                model.init(key, values[0])
        elif command == 'optimizer':
            store.set_optimizer(optimizer.SGD(learning_rate=0.5))
            model.lr = 0.5
        elif key not in model.values:
            with pytest.raises(KeyError, match=repr(key)):
                store.push(key, arrays) if command != 'pull' else store.pull(key, out=arrays)
        elif command == 'push':
            store.push(key, arrays)
            model.push(key, values)
        elif command == 'pushpull':
            store.pushpull(key, arrays)
            model.push(key, values)
            for a in arrays:
                numpy.testing.assert_allclose(a.asnumpy(), model.values[key], rtol=1e-6)
        else:
            store.pull(key, out=arrays)
            for a in arrays:
                numpy.testing.assert_array_equal(a.asnumpy(), model.values[key])
    for key, value in model.values.items():
        out = np.zeros(SHAPE)
        store.pull(key, out=out)
        numpy.testing.assert_allclose(out.asnumpy(), value, rtol=1e-6)


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_refused_calls_leave_the_store_unchanged(kind):
    store = kvstore.create(kind)
    store.init(['a', 'b'], [np.ones(SHAPE), np.full(SHAPE, 2.0)])
    bad_calls = [
        (KeyError, "'c' was never initialized", lambda: store.push('c', np.ones(SHAPE))),
        (KeyError, "'c'", lambda: store.pull('c', out=np.ones(SHAPE))),
        (ValueError, "'a' is already initialized", lambda: store.init('a', np.ones(SHAPE))),
        (ValueError, r"'b' holds float32\[2, 3\], got float32\[3, 2\]",
         lambda: store.push(['a', 'b'], [np.zeros(SHAPE), np.zeros((3, 2))])),
        (ValueError, r"float64\[2, 3\]",
         lambda: store.push('a', [np.zeros(SHAPE), np.zeros(SHAPE, dtype=numpy.float64)])),
        (ValueError, '2 keys need a list of 2 values', lambda: store.push(['a', 'b'], np.ones(SHAPE))),
        (TypeError, 'ints or strings', lambda: store.init(1.5, np.ones(SHAPE))),
    ]
    for error, words, call in bad_calls:
        with pytest.raises(error, match=words):
            call()
    out = [np.zeros(SHAPE), np.zeros(SHAPE)]
    store.pull(['a', 'b'], out=out)
    assert out[0].asnumpy().tolist() == numpy.ones(SHAPE).tolist()     # 'a' untouched by the
    assert out[1].asnumpy().tolist() == numpy.full(SHAPE, 2.0).tolist()   # refused push


def test_device_store_spreads_keys_over_the_pushing_devices():
    store = kvstore.create('device')
    for key in range(4):
        store.init(key, np.zeros((100,), device=DEVICES[0]))
        store.push(key, [np.ones((100,), device=d) for d in DEVICES[:2]])
    homes = [store.values[key].device for key in range(4)]
    assert homes == [DEVICES[0], DEVICES[1], DEVICES[0], DEVICES[1]]
    assert kvstore.create('local').values == {} and kvstore.create('local').type == 'local'


def test_optimizer_states_round_trip_as_npz(tmp_path):
    store = kvstore.create('device')
    store.init([3, '3'], [np.zeros(SHAPE, device=DEVICES[1]), np.zeros(SHAPE)])
    store.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    store.push([3, '3'], [np.ones(SHAPE, device=DEVICES[1]), np.full(SHAPE, 2.0)])
    path = tmp_path / 'states.npz'
    store.save_optimizer_states(path)
    with numpy.load(path, allow_pickle=False) as saved:
        assert sorted(saved.files) == ['i:3', 's:3']          # 3 and '3' do not collide
    fresh = kvstore.create('device')
    fresh.init([3, '3'], [np.zeros(SHAPE, device=DEVICES[1]), np.zeros(SHAPE)])
    fresh.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    fresh.load_optimizer_states(path)
    assert fresh.optimizer.states[3].device == DEVICES[1]
    numpy.testing.assert_allclose(fresh.optimizer.states['3'].asnumpy(), -0.2)


def test_a_pickled_or_foreign_state_file_is_refused(tmp_path):
    store = kvstore.create('local')
    store.init('w', np.zeros(SHAPE))
    store.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    pickled = tmp_path / 'pickled.npz'
    numpy.savez(pickled, **{'s:w': numpy.array([{'evil': 1}], dtype=object)})
    with pytest.raises(ValueError, match='not an optimizer-state file'):
        store.load_optimizer_states(pickled)
    foreign = tmp_path / 'foreign.npz'
    numpy.savez(foreign, **{'s:other': numpy.zeros(SHAPE)})
    with pytest.raises(ValueError, match="never initialized: \\['other'\\]"):
        store.load_optimizer_states(foreign)
    with pytest.raises(ValueError, match='no optimizer'):
        kvstore.create('local').save_optimizer_states(tmp_path / 'x.npz')


def test_unknown_store_names_the_choices():
    with pytest.raises(ValueError, match="unknown kvstore 'nccl'.*'local', 'device', 'dist_sync'"):
        kvstore.create('nccl')


# -- the Trainer through the store ----------------------------------------------------------

def train(kvstore_name, devices, overlap, momentum=0.0, steps=3):
    np.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation='relu'), nn.Dense(4))
    net.initialize(device=devices)
    rng = numpy.random.default_rng(1)
    trainer = d2l.Trainer(net.collect_params(), 'sgd',
                          {'learning_rate': 0.3, 'momentum': momentum}, kvstore=kvstore_name)
    loss = d2l.SoftmaxCrossEntropyLoss()
    for _ in range(steps):
        X = np.array(rng.normal(size=(12, 5)).astype(numpy.float32))
        y = np.array(rng.integers(0, 4, 12))
        X_shards, y_shards = d2l.split_batch(X, y, devices)
        with autograd.record():
            losses = [loss(net(a), b) for a, b in zip(X_shards, y_shards)]
        if overlap:
            trainer.backward(losses)
        else:
            for value in losses:
                value.backward()
        trainer.step(12)
    return [[c.asnumpy() for c in p.list_data()] for p in net.collect_params().values()]


@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_every_store_and_the_overlap_train_alike_and_keep_copies_identical(momentum):
    alone = train(None, [d2l.cpu(1)], overlap=False, momentum=momentum)
    for name in ('device', 'local', None):
        for overlap in (False, True):
            got = train(name, DEVICES[:2], overlap, momentum=momentum)
            for copies, (reference,) in zip(got, alone):
                numpy.testing.assert_allclose(copies[0], reference, rtol=1e-5, atol=1e-6)
                numpy.testing.assert_array_equal(copies[0], copies[1])


def test_trainer_refuses_unknown_optimizer_parameters():
    net = nn.Dense(2)
    net.initialize()
    with pytest.raises(ValueError, match="'sgd' does not take"):
        d2l.Trainer(net.collect_params(), 'sgd', {'learning_rte': 0.1})


def test_backward_reports_each_gradient_as_soon_as_its_last_consumer_is_done():
    """Last layer first: a trainer can sum the output layer's gradients while the first layer's
    are still being computed."""
    net = nn.HybridSequential()
    net.add(nn.Dense(8, activation='relu'), nn.Dense(8, activation='relu'), nn.Dense(3))
    net.initialize()
    with autograd.record():
        loss = d2l.SoftmaxCrossEntropyLoss()(net(np.ones((4, 5))), np.array([0, 1, 2, 0]))
    reported = []
    loss.backward(on_gradient=reported.append)
    layer_of = {id(p.data()): i for i, layer in enumerate(net)
                for p in (layer.weight, layer.bias)}
    assert [layer_of[id(a)] for a in reported] == [2, 2, 1, 1, 0, 0]
