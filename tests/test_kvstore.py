"""The key-value store against a plain Python model of MXNet's rules, its refusals, its saved
states, and the Trainer that goes through it. MXNet's own unit tests of its local store
(tests/python/unittest/test_kvstore.py, tests/nightly/test_kvstore.py) are ported below, where
they test what d2lperf has: dense arrays, no row_sparse, no gradient compression."""
import numpy
import pytest
from hypothesis import given, settings, strategies as st

import d2lperf as d2l
from d2lperf import autograd, kvstore, nn, np, optimizer

pytestmark = pytest.mark.chapter('parameter_servers')

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


def commands(keys):
    return st.lists(st.tuples(
        st.sampled_from(['init', 'push', 'pull', 'pushpull', 'optimizer']),
        st.sampled_from(keys),
        st.integers(1, len(DEVICES)),
        st.integers(0, 2 ** 16)), min_size=1, max_size=12)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(['local', 'device']),
       program=commands([0, 1, 2]) | commands(['w', 'b', '0']))
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


def trained_store(kind, keys, path=None):
    """A store with momentum after one push of 1 and 2 into `keys`, saving to `path`."""
    store = kvstore.create(kind)
    store.init(keys, [np.zeros(SHAPE, device=DEVICES[1]), np.zeros(SHAPE)])
    store.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    store.push(keys, [np.ones(SHAPE, device=DEVICES[1]), np.full(SHAPE, 2.0)])
    if path is not None:
        store.save_optimizer_states(path)
    return store


def test_optimizer_states_round_trip_as_npz(tmp_path):
    trained_store('device', [3, 5], tmp_path / 'ints.npz')
    trained_store('local', ['3', 'w'], tmp_path / 'strs.npz')
    with numpy.load(tmp_path / 'ints.npz', allow_pickle=False) as ints, \
            numpy.load(tmp_path / 'strs.npz', allow_pickle=False) as strs:
        assert sorted(ints.files) == ['int:3', 'int:5']       # the one encoding of every
        assert sorted(strs.files) == ['str:3', 'str:w']       # store: 3 and '3' stay apart
    assert [kvstore.key_of_state(kvstore.state_name(k)) for k in (3, -3, '3', 'a:b')] == \
        [3, -3, '3', 'a:b']
    for kind in ('local', 'device'):        # saved by one placement, loaded by the other
        fresh = kvstore.create(kind)
        fresh.init([3, 5], [np.zeros(SHAPE, device=DEVICES[1]), np.zeros(SHAPE)])
        fresh.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
        fresh.load_optimizer_states(tmp_path / 'ints.npz')
        assert fresh.optimizer.states[3].device == fresh.values[3].device
        numpy.testing.assert_allclose(fresh.optimizer.states[5].asnumpy(), -0.2)
    strings = kvstore.create('local')
    strings.init(['3', '5'], [np.zeros(SHAPE), np.zeros(SHAPE)])
    strings.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"never initialized: \[3, 5\]"):
        strings.load_optimizer_states(tmp_path / 'ints.npz')    # int 3 is not '3'


def test_a_pickled_or_foreign_state_file_is_refused(tmp_path):
    store = kvstore.create('local')
    store.init('w', np.zeros(SHAPE))
    store.set_optimizer(optimizer.SGD(learning_rate=0.1, momentum=0.9))
    pickled = tmp_path / 'pickled.npz'
    numpy.savez(pickled, **{'str:w': numpy.array([{'evil': 1}], dtype=object)})
    with pytest.raises(ValueError, match='not an optimizer-state file'):
        store.load_optimizer_states(pickled)
    foreign = tmp_path / 'foreign.npz'
    numpy.savez(foreign, **{'str:other': numpy.zeros(SHAPE)})
    with pytest.raises(ValueError, match="never initialized: \\['other'\\]"):
        store.load_optimizer_states(foreign)
    numpy.savez(foreign, **{'s:w': numpy.zeros(SHAPE)})
    with pytest.raises(ValueError, match="'s:w' is not a key written by"):
        store.load_optimizer_states(foreign)
    numpy.savez(foreign, **{'str:w': numpy.zeros(SHAPE, numpy.float64)})
    with pytest.raises(ValueError, match=r"float64\[2, 3\] for key 'w', whose value is float32"):
        store.load_optimizer_states(foreign)
    with pytest.raises(ValueError, match='no optimizer'):
        kvstore.create('local').save_optimizer_states(tmp_path / 'x.npz')


