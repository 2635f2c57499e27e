"""Half precision through the GPT: every operation its training step records, forward and
backward, in bfloat16 and float16 against float64 on the same (rounded) inputs, and a whole
GPT's loss and gradients in both. A tolerance a few units in the last place of the dtype,
relative to the values' scale: the ops sum (and exponentiate) half precision in float32, so
their error is the final rounding, not one that grows with the length of a sum."""
import ml_dtypes
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, np, npx
from test_autograd import analytic_gradients

pytestmark = pytest.mark.usefixtures('fresh_engine')

HALF = {'bfloat16': numpy.dtype(ml_dtypes.bfloat16), 'float16': numpy.dtype(numpy.float16)}
ULPS = 8                          # allowed error, in units of the dtype's epsilon
VOCAB = 7
RNG = numpy.random.default_rng(0)


def signed(*shape):
    return RNG.uniform(-1.5, 1.5, shape)


IDS = numpy.array([[0, 3, 3, 6], [1, 0, 3, 5]])           # repeated ids: gradients add up
OP_CASES = {           # op name -> (a function of float arrays that runs it, its inputs)
    'embedding': (lambda w: npx.embedding(np.array(IDS), w), signed(VOCAB, 8)),
    'add_position_embedding': (npx.add_position_embedding, signed(2, 4, 8), signed(6, 8)),
    'layer_norm': (npx.layer_norm, signed(2, 4, 8) + 3, signed(8), signed(8)),
    'fully_connected': (npx.fully_connected, signed(2, 4, 8), signed(5, 8), signed(5)),
    'reshape': (lambda a: a.reshape(2, 4, 2, 4), signed(2, 4, 8)),
    'transpose': (lambda a: a.transpose(0, 2, 1, 3), signed(2, 4, 2, 4)),
    'matmul': (lambda a, b: a @ b, signed(2, 2, 4, 4), signed(2, 2, 4, 4)),
    'multiply': (lambda a, b: a * b * 0.5, signed(2, 4, 8), signed(2, 4, 8)),
    'causal_softmax': (npx.causal_softmax, 3 * signed(2, 2, 4, 4)),
    'attention': (lambda q, k, v: npx.attention(q, k, v, block_size=3),
                  *(2 * signed(2, 2, 5, 4) for _ in range(3))),
    'gelu': (npx.gelu, 3 * signed(2, 4, 8)),
    'add': (lambda a, b: a + b, signed(2, 4, 8), signed(2, 4, 8)),
    'log_softmax': (npx.log_softmax, 3 * signed(2, 4, VOCAB)),
    'pick': (lambda a: npx.pick(a, np.array(IDS)), signed(2, 4, VOCAB)),
    'negative': (lambda a: -a, signed(2, 4)),
    'sum': (lambda a: a.sum(), signed(2, 4, 8)),
}


def ops_recorded(head):
    """The names of the operations on the tape that leads to `head`."""
    names, seen, stack = set(), set(), [head]
    while stack:
        array = stack.pop()
        if id(array) in seen or getattr(array, 'node', None) is None:
            continue
        seen.add(id(array))
        names.add(array.node.op.name)
        stack += array.node.inputs
    return names


def gpt(dtype=None, layers=2):
    np.random.seed(0)
    net = d2l.nn.GPT(VOCAB, layers, 8, 2, 6).initialize()
    if dtype is not None:
        net.cast(dtype)
    return net


def loss_of(net, tokens, labels):
    with autograd.record():
        loss = d2l.SoftmaxCrossEntropyLoss()(net(np.array(tokens)), np.array(labels)).sum()
    return loss


def test_the_cases_cover_every_op_a_gpt_step_records():
    """A new op in the GPT must join OP_CASES, or this fails: so "every op" stays true."""
    assert ops_recorded(loss_of(gpt(), IDS, IDS)) <= set(OP_CASES)


def assert_close_in(dtype, got, expected, what):
    """`got` (of `dtype`) within ULPS of the dtype's epsilon of `expected`, relative to the
    largest value of `expected`."""
    assert got.dtype == dtype, f'{what}: {got.dtype}, not {dtype}'
    scale = max(numpy.abs(expected).max(), 1e-3)
    eps = float(ml_dtypes.finfo(dtype).eps)
    numpy.testing.assert_allclose(got.astype(numpy.float64), expected, rtol=ULPS * eps,
                                  atol=ULPS * eps * scale, err_msg=what)


@pytest.mark.parametrize('name', sorted(OP_CASES))
@pytest.mark.parametrize('dtype', sorted(HALF))
def test_each_op_in_half_precision_matches_float64(name, dtype):
    """Forward and backward of each op in `dtype`, against float64 on the same inputs (the
    half values, widened), so that only the op's own rounding is measured."""
    f, *values = OP_CASES[name]
    half = [v.astype(HALF[dtype]) for v in values]
    wide = [v.astype(numpy.float64) for v in half]
    assert_close_in(HALF[dtype], f(*map(np.array, half)).asnumpy(),
                    f(*map(np.array, wide)).asnumpy(), f'{name} forward')
    projection = RNG.uniform(-1, 1, f(*map(np.array, wide)).shape).astype(HALF[dtype])
    expected = analytic_gradients(f, wide, projection.astype(numpy.float64))
    for k, (got, want) in enumerate(zip(analytic_gradients(f, half, projection), expected)):
        assert_close_in(HALF[dtype], got, want, f'{name} gradient of input {k}')


@pytest.mark.parametrize('dtype', sorted(HALF))
def test_a_gpt_cast_to_half_precision_trains_forward_and_backward(dtype):
    """The loss and every gradient of a GPT cast to `dtype`, against the float64 GPT with the
    same (rounded) weights: each within a few percent of its scale (two layers of rounding
    compound), every gradient in `dtype`."""
    rng = numpy.random.default_rng(1)
    tokens, labels = rng.integers(0, VOCAB, (2, 6)), rng.integers(0, VOCAB, (2, 6))
    half, wide = gpt(dtype), gpt('float64')
    for mine, theirs in zip(half.collect_params().values(), wide.collect_params().values()):
        theirs.set_data(np.array(mine.data().asnumpy().astype(numpy.float64)))
    losses = {}
    for key, net in (('half', half), ('wide', wide)):
        loss = loss_of(net, tokens, labels)
        loss.backward()
        losses[key] = loss.asnumpy()
    assert losses['half'].dtype == HALF[dtype]
    numpy.testing.assert_allclose(float(losses['half']), float(losses['wide']), rtol=0.02)
    grads = {name: (mine.grad().asnumpy(), theirs.grad().asnumpy()) for (name, mine), theirs
             in zip(half.collect_params().items(), wide.collect_params().values())}
    scale = max(numpy.abs(want).max() for _, want in grads.values())
    for name, (got, want) in grads.items():
        assert got.dtype == HALF[dtype], name
        # a key's bias moves no softmax: its exact gradient is 0, the half one rounding noise
        atol = 0.05 * numpy.abs(want).max() if numpy.abs(want).max() > 1e-6 * scale else 1e-3 * scale
        numpy.testing.assert_allclose(got.astype(numpy.float64), want, rtol=0.1, atol=atol,
                                      err_msg=name)
