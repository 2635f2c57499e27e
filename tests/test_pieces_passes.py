"""Tests of the Transformer's passes in pieces (d2lperf.engine.pieces): GELU, the causal softmax
and layer norm, forward and gradient, give bit for bit the values of the whole when cut, at
every shape (odd sizes, fewer rows than pieces) and dtype; and at the small GPT's sizes on two
cores, those measured to gain are cut, where before every one ran whole on one core.

How many pieces the rule gives is tested in test_pieces; here each pass is cut into three (more
than this machine's cores: the values are tested, not the speed)."""
import ml_dtypes
import numpy
import pytest
from hypothesis import given, settings, strategies as st

from d2lperf import engine
from d2lperf.engine import pieces
from d2lperf.ops import transformer
from test_pieces import cut_into_three

pytestmark = pytest.mark.usefixtures('fresh_engine')

DTYPES = (numpy.float32, numpy.float64, numpy.float16, ml_dtypes.bfloat16)


def values(rng, shape, dtype):
    return rng.normal(size=shape).astype(dtype)


def gelu_case(rng, shape, dtype):
    a, g = values(rng, shape, dtype), values(rng, shape, dtype)
    return [transformer.gelu(numpy, a), *transformer.gelu_vjp(numpy, g, None, a)]


def softmax_case(rng, shape, dtype):
    scores, g = values(rng, shape, dtype), values(rng, shape, dtype)
    p = transformer.causal_softmax(numpy, scores)
    return [p, *transformer.causal_softmax_vjp(numpy, g, p, scores)]


def layer_norm_case(rng, shape, dtype):
    x, g = values(rng, shape, dtype), values(rng, shape, dtype)
    gamma, beta = values(rng, shape[-1:], dtype), values(rng, shape[-1:], dtype)
    return [transformer.layer_norm(numpy, x, gamma, beta),
            *transformer.layer_norm_vjp(numpy, g, None, x, gamma, beta)]


CASES = {'gelu': gelu_case, 'causal_softmax': softmax_case, 'layer_norm': layer_norm_case}


@st.composite
def pass_cases(draw):
    """A pass, a shape (scores with no more queries than keys), a dtype and a seed."""
    name = draw(st.sampled_from(sorted(CASES)))
    shape = draw(st.lists(st.integers(1, 9), min_size=1 if name == 'gelu' else 2, max_size=4))
    if name == 'causal_softmax':
        shape[-2] = min(shape[-2], shape[-1])
    return name, tuple(shape), draw(st.sampled_from(DTYPES)), draw(st.integers(0, 999))


@settings(max_examples=80, deadline=None)
@given(pass_cases())
def test_passes_cut_into_pieces_give_the_values_of_the_whole(case):
    name, shape, dtype, seed = case
    whole = CASES[name](numpy.random.default_rng(seed), shape, dtype)
    with pytest.MonkeyPatch.context() as patch:
        used = cut_into_three(patch)
        cut = CASES[name](numpy.random.default_rng(seed), shape, dtype)
    rows = numpy.prod(shape[:-2 if name == 'causal_softmax' else -1], dtype=int)
    if (numpy.prod(shape) if name == 'gelu' else rows) > 1:
        assert any(count > 1 for count in used)
    for a, b in zip(cut, whole):
        numpy.testing.assert_array_equal(a, b, strict=True)


def test_gelu_of_a_view_not_contiguous_is_cut_along_its_outer_axis(cut_everything):
    a = numpy.random.default_rng(0).normal(size=(5, 7)).astype(numpy.float32).T
    cut = transformer.gelu(numpy, a)
    assert cut_everything == [3]
    rows = [transformer.gelu(numpy, row) for row in a]
    numpy.testing.assert_array_equal(cut, numpy.stack(rows), strict=True)


def test_gelu_of_a_scalar_runs_whole(cut_everything):
    assert transformer.gelu(numpy, numpy.float32(1.0)).shape == ()
    assert cut_everything == []


@pytest.fixture
def cut_everything(monkeypatch):
    return cut_into_three(monkeypatch)


@pytest.fixture
def two_cores(monkeypatch):
    """Two threads for an operation, as on the course's VM: every piece run counted."""
    cores = engine.current().workers.cores
    monkeypatch.setattr(cores, 'current', 2)
    monkeypatch.setattr(cores, 'get', lambda: 2)
    used, run = [], pieces.run

    def counted(piece, size, count):
        used.append(len(pieces.spans(size, count)))
        return run(piece, size, count)
    monkeypatch.setattr(pieces, 'run', counted)
    return used


@pytest.mark.parametrize('name, shape, count', [
    ('gelu', (16, 128, 512), 2), ('causal_softmax', (16, 4, 128, 128), 2),
    ('layer_norm', (16, 128, 128), 1), ('layer_norm', (8, 256, 256), 2)])
def test_the_small_gpts_passes_take_both_cores_where_it_pays(two_cores, name, shape, count):
    """GPT 4×128 (batch 16, sequence 128, width 128, 4 heads) and 4×256 (batch 8, sequence
    256, width 256): GELU (4 MB) and the softmax (4 MB) are cut, forward and gradient, where a
    copy as large would run whole; layer norm is cut at 2 MB, not at 1."""
    CASES[name](numpy.random.default_rng(0), shape, numpy.float32)
    assert two_cores == [count, count]


def test_a_copy_as_large_still_runs_whole(two_cores):
    assert pieces.count(4 << 20) == 1               # a 4 MB copy: waking a thread costs more
    assert pieces.count(4 << 20, weight=2) == 2
    assert pieces.count(40 << 20, weight=8) == 2    # never more than the threads


def test_more_work_takes_more_of_the_free_cores(monkeypatch):
    cores = engine.current().workers.cores
    monkeypatch.setattr(cores, 'current', 16)
    monkeypatch.setattr(cores, 'get', lambda: 16)
    half = pieces.SPLIT_BYTES // 2
    assert [pieces.count(k * half) for k in (1, 2, 3, 8, 16, 40)] == [1, 2, 3, 8, 16, 16]
    assert pieces.count(half, weight=5) == 5