def test_unknown_store_names_the_choices():
    with pytest.raises(ValueError, match="unknown kvstore 'nccl'.*'local', 'device', 'dist_sync'"):
        kvstore.create('nccl')


def test_every_store_is_a_kvstore_base():
    for name in ('local', 'device'):
        assert isinstance(kvstore.create(name), kvstore.KVStoreBase)
    assert issubclass(kvstore.DistKVStore, kvstore.KVStoreBase)   # created only under MPI
    assert list(kvstore.KVStoreBase.registry) == list(kvstore.TYPES)


def test_a_backend_registered_by_name_is_created_by_name():
    @kvstore.KVStoreBase.register('test_store')
    class TestStore(kvstore.KVStoreBase):
        def __init__(self, type):
            self.type = type
    try:
        store = kvstore.create('test_store')
        assert isinstance(store, TestStore) and store.type == 'test_store'
        with pytest.raises(ValueError, match="unknown kvstore 'nccl'.*'local'.*'test_store'"):
            kvstore.create('nccl')
    finally:
        del kvstore.KVStoreBase.registry['test_store']


def test_a_pull_after_the_next_backward_returns_the_earlier_sum():
    """The store keeps the summed gradient by reference: the next backward must not write
    into it (it gives `.grad` a new array)."""
    store, weights = kvstore.create('device'), [np.ones(SHAPE, device=d) for d in DEVICES[:2]]
    for w in weights:
        w.attach_grad()
    store.init(0, weights[0])

    def backward(factor):
        with autograd.record():
            losses = [(w * factor).sum() for w in weights]
        for loss in losses:
            loss.backward()
        return [w.grad for w in weights]
    grads = backward(3.0)
    store.pushpull(0, grads)
    assert store.values[0] is grads[0]              # the sum itself, no copy
    backward(5.0)
    out = np.zeros(SHAPE)
    store.pull(0, out=out)
    numpy.testing.assert_array_equal(out.asnumpy(), numpy.full(SHAPE, 6.0))


def test_a_store_writes_into_no_array_it_was_given():
    """A pushed array, kept by reference, is copied before the store writes into it."""
    for kind in ('local', 'device'):
        store = kvstore.create(kind)
        arrays = [np.full(SHAPE, 2.0, device=d) for d in DEVICES[:2]]
        store.init(0, np.zeros(SHAPE, device=DEVICES[0]))
        store.pushpull(0, arrays)                     # both hold 4 now
        store.set_optimizer(optimizer.SGD(learning_rate=1.0))
        store.push(0, np.ones(SHAPE, device=DEVICES[0]))
        for a in arrays:
            numpy.testing.assert_array_equal(a.asnumpy(), numpy.full(SHAPE, 4.0))
        alone = np.full(SHAPE, 7.0, device=DEVICES[0])
        store = kvstore.create(kind)
        store.init(0, np.zeros(SHAPE, device=DEVICES[0]))
        store.push(0, alone)
        alone[...] = 0
        out = np.zeros(SHAPE)
        store.pull(0, out=out)
        numpy.testing.assert_array_equal(out.asnumpy(), numpy.full(SHAPE, 7.0))


# -- MXNet's unit tests of its store (tests/python/unittest/test_kvstore.py) ------------------

MX_SHAPE, MX_KEYS, MX_STR_KEYS = (4, 4), [5, 7, 11], ['b', 'c', 'd']
FOUR = [d2l.cpu(i) for i in range(4)]


