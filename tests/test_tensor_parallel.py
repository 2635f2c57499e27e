"""Tensor parallelism (Megatron-LM) on virtual devices: the same logits and gradients as one
device, the bytes the paper's allreduces move, and 1/t of each layer's weights a device."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, comm, np
from d2lperf.model_parallel import tensor_parallel
import model_parallel_helpers as helpers
from model_parallel_helpers import HIDDEN, SEQ, VOCAB, devices, gpt
from test_memory import settle

pytestmark = pytest.mark.chapter('model_parallelism')

LAYERS, BATCH, HOME = 2, 3, d2l.cpu(5)          # HOME: the whole net's device
LOSS = d2l.SoftmaxCrossEntropyLoss()
rng = numpy.random.default_rng(0)
TOKENS = rng.integers(0, VOCAB, (BATCH, SEQ))
LABELS = rng.integers(0, VOCAB, (BATCH, SEQ))


def one_device_step(net):
    with autograd.record():
        logits = net(np.array(TOKENS, device=d2l.cpu(5)))
        loss = LOSS(logits, np.array(LABELS, device=d2l.cpu(5))).sum()
    loss.backward()
    return logits.asnumpy()


def split_step(tp):
    return helpers.split_step(tp, TOKENS, LABELS)


@pytest.mark.parametrize('t', [1, 2, 4])
def test_logits_and_gradients_equal_one_devices(t):
    net = gpt(LAYERS, HOME)
    tp = tensor_parallel(net, devices(t))
    whole = one_device_step(net)
    for logits in split_step(tp):
        numpy.testing.assert_allclose(logits, whole, atol=1e-6, rtol=0)
    grad = lambda param: param.grad().asnumpy()
    for depth, layer in enumerate(net[1:-1]):
        parts = [rank.units[1 + depth] for rank in tp.ranks]
        for name in ('query', 'key', 'value'):          # split by rows: this device's heads
            numpy.testing.assert_allclose(numpy.concatenate(
                [grad(getattr(p.attention, name).weight) for p in parts]),
                grad(getattr(layer.attention, name).weight), atol=1e-6)
        numpy.testing.assert_allclose(numpy.concatenate(            # by columns
            [grad(p.mlp.output.weight) for p in parts], axis=1), grad(layer.mlp.output.weight),
            atol=1e-5)
        numpy.testing.assert_allclose(grad(parts[0].attention.output.bias),
                                      grad(layer.attention.output.bias), atol=1e-5)
        for p in parts:                                 # whole copies: the whole gradient
            numpy.testing.assert_allclose(grad(p.mlp_norm.gamma), grad(layer.mlp_norm.gamma),
                                          atol=1e-5)
    for rank in tp.ranks:
        numpy.testing.assert_allclose(grad(rank.units[0].token.weight),
                                      grad(net[0].token.weight), atol=1e-5)


def test_training_steps_keep_the_split_net_equal_to_one_device():
    net = gpt(LAYERS, HOME)
    tp = tensor_parallel(net, devices(2))
    one = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01})
    split = d2l.Trainer(tp.collect_params(), 'adam', {'learning_rate': 0.01})
    for _ in range(3):
        whole = one_device_step(net)
        one.step(BATCH)
        logits = split_step(tp)
        split.step(BATCH)
        numpy.testing.assert_allclose(logits[1], whole, atol=1e-5, rtol=0)
    numpy.testing.assert_allclose(split_step(tp)[0], one_device_step(net), atol=1e-5, rtol=0)


@pytest.mark.parametrize('t', [2, 4])
def test_each_layer_moves_two_allreduces_forward_and_two_backward(t):
    tp = tensor_parallel(gpt(LAYERS, HOME), devices(t))
    with d2l.profiler.profile() as records:
        split_step(tp)
        d2l.npx.waitall()
    one_allreduce = 2 * (t - 1) / t * BATCH * SEQ * HIDDEN * 4     # bytes a device sends
    assert comm.bytes_sent(records) / t == LAYERS * 4 * one_allreduce


@pytest.mark.parametrize('t', [2, 4])
def test_a_device_holds_a_tth_of_each_layers_split_weights(t):
    settle()
    before = [d2l.device.memory(d).by_kind['weights'] for d in devices(t)]
    net = gpt(LAYERS, HOME)
    tp = tensor_parallel(net, devices(t))
    settle()
    held = [d2l.device.memory(d).by_kind['weights'] - b for d, b in zip(devices(t), before)]
    size = lambda block: sum(p.data().size for p in block.collect_params().values()) * 4
    layers = net[1:-1]
    split = sum(size(layer.attention) + size(layer.mlp) for layer in layers)
    whole = size(net) - split
    # every device: the whole copies, 1/t of the split weights, and the attention's and the
    # MLP's output biases, whole on every device (trained on the first, zeros elsewhere: the
    # parts are summed, so the bias is added once)
    output_biases = LAYERS * 2 * HIDDEN * 4
    assert held == [whole + (split - output_biases) / t + output_biases] * t
    del tp


def test_devices_that_do_not_divide_the_heads_are_named():
    with pytest.raises(ValueError, match='4 attention heads do not split among 3 devices'):
        tensor_parallel(gpt(LAYERS, HOME), devices(3))


@pytest.mark.parametrize('t', [2, 4])
def test_sequence_parallel_logits_and_gradients_equal_one_devices(t):
    net = gpt(LAYERS, HOME)
    tp = tensor_parallel(net, devices(t), sequence=True)
    whole = one_device_step(net)
    for logits in split_step(tp):
        numpy.testing.assert_allclose(logits, whole, atol=1e-6, rtol=0)
    grad = lambda param: param.grad().asnumpy()
    for rank in tp.ranks:          # copies that saw 1/t of the tokens: summed after backward
        numpy.testing.assert_allclose(grad(rank.units[2].mlp_norm.gamma),
                                      grad(net[2].mlp_norm.gamma), atol=1e-6)
        numpy.testing.assert_allclose(grad(rank.units[0].token.weight),
                                      grad(net[0].token.weight), atol=1e-5)
    numpy.testing.assert_allclose(numpy.concatenate(
        [grad(rank.units[2].attention.query.weight) for rank in tp.ranks]),
        grad(net[2].attention.query.weight), atol=1e-6)


@pytest.mark.parametrize('t', [2, 4])
def test_sequence_parallelism_sends_what_tensor_parallelism_does_and_the_heads_gather(t):
    """Each allreduce became a reduce-scatter and an all-gather: the same bytes. On top: the
    all-gather before the head, and the sum of the gradients of the copies that saw a
    device's tokens only (embeddings and norms)."""
    sent = {}
    for sequence in (False, True):
        tp = tensor_parallel(gpt(LAYERS, HOME), devices(t), sequence=sequence)
        with d2l.profiler.profile() as records:
            split_step(tp)
            d2l.npx.waitall()
        sent[sequence] = comm.bytes_sent(records) / t
    share = (t - 1) / t
    token_values = sum(p.data().size for p in tp.ranks[0].token_params())
    assert sent[True] == sent[False] + share * BATCH * SEQ * HIDDEN * 4 \
        + 2 * share * token_values * 4


