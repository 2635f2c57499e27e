"""Tests of d2lperf.autograd: every differentiable op against central finite differences.

Each case is a function of float64 arrays. Its gradient is taken of `sum(f(x) * r)` for a
fixed random `r` (so a transposed or misplaced gradient cannot hide behind a sum of ones)
and compared with central differences of the same function run forward only.
"""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, engine, np, npx, ops
from d2lperf.np.multiarray import apply

pytestmark = pytest.mark.usefixtures('fresh_engine')

RNG = numpy.random.default_rng(0)
STEP, RTOL, ATOL = 1e-6, 1e-5, 1e-7


RUNNING_MEAN, RUNNING_VAR = [0.1, -0.2, 0.3], [0.5, 1.5, 2.0]


def signed(*shape):
    """Values in ±[0.3, 1.5]: away from 0, where abs and relu have their kink."""
    return numpy.asarray(RNG.uniform(0.3, 1.5, shape) * RNG.choice([-1.0, 1.0], shape))


def positive(*shape):
    return RNG.uniform(0.5, 2.0, shape)


def distinct(*shape):
    """Values far apart (0.1 steps), so that max has one winner well beyond the step."""
    return RNG.permutation(int(numpy.prod(shape))).reshape(shape) * 0.1 - 0.5


def analytic_gradients(f, values, projection):
    xs = [np.array(v) for v in values]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        head = (f(*xs) * np.array(projection)).sum()
    head.backward()
    return [x.grad.asnumpy() for x in xs]


def numeric_gradients(f, values, projection):
    def loss(vs):
        return float((f(*[np.array(v) for v in vs]) * np.array(projection)).sum().item())
    grads = []
    for i, value in enumerate(values):
        grad = numpy.zeros_like(value)
        for index in numpy.ndindex(value.shape):
            shifted = [v.copy() for v in values]
            shifted[i][index] += STEP
            plus = loss(shifted)
            shifted[i][index] -= 2 * STEP
            grad[index] = (plus - loss(shifted)) / (2 * STEP)
        grads.append(grad)
    return grads


def check_gradients(f, *values):
    out = f(*[np.array(v) for v in values]).asnumpy()
    projection = RNG.uniform(-1, 1, out.shape)
    for got, want in zip(analytic_gradients(f, values, projection),
                         numeric_gradients(f, values, projection)):
        assert got.shape == want.shape and got.dtype == numpy.float64
        numpy.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def seeded_dropout_mask(a):
    """A dropout mask drawn after the same seed each time: a constant, so it has a derivative
    (and the finite differences see the same mask only if seeding really repeats it)."""
    np.random.seed(7)
    return apply('dropout_mask', a, rate=0.5)


PICKED = numpy.array([2, 0, 3])
CONDITION = numpy.array([[True, False, True], [False, False, True]])