def mx_store(kind, str_keys):
    """MXNet's init_kv and init_kv_with_str: one key, then a list, all zeros."""
    store = kvstore.create(kind)
    single, keys = ('a', MX_STR_KEYS) if str_keys else (3, MX_KEYS)
    store.init(single, np.zeros(MX_SHAPE))
    store.init(keys, [np.zeros(MX_SHAPE)] * len(keys))
    return store, single, keys


def assert_all(arrays, value):
    for a in arrays:
        assert numpy.array_equal(a.asnumpy(), numpy.full(MX_SHAPE, value)), (a.device, value)


@pytest.mark.parametrize('kind', ['local', 'device'])
@pytest.mark.parametrize('str_keys', [False, True])
def test_mxnet_single_and_list_key_pairs(kind, str_keys):
    store, single, keys = mx_store(kind, str_keys)
    store.push(single, np.ones(MX_SHAPE))
    out = np.zeros(MX_SHAPE)
    store.pull(single, out=out)
    assert_all([out], 1)
    store.push(keys, [np.ones(MX_SHAPE) * 4] * len(keys))
    outs = [np.zeros(MX_SHAPE)] * len(keys)           # one array, the output of every key
    store.pull(keys, out=outs)
    assert_all(outs, 4)


@pytest.mark.parametrize('kind', ['local', 'device'])
@pytest.mark.parametrize('key', [3, 'a'])
def test_mxnet_init_and_pull(kind, key):
    store = kvstore.create(kind)
    store.init(key, np.ones(MX_SHAPE) * 4)
    out = np.zeros(MX_SHAPE)
    store.pull(key, out=out)
    assert_all([out], 4)
    ones = np.ones(MX_SHAPE)
    fresh = kvstore.create(kind)
    fresh.init('1', np.zeros(MX_SHAPE))
    fresh.push('1', [ones, ones, ones, ones])          # one array pushed four times
    fresh.pull('1', out)
    assert_all([out], 4)
    fresh.init('2', np.zeros(MX_SHAPE))
    fresh.pull('2', out)
    assert_all([out], 0)


@pytest.mark.parametrize('kind', ['local', 'device'])
@pytest.mark.parametrize('str_keys', [False, True])
def test_mxnet_aggregator_sums_over_devices(kind, str_keys):
    store, single, keys = mx_store(kind, str_keys)
    store.push(single, [np.ones(MX_SHAPE, device=d) for d in FOUR])
    outs = [np.zeros(MX_SHAPE, device=d) for d in FOUR]
    store.pull(single, out=outs)
    assert_all(outs, 4)
    values = [[np.ones(MX_SHAPE, device=d) * 2 for d in FOUR]] * len(keys)
    outs = [[np.zeros(MX_SHAPE, device=d) for d in FOUR]] * len(keys)
    store.push(keys, values)
    store.pull(keys, out=outs)
    assert_all(outs[0], 8)


class Accumulate:
    """MXNet's test updater: the stored value grows by what is pushed; keys keep their type."""

    def __init__(self, key_type):
        self.key_type = key_type

    def update(self, key, weight, grad):
        assert type(key) is self.key_type
        weight += grad


@pytest.mark.parametrize('kind', ['local', 'device'])
@pytest.mark.parametrize('str_keys', [False, True])
def test_mxnet_updater(kind, str_keys):
    store, single, keys = mx_store(kind, str_keys)
    store.set_optimizer(Accumulate(str if str_keys else int))
    store.push(single, [np.ones(MX_SHAPE, device=d) for d in FOUR])
    outs = [np.zeros(MX_SHAPE, device=d) for d in FOUR]
    store.pull(single, out=outs)
    assert_all(outs, 4)
    values = [[np.ones(MX_SHAPE, device=d) for d in FOUR]] * len(keys)
    outs = [[np.zeros(MX_SHAPE, device=d) for d in FOUR]] * len(keys)
    for _ in range(4):
        store.push(keys, values)
    store.pull(keys, out=outs)
    assert_all(outs[0], 16)


