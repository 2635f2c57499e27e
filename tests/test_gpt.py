"""Tests of the Transformer ops (d2lperf.ops.transformer) and the small GPT built from them
(d2lperf.nn.transformer): gradients against finite differences, compiled against imperative,
causality, PyTorch's numbers where PyTorch is installed, and a loss that falls on real text.
"""
import math
import sys

import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, data, np, npx
from test_autograd import analytic_gradients

pytestmark = pytest.mark.usefixtures('fresh_engine')

RNG = numpy.random.default_rng(0)
STEP, RTOL, ATOL = 1e-6, 1e-5, 1e-7


def signed(*shape):
    return RNG.uniform(-1.5, 1.5, shape)


def tokens(batch, seq, vocab, seed=0):
    return numpy.random.default_rng(seed).integers(0, vocab, (batch, seq))


# -- each op's gradient against central finite differences (float64) ---------------------------

def numeric_gradient(loss, value):
    """d loss / d value, one central difference per entry (`value` is shifted in place)."""
    grad = numpy.zeros_like(value)
    for index in numpy.ndindex(value.shape):
        kept = value[index]
        value[index] = kept + STEP
        plus = loss()
        value[index] = kept - STEP
        grad[index] = (plus - loss()) / (2 * STEP)
        value[index] = kept
    return grad


def check_gradients(f, *values):
    """Gradients of sum(f(x) · r) for a random r, so a misplaced gradient cannot hide."""
    values = [numpy.array(v, dtype=numpy.float64) for v in values]
    projection = RNG.uniform(-1, 1, f(*map(np.array, values)).shape)

    def loss():
        return (f(*map(np.array, values)) * np.array(projection)).sum().item()
    for got, value in zip(analytic_gradients(f, values, projection), values):
        numpy.testing.assert_allclose(got, numeric_gradient(loss, value), rtol=RTOL, atol=ATOL)


IDS = np.array(numpy.array([[0, 3, 3], [1, 0, 3]]))      # repeated ids: gradients add up
OP_CASES = {
    'embedding': (lambda w: npx.embedding(IDS, w), signed(4, 3)),
    'add_position_embedding': (npx.add_position_embedding, signed(2, 3, 4), signed(5, 4)),
    'layer_norm': (npx.layer_norm, signed(2, 3, 5), signed(5), signed(5)),
    'gelu': (npx.gelu, signed(3, 4)),
    'causal_softmax': (npx.causal_softmax, signed(2, 4, 4)),
    'causal_softmax_with_earlier_keys': (npx.causal_softmax, signed(2, 3, 5)),
}


@pytest.mark.parametrize('case', sorted(OP_CASES))
def test_op_gradient_matches_finite_differences(case):
    f, *values = OP_CASES[case]
    check_gradients(f, *values)


def test_op_values():
    """Each op against its definition, written out with NumPy."""
    w = signed(4, 3)
    assert numpy.array_equal(npx.embedding(IDS, np.array(w)).asnumpy(), w[IDS.asnumpy()])
    x, g, b = signed(2, 5), signed(5), signed(5)
    expected = (x - x.mean(-1, keepdims=True)) / numpy.sqrt(x.var(-1, keepdims=True) + 1e-5)
    numpy.testing.assert_allclose(npx.layer_norm(*map(np.array, (x, g, b))).asnumpy(),
                                  expected * g + b, rtol=1e-12)
    erf = numpy.vectorize(math.erf)         # the tanh form is within 1e-3 of the exact GELU
    numpy.testing.assert_allclose(npx.gelu(np.array(x)).asnumpy(),
                                  x * (1 + erf(x / math.sqrt(2))) / 2, atol=1e-3)
    p = npx.causal_softmax(np.array(signed(3, 2, 4))).asnumpy()
    assert numpy.allclose(p.sum(-1), 1) and numpy.all(p[:, 0, 3] == 0) and numpy.all(p[:, 1, 3] > 0)