CASES = {
    # the Transformer's own (nn/transformer.py)
    'embedding': (lambda w: npx.embedding(np.array(numpy.array([[0, 2, 2]])), w), signed(3, 4)),
    'add_position_embedding': (npx.add_position_embedding, signed(2, 3, 4), signed(5, 4)),
    'layer_norm': (npx.layer_norm, signed(2, 3, 5), signed(5), signed(5)),
    'gelu': (npx.gelu, signed(3, 4)),
    'causal_softmax': (npx.causal_softmax, signed(2, 3, 5)),
    'attention': (lambda q, k, v: npx.attention(q, k, v, block_size=(2, 3)),
                  signed(1, 2, 5, 3), signed(1, 2, 5, 3), signed(1, 2, 5, 3)),
    'attention_full': (lambda q, k, v: npx.attention(q, k, v, causal=False, block_size=2),
                       signed(2, 1, 3, 2), signed(2, 1, 3, 2), signed(2, 1, 3, 2)),
    # elementwise, with broadcasting and Python scalars
    'add': (lambda a, b: a + b, signed(2, 3), signed(3)),
    'add_outer': (lambda a, b: a + b, signed(2, 1), signed(1, 3)),
    'subtract': (lambda a, b: a - b, signed(2, 3), signed(2, 1)),
    'multiply': (lambda a, b: a * b, signed(2, 3), signed(3)),
    'multiply_scalar_batch': (lambda a, b: a * b, signed(2, 3, 2), signed()),
    'divide': (lambda a, b: a / b, signed(2, 3), positive(2, 1)),
    'power': (lambda a, b: a ** b, positive(2, 3), signed(3)),
    'power_scalar_exponent': (lambda a: a ** 3, signed(2, 3)),
    'power_scalar_base': (lambda b: 2.0 ** b, signed(4)),
    'scalars_on_the_left': (lambda a: 1.5 / a - 2 * a + (3 - a), positive(4)),
    'maximum': (lambda a, b: np.maximum(a, b), distinct(2, 3), distinct(3) + 0.05),
    'minimum': (lambda a, b: np.minimum(a, b), distinct(2, 3), distinct(2, 1) + 0.05),
    'maximum_scalar': (lambda a: np.maximum(a, 0.0), signed(5)),
    'negative': (lambda a: -a, signed(2, 3)),
    'exp': (np.exp, signed(2, 3)),
    'log': (np.log, positive(2, 3)),
    'sqrt': (np.sqrt, positive(2, 3)),
    'abs': (np.abs, signed(2, 3)),
    'tanh': (np.tanh, signed(2, 3)),
    'sigmoid': (npx.sigmoid, signed(2, 3)),
    'relu': (npx.relu, signed(2, 3)),
    # products
    'dot': (np.dot, signed(2, 3), signed(3, 4)),
    'dot_vectors': (np.dot, signed(3), signed(3)),
    'dot_matrix_vector': (np.dot, signed(2, 3), signed(3)),
    'dot_vector_matrix': (np.dot, signed(3), signed(3, 2)),
    'matmul': (lambda a, b: a @ b, signed(2, 3), signed(3, 4)),
    'matmul_vectors': (np.matmul, signed(3), signed(3)),
    'matmul_batches': (np.matmul, signed(2, 2, 3), signed(2, 3, 4)),
    'matmul_broadcast_batch': (np.matmul, signed(2, 3), signed(4, 3, 2)),
    'matmul_batch_of_one': (np.matmul, signed(1, 2, 3), signed(3, 3, 2)),
    'matmul_vector_batch': (np.matmul, signed(3), signed(2, 3, 4)),
    'matmul_batch_vector': (np.matmul, signed(2, 3, 4), signed(4)),
    # shapes, copies, selection
    'reshape': (lambda a: a.reshape(-1, 4), signed(2, 3, 2)),
    'transpose': (lambda a: a.T, signed(2, 3, 4)),
    'transpose_axes': (lambda a: a.transpose(1, 0, 2), signed(2, 3, 4)),
    'transpose_negative_axes': (lambda a: np.transpose(a, (-1, 0, 1)), signed(2, 3, 4)),
    'broadcast_to': (lambda a: np.broadcast_to(a, (2, 3, 4)), signed(3, 1)),
    'astype': (lambda a: a.astype('float64') * a, signed(2, 3)),
    'copy': (lambda a: a.copy() * a, signed(2, 3)),
    'getitem_row': (lambda a: a[1], signed(3, 4)),
    'getitem_slice': (lambda a: a[0:2] * a[1:3], signed(3, 4)),
    'getitem_column': (lambda a: a[:, 1], signed(3, 4)),
    'getitem_mixed': (lambda a: a[None, 1:, ::2], signed(3, 4)),
    'getitem_ellipsis': (lambda a: a[..., -1], signed(2, 3, 4)),
    'getitem_of_a_result': (lambda a: (a * a)[1:], signed(3, 2)),
    'concatenate': (lambda a, b: np.concatenate([a, b]), signed(2, 3), signed(1, 3)),
    'concatenate_last_axis': (lambda a, b, c: np.concatenate([a, b, c], axis=-1),
                              signed(2, 3), signed(2, 1), signed(2, 2)),
    'log_softmax': (npx.log_softmax, signed(3, 4)),
    'softmax': (npx.softmax, signed(2, 2, 3)),
    'pick': (lambda a: npx.pick(a, np.array(PICKED)), signed(3, 4)),
    'cross_entropy': (lambda a: -npx.pick(npx.log_softmax(a), np.array(PICKED)), signed(3, 4)),
    'fully_connected': (npx.fully_connected, signed(4, 3), signed(2, 3), signed(2)),
    'fully_connected_3d': (npx.fully_connected, signed(2, 4, 3), signed(2, 3), signed(2)),
    'fully_connected_vector': (npx.fully_connected, signed(3), signed(2, 3), signed(2)),
    'where': (lambda a, b: apply('where', np.array(CONDITION), a, b), signed(2, 3), signed(3)),
    'dropout': (lambda a: a * seeded_dropout_mask(a), signed(4, 5)),
    # convolutional networks
    'convolution': (lambda a, w, b: npx.convolution(a, w, b, kernel=(2, 3), stride=(2, 1),
                                                    pad=(1, 0), num_filter=2),
                    signed(2, 3, 5, 4), signed(2, 3, 2, 3), signed(2)),
    'convolution_without_bias': (lambda a, w: npx.convolution(a, w, kernel=(3, 3), pad=(1, 1),
                                                              num_filter=2),
                                 signed(1, 2, 4, 4), signed(2, 2, 3, 3)),
    'max_pooling': (lambda a: npx.pooling(a, kernel=(2, 2), stride=(1, 2), pad=(1, 0)),
                    distinct(2, 2, 4, 5)),
    'avg_pooling': (lambda a: npx.pooling(a, kernel=(3, 2), stride=(2, 2), pad=(1, 1),
                                          pool_type='avg'), signed(2, 2, 5, 4)),
    'global_avg_pooling': (lambda a: npx.pooling(a, pool_type='avg', global_pool=True),
                           signed(2, 3, 3, 2)),
    'batch_norm_train': (lambda a, g, b: training_batch_norm(a, g, b),
                         signed(4, 3, 2, 2), positive(3), signed(3)),
    'batch_norm_train_dense': (lambda a, g, b: training_batch_norm(a, g, b),
                               signed(5, 3), positive(3), signed(3)),
    'batch_norm_predict': (lambda a, g, b: npx.batch_norm(
        a, g, b, np.array(RUNNING_MEAN), np.array(RUNNING_VAR), use_global_stats=True),
        signed(3, 3, 2, 2), positive(3), signed(3)),
    # a value used more than once accumulates its gradients
    'used_twice': (lambda a: a * a, signed(2, 3)),
    'used_thrice': (lambda a: a * np.exp(a) + a, signed(2, 3)),
    'shared_by_two_paths': (lambda a, b: np.tanh(a @ b).sum(axis=1) * a.mean(), signed(2, 3),
                            signed(3, 2)),
    'mask_from_a_comparison': (lambda a: (a > 0) * a, signed(2, 3)),
}
for _op in ('sum', 'mean', 'max'):
    for _axis in (None, 1, (0, 2), -1):
        for _keepdims in (False, True):
            CASES[f'{_op}_axis{_axis}_keepdims{_keepdims}'] = (
                lambda a, op=_op, axis=_axis, keepdims=_keepdims:
                    getattr(a, op)(axis=axis, keepdims=keepdims), distinct(2, 3, 4))


