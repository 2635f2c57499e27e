"""The distributed key-value store in real MPI jobs of at most 4 processes on this host.

MXNet's nightly tests of its distributed stores (tests/nightly/dist_sync_kvstore.py,
dist_device_sync_kvstore.py) are ported where they test what d2lperf has: dense keys, no
row_sparse, no gradient compression."""
import json
import re

import numpy
import pytest

from tests.dist_helpers import run_program

pytestmark = pytest.mark.chapter('parameter_servers', 'distributed_training')

ASYNC = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_async')
kv.init(3, d2l.np.array(numpy.zeros((4, 3), numpy.float32)))
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=1))
minus_one = d2l.np.array(-numpy.ones((4, 3), numpy.float32))
for _ in range(200):
    kv.push(3, minus_one)
kv.barrier()
out = d2l.np.array(numpy.zeros((4, 3), numpy.float32))
kv.pull(3, out=out)
print('RESULT', kv.rank, kv.num_workers, kv.type, sorted(set(out.asnumpy().ravel().tolist())))
'''


def test_async_pushes_are_each_applied_once(tmp_path):
    result = run_program(tmp_path, ASYNC, 4, D2LPERF_NUM_SERVERS=1, D2LPERF_VERBOSE=1)
    assert result.returncode == 0, result.report()
    assert result.lines('RESULT') == [f'RESULT {rank} 3 dist_async [600.0]' for rank in range(3)]
    logged = re.findall(r'^\[d2lperf rank (\d)\] (push|pull) key 3 \(id \d+\): 48 bytes, '
                        r'[\d.]+ ms$',
                        ''.join(result.stderr.values()), flags=re.MULTILINE)
    assert sorted(set(logged)) == [(str(rank), what) for rank in range(3)
                                   for what in ('pull', 'push')]
    assert len(logged) == 3 * 201                       # every push and pull, on each worker
    assert result.stderr[3].count('[d2lperf rank 3] push key') == 600     # and on the server


SYNC = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
rng = numpy.random.default_rng(0)
features = rng.normal(size=(5, 2 * 8, 7)).astype(numpy.float32)     # 5 steps, 2 workers x 8
labels = rng.normal(size=(5, 2 * 8, 1)).astype(numpy.float32)
w = d2l.np.array(numpy.full((7, 1), 0.1, numpy.float32))
kv.init('w', w)
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=0.01,
                                   rescale_grad=1 / 16))
for step in range(5):
    part = slice(8 * kv.rank, 8 * kv.rank + 8)
    X, y = d2l.np.array(features[step, part]), d2l.np.array(labels[step, part])
    w.attach_grad()
    with d2l.autograd.record():
        loss = ((d2l.np.dot(X, w) - y) ** 2).sum()
    loss.backward()
    kv.push('w', w.grad)
    kv.pull('w', out=w)
print('WEIGHTS', kv.rank, ' '.join(repr(float(v)) for v in w.asnumpy().ravel()))
kv.save_optimizer_states('states.npz')
'''


def local_reference(steps=5, batch=16):
    """The same five steps by one process at the combined batch, by MXNet's SGD rule."""
    rng = numpy.random.default_rng(0)
    features = rng.normal(size=(5, batch, 7)).astype(numpy.float32)
    labels = rng.normal(size=(5, batch, 1)).astype(numpy.float32)
    w = numpy.full((7, 1), 0.1, numpy.float64)
    momentum = numpy.zeros_like(w)
    for step in range(steps):
        X, y = features[step].astype(numpy.float64), labels[step].astype(numpy.float64)
        grad = 2 * X.T @ (X @ w - y) / batch + 0.01 * w
        momentum = 0.9 * momentum - 0.05 * grad
        w = w + momentum
    return w.ravel(), momentum


def test_sync_training_equals_one_process_at_the_combined_batch(tmp_path):
    result = run_program(tmp_path, SYNC, 4, D2LPERF_NUM_SERVERS=2)    # 2 workers, 2 servers
    assert result.returncode == 0, result.report()
    expected, momentum = local_reference()
    weights = [line.split()[1:] for line in result.lines('WEIGHTS')]
    assert sorted(rank for rank, *_ in weights) == ['0', '1']
    for _, *values in weights:
        numpy.testing.assert_allclose(numpy.array(values, float), expected, rtol=1e-5,
                                      atol=1e-6)
    with numpy.load(tmp_path / 'states.npz', allow_pickle=False) as saved:
        assert saved.files == ['str:w']
        numpy.testing.assert_allclose(saved['str:w'], momentum, rtol=1e-5, atol=1e-6)


