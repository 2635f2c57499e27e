"""The distributed key-value store in real MPI jobs of at most 4 processes on this host."""
import json
import re

import numpy

from tests.dist_helpers import run_program

ASYNC = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore_dist import create_dist
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
    logged = re.findall(r'^\[d2lperf rank (\d)\] (push|pull) key 3: 48 bytes, [\d.]+ ms$',
                        ''.join(result.stderr.values()), flags=re.MULTILINE)
    assert sorted(set(logged)) == [(str(rank), what) for rank in range(3)
                                   for what in ('pull', 'push')]
    assert len(logged) == 3 * 201                       # every push and pull, on each worker
    assert result.stderr[3].count('[d2lperf rank 3] push key') == 600     # and on the server


SYNC = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore_dist import create_dist
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
from d2lperf.kvstore_dist import create_dist
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
from d2lperf.kvstore_dist import create_dist
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