def training_batch_norm(a, gamma, beta):
    """Batch statistics, inside record() and out (finite differences run outside)."""
    with autograd.train_mode():
        return npx.batch_norm(a, gamma, beta, np.array(RUNNING_MEAN), np.array(RUNNING_VAR))


@pytest.mark.parametrize('case', sorted(CASES))
def test_gradient_matches_finite_differences(case):
    f, *values = CASES[case]
    check_gradients(f, *values)


def recorded_ops(f, values):
    """The names of the operations the tape recorded for one case."""
    xs = [np.array(v) for v in values]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        head = f(*xs)
    return {a.node.op.name for a in autograd.topological_order(head) if a.node is not None}


def test_every_op_with_a_gradient_rule_has_a_finite_difference_case():
    covered = set().union(*(recorded_ops(f, values) for f, *values in CASES.values()))
    with_rule = {name for name, op in ops.REGISTRY.items() if op.vjp is not None}
    assert with_rule <= covered, f'give {sorted(with_rule - covered)} a case in CASES'


@pytest.mark.parametrize('case', ['multiply', 'matmul_batches', 'getitem_slice', 'cross_entropy',
                                  'sum_axis(0, 2)_keepdimsTrue'])
def test_gradient_matches_under_the_naive_engine(case):
    engine.use('naive')
    f, *values = CASES[case]
    check_gradients(f, *values)