RULES = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_device_sync')
def refused(call, error):
    try:
        call()
    except error as caught:
        print('REFUSED', type(caught).__name__, kv.rank)
    else:
        print('ACCEPTED', kv.rank)
ones = numpy.ones((2, 3), numpy.float32)
kv.init('g', d2l.np.array(ones))
refused(lambda: kv.init('g', d2l.np.array(ones)), ValueError)
refused(lambda: kv.push('nope', d2l.np.array(ones)), KeyError)
refused(lambda: kv.push('g', d2l.np.array(numpy.ones((3, 2), numpy.float32))), ValueError)
refused(lambda: kv.push('g', d2l.np.array(ones.astype(numpy.float64))), ValueError)
devices = [d2l.cpu(0), d2l.cpu(1)]
kv.push('g', [d2l.np.array(ones * (kv.rank + 1), device=d) for d in devices])
outs = [d2l.np.zeros((2, 3), device=d) for d in devices]
kv.pull('g', out=outs)
print('SUM', kv.rank, [sorted(set(o.asnumpy().ravel().tolist())) for o in outs])
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5, momentum=0.5))
if kv.rank == 0:
    numpy.savez('bad.npz', **{'str:other': ones})
    numpy.savez('good.npz', **{'str:g': ones})
    open('broken.npz', 'wb').write(b'PK not a zip')
kv.barrier()
refused(lambda: kv.load_optimizer_states('bad.npz'), ValueError)
refused(lambda: kv.load_optimizer_states('broken.npz'), ValueError)
kv.load_optimizer_states('good.npz')
kv.pushpull('g', d2l.np.array(ones), out=outs[0])
print('STEP', kv.rank, sorted(set(outs[0].asnumpy().ravel().tolist())))
out = d2l.np.array(ones * 7)
queued = out + 0                    # pushed before the pull, which lands in out's own buffer
buffer = out.wait_to_read().data
kv.pull('g', out=out)
transposed = d2l.np.zeros((3, 2)).T     # not one C-contiguous block: received, then copied
kv.pull('g', out=transposed)
print('INPLACE', kv.rank, out.data is buffer, sorted(set(queued.asnumpy().ravel().tolist())),
      sorted(set(out.asnumpy().ravel().tolist())), transposed.asnumpy().tolist())
'''


def test_store_rules_and_refusals(tmp_path):
    result = run_program(tmp_path, RULES, 3, D2LPERF_NUM_SERVERS=1)     # 2 workers, 1 server
    assert result.returncode == 0, result.report()
    assert result.lines('ACCEPTED') == []
    assert result.lines('REFUSED') == sorted(
        [f'REFUSED {error} {rank}' for rank in (0, 1)
         for error in ('ValueError', 'KeyError', 'ValueError', 'ValueError', 'ValueError',
                       'ValueError')])
    # dist_device_sync: each worker sums its two devices (2·(r+1)), the servers sum workers: 6
    assert result.lines('SUM') == [
        'SUM 0 [[6.0], [6.0]]', 'SUM 1 [[6.0], [6.0]]']
    # loaded momentum 1: m = 0.5·1 − 0.5·(1 + 1) = −0.5, weight 6 − 0.5 = 5.5
    assert result.lines('STEP') == [
        'STEP 0 [5.5]', 'STEP 1 [5.5]']
    # a lone host output receives in place, after what was queued on it read the old values
    assert result.lines('INPLACE') == [
        f'INPLACE {rank} True [7.0] [5.5] [[5.5, 5.5, 5.5], [5.5, 5.5, 5.5]]'
        for rank in (0, 1)]


PULL_INTO_VIEWS = '''
import json, threading, time, numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
value = numpy.arange(12, dtype=numpy.float32).reshape(3, 4)
kv.init('w', d2l.np.array(value))
flat = d2l.np.ones(12)
flat.wait_to_read()
gate, seen = threading.Event(), {}

def slow_read():                            # queued before the pull: must see the old values
    gate.wait(30)
    seen['before'] = flat.data.tolist()

def open_once_the_pull_waits():             # for the reader, on the base's own variable
    deadline = time.monotonic() + 10
    while not flat.var.pending and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()

