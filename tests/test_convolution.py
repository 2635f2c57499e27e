"""Tests of convolution, pooling and batch normalization (d2lperf.ops.convolution and the
layers of d2lperf.nn.conv_layers): forward against direct loops on random shapes, running
statistics, errors, and conv nets through hybridize, export and import. Gradients are
checked against finite differences in test_autograd.py."""
import numpy
import pytest
from hypothesis import given, settings, strategies as st

import d2lperf as d2l
from d2lperf import autograd, np, npx, nn


def loop_convolution(x, w, b, stride, pad):
    """The definition, one output value at a time."""
    xp = numpy.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2))
    f, _, kh, kw = w.shape
    oh, ow = (xp.shape[2] - kh) // stride[0] + 1, (xp.shape[3] - kw) // stride[1] + 1
    out = numpy.zeros((x.shape[0], f, oh, ow))
    for n in range(x.shape[0]):
        for k in range(f):
            for i in range(oh):
                for j in range(ow):
                    patch = xp[n, :, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
                    out[n, k, i, j] = (patch * w[k]).sum() + b[k]
    return out


def loop_pooling(x, kernel, stride, pad, pool_type):
    fill = -numpy.inf if pool_type == 'max' else 0.0
    xp = numpy.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2), constant_values=fill)
    oh, ow = (xp.shape[2] - kernel[0]) // stride[0] + 1, (xp.shape[3] - kernel[1]) // stride[1] + 1
    out = numpy.zeros(x.shape[:2] + (oh, ow))
    reduce = numpy.max if pool_type == 'max' else numpy.mean
    for i in range(oh):
        for j in range(ow):
            window = xp[:, :, i * stride[0]:i * stride[0] + kernel[0],
                        j * stride[1]:j * stride[1] + kernel[1]]
            out[:, :, i, j] = reduce(window, axis=(2, 3))
    return out


@st.composite
def conv_cases(draw):
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    pad = (draw(st.integers(0, kernel[0] - 1)), draw(st.integers(0, kernel[1] - 1)))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)),
             draw(st.integers(kernel[0], 6)), draw(st.integers(kernel[1], 6)))
    filters, seed = draw(st.integers(1, 4)), draw(st.integers(0, 2**16))
    return shape, filters, kernel, stride, pad, seed


@st.composite
def winograd_cases(draw):
    """3×3 kernels at stride 1 whose output has even sides of at least 8: Winograd's road."""
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    out = (2 * draw(st.integers(4, 6)), 2 * draw(st.integers(4, 6)))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), out[0] + 2 - 2 * pad[0],
             out[1] + 2 - 2 * pad[1])
    return shape, draw(st.integers(1, 4)), pad, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(winograd_cases())
def test_winograd_matches_the_definition_and_its_gradients_are_adjoints(case):
    """The forward against the loops; the gradients by the adjoint identity: for a function
    linear in x, <dx, x'> = <r, conv(x', w)> for any x', and the same for the weight."""
    from d2lperf.ops import winograd
    shape, filters, pad, seed = case
    rng = numpy.random.default_rng(seed)
    x, w = rng.normal(size=shape), rng.normal(size=(filters, shape[1], 3, 3))
    no_bias = numpy.zeros(filters)
    want = loop_convolution(x, w, no_bias, (1, 1), pad)
    got = winograd.convolution(numpy, x, w, pad).transpose(3, 0, 1, 2)
    numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    r = rng.normal(size=want.shape)
    d_x, d_w = winograd.convolution_vjp(numpy, r.transpose(1, 2, 3, 0), x, w, pad, True)
    other_x, other_w = rng.normal(size=x.shape), rng.normal(size=w.shape)
    numpy.testing.assert_allclose((d_x * other_x).sum(),
                                  (r * loop_convolution(other_x, w, no_bias, (1, 1), pad)).sum(),
                                  rtol=1e-9)
    numpy.testing.assert_allclose((d_w * other_w).sum(),
                                  (r * loop_convolution(x, other_w, no_bias, (1, 1), pad)).sum(),
                                  rtol=1e-9)


