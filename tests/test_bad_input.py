"""Input that would give a wrong answer with no error is refused, as PyTorch refuses it: an id
out of range (-1 would wrap to the last row or class), a float id (2.7 would be read as 2), and
settings with nothing to run (no devices, no layers' worth of stages, no micro-batches)."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import engine, nn, np, npx
from d2lperf.model_parallel import Pipeline, parallel_gpt, tensor_parallel

pytestmark = pytest.mark.usefixtures('fresh_engine')

VOCAB, HIDDEN, HEADS, SEQ = 20, 16, 4, 8
TABLE = np.array(numpy.arange(VOCAB * 3, dtype=numpy.float32).reshape(VOCAB, 3))
SCORES = np.array(numpy.zeros((2, VOCAB), numpy.float32))


def gpt(layers=2):
    np.random.seed(0)
    return nn.GPT(VOCAB, layers, HIDDEN, HEADS, SEQ).initialize()


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
        gpt()(np.array(tokens)).asnumpy()
