"""Input that would give a wrong answer with no error is refused, as PyTorch refuses it: an id
out of range (-1 would wrap to the last row or class), a float id (2.7 would be read as 2), and
settings with nothing to run (no devices, no layers' worth of stages, no micro-batches)."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import engine, nn, np, npx
from d2lperf.model_parallel import Pipeline, parallel_gpt, tensor_parallel
from conftest import drain_engine
from model_parallel_helpers import HEADS, HIDDEN, SEQ, VOCAB, gpt

pytestmark = pytest.mark.usefixtures('fresh_engine')

TABLE = np.array(numpy.arange(VOCAB * 3, dtype=numpy.float32).reshape(VOCAB, 3))
SCORES = np.array(numpy.zeros((2, VOCAB), numpy.float32))


# -- ids: out of range, or not integers ------------------------------------------------------

@pytest.mark.parametrize('bad', [-1, VOCAB, VOCAB + 5, -VOCAB])
@pytest.mark.parametrize('op, words', [
    (lambda ids: npx.embedding(ids, TABLE), 'an embedding of 20 rows'),
    (lambda ids: npx.pick(SCORES, ids), '20 classes'),
    (lambda ids: d2l.SoftmaxCrossEntropyLoss()(SCORES, ids), '20 classes')])
def test_an_id_out_of_range_is_named_at_the_first_wait(op, words, bad):
    """-1 read the last row and 20 raised NumPy's message without the vocabulary; now each
    names the id and the size it must stay below, as an IndexError the wait shows."""
    out = op(np.array(numpy.array([3, bad])))
    with pytest.raises(engine.OperationError,
                       match=fr'IndexError: \w+ {bad} is out of range for {words}'):
        out.asnumpy()


def test_an_id_out_of_range_is_named_on_a_gpu(fake_gpus):
    """The CuPy path: min and max come back in one transfer."""
    gpu = d2l.gpu(0)
    table = TABLE.copyto(gpu)
    assert npx.embedding(np.array(numpy.array([0, VOCAB - 1]), device=gpu), table) \
        .asnumpy().tolist() == TABLE.asnumpy()[[0, VOCAB - 1]].tolist()
    out = npx.embedding(np.array(numpy.array([0, -1]), device=gpu), table)
    with pytest.raises(engine.OperationError, match='id -1 is out of range for an embedding'):
        out.asnumpy()
    drain_engine()                 # before fake_gpus switches engines, which waits for all


def test_ids_in_range_still_read_their_rows_and_labels():
    ids = numpy.array([0, VOCAB - 1, 3])
    assert npx.embedding(np.array(ids), TABLE).asnumpy().tolist() == \
        TABLE.asnumpy()[ids].tolist()
    scores = numpy.arange(2 * VOCAB, dtype=numpy.float32).reshape(2, VOCAB)
    assert npx.pick(np.array(scores), np.array(numpy.array([0, VOCAB - 1]))).asnumpy() \
        .tolist() == [0, 2 * VOCAB - 1]


@pytest.mark.parametrize('dtype', ['float32', 'float64', 'bool'])
@pytest.mark.parametrize('op', [lambda ids: npx.embedding(ids, TABLE),
                                lambda ids: npx.pick(SCORES, ids)])
def test_a_float_id_is_refused_when_pushed(op, dtype):
    """2.7 was read as 2 (and True as 1): an index must have an integer dtype."""
    with pytest.raises(TypeError, match=f'must be integers, not {dtype}.*astype'):
        op(np.array(numpy.array([1, 0]).astype(dtype)))


def test_a_gpt_refuses_a_token_out_of_its_vocabulary():
    tokens = numpy.zeros((2, 4), numpy.int64)
    tokens[1, 2] = VOCAB
    with pytest.raises(engine.OperationError, match=f'{VOCAB} is out of range'):
        gpt(2)(np.array(tokens)).asnumpy()


# -- settings with nothing to run, or that would run wrong -------------------------------------

CPUS = [d2l.cpu(i) for i in range(1, 9)]


@pytest.mark.parametrize('build, words', [
    (lambda: Pipeline(gpt(2), [CPUS[:2], CPUS[2:3]]),
     r'tensor-parallel groups of one size: stage 1 has 1 device, stage 0 has 2'),
    (lambda: Pipeline(gpt(2), []), 'at least one stage'),
    (lambda: Pipeline(gpt(2), [[], []]), 'at least one device'),
    (lambda: Pipeline(gpt(2), CPUS[:2], chunks=0), 'chunks .* at least 1, not 0'),
    (lambda: Pipeline(gpt(2), CPUS[:2], 'zigzag'), "unknown schedule 'zigzag'"),
    (lambda: tensor_parallel(gpt(2), []), 'at least one device'),
    (lambda: tensor_parallel(gpt(2), CPUS[:2], algorithm='bogus'), "'bogus'.*'ring'"),
    (lambda: tensor_parallel(gpt(2), CPUS[:2], algorithm='tree', sequence=True),
     r"sequence=True .* \['ring', 'split'\], not 'tree'"),
    (lambda: parallel_gpt(gpt(2), [], data=0), 'data=0: each size .* at least 1'),
    (lambda: parallel_gpt(gpt(2), [], tensor=0), 'tensor=0: each size'),
    (lambda: parallel_gpt(gpt(2), [], pipeline=0), 'pipeline=0: each size'),
    (lambda: parallel_gpt(gpt(2), CPUS[:4], tensor=2, pipeline=2, algorithm='tree',
                          sequence=True), "sequence=True .* not 'tree'"),
    (lambda: nn.GPT(VOCAB, -1, HIDDEN, HEADS, SEQ), 'num_layers=-1'),
    (lambda: parallel_gpt(gpt(2), CPUS[:6], data=2, context=2), '6 devices do not make a grid'
     ' of data 2 × tensor 1 × pipeline 1 × context 2: give 4'),
    (lambda: Pipeline(gpt(2), CPUS[:2], data=2), 'data=2 split a stage over its devices'),
])
def test_a_setting_with_nothing_or_something_wrong_to_run_is_refused_when_built(build, words):
    with pytest.raises(ValueError, match=words):
        build()


def test_no_micro_batches_are_refused():
    tokens = np.array(numpy.zeros((4, SEQ), numpy.int64))
    with pytest.raises(ValueError, match='microbatches=0: .* at least 1'):
        parallel_gpt(gpt(2), CPUS[:2], pipeline=2).forward_backward(
            tokens, tokens, d2l.SoftmaxCrossEntropyLoss(), 0)
    with pytest.raises(ValueError, match='no micro-batches'):
        Pipeline(gpt(2), CPUS[:2]).forward_backward([], [], d2l.SoftmaxCrossEntropyLoss())


def test_ranks_that_drift_apart_raise_instead_of_dropping_a_gradient():
    """A part's backward takes one head a device: fewer would leave a device's walk out."""
    tp = tensor_parallel(gpt(2), CPUS[:2])
    with d2l.autograd.record():
        logits = tp(np.array(numpy.zeros((2, SEQ), numpy.int64)))
        losses = [out.sum() for out in logits]
    with pytest.raises(ValueError, match='1 heads for 2 devices'):
        tp.backward(losses[:1], None)
    with pytest.raises(ValueError, match='3 head gradients for 2 devices'):
        tp.backward(losses, [np.ones(())] * 3)


def test_a_gpt_with_no_layers_is_a_bigram_model_split_like_any_other():
    """Embedding then head: one device, two tensor-parallel ranks and a two-stage pipeline
    give the same logits and the same embedding gradient."""
    net = gpt(layers=0)
    tokens = numpy.random.default_rng(0).integers(0, VOCAB, (2, SEQ))
    loss = d2l.SoftmaxCrossEntropyLoss()
    with d2l.autograd.record():
        whole = net(np.array(tokens))
        total = loss(whole, np.array(tokens)).sum()
    total.backward()
    tp = tensor_parallel(net, CPUS[:2])
    with d2l.autograd.record():
        logits = tp(np.array(tokens))
        losses = [loss(out, np.array(tokens, device=out.device)).sum() for out in logits]
    tp.backward(losses)
    for out, rank in zip(logits, tp.ranks):
        numpy.testing.assert_allclose(out.asnumpy(), whole.asnumpy(), atol=1e-6)
        numpy.testing.assert_allclose(rank.units[0].token.weight.grad().asnumpy(),
                                      net[0].token.weight.grad().asnumpy(), atol=1e-6)
    expected = net[0].token.weight.grad().asnumpy()
    pipeline = Pipeline(net, CPUS[2:4])
    pipeline.forward_backward([np.array(tokens)], [np.array(tokens)], loss)
    numpy.testing.assert_allclose(net[0].token.weight.grad().asnumpy(), expected, atol=1e-6)