def test_gradients_of_ties_in_max_are_shared():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]], dtype='float64')
    x.attach_grad()
    with autograd.record():
        y = x.max(axis=1)
    y.backward()
    assert x.grad.asnumpy().tolist() == [[0, 0.5, 0.5], [1, 0, 0]]


def test_gradient_of_a_float32_cast_is_cast_back():
    x = np.array(signed(2, 3))
    x.attach_grad()
    with autograd.record():
        y = x.astype('float32') * 2
    y.backward()
    assert x.grad.dtype == numpy.float64 and x.grad.asnumpy().tolist() == [[2.0] * 3] * 2


# -- the gradient buffer ------------------------------------------------------------------------

def test_attach_grad_gives_a_zero_buffer_like_the_array():
    x = np.array([numpy.inf, -1.0, numpy.nan], device=d2l.cpu(1))
    x.attach_grad()
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and x.grad.device == d2l.cpu(1)
    assert x.grad.asnumpy().tolist() == [0.0, 0.0, 0.0]


def test_backward_writes_not_adds():
    x = np.array([1.0, 2.0])
    x.attach_grad()
    for scale in (3.0, 5.0):
        with autograd.record():
            y = x * scale
        y.backward()
        assert x.grad.asnumpy().tolist() == [scale, scale]


def test_backward_of_a_non_scalar_sums_it():
    x = np.array([1.0, 2.0, 3.0], dtype='float64')
    x.attach_grad()
    with autograd.record():
        y = x * x
    y.backward()
    assert x.grad.asnumpy().tolist() == [2.0, 4.0, 6.0]


def test_backward_with_a_head_gradient():
    x = np.array([1.0, 2.0], dtype='float64')
    x.attach_grad()
    with autograd.record():
        y = x * x
    y.backward(np.array([10.0, -1.0], dtype='float64'))
    assert x.grad.asnumpy().tolist() == [20.0, -4.0]


def test_a_zero_dimensional_leaf_gets_its_gradient():
    x = np.array(3.0, dtype='float64')
    x.attach_grad()
    with autograd.record():
        y = x * x
    y.backward()
    assert x.grad.item() == 6.0


@pytest.mark.filterwarnings('ignore:divide by zero:RuntimeWarning')
def test_an_infinite_head_still_gives_finite_gradients_elsewhere():
    x = np.array([1.0, 2.0], dtype='float64')
    x.attach_grad()
    with autograd.record():
        y = np.log(x - 1)                              # -inf at x = 1
    y.backward()
    assert x.grad.asnumpy().tolist() == [numpy.inf, 1.0]


def test_gradients_stay_on_the_device_of_their_array():
    x = np.array([1.0, 2.0], device=d2l.cpu(1))
    x.attach_grad()
    with autograd.record():
        y = (x * x).sum()
    y.backward()
    assert x.grad.device == d2l.cpu(1) and x.grad.asnumpy().tolist() == [2.0, 4.0]


def test_retain_graph_allows_a_second_backward():
    x = np.array([1.0, 2.0])
    x.attach_grad()
    with autograd.record():
        y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad.asnumpy().tolist() == [2.0, 4.0]
    with pytest.raises(RuntimeError, match='nothing to differentiate'):
        y.backward()


def test_pause_stops_recording():
    x = np.array([1.0, 2.0])
    x.attach_grad()
    assert not autograd.is_recording()
    with autograd.record():
        assert autograd.is_recording()
        with autograd.pause():
            assert not autograd.is_recording()
            unrecorded = x * 2
        recorded = x * 2
    assert unrecorded.node is None and recorded.node is not None


def test_the_tape_names_each_recorded_operation_and_its_inputs():
    x = np.array([1.0, 2.0])
    x.attach_grad()
    with autograd.record():
        y = (x * 3).sum(axis=0)
    assert (y.node.op.name, y.node.attrs) == ('sum', {'axis': 0, 'keepdims': False})
    product = y.node.inputs[0]
    assert product.node.op.name == 'multiply' and product.node.inputs == (x, 3)
    assert [a.node.op.name if a.node else 'leaf' for a in autograd.topological_order(y)] == [
        'leaf', 'multiply', 'sum']