def test_causal_softmax_is_stable_in_float32_and_half_precision():
    """Scores far beyond exp's range (float32 overflows past 88) still give probabilities."""
    scores = numpy.array([[[1000.0, 0, 0], [1000.0, 1001.0, 0], [-1e4, -1e4, -1e4]]])
    for dtype in ('float32', 'float16'):
        p = npx.causal_softmax(np.array(scores.astype(dtype))).asnumpy()
        assert p.dtype == dtype and numpy.all(numpy.isfinite(p))
        numpy.testing.assert_allclose(p[0], [[1, 0, 0], [1 / (1 + math.e), 1 / (1 + 1 / math.e), 0],
                                             [1 / 3, 1 / 3, 1 / 3]], rtol=1e-3)


@pytest.mark.parametrize('call, message', [
    (lambda: npx.embedding(IDS, np.ones((4,))), 'rows, features'),
    (lambda: npx.add_position_embedding(np.ones((2, 6, 3)), np.ones((5, 3))), 'seq rows'),
    (lambda: npx.layer_norm(np.ones((2, 3)), np.ones((2,)), np.ones((3,))), 'gamma and beta'),
    (lambda: npx.causal_softmax(np.ones((2, 4, 3))), 'no more queries than keys'),
])
def test_bad_shapes_raise_at_push_time(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- the whole GPT ---------------------------------------------------------------------------

def small_gpt(vocab=11, layers=2, width=8, heads=2, max_len=6, seed=0):
    np.random.seed(seed)
    net = d2l.nn.GPT(vocab, layers, width, heads, max_len)
    return net.initialize()


def loss_and_gradients(net, x, y):
    with autograd.record():
        loss = d2l.nn.SoftmaxCrossEntropyLoss()(net(x), y).mean()
    loss.backward()
    return loss.item(), {name: p.grad().asnumpy() for name, p in net.collect_params().items()}


def test_gpt_is_a_flat_sequence_of_units_with_named_projections():
    net = small_gpt(layers=3)
    kinds = [type(unit).__name__ for unit in net.children()]
    assert kinds == ['GPTEmbedding'] + ['TransformerLayer'] * 3 + ['LanguageModelHead']
    names = set(net.collect_params())
    for part in ('attention.query', 'attention.key', 'attention.value', 'attention.output',
                 'mlp.hidden', 'mlp.output'):
        assert {f'2.{part}.weight', f'2.{part}.bias'} <= names
    assert net.collect_params()['2.mlp.hidden.weight'].shape == (32, 8)
    with pytest.raises(ValueError, match='10 features do not split among num_heads=4'):
        d2l.nn.GPT(11, 1, 10, 4, 6)


def test_gpt_gradients_match_finite_differences_in_float64():
    net = small_gpt(vocab=5, layers=1, width=4, heads=2, max_len=3).cast('float64')
    x, y = tokens(2, 3, 5), tokens(2, 3, 5, seed=1)
    _, grads = loss_and_gradients(net, np.array(x), np.array(y))
    criterion = d2l.nn.SoftmaxCrossEntropyLoss()
    for name, param in net.collect_params().items():
        value = param.data().asnumpy().copy()

        def loss():
            param.set_data(np.array(value))
            return criterion(net(np.array(x)), np.array(y)).mean().item()
        numeric = numeric_gradient(loss, value)
        param.set_data(np.array(value))
        numpy.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8, err_msg=name)


def test_hybridized_gpt_equals_imperative():
    x, y = np.array(tokens(3, 6, 11)), np.array(tokens(3, 6, 11, seed=1))
    imperative, hybridized = small_gpt(), small_gpt().hybridize()
    numpy.testing.assert_allclose(hybridized(x).asnumpy(), imperative(x).asnumpy(),
                                  rtol=1e-5, atol=1e-6)
    loss, grads = loss_and_gradients(imperative, x, y)
    hybrid_loss, hybrid_grads = loss_and_gradients(hybridized, x, y)
    assert hybrid_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        numpy.testing.assert_allclose(hybrid_grads[name], grad, rtol=1e-4, atol=1e-6,
                                      err_msg=name)