d2l.engine.push(slow_read, [flat.var], [], d2l.cpu(1), 'slow_read')
threading.Thread(target=open_once_the_pull_waits, daemon=True).start()
kv.pull('w', out=flat.reshape(3, 4))        # one C-contiguous view: received in place
d2l.npx.waitall()
before, after = d2l.np.array(seen['before']), flat + 0
rows = d2l.np.ones((5, 4))
kv.pull('w', out=rows[1:4])                 # rows of a bigger array
wide = d2l.np.ones((4, 3))
kv.pull('w', out=wide.T)                    # not one C-contiguous block: received, then copied
print('VIEWS', kv.rank, json.dumps([a.asnumpy().tolist() for a in (before, after, rows, wide)]))
'''


def test_a_pull_into_a_view_writes_its_base(tmp_path):
    result = run_program(tmp_path, PULL_INTO_VIEWS, 3, D2LPERF_NUM_SERVERS=1)  # 2 workers
    assert result.returncode == 0, result.report()
    value = numpy.arange(12.0).reshape(3, 4)
    rows = numpy.ones((5, 4))
    rows[1:4] = value
    expected = json.dumps([[1.0] * 12, value.ravel().tolist(), rows.tolist(), value.T.tolist()])
    assert result.lines('VIEWS') == [f'VIEWS {rank} {expected}' for rank in (0, 1)]


PUSHPULL = '''
import json, os, numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist(os.environ['STORE'])
np, shape, devices = d2l.np, (2, 3), [d2l.cpu(0), d2l.cpu(1)]
kv.init(['3', '4', '5', '6', '7', '8', '9'], [np.zeros(shape)] * 7)
seen = {}
a = np.zeros(shape)
kv.pushpull('3', np.ones(shape) * 8, out=a)
seen['one key'] = a.asnumpy()[0, 0].item()
kv.barrier()                    # dist_async: every push of a phase is in before the next
kv.pushpull('3', [np.ones(shape, device=d) for d in devices], out=a)
seen['summed over devices'] = a.asnumpy()[0, 0].item()
kv.barrier()
b = [np.zeros(shape)] * 3                               # one output for three keys
kv.pushpull(['4', '5', '6'], [np.ones(shape)] * 3, out=b)
seen['keys, one device'] = b[1].asnumpy()[0, 0].item()
kv.barrier()
b = [[np.ones(shape, device=d) for d in devices]] * 3   # the same arrays for three keys
kv.pushpull(['7', '8', '9'], b)
seen['keys, every device'] = sorted({x.asnumpy()[0, 0].item() for arrays in b for x in arrays})
print('SEEN', kv.rank, json.dumps(seen, sort_keys=True))

def refused(call, error):
    try:
        call()
    except error as caught:
        print('REFUSED', kv.rank, type(caught).__name__, str(caught).split(':')[0])
    else:
        print('ACCEPTED', kv.rank)
refused(lambda: kv.push(3, np.ones(shape)), TypeError)
refused(lambda: kv.pull(3, out=np.ones(shape)), TypeError)
refused(lambda: kv.pushpull(['3', 4], [np.ones(shape)] * 2), TypeError)
refused(lambda: kv.init(['v', 10], [np.ones(shape)] * 2), TypeError)
refused(lambda: kv.init(['v', 'v'], [np.ones(shape)] * 2), ValueError)
refused(lambda: kv.pushpull('3', np.ones(shape), out=np.ones((3, 2))), ValueError)
kv.init('v', np.ones(shape) * (kv.rank + 5))           # refused before: so still new
kv.pull(['v', '3'], out=[a, b[0][0]])
print('AFTER', kv.rank, a.asnumpy()[0, 0].item(), b[0][0].asnumpy()[0, 0].item())
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_device_sync', 'dist_async'])
def test_pushpull_pushes_every_key_before_it_pulls_and_keys_keep_one_type(tmp_path, store):
    """MXNet's pushpull docstring example, and its refusal of mixed key types."""
    result = run_program(tmp_path, PUSHPULL, 3, D2LPERF_NUM_SERVERS=1, STORE=store)
    assert result.returncode == 0, result.report()
    workers = 1 if store == 'dist_async' else 2     # async: the last push is the value
    seen = {'one key': 8.0 * workers, 'summed over devices': 2.0 * workers,
            'keys, one device': 1.0 * workers, 'keys, every device': [2.0 * workers]}
    assert result.lines('SEEN') == [f'SEEN {rank} {json.dumps(seen, sort_keys=True)}'
                                    for rank in (0, 1)]
    assert result.lines('ACCEPTED') == []
    assert result.lines('REFUSED') == sorted(
        f'REFUSED {rank} {error} {words}' for rank in (0, 1) for error, words in [
            ('TypeError', 'mixed key types are not allowed'),
            ('TypeError', 'mixed key types are not allowed'),
            ('TypeError', 'mixed key types are not allowed'),
            ('TypeError', 'mixed key types are not allowed'),
            ('ValueError', "key 'v' is already initialized; init a key once, then push and "
                           'pull it'),
            ('ValueError', "key '3' holds shape (2, 3) float32, not shape (3, 2) float32")])
    # 'v' holds worker 0's value; '3' still holds its last sum: no refused call changed it
    assert result.lines('AFTER') == [f'AFTER {rank} 5.0 {2.0 * workers}' for rank in (0, 1)]