def test_mxnet_store_type():
    assert [kvstore.create(kind).type for kind in ('local', 'device')] == ['local', 'device']


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_mixed_key_types_are_refused(kind):
    for str_keys in (False, True):
        store, single, keys = mx_store(kind, str_keys)
        other_single, other_keys = (3, MX_KEYS) if str_keys else ('a', MX_STR_KEYS)
        kinds = ('str', 'int') if str_keys else ('int', 'str')
        words = f'mixed key types.*key {other_single!r} is a {kinds[1]}.*keys are {kinds[0]}s'
        values = [np.ones(MX_SHAPE)] * len(other_keys)
        for call in (lambda: store.init(other_single, np.ones(MX_SHAPE)),
                     lambda: store.push(other_single, np.ones(MX_SHAPE)),
                     lambda: store.pull(other_single, out=np.ones(MX_SHAPE)),
                     lambda: store.pushpull(other_single, np.ones(MX_SHAPE))):
            with pytest.raises(TypeError, match=words):
                call()
        for call in (lambda: store.init(other_keys, values),
                     lambda: store.push(other_keys, values),
                     lambda: store.pull(other_keys, out=values)):
            with pytest.raises(TypeError, match='mixed key types'):
                call()
        assert sorted(store.values) == sorted([single, *keys])
    empty = kvstore.create(kind)
    with pytest.raises(TypeError, match="key 'w' is a str, but this store's keys are ints "
                                        r'\(key 1 came first\)'):
        empty.init([1, 'w'], [np.zeros(SHAPE), np.zeros(SHAPE)])
    assert empty.values == {} and empty.first_key is None       # all or nothing
    empty.init(['w', 'b'], [np.zeros(SHAPE), np.zeros(SHAPE)])   # a str store, then
    with pytest.raises(ValueError, match="key 'w' is already initialized"):
        empty.init(['v', 'w'], [np.zeros(SHAPE), np.zeros(SHAPE)])
    with pytest.raises(ValueError, match="key 'v' is already initialized"):
        empty.init(['v', 'v'], [np.zeros(SHAPE), np.zeros(SHAPE)])
    assert sorted(empty.values) == ['b', 'w']


# -- MXNet's nightly test of the local store (tests/nightly/test_kvstore.py) -------------------

@pytest.mark.parametrize('kind', ['local', 'device'])
@pytest.mark.parametrize('grouped', [False, True])
def test_mxnet_nightly_repeated_pushes_match_numpy(kind, grouped):
    keys, shapes, repeats, lr = [3, 5, 7], [(4, 4), (100, 100), (600, 600)], 3, 0.25
    rng = numpy.random.default_rng(0)
    data = [[[rng.uniform(size=s).astype(numpy.float32) for _ in FOUR] for s in shapes]
            for _ in range(repeats)]
    store = kvstore.create(kind)
    store.set_optimizer(optimizer.SGD(learning_rate=lr))
    store.init(keys, [np.zeros(s) for s in shapes])
    expected = [numpy.zeros(s) for s in shapes]
    outs = [[np.zeros(s, device=d) for d in FOUR] for s in shapes]
    for step in range(repeats):
        pushed = [[np.array(v, device=d) for v, d in zip(per_key, FOUR)] for per_key in data[step]]
        if grouped:
            store.push(keys, pushed)
        else:
            for key, values in zip(keys, pushed):
                store.push(key, values)
        expected = [e - lr * sum(v.astype(numpy.float64) for v in per_key)
                    for e, per_key in zip(expected, data[step])]
        store.pull(keys, out=outs)
        for want, got in zip(expected, outs):
            for o in got:
                assert numpy.abs(o.asnumpy() - want).sum() / numpy.abs(want).sum() < 1e-6


# -- pushpull: every key pushed before any is pulled --------------------------------------