def test_wide_3x3_layers_take_winograds_road_and_narrow_ones_im2col(monkeypatch):
    from d2lperf.ops import convolution, winograd
    taken = []
    for name in ('convolution', 'convolution_vjp'):
        road = getattr(winograd, name)
        monkeypatch.setattr(winograd, name,
                            lambda *args, road=road, name=name: taken.append(name) or road(*args))
    assert winograd.applies(numpy, (64, 64, 3, 3), (1, 1), (1, 1), (8, 8))
    assert not winograd.applies(numpy, (64, 1, 3, 3), (1, 1), (1, 1), (28, 28))     # a first layer
    assert not winograd.applies(numpy, (64, 64, 3, 3), (2, 2), (1, 1), (8, 8))
    assert not winograd.applies(numpy, (64, 64, 3, 3), (1, 1), (1, 1), (7, 7))
    rng = numpy.random.default_rng(0)
    x, w, b = rng.normal(size=(2, 64, 8, 8)), rng.normal(size=(64, 64, 3, 3)), rng.normal(size=64)
    x_nd, w_nd = np.array(x), np.array(w)
    x_nd.attach_grad()
    w_nd.attach_grad()
    with autograd.record():
        y = npx.convolution(x_nd, w_nd, np.array(b), kernel=(3, 3), pad=(1, 1), num_filter=64)
    y.backward()
    columns = convolution.im2col(numpy, x, (3, 3), (1, 1), (1, 1))
    by_im2col = (w.reshape(64, -1) @ columns).reshape(64, 8, 8, 2).transpose(3, 0, 1, 2)
    numpy.testing.assert_allclose(y.asnumpy(), by_im2col + b[:, None, None], rtol=1e-10)
    ones = numpy.ones((64, 8 * 8 * 2))
    numpy.testing.assert_allclose(w_nd.grad.asnumpy(), (ones @ columns.T).reshape(w.shape),
                                  rtol=1e-10)
    numpy.testing.assert_allclose(
        x_nd.grad.asnumpy(),
        convolution.col2im(numpy, w.reshape(64, -1).T @ ones, x.shape, (3, 3), (1, 1), (1, 1)),
        rtol=1e-10)
    # the input's gradient is itself a Winograd convolution, of g with the filters turned
    assert taken == ['convolution', 'convolution_vjp', 'convolution']