@pytest.mark.parametrize('hybridize', [False, True])
def test_a_later_token_does_not_change_earlier_logits(hybridize):
    net = small_gpt().hybridize(hybridize)
    x = tokens(2, 6, 11)
    changed = x.copy()
    changed[:, 3] = (changed[:, 3] + 1) % 11
    before, after = net(np.array(x)).asnumpy(), net(np.array(changed)).asnumpy()
    assert numpy.array_equal(before[:, :3], after[:, :3])
    assert numpy.abs(before[:, 3:] - after[:, 3:]).max(axis=-1).min() > 0


def test_a_sequence_longer_than_max_len_is_refused():
    with pytest.raises(ValueError, match='seq rows'):
        small_gpt(max_len=6)(np.array(tokens(1, 7, 11)))



# -- on a GPU (CuPy): the same numbers as on the CPU ------------------------------------------

needs_gpu = pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')


def gpu_matches_cpu(hybridize):
    """Logits and every gradient of a GPT on gpu(0) equal the CPU's, to float32 rounding."""
    x, y = tokens(3, 6, 11), tokens(3, 6, 11, seed=1)
    on_cpu = small_gpt().hybridize(hybridize)
    cpu_loss, cpu_grads = loss_and_gradients(on_cpu, np.array(x), np.array(y))
    gpu = d2l.gpu(0)
    on_gpu = small_gpt().initialize(device=gpu, force_reinit=True).hybridize(hybridize)
    for param, source in zip(on_gpu.collect_params().values(),
                             on_cpu.collect_params().values()):
        param.set_data(source.data().copyto(gpu))          # the GPU draws other numbers
    gpu_loss, gpu_grads = loss_and_gradients(on_gpu, np.array(x, device=gpu),
                                             np.array(y, device=gpu))
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-5)
    for name, grad in cpu_grads.items():
        numpy.testing.assert_allclose(gpu_grads[name], grad, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize('hybridize', [False, True])
def test_gpt_on_fake_gpus_takes_the_cupy_path(fake_gpus, monkeypatch, hybridize):
    """The stand-in's ufuncs are plain functions; CuPy's, like NumPy's, have `at`, which the
    embedding's gradient scatters with."""
    monkeypatch.setattr(sys.modules['cupy'], 'add', numpy.add, raising=False)
    gpu_matches_cpu(hybridize)


@needs_gpu
@pytest.mark.parametrize('hybridize', [False, True])
def test_gpt_on_a_gpu_matches_the_cpu(hybridize):
    gpu_matches_cpu(hybridize)

# -- PyTorch, where it is installed: the same weights give the same numbers ------------------

def torch_gpt_loss(torch, weights, x, y, num_layers, num_heads):
    """The same GPT written with torch.nn.functional, over a dict of our parameter names."""
    functional = torch.nn.functional

    def norm(prefix, h):
        return functional.layer_norm(h, h.shape[-1:], weights[f'{prefix}.gamma'],
                                     weights[f'{prefix}.beta'], eps=1e-5)

    def linear(prefix, h):
        return functional.linear(h, weights[f'{prefix}.weight'], weights[f'{prefix}.bias'])

    batch, seq = x.shape
    h = functional.embedding(x, weights['0.token.weight']) + weights['0.position'][:seq]
    for i in range(1, num_layers + 1):
        a = norm(f'{i}.attention_norm', h)
        q, k, v = (linear(f'{i}.attention.{part}', a).reshape(batch, seq, num_heads, -1)
                   .transpose(1, 2) for part in ('query', 'key', 'value'))
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(mask, -math.inf)
        heads = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        h = h + linear(f'{i}.attention.output', heads)
        m = functional.gelu(linear(f'{i}.mlp.hidden', norm(f'{i}.mlp_norm', h)),
                            approximate='tanh')
        h = h + linear(f'{i}.mlp.output', m)
    last = num_layers + 1
    logits = linear(f'{last}.output', norm(f'{last}.norm', h))
    return logits, functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_gpt_matches_pytorch():
    torch = pytest.importorskip('torch')
    net = small_gpt(vocab=13, layers=2, width=16, heads=4, max_len=8)
    x, y = tokens(3, 8, 13), tokens(3, 8, 13, seed=1)
    loss, grads = loss_and_gradients(net, np.array(x), np.array(y))
    logits = net(np.array(x)).asnumpy()
    weights = {name: torch.tensor(p.data().asnumpy(), requires_grad=True)
               for name, p in net.collect_params().items()}
    torch_logits, torch_loss = torch_gpt_loss(torch, weights, torch.tensor(x), torch.tensor(y),
                                              num_layers=2, num_heads=4)
    torch_loss.backward()
    numpy.testing.assert_allclose(logits, torch_logits.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert loss == pytest.approx(torch_loss.item(), rel=1e-5)
    for name, weight in weights.items():
        numpy.testing.assert_allclose(grads[name], weight.grad.numpy(), rtol=1e-3, atol=1e-6,
                                      err_msg=name)



# -- the text: a corpus, its characters, windows of it ----------------------------------------

def test_the_corpus_falls_back_to_python_docs_and_never_downloads_unverified(monkeypatch,
                                                                              capsys, tmp_path):
    asked = []

    def offline(url, timeout):
        asked.append(url)
        raise data.urllib.error.URLError('offline')
    monkeypatch.setattr(data.urllib.request, 'urlopen', offline)
    text, name = data.load_text_corpus(root=tmp_path)
    assert 'pydoc_data' in name and len(text) > 400_000
    assert 'text corpus: ' in capsys.readouterr().out
    if data.TINY_SHAKESPEARE_FILE[1] is None:
        assert asked == []                           # no checksum to check it against
    vocab = data.CharVocabulary(text)
    assert vocab.decode(vocab.encode(text[:200])) == text[:200]


def test_char_batches_pair_each_window_with_the_next_characters():
    batches = list(data.char_batches(numpy.arange(100), 4, 10, 3, seed=0))
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (4, 10) and x.dtype == numpy.int64
        assert numpy.array_equal(y.asnumpy(), x.asnumpy() + 1)
    with pytest.raises(ValueError, match='no window'):
        next(data.char_batches(numpy.arange(10), 1, 10, 1))

# -- training on real text -------------------------------------------------------------------

def unigram_entropy(ids):
    """The loss of the best guess that ignores context: each character's frequency."""
    frequency = numpy.bincount(ids) / len(ids)
    frequency = frequency[frequency > 0]
    return -(frequency * numpy.log(frequency)).sum()


def test_a_tiny_gpt_learns_characters_of_real_text():
    """2 layers, width 32, 2 heads, 32 characters, hybridized: from ln(V) (uniform guessing)
    to below what character frequencies alone give, in 100 Adam steps of 16 windows."""
    text, _ = data.load_text_corpus()
    vocab = data.CharVocabulary(text)
    ids = vocab.encode(text)
    net = small_gpt(vocab=len(vocab), layers=2, width=32, heads=2, max_len=32).hybridize()
    trainer = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 3e-3}, kvstore=None)
    criterion = d2l.nn.SoftmaxCrossEntropyLoss()
    losses = []
    for x, y in data.char_batches(ids, 16, 32, 100, seed=0):
        with autograd.record():
            loss = criterion(net(x), y).mean()
        loss.backward()
        trainer.step(1)
        losses.append(loss.item())
    uniform, final = math.log(len(vocab)), numpy.mean(losses[-10:])
    assert losses[0] == pytest.approx(uniform, rel=0.05)
    assert final < 0.7 * uniform and final < unigram_entropy(ids), losses
