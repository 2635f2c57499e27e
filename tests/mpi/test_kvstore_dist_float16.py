"""float16 keys in the distributed store: MXNet's nightly dist_sync checks, and the error of a
long sum on a server that sums and keeps float16 keys in float32 (`kvstore.server`)."""
import numpy
import pytest

from tests.dist_helpers import run_program
from d2lperf.kvstore import protocol

pytestmark = pytest.mark.chapter('parameter_servers', 'distributed_training')

HALF = numpy.float16

NIGHTLY = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
half = numpy.float16
kv = create_dist('dist_sync')
n, rank = kv.num_workers, kv.rank
keys = [('4', (2, 3)), ('6', (2, 3)), ('8', (2, 3)), ('100', (300, 400))]
kv.init([key for key, _ in keys], [d2l.np.ones(shape, dtype=half) for _, shape in keys])

def pulled(key, shape, dtype=half):
    out = d2l.np.zeros(shape, dtype=dtype)
    kv.pull(key, out=out)
    values = out.asnumpy()
    return f'{values.dtype} {sorted(set(values.ravel().tolist()))}'

for key, shape in keys:                      # no optimizer: a round stores its pushes' sum
    for step in range(3):
        kv.push(key, d2l.np.ones(shape, dtype=half) * (rank + 1))
        print('SUM', key, step, rank, pulled(key, shape))
for i, dtype in enumerate(['float32', 'float32', 'float16', 'float16']):    # check_init
    kv.init(f'init{i}', d2l.np.ones((3, 5), dtype=dtype) * i)
    print('INIT', i, rank, pulled(f'init{i}', (3, 5), dtype))
# MXNet's 'test' optimizer (weight += rescale_grad * grad) is SGD(1, rescale_grad=2) of -grad
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=1, rescale_grad=2))
for key, shape in keys:
    for step in range(3):
        kv.push(key, d2l.np.ones(shape, dtype=half) * -(rank + 1))
        print('UPDATE', key, step, rank, pulled(key, shape))
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=1, momentum=0.5, rescale_grad=2))
for step in range(2):
    kv.push('4', d2l.np.ones((2, 3), dtype=half) * -(rank + 1))
    print('MOMENTUM', step, rank, pulled('4', (2, 3)))
kv.save_optimizer_states('states.npz')
kv.load_optimizer_states('states.npz')
kv.push('4', d2l.np.ones((2, 3), dtype=half) * -(rank + 1))
print('MOMENTUM', 2, rank, pulled('4', (2, 3)))
'''


def test_float16_keys_pass_mxnets_nightly_dist_sync_checks(tmp_path):
    result = run_program(tmp_path, NIGHTLY, 4, timeout=240, D2LPERF_NUM_SERVERS=2)
    assert result.returncode == 0, result.report()
    workers, total = (0, 1), 3                       # 2 workers push 1 and 2: a round sums 3
    keys = ['4', '6', '8', '100']
    assert result.lines('SUM') == sorted(f'SUM {key} {step} {rank} float16 [3.0]'
                                         for key in keys for step in range(3) for rank in workers)
    assert result.lines('INIT') == sorted(
        f'INIT {i} {rank} {dtype} [{float(i)}]' for i, dtype in enumerate(
            ['float32', 'float32', 'float16', 'float16']) for rank in workers)
    # MXNet's expected value: the stored sum, plus rescale_grad times the round's sum, a step
    assert result.lines('UPDATE') == sorted(
        f'UPDATE {key} {step} {rank} float16 [{total + 2 * total * (step + 1):.1f}]'
        for key in keys for step in range(3) for rank in workers)
    weight, momentum, expected = total + 2 * total * 3, 0.0, []
    for _ in range(3):                               # saved and loaded before the third step
        momentum = 0.5 * momentum + 2 * total
        weight += momentum
        expected.append(weight)
    assert result.lines('MOMENTUM') == sorted(f'MOMENTUM {step} {rank} float16 [{value}]'
                                              for step, value in enumerate(expected)
                                              for rank in workers)
    with numpy.load(tmp_path / 'states.npz', allow_pickle=False) as saved:
        assert saved['str:4'].dtype == HALF               # states travel in the key's dtype
        numpy.testing.assert_array_equal(saved['str:4'], numpy.full((2, 3), 0.5 * 6 + 6, HALF))


LONG_SUM = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_async')
pushes = numpy.random.default_rng(0).uniform(0, 0.002, size=(1000, 1000)).astype(numpy.float16)
kv.init('w', d2l.np.zeros(1000, dtype=numpy.float16))
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=1))
for push in pushes:
    kv.push('w', d2l.np.array(push))
out = d2l.np.zeros(1000, dtype=numpy.float16)
kv.pull('w', out=out)
numpy.save('pulled.npy', out.asnumpy())
'''


def relative_error(values, pushes):
    reference = -pushes.astype(numpy.float64).sum(axis=0)
    return float(numpy.max(numpy.abs(values.astype(numpy.float64) - reference)
                           / numpy.abs(reference)))


def test_a_long_float16_sum_is_off_by_one_float16_rounding_at_most(tmp_path):
    result = run_program(tmp_path, LONG_SUM, 2, timeout=240, D2LPERF_NUM_SERVERS=1)
    assert result.returncode == 0, result.report()
    pulled = numpy.load(tmp_path / 'pulled.npy', allow_pickle=False)
    pushes = numpy.random.default_rng(0).uniform(0, 0.002, size=(1000, 1000)).astype(HALF)
    in_float16 = numpy.zeros(1000, HALF)             # what summing in float16 would give
    for push in pushes:
        in_float16 -= push
    error, float16_error = relative_error(pulled, pushes), relative_error(in_float16, pushes)
    print(f'\n1000 float16 pushes, max relative error against float64: {error:.2e} '
          f'(summed in float16: {float16_error:.2e}; one float16 rounding: {2.0 ** -11:.2e})')
    assert pulled.dtype == HALF
    assert error <= 2 * 2.0 ** -11                   # measured 4.8e-4: half an ulp, plus little
    assert float16_error > 10 * error                # measured 1.2e-2: why the server widens


def test_float16_goes_at_the_end_so_older_codes_keep_their_meaning():
    assert [d.name for d in protocol.DTYPES] == ['float32', 'float64', 'int32', 'int64',
                                                  'float16', 'uint8']    # uint8: text
    assert protocol.VALUE_DTYPES == protocol.DTYPES[:5]
    header = protocol.header_for('push', 5, numpy.ones((3, 2), HALF))
    assert protocol.parse_header(header.view(numpy.uint8), 1) == (
        'push', 5, numpy.dtype(HALF), (3, 2), 12)