@settings(max_examples=40, deadline=None)
@given(conv_cases())
def test_convolution_matches_the_definition(case):
    shape, filters, kernel, stride, pad, seed = case
    rng = numpy.random.default_rng(seed)
    x, w = rng.normal(size=shape), rng.normal(size=(filters, shape[1]) + kernel)
    b = rng.normal(size=filters)
    got = npx.convolution(np.array(x), np.array(w), np.array(b), kernel=kernel, stride=stride,
                          pad=pad, num_filter=filters).asnumpy()
    numpy.testing.assert_allclose(got, loop_convolution(x, w, b, stride, pad), rtol=1e-10,
                                  atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(conv_cases(), st.sampled_from(['max', 'avg']))
def test_pooling_matches_the_definition(case, pool_type):
    shape, _, kernel, stride, pad, seed = case
    x = numpy.random.default_rng(seed).normal(size=shape)
    got = npx.pooling(np.array(x), kernel=kernel, stride=stride, pad=pad,
                      pool_type=pool_type).asnumpy()
    numpy.testing.assert_allclose(got, loop_pooling(x, kernel, stride, pad, pool_type),
                                  rtol=1e-12)


def test_pooling_stride_defaults_to_the_window_and_global_pooling_takes_the_image():
    x = numpy.arange(2 * 3 * 4 * 6, dtype=numpy.float32).reshape(2, 3, 4, 6)
    assert npx.pooling(np.array(x), kernel=(2, 3)).shape == (2, 3, 2, 2)
    got = npx.pooling(np.array(x), pool_type='avg', global_pool=True).asnumpy()
    numpy.testing.assert_allclose(got[:, :, 0, 0], x.mean(axis=(2, 3)))


def test_convolution_without_bias_and_float32_stays_float32():
    x = numpy.ones((1, 2, 3, 3), numpy.float32)
    w = numpy.ones((1, 2, 3, 3), numpy.float32)
    y = npx.convolution(np.array(x), np.array(w), kernel=(3, 3), num_filter=1)
    assert y.dtype == numpy.float32 and y.asnumpy().item() == 18.0


def test_input_channels_that_do_not_match_the_weight_fail_at_the_push():
    x, w = np.ones((2, 3, 8, 8)), np.ones((4, 1, 3, 3))
    with pytest.raises(ValueError, match=r'\(4, 1, 3, 3\).*1 channels.*\(2, 3, 8, 8\)'):
        npx.convolution(x, w, kernel=(3, 3), num_filter=4)
    net = nn.Conv2D(4, kernel_size=3, in_channels=1)
    net.initialize()
    with pytest.raises(ValueError, match='channels'):
        net(x)


def test_a_kernel_larger_than_the_input_is_refused():
    with pytest.raises(ValueError, match='larger than the padded input'):
        npx.pooling(np.ones((1, 1, 2, 2)), kernel=(3, 3))


def test_batch_norm_uses_batch_statistics_while_training_and_running_ones_in_prediction():
    rng = numpy.random.default_rng(0)
    x = rng.normal(2.0, 3.0, size=(8, 2, 3, 3))
    layer = nn.BatchNorm(momentum=0.5)
    layer.initialize()
    with autograd.record():
        y = layer(np.array(x)).asnumpy()
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    expected = (x - mean[None, :, None, None]) / numpy.sqrt(var[None, :, None, None] + 1e-5)
    numpy.testing.assert_allclose(y, expected, atol=1e-6)
    n = 8 * 3 * 3
    numpy.testing.assert_allclose(layer.running_mean.data().asnumpy(), 0.5 * mean)
    numpy.testing.assert_allclose(layer.running_var.data().asnumpy(),
                                  0.5 + 0.5 * var * n / (n - 1))
    predicted = layer(np.array(x)).asnumpy()           # outside record(): running statistics
    rm, rv = 0.5 * mean, 0.5 + 0.5 * var * n / (n - 1)
    numpy.testing.assert_allclose(
        predicted, (x - rm[None, :, None, None]) / numpy.sqrt(rv[None, :, None, None] + 1e-5),
        atol=1e-6)
    with autograd.predict_mode():
        layer(np.array(x))
    numpy.testing.assert_allclose(layer.running_mean.data().asnumpy(), rm)  # not updated


def test_running_statistics_are_updated_in_engine_order():
    """Each training call reads the running mean the previous one wrote: after k calls on
    the same batch, the mean is (1 - m^k) times the batch mean, on either engine."""
    x = np.array(numpy.random.default_rng(1).normal(5.0, 1.0, size=(16, 3)))
    layer = nn.BatchNorm(momentum=0.9)
    layer.initialize()
    with autograd.train_mode():
        for _ in range(20):
            layer(x)
    numpy.testing.assert_allclose(layer.running_mean.data().asnumpy(),
                                  (1 - 0.9 ** 20) * x.asnumpy().mean(axis=0), rtol=1e-5)


def test_running_statistics_have_no_gradient_and_the_trainer_leaves_them_alone():
    layer = nn.BatchNorm()
    layer.initialize()
    x = np.array(numpy.random.default_rng(2).normal(size=(4, 2)))
    with autograd.record():
        y = (layer(x) * np.array([1.0, 2.0])).sum()
    y.backward()
    trainer = d2l.Trainer(layer.collect_params(), 'sgd', {'learning_rate': 0.5})
    assert {p.name for p in trainer.params} == {'gamma', 'beta'}
    before = layer.running_var.data().asnumpy().copy()
    trainer.step(1)
    numpy.testing.assert_array_equal(layer.running_var.data().asnumpy(), before)
    assert layer.running_mean.data().grad is None


def lenet():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(6, kernel_size=5, padding=2, activation='sigmoid'),
            nn.AvgPool2D(pool_size=2, strides=2),
            nn.Conv2D(16, kernel_size=5, activation='sigmoid'), nn.MaxPool2D(pool_size=2),
            nn.Flatten(), nn.Dense(32, activation='relu'), nn.Dense(10))
    return net


@pytest.mark.parametrize('make', [lenet, lambda: d2l.Residual(4, use_1x1conv=True, strides=2)],
                         ids=['lenet', 'residual'])