ALL_OR_NOTHING = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
np, shape = d2l.np, (2, 3)
kv.init('3', np.ones(shape))

def refused(call, error):
    try:
        call()
    except error as caught:
        print('REFUSED', kv.rank, type(caught).__name__, str(caught)[:40])
    else:
        print('ACCEPTED', kv.rank)
# worker 1 alone refuses '3', known already: every worker raises, and neither key is kept
refused(lambda: kv.init(['p', '3' if kv.rank else 'q'], [np.ones(shape)] * 2), ValueError)
refused(lambda: kv.save_optimizer_states('states.npz'), ValueError)
kv.init(['p', 'q'], [np.ones(shape) * 2] * 2)
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5, momentum=0.5))
kv.push(['p', 'q'], [np.ones(shape)] * 2)
if kv.rank == 0:
    open('blocked', 'w').close()        # a file where the states' folder should be
kv.barrier()
refused(lambda: kv.save_optimizer_states('blocked/states.npz'), OSError)
kv.save_optimizer_states('states.npz')                # the store goes on working
with numpy.load('states.npz', allow_pickle=False) as saved:
    print('SAVED', kv.rank, sorted(saved.files), saved['str:p'][0, 0].item())
'''


def test_init_and_save_are_all_or_nothing_on_every_worker(tmp_path):
    result = run_program(tmp_path, ALL_OR_NOTHING, 3, D2LPERF_NUM_SERVERS=1, timeout=60)
    assert result.returncode == 0, result.report()
    assert result.lines('ACCEPTED') == []
    refused = result.lines('REFUSED')
    own = [line for line in refused if line.startswith('REFUSED 0 FileExistsError [Errno 17]')]
    assert len(own) == 1, refused                     # worker 0 raises its own error
    assert [line for line in refused if line not in own] == sorted(
        f'REFUSED {rank} {error} {message[:40]}' for rank, error, message in [
            (0, 'ValueError', 'another worker refused this init; its error says why'),
            (1, 'ValueError', "key '3' is already initialized; init a key once"),
            (0, 'ValueError', 'this store has no optimizer, hence no states'),
            (1, 'ValueError', 'this store has no optimizer, hence no states'),
            (1, 'OSError', "worker 0 could not save optimizer states to 'blocked/")])
    # momentum 0.5·0 − 0.5·(1 + 1) = −1 for the keys of the init refused before; none for '3'
    assert result.lines('SAVED') == [f"SAVED {rank} ['str:p', 'str:q'] -1.0" for rank in (0, 1)]


NIGHTLY = '''
import os, numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist(os.environ['STORE'])
np, rate, repeats = d2l.np, 2, 3
devices = [d2l.cpu(0), d2l.cpu(1)] if kv.type == 'dist_device_sync' else [d2l.cpu(0)]
shape, big = (2, 3), (1200, 1200)
keys = {'float32': [('3', shape), ('5', shape), ('7', shape), ('99', big)],
        'float16': [('4', shape), ('6', shape), ('8', shape), ('100', big)]}
for dtype, pairs in keys.items():
    kv.init([k for k, _ in pairs], [np.ones(s, dtype=dtype) for _, s in pairs])
    kv.init([k + 'p' for k, _ in pairs], [np.ones(s, dtype=dtype) for _, s in pairs])
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=1, rescale_grad=rate))
wrong = 0
n = kv.num_workers
for dtype, pairs in keys.items():
    for key, s in pairs:
        for i in range(repeats):
            # pushing -(rank + 1) under SGD(1, rescale_grad=rate) adds rate·(rank + 1)
            grads = [np.ones(s, dtype=dtype, device=d) * -(kv.rank + 1) for d in devices]
            expected = (n + 1) * n / 2 * rate * len(devices) * (i + 1) + 1
            kv.push(key, grads)
            out = np.zeros(s, dtype=dtype)
            kv.pull(key, out=out)
            outs = [np.zeros(s, dtype=dtype, device=d) for d in devices]
            kv.pushpull(key + 'p', grads, out=outs)
            wrong += sum(int((o.asnumpy() != expected).sum()) for o in [out] + outs)