def docstring_example(kind, devices):
    """MXNet's pushpull docstring, in d2lperf's names: what each array holds afterwards."""
    store = kvstore.create(kind)
    store.init(['3', '4', '5', '6', '7', '8', '9'], [np.zeros(SHAPE)] * 7)
    a = np.zeros(SHAPE)
    store.pushpull('3', np.ones(SHAPE) * 8, out=a)
    seen = {'one key': a.asnumpy().copy()}
    store.pushpull('3', [np.ones(SHAPE, device=d) for d in devices], out=a)
    seen['summed over devices'] = a.asnumpy().copy()
    keys = ['4', '5', '6']
    b = [np.zeros(SHAPE)] * len(keys)                       # one output for three keys
    store.pushpull(keys, [np.ones(SHAPE)] * len(keys), out=b)
    seen['keys, one device'] = b[1].asnumpy().copy()
    b = [[np.ones(SHAPE, device=d) for d in devices]] * 3   # the same arrays for three keys
    store.pushpull(['7', '8', '9'], b)
    seen['keys, every device'] = [[a.asnumpy() for a in arrays] for arrays in b]
    return seen


def check_docstring_example(seen, devices):
    n = len(devices)
    assert seen['one key'].tolist() == numpy.full(SHAPE, 8.0).tolist()
    assert seen['summed over devices'].tolist() == numpy.full(SHAPE, float(n)).tolist()
    assert seen['keys, one device'].tolist() == numpy.ones(SHAPE).tolist()
    for arrays in seen['keys, every device']:   # n, not n, n**2, n**3 key after key
        assert [a.tolist() for a in arrays] == [numpy.full(SHAPE, float(n)).tolist()] * n


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_pushpull_docstring_example_on_virtual_devices(kind):
    check_docstring_example(docstring_example(kind, FOUR), FOUR)


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_pushpull_docstring_example_on_fake_gpus(fake_gpus, kind):
    devices = [d2l.gpu(0), d2l.gpu(1)]
    check_docstring_example(docstring_example(kind, devices), devices)


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_pushpull_of_keys_whose_arrays_are_views_of_one_array(kind):
    store = kvstore.create(kind)
    store.init([0, 1], [np.zeros((2, 3)), np.zeros((2, 3))])
    bases = [np.ones((2, 2, 3), device=d) for d in DEVICES[:2]]
    store.pushpull([0, 1], [[b[0] for b in bases], [b[0] for b in bases]])   # one row, twice
    assert [b.asnumpy()[0].tolist() for b in bases] == [numpy.full((2, 3), 2.0).tolist()] * 2
    separate = [[np.full((2, 3), float(k + 1), device=d) for d in DEVICES[:2]] for k in (0, 1)]
    store.pushpull([0, 1], separate)                       # no sharing: an allreduce a key
    assert [[a.asnumpy()[0, 0] for a in arrays] for arrays in separate] == [[2, 2], [4, 4]]


@pytest.mark.parametrize('kind', ['local', 'device'])
@pytest.mark.parametrize('how', ['push', 'pushpull'])
def test_float16_is_summed_in_float16_as_mxnet_sums_it(kind, how):
    """MXNet's local store reduces in the key's dtype (CommCPU's ReduceSumCPU on half_t): every
    addition rounds to float16. 1 + 2048 is 2048 in float16 (the spacing there is 2), so the
    sum of [1, 2048, 1] is 2048, where a float32 sum would give 2050. The distributed servers
    sum float16 in float32 instead (kvstore/server.py says why)."""
    store = kvstore.create(kind)
    store.init('w', np.zeros((1,), dtype='float16'))
    pushed = [np.array(numpy.array([v], numpy.float16), device=d)
              for v, d in zip([1, 2048, 1], DEVICES)]
    if how == 'push':
        store.push('w', pushed)
    else:
        store.pushpull('w', pushed)
    out = np.zeros((1,), dtype='float16')
    store.pull('w', out=out)
    for array in [out] + (pushed if how == 'pushpull' else []):
        assert array.dtype == numpy.float16 and array.asnumpy().tolist() == [2048.0]


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_pushpull_with_an_optimizer_pushes_every_key_first(kind):
    store = kvstore.create(kind)
    store.init([0, 1, 2], [np.zeros(SHAPE)] * 3)
    store.set_optimizer(optimizer.SGD(learning_rate=1.0))
    shared = [np.ones(SHAPE, device=d) for d in DEVICES[:2]]
    store.pushpull([0, 1, 2], [shared] * 3)
    assert [a.asnumpy().tolist() for a in shared] == [numpy.full(SHAPE, -2.0).tolist()] * 2