def test_conv_nets_survive_hybridize_export_and_import(make, tmp_path):
    x = np.array(numpy.random.default_rng(3).uniform(size=(3, 2, 12, 12)).astype('float32'))
    net = make()
    net.initialize(nn.init.Xavier())
    with autograd.train_mode():
        net(x)                                     # running statistics move off 0 and 1
    imperative = net(x).asnumpy()
    net.hybridize()
    numpy.testing.assert_allclose(net(x).asnumpy(), imperative, rtol=1e-5, atol=1e-6)
    symbol, params = net.export(str(tmp_path / 'net'))
    loaded = nn.SymbolBlock.imports(symbol, ['data'], params)
    numpy.testing.assert_allclose(loaded(x).asnumpy(), imperative, rtol=1e-5, atol=1e-6)


def test_hybridized_training_matches_imperative_training():
    """Gradients and running statistics agree whether the net runs compiled or not."""
    x = numpy.random.default_rng(4).uniform(size=(4, 1, 8, 8)).astype('float32')
    y = numpy.array([0, 1, 2, 3])
    results = []
    for hybridize in (False, True):
        numpy.random.seed(0)
        net = d2l.Residual(3, use_1x1conv=True)
        net.initialize(nn.init.Constant(0.1))
        net.hybridize(hybridize)
        loss_fn = d2l.SoftmaxCrossEntropyLoss()
        with autograd.record():
            loss = loss_fn(npx.flatten(net(np.array(x))), np.array(y))
        loss.backward()
        results.append([net.conv1.weight.grad().asnumpy(),
                        net.bn1.running_mean.data().asnumpy()])
    for imperative, compiled in zip(*results):
        numpy.testing.assert_allclose(compiled, imperative, rtol=1e-4, atol=1e-6)


def test_resnet18_shapes_and_parameter_count():
    net = d2l.resnet18(10)
    net.initialize()
    assert net(np.ones((2, 1, 28, 28))).shape == (2, 10)
    trainable = sum(int(numpy.prod(p.shape)) for p in net.collect_params().values()
                    if p.grad_req == 'write')
    assert 11_150_000 < trainable < 11_200_000       # ResNet-18 with 1 input channel, 10 classes


def batch_innermost(a):
    """True when an (N, C, H, W) array lies in memory as a contiguous (C, H, W, N) one."""
    return a.transpose(1, 2, 3, 0).flags.c_contiguous


def test_layers_keep_the_batch_axis_innermost_and_read_it_in_place():
    """The convolution returns its product as a view (no copy back to NCHW order), ReLU and
    pooling keep that layout, and the next convolution's im2col reads it without a copy."""
    from d2lperf.ops.convolution import batch_last
    rng = numpy.random.default_rng(5)
    x = np.array(rng.normal(size=(4, 2, 9, 9)).astype('float32'))
    w1, w2 = (np.array(rng.normal(size=s).astype('float32')) for s in [(3, 2, 3, 3),
                                                                        (5, 3, 2, 2)])
    conv = npx.convolution(x, w1, kernel=(3, 3), num_filter=3)
    relu = npx.relu(conv)
    pooled = npx.pooling(relu, kernel=(2, 2), pool_type='avg')
    for a in (conv, relu, pooled):
        a.wait_to_read()
        assert batch_innermost(a.data), a.data.strides
    assert conv.data.base is not None                          # a view of the product
    assert numpy.shares_memory(batch_last(numpy, pooled.data), pooled.data)
    flat = npx.flatten(pooled)
    flat.wait_to_read()
    assert numpy.shares_memory(flat.data, pooled.data)        # Flatten: a view as well
    expected = loop_convolution(pooled.asnumpy(), w2.asnumpy(), numpy.zeros(5), (1, 1), (0, 0))
    got = npx.convolution(pooled, w2, kernel=(2, 2), num_filter=5).asnumpy()
    numpy.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def conv_net():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(3, kernel_size=3, activation='relu'), nn.MaxPool2D(2),
            nn.Conv2D(4, kernel_size=2), nn.Flatten(), nn.Dense(2))
    net.initialize(nn.init.Normal(0.5))
    return net


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_a_convolution_skips_the_gradient_of_an_input_that_needs_none(hybridize, monkeypatch):
    """The first layer's input is data: its gradient is never computed, and every other
    gradient is the same as when the data does want one."""
    from d2lperf.ops import REGISTRY
    op, asked = REGISTRY['convolution'], []
    vjp = op.vjp

    def spy(*args, needs, **attrs):
        asked.append(needs)
        grads = vjp(*args, needs=needs, **attrs)
        assert (grads[0] is None) == (not needs[0])
        return grads
    monkeypatch.setattr(op, 'vjp', spy)
    x = numpy.random.default_rng(6).normal(size=(2, 2, 8, 8)).astype('float32')
    net = conv_net()
    results = []
    for wants_input, compiled in ((False, hybridize), (True, hybridize), (True, False)):
        net.hybridize(compiled)
        data = np.array(x)
        if wants_input:
            data.attach_grad()
        with autograd.record():
            loss = (net(data) ** 2).sum()
        loss.backward()
        results.append([p.grad().asnumpy() for p in net.collect_params().values()]
                       + ([data.grad.asnumpy()] if wants_input else []))
    assert sorted(asked[:4]) == [(False, True, True), (True, True, True), (True, True, True),
                                 (True, True, True)]
    for without, with_input in zip(results[0], results[1]):
        numpy.testing.assert_allclose(without, with_input, rtol=1e-6)
    for got, imperative in zip(results[1], results[2]):     # the input's gradient too
        numpy.testing.assert_allclose(got, imperative, rtol=1e-4, atol=1e-5)