print('WRONG', kv.rank, wrong)
# MXNet's test_sync_init: keys initialized one by one, half float32 and half float16
for names, s in ((range(200, 210), shape), (range(300, 304), big)):
    names = [str(i) for i in names]
    for i, key in enumerate(names):
        dtype = 'float32' if i < len(names) / 2 else 'float16'
        kv.init(key, np.ones(s, dtype=dtype) * i)
        out = np.zeros(s, dtype=dtype)
        kv.pull(key, out=out)
        wrong += int((out.asnumpy() != i).sum())
print('INIT', kv.rank, wrong)
'''


@pytest.mark.parametrize('store', ['dist_sync', 'dist_device_sync'])
def test_mxnet_nightly_sync_push_pull_and_init(tmp_path, store):
    """MXNet's tests/nightly/dist_sync_kvstore.py (and dist_device_sync_kvstore.py), dense
    keys: small and big, float32 and float16, sliced over two servers."""
    result = run_program(tmp_path, NIGHTLY, 4, D2LPERF_NUM_SERVERS=2, STORE=store, timeout=180)
    assert result.returncode == 0, result.report()
    assert result.lines('WRONG') == ['WRONG 0 0', 'WRONG 1 0']
    assert result.lines('INIT') == ['INIT 0 0', 'INIT 1 0']


CROSS_LOAD = '''
import numpy, d2lperf as d2l
from d2lperf import kvstore
from d2lperf.kvstore.dist import create_dist
dist = create_dist('dist_sync')            # one worker: its pushes are the whole sum
np, keys = d2l.np, [3, 5]
rng = numpy.random.default_rng(0)
host = {k: rng.normal(size=(4, 5)).astype(numpy.float32) for k in keys}
grads = [[np.array(rng.normal(size=(4, 5)).astype(numpy.float32)) for k in keys]
         for _ in range(3)]
sgd = lambda: d2l.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01)

local = kvstore.create('local')
local.init(keys, [np.array(host[k]) for k in keys])
local.set_optimizer(sgd())
local.push(keys, grads[0])
local.save_optimizer_states('local.npz')
weights = [np.zeros((4, 5)) for _ in keys]
local.pull(keys, out=weights)

dist.init(keys, weights)                   # where the local store stands, and its momentum
dist.set_optimizer(sgd())
dist.load_optimizer_states('local.npz')
for grad in grads[1:]:
    dist.push(keys, grad)
    local.push(keys, grad)
from_dist, from_local = [np.zeros((4, 5)) for _ in keys], [np.zeros((4, 5)) for _ in keys]
dist.pull(keys, out=from_dist)
local.pull(keys, out=from_local)
print('WEIGHTS', max(float(abs(a.asnumpy() - b.asnumpy()).max())
                     for a, b in zip(from_dist, from_local)))
dist.save_optimizer_states('dist.npz')
back = kvstore.create('device')
back.init(keys, [np.zeros((4, 5)) for _ in keys])
back.set_optimizer(sgd())
back.load_optimizer_states('dist.npz')
with numpy.load('local.npz') as a, numpy.load('dist.npz') as b:
    print('FILES', sorted(a.files), sorted(b.files))
print('STATES', max(float(abs(back.optimizer.states[k].asnumpy()
                             - local.optimizer.states[k].asnumpy()).max()) for k in keys))
'''


def test_states_saved_by_a_local_store_load_into_a_distributed_one_and_back(tmp_path):
    result = run_program(tmp_path, CROSS_LOAD, 3, D2LPERF_NUM_SERVERS=2)   # 1 worker, 2 servers
    assert result.returncode == 0, result.report()
    assert result.lines('FILES') == ["FILES ['int:3', 'int:5'] ['int:3', 'int:5']"]
    [weights], [states] = result.lines('WEIGHTS'), result.lines('STATES')
    assert float(weights.split()[1]) < 1e-6 and float(states.split()[1]) < 1e-6