def flags():
    return autograd.is_recording(), autograd.is_training()


def test_training_and_recording_flags_nest_as_in_gluon():
    assert flags() == (False, False)
    with autograd.record():
        assert flags() == (True, True)
        with autograd.predict_mode():
            assert flags() == (True, False)
            with autograd.train_mode():
                assert flags() == (True, True)
        with autograd.pause():
            assert flags() == (False, False)
        with autograd.pause(train_mode=True):
            assert flags() == (False, True)
        assert flags() == (True, True)
    with autograd.record(train_mode=False):
        assert flags() == (True, False)
    with autograd.train_mode():
        assert flags() == (False, True)
    assert flags() == (False, False)


def test_flags_are_restored_when_the_block_raises():
    with pytest.raises(KeyError):
        with autograd.record():
            raise KeyError('inside')
    assert flags() == (False, False)


# -- errors -------------------------------------------------------------------------------

def test_backward_with_nothing_recorded():
    x = np.array([1.0, 2.0])
    x.attach_grad()
    y = x * 2                                          # outside record()
    with pytest.raises(RuntimeError, match='nothing to differentiate.*record'):
        y.backward()
    with pytest.raises(RuntimeError, match='nothing to differentiate'):
        np.ones((2,)).backward()


@pytest.mark.parametrize('update', [
    lambda x, y: x.__iadd__(1), lambda x, y: y.__imul__(2),
    lambda x, y: x.__setitem__(0, 5.0), lambda x, y: y.__setitem__(slice(None), 0.0),
], ids=['leaf +=', 'result *=', 'leaf[0] =', 'result[:] ='])
def test_in_place_updates_of_recorded_arrays_are_refused(update):
    x = np.array([1.0, 2.0])
    x.attach_grad()
    with autograd.record():
        y = x * 2
        with pytest.raises(RuntimeError, match='autograd is recording'):
            update(x, y)
    x += 1                                             # outside record() it is allowed
    assert x.asnumpy().tolist() == [2.0, 3.0]


def test_only_floating_arrays_take_gradients():
    with pytest.raises(TypeError, match='floating'):
        np.array([1, 2], dtype='int32').attach_grad()


def test_an_op_without_gradient_says_so_at_the_wait():
    a, b = np.array(signed(2, 3, 4)), np.array(signed(4, 2))
    a.attach_grad()
    with autograd.record():
        y = np.dot(a, b)
    y.backward()
    with pytest.raises(engine.OperationError, match='dot_backward.*matmul'):
        a.grad.asnumpy()


def test_backward_gives_grad_a_new_array_and_leaves_the_old_one():
    """The gradient is written once, as `.grad`, not into the old buffer and copied: an array
    held from an earlier `.grad` (a store's summed gradient) keeps its values."""
    w = np.ones((3,))
    w.attach_grad()
    with autograd.record():
        (w * 2.0).sum().backward()
    first = w.grad
    with autograd.record():
        (w * 5.0).sum().backward()
    assert w.grad is not first
    numpy.testing.assert_array_equal(first.asnumpy(), [2.0, 2.0, 2.0])
    numpy.testing.assert_array_equal(w.grad.asnumpy(), [5.0, 5.0, 5.0])
    assert d2l.device.memory(w.device).by_kind.get('gradients', 0) >= w.grad.size * 4


def test_leaves_that_share_a_rule_output_get_gradients_of_their_own():
    """`a + b` gives both the same upstream gradient: each `.grad` must still be its own
    memory, since stores and collectives sum into `.grad` in place."""
    a, b = np.ones((2, 2)), np.ones((2, 2))
    a.attach_grad()
    b.attach_grad()
    with autograd.record():
        y = a + b
    y.backward(np.full((2, 2), 3.0))
    a.grad[...] = 0
    numpy.testing.assert_array_equal(b.grad.asnumpy(), numpy.full((2, 2), 3.0))
    with autograd.record():
        z = a.reshape(4) * 1.0
    z.backward()
    numpy.testing.assert_array_equal(a.grad.asnumpy(), numpy.ones((2, 2)))