def activations_of(layers, t, sequence):
    """Activations a forward leaves on the first device."""
    net = gpt(layers, HOME)
    tp = tensor_parallel(net, devices(t), sequence=sequence)
    settle()
    before = d2l.device.memory(d2l.cpu(1)).by_kind['activations']
    with autograd.record():
        logits = tp(np.array(TOKENS))
    settle()
    kept = d2l.device.memory(d2l.cpu(1)).by_kind['activations'] - before
    del logits
    return kept


@pytest.mark.parametrize('t', [2, 4])
def test_sequence_parallelism_keeps_a_tth_of_the_residual_stream_and_norm_inputs(t):
    """A layer's two blocks keep, under tensor parallelism, the residual stream and each
    norm's input (bsh each a block) and the summed output (bsh): 4·bsh a layer outside the
    split products. Split by tokens they are 4·bsh/t; the gathers keep the norm outputs'
    shards besides (2·bsh/t a layer): 2·(2 - 3/t)·bsh less a layer, measured to the byte."""
    per_layer = {sequence: activations_of(2, t, sequence) - activations_of(1, t, sequence)
                 for sequence in (False, True)}
    bsh = BATCH * SEQ * HIDDEN * 4
    assert per_layer[False] - per_layer[True] == 2 * (2 - 3 / t) * bsh