@pytest.mark.parametrize('kind', ['local', 'device'])
def test_pushpull_refuses_a_bad_output_before_it_pushes(kind):
    store = kvstore.create(kind)
    store.init(['a', 'b'], [np.ones(SHAPE), np.ones(SHAPE)])
    with pytest.raises(ValueError, match=r"'b' holds float32\[2, 3\], got float32\[3, 2\]"):
        store.pushpull(['a', 'b'], [np.zeros(SHAPE)] * 2, out=[np.zeros(SHAPE), np.zeros((3, 2))])
    out = [np.zeros(SHAPE), np.zeros(SHAPE)]
    store.pull(['a', 'b'], out=out)
    assert [o.asnumpy().tolist() for o in out] == [numpy.ones(SHAPE).tolist()] * 2


# -- the Trainer through the store ----------------------------------------------------------

def train(store, devices, overlap, momentum=0.0, steps=3, update_on_kvstore=None):
    np.random.seed(0)
    net = nn.HybridSequential()
    net.add(nn.Dense(16, activation='relu'), nn.Dense(4))
    net.initialize(device=devices)
    rng = numpy.random.default_rng(1)
    trainer = d2l.Trainer(net.collect_params(), 'sgd',
                          {'learning_rate': 0.3, 'momentum': momentum}, kvstore=store,
                          update_on_kvstore=update_on_kvstore)
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
    stores = [('device', None), ('local', None), ('device', True),
              (kvstore.create('local'), True), (kvstore.create('device'), None)]
    for store, update_on_kvstore in stores:
        for overlap in (False, True):
            if not isinstance(store, (str, type(None))):
                store = kvstore.create(store.type)          # a fresh store for each run
            got = train(store, DEVICES[:2], overlap, momentum, update_on_kvstore=update_on_kvstore)
            for copies, (reference,) in zip(got, alone):
                numpy.testing.assert_allclose(copies[0], reference, rtol=1e-5, atol=1e-6)
                numpy.testing.assert_array_equal(copies[0], copies[1])


def test_trainer_takes_a_store_by_name_or_as_an_object_and_decides_where_to_update():
    net = nn.Dense(2, in_units=3)
    net.initialize(device=DEVICES[:2])
    params = net.collect_params()
    store = kvstore.create('local')
    by_object = d2l.Trainer(params, 'sgd', kvstore=store)
    assert (by_object.store, by_object.kvstore, by_object.update_on_kvstore) == (store, 'local',
                                                                                False)
    assert d2l.Trainer(params, 'sgd', kvstore='device').update_on_kvstore is False
    on_store = d2l.Trainer(params, 'sgd', kvstore='device', update_on_kvstore=True)
    for call in (on_store.allreduce_grads, lambda: on_store.update(1)):
        with pytest.raises(ValueError, match="updates in the 'device' store: call step"):
            call()
    with pytest.raises(ValueError, match='update_on_kvstore=True needs a kvstore'):
        d2l.Trainer(params, 'sgd', kvstore=None, update_on_kvstore=True)
    with pytest.raises(ValueError, match="kvstore=None sums nothing, and the parameters live on "
                                         "2 devices"):
        d2l.Trainer(params, 'sgd', kvstore=None).step(1)


def test_a_trainer_on_one_device_needs_no_store():
    net = nn.Dense(2, in_units=3)
    net.initialize()
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore='device')
    with autograd.record():
        loss = (net(np.ones((4, 3))) ** 2).sum()
    loss.backward()
    trainer.step(4)
    assert trainer.store is None and trainer.kvstore is None


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
