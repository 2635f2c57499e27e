"""Tests of d2lperf.ops.linalg: a stack of small products cut into pieces and row blocks
gives NumPy's product and gradients (gradients of small products against finite differences
are in test_autograd)."""
import numpy
import pytest

from d2lperf import autograd, np
from d2lperf.ops import linalg


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of two rows and pieces for every stack, as large stacks get them."""
    monkeypatch.setattr(linalg, 'ONE_THREAD_WORK', 2 * 3 * 5)
    monkeypatch.setattr(linalg, 'STACK_WORK', 0)


def test_a_stack_in_row_blocks_is_numpys_product_and_gradient(tiny_blocks, engine_kind):
    rng = numpy.random.default_rng(0)
    a, b, g = (rng.standard_normal(shape, dtype=numpy.float32)
               for shape in ((4, 3, 6, 3), (4, 3, 3, 5), (4, 3, 6, 5)))
    assert linalg.row_blocks(a, b) == 3
    x, y = np.array(a), np.array(b)
    x.attach_grad()
    y.attach_grad()
    with autograd.record():
        out = x @ y
    out.backward(np.array(g))
    numpy.testing.assert_allclose(out.asnumpy(), a @ b, rtol=1e-6, atol=1e-6)
    numpy.testing.assert_allclose(x.grad.asnumpy(), g @ b.swapaxes(-1, -2), rtol=1e-6,
                                  atol=1e-6)
    numpy.testing.assert_allclose(y.grad.asnumpy(), a.swapaxes(-1, -2) @ g, rtol=1e-6,
                                  atol=1e-6)


def test_stacks_that_are_not_plain_go_to_numpy_whole(tiny_blocks):
    """Broadcast batches, vectors, mixed or integer dtypes and rows that no block divides."""
    f32 = numpy.float32
    assert linalg.row_blocks(numpy.ones((2, 4, 3), f32), numpy.ones((1, 3, 5), f32)) is None
    assert linalg.row_blocks(numpy.ones((4, 3), f32), numpy.ones((3, 5), f32)) is None
    assert linalg.row_blocks(numpy.ones((2, 4, 3), f32), numpy.ones((2, 3, 5))) is None
    assert linalg.row_blocks(numpy.ones((2, 4, 3), int), numpy.ones((2, 3, 5), int)) is None
    assert linalg.row_blocks(numpy.ones((2, 4, 7), f32), numpy.ones((2, 7, 5), f32)) is None
    a, b = numpy.ones((2, 4, 3), f32), numpy.ones((1, 3, 5), f32)
    numpy.testing.assert_array_equal((np.array(a) @ np.array(b)).asnumpy(), a @ b)