def test_tokens_that_do_not_split_are_named():
    tp = tensor_parallel(gpt(LAYERS, HOME), devices(4), sequence=True)
    with pytest.raises(ValueError, match='6 tokens .* do not split among 4 devices'):
        tp(np.array(TOKENS[:3, :2]))


def mixed_precision_gpt(LAYERS, HOME):
    """The GPT in float16 but for its norms, kept in float32 (as mixed precision keeps them)."""
    net = gpt(LAYERS, HOME).cast('float16')
    for norm in [net[-1].norm] + [n for layer in net[1:-1]
                                  for n in (layer.attention_norm, layer.mlp_norm)]:
        norm.cast('float32')
    return net


@pytest.mark.parametrize('split', ['tensor_parallel', 'parallel_gpt'])
def test_the_split_keeps_every_parameters_dtype_and_value(split):
    """Each part's parameters in the dtype of the parameter they come from (float16, the
    norms float32), the values bit for bit; the logits those of the whole net, in its dtype."""
    net = mixed_precision_gpt(LAYERS, HOME)
    if split == 'tensor_parallel':
        ranks = tensor_parallel(net, devices(2)).ranks
    else:
        parts = d2l.model_parallel.parallel_gpt(net, devices(4), tensor=2, pipeline=2)
        ranks = [rank for part in parts.pipeline.stages for rank in part.ranks]
    for rank in ranks:
        for name, param in rank.collect_params().items():
            assert param.data().dtype == ('float32' if 'norm' in name else 'float16'), name
    first = ranks[0]
    numpy.testing.assert_array_equal(first.units[0].token.weight.data().asnumpy(),
                                     net[0].token.weight.data().asnumpy())
    numpy.testing.assert_array_equal(first.units[1].attention.query.weight.data().asnumpy(),
                                     net[1].attention.query.weight.data().asnumpy()[:HIDDEN // 2])
    if split == 'tensor_parallel':
        tp = tensor_parallel(net, devices(2))
        logits = tp(np.array(TOKENS))
        whole = net(np.array(TOKENS, device=d2l.cpu(5))).asnumpy()
        for out in logits:
            assert out.dtype == whole.dtype
            numpy.testing.assert_allclose(out.asnumpy(), whole, atol=1e-3)


def test_each_device_runs_the_gpts_own_forward_with_f_and_g_inside_its_layers(monkeypatch):
    """A device's share is a GPT made of column- and row-parallel layers: its layers'
    forward is TransformerLayer.forward (count the calls: one a layer a device), and the
    devices wait for each other only at g, two a layer (f's forward is the identity: a
    device goes on with its own input at once)."""
    from d2lperf.model_parallel.layers import (ColumnParallelDense, RowParallelDense,
                                               TensorGroup)
    t = 2
    tp = tensor_parallel(gpt(LAYERS, HOME), devices(t))
    for rank in tp.ranks:
        layers = rank.units[1:-1]
        assert all(type(layer) is d2l.nn.TransformerLayer for layer in layers)
        for layer in layers:
            assert [type(d) for d in (layer.attention.query, layer.attention.key,
                                      layer.attention.value, layer.mlp.hidden)] == \
                [ColumnParallelDense] * 4
            assert type(layer.attention.output) is type(layer.mlp.output) is RowParallelDense
    calls, meets = [], []
    forward = d2l.nn.TransformerLayer.forward
    monkeypatch.setattr(d2l.nn.TransformerLayer, 'forward',
                        lambda self, x: calls.append(1) or forward(self, x))
    meet = TensorGroup.meet
    monkeypatch.setattr(TensorGroup, 'meet',
                        lambda self, x, c: meets.append(self.program()) or meet(self, x, c))
    tp(np.array(TOKENS))
    assert len(calls) == t * LAYERS and len(meets) == t * LAYERS * 2


def test_an_error_on_one_device_reaches_the_caller_and_the_group_runs_again():
    """A device's program that fails ends the others (none waits forever at a collective),
    the caller gets the error, and the group runs the next forward as before."""
    tp = tensor_parallel(gpt(LAYERS, HOME), devices(4), sequence=True)
    with pytest.raises(ValueError, match='6 tokens'):
        tp(np.array(TOKENS[:3, :2]))
    logits = tp(np.array(TOKENS))
    numpy.testing.assert_allclose(logits[3].asnumpy(), gpt(LAYERS, HOME)(
        np.array(TOKENS, device=HOME)).asnumpy(), atol=1e-6)