def bn_gradients(x, hybridize):
    """The input's, gamma's and beta's gradients of a weighted sum of a BatchNorm's output."""
    net = nn.HybridSequential()
    net.add(nn.BatchNorm(momentum=0.5))
    net.initialize()
    net.hybridize(hybridize)
    data, weights = np.array(x), np.array(numpy.random.default_rng(9).normal(size=x.shape))
    data.attach_grad()
    with autograd.record():
        loss = (net(data) * weights).sum()
    loss.backward()
    layer = net[0]
    return [a.asnumpy() for a in (data.grad, layer.gamma.grad(), layer.beta.grad())]


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_batch_norms_backward_takes_the_forwards_statistics_with_the_same_gradients(
        monkeypatch, hybridize):
    """`Op.saves`: the training forward keeps the batch's mean and inverse deviation, and the
    backward reads them rather than making two passes over the batch again (one row_dots a
    block of channels for dγ, not two), bit for bit the gradients it computed before."""
    from d2lperf.ops import convolution, registry
    x = numpy.random.default_rng(3).normal(1.0, 2.0, size=(6, 3, 4, 4))
    calls = []
    row_dots = convolution.row_dots
    monkeypatch.setattr(convolution, 'row_dots', lambda *a: (calls.append(1), row_dots(*a))[1])
    kept = bn_gradients(x, hybridize)
    forward_and_backward = len(calls)
    monkeypatch.setattr(registry.REGISTRY['batch_norm_train'], 'saves', False)
    calls.clear()
    found_again = bn_gradients(x, hybridize)
    assert forward_and_backward == len(calls) - 1       # one block of channels at this size
    for a, b in zip(kept, found_again):
        numpy.testing.assert_array_equal(a, b)


def test_batch_norm_keeps_nothing_outside_record():
    """Only a recording run passes `saved`: prediction and an unrecorded training call keep
    no statistics, so nothing outlives the call."""
    from d2lperf.ops.convolution import batch_norm_train
    x = numpy.random.default_rng(4).normal(size=(4, 2))
    ones, zeros = numpy.ones(2), numpy.zeros(2)
    saved = {}
    out = batch_norm_train(numpy, x, ones, zeros, zeros.copy(), ones.copy(), 1e-5, 0.9, saved)
    numpy.testing.assert_allclose(saved['mean'], x.mean(axis=0))
    numpy.testing.assert_allclose(saved['inv_std'], 1 / numpy.sqrt(x.var(axis=0) + 1e-5))
    numpy.testing.assert_allclose(out, (x - x.mean(axis=0)) * saved['inv_std'], atol=1e-12)
    layer = nn.BatchNorm()
    layer.initialize()
    with autograd.train_mode():
        y = layer(np.array(x))
    assert y.node is None
