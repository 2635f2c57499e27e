"""What a Transformer layer keeps for backward: Korthikanti et al.'s formula, and the count of
this package's small GPT layer, measured by the memory counter to the byte."""
import gc

import pytest

import d2lperf as d2l
from d2lperf import autograd, np
from d2lperf.data_parallel import predict
from d2lperf.nn.transformer import TransformerLayer


@pytest.mark.parametrize('s, b, h, a', [(2048, 1, 12288, 96), (1024, 32, 1600, 25)])
def test_the_formula_is_the_papers(s, b, h, a):
    """sbh(34 + 5as/h) bytes, as the paper writes it (GPT-3's layer; GPT-2 1.5B's)."""
    assert predict.transformer_layer_activations(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)


def kept_by_one_layer(s, b, h, a):
    layer = TransformerLayer(h, a)
    layer.initialize()
    x = np.random.normal(0, 1, size=(b, s, h))
    x.attach_grad()
    d2l.npx.waitall()
    gc.collect()
    before = d2l.device.memory(d2l.cpu()).by_kind['activations']
    with autograd.record():
        y = layer(x)
    d2l.npx.waitall()
    gc.collect()
    kept = d2l.device.memory(d2l.cpu()).by_kind['activations'] - before
    del y
    return kept


@pytest.mark.parametrize('s, b, h, a', [(16, 2, 32, 2), (32, 2, 32, 2), (16, 4, 64, 4)])
def test_the_small_gpt_keeps_the_formulas_values_and_four_arrays_more(s, b, h, a):
    """Without dropout the formula keeps 16·sbh + a·s²·b values. This layer keeps those, in
    float32, and four arrays more, because the tape keeps every input of every recorded
    operation, where PyTorch keeps only what each backward reads: the two residual sums'
    second inputs (attention's and the MLP's outputs, sbh each), the scores before their
    scaling and before the causal softmax (a·s²·b each)."""
    paper = predict.transformer_layer_activations(s, b, h, a, value_bytes=4, dropout=False)
    extra = 4 * (2 * s * b * h + 2 * a * s * s * b)
    assert kept_by_one_layer(s, b, h, a) == paper + extra
