"""Tests of cuDNN's batch normalization in d2lperf.ops.cudnn, as batch_norm_train and its vjp
(ops/convolution.py) take it on a GPU in float32: on fake GPUs (tests/fakes/cupy.py) and a
fake cuDNN frontend (tests/fakes/cudnn.py) whose batchnorm moves the running statistics by
cuDNN's convention, (1 - m)·running + m·batch, from the m it is handed by value.

The output, the running statistics (updated in place, d2lperf's momentum convention) and
the gradients equal the NumPy path's; a graph is built once per layout, whatever epsilon and
momentum; a layout cuDNN refuses is tried again as NHWC; a batch of one value a channel,
float64 and `off()` stay on CuPy; through the engine, a convolution net with batch norm on
gpu(0) equals cpu(0), running statistics included; tests/cudnn_check.py's batch norm rows
run on the fakes."""
import sys

import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, np
from d2lperf.ops import convolution, cudnn
import cudnn_check
from fakes import cupy as fake_cupy
from strategies import checks


def batch_last_view(x):
    """x on the fake GPU laid out batch last, as im2col's results are."""
    order = tuple(range(1, x.ndim)) + (0,)
    back = (x.ndim - 1,) + tuple(range(x.ndim - 1))
    return fake_cupy.on_device(numpy.ascontiguousarray(x.transpose(order))).transpose(back)


def both_roads(shape, dtype='float32', seed=0, batch_last=False, eps=1e-5, momentum=0.9):
    """(out, running_mean, running_var, d_data, d_gamma, d_beta) on the fake GPU and by
    NumPy, from the same running statistics."""
    rng = numpy.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=shape).astype(dtype)
    gamma, beta, mean, var = (rng.uniform(0.5, 1.5, size=shape[1]).astype(dtype)
                              for _ in range(4))
    g = rng.normal(size=shape).astype(dtype)
    roads = []
    for xp, move in ((sys.modules['cupy'], lambda a: fake_cupy.on_device(a.copy())),
                     (numpy, lambda a: a.copy())):       # copies: the statistics are updated
        on = batch_last_view if batch_last and xp is not numpy else move
        x_d, g_d = on(x), on(g)
        params = [move(a) for a in (gamma, beta, mean, var)]
        out = convolution.batch_norm_train(xp, x_d, *params, eps, momentum)
        grads = convolution.batch_norm_train_vjp(xp, g_d, out, x_d, *params, eps, momentum)
        roads.append([numpy.asarray(a) for a in (out, params[2], params[3]) + grads[:3]])
    return roads


NAMES = ('out', 'running_mean', 'running_var', 'd_data', 'd_gamma', 'd_beta')


@checks(40)
@given(shape=st.one_of(st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4),
                                 st.integers(1, 4)),
                       st.tuples(st.integers(2, 5), st.integers(1, 4))),
       batch_last=st.booleans(), momentum=st.floats(0, 0.99), seed=st.integers(0, 2 ** 16))
def test_cudnns_batch_norm_equals_the_numpy_path(frontend, shape, batch_last, momentum, seed):
    before = len(frontend.executions)
    got, want = both_roads(shape, seed=seed, batch_last=batch_last, momentum=momentum)
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        numpy.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)
    one_value_a_channel = numpy.prod(shape) == shape[1]
    kinds = [e.graph.kind for e in frontend.executions[before:]]
    assert kinds == ([] if one_value_a_channel else ['batchnorm', 'batchnorm_backward'])


def test_the_running_statistics_follow_d2lperfs_momentum_not_cudnns(frontend):
    """momentum 0.9 keeps 0.9 of the old running mean (MXNet's convention): cuDNN is told
    0.1, the batch's weight; the variance moves by the unbiased batch variance."""
    (_, mean, var, *_), _ = both_roads((4, 2, 3, 3), seed=1, momentum=0.9)
    rng = numpy.random.default_rng(1)
    x = rng.normal(1.0, 2.0, size=(4, 2, 3, 3)).astype('float32')
    _, _, old_mean, old_var = (rng.uniform(0.5, 1.5, size=2) for _ in range(4))
    numpy.testing.assert_allclose(mean, 0.9 * old_mean + 0.1 * x.mean(axis=(0, 2, 3)),
                                  rtol=1e-5)
    numpy.testing.assert_allclose(var, 0.9 * old_var + 0.1 * x.var(axis=(0, 2, 3), ddof=1),
                                  rtol=1e-5)
    assert frontend.executions[0].graph.inputs[6].by_value


def test_a_graph_is_built_once_per_layout_whatever_epsilon_and_momentum(frontend):
    for eps, momentum in ((1e-5, 0.9), (1e-3, 0.5), (1e-5, 0.0)):
        both_roads((2, 3, 4, 4), eps=eps, momentum=momentum)
    assert [g.kind for g in frontend.built] == ['batchnorm', 'batchnorm_backward']
    both_roads((2, 3, 4, 4), batch_last=True)                      # a new layout
    both_roads((3, 3, 4, 4))                                       # a new batch
    assert len(frontend.built) == len(frontend.attempts) == 6


def test_a_layout_cudnn_refuses_is_tried_again_as_nhwc(frontend):
    def nhwc_only(data):
        n, c, h, w = data.dim
        return {(h * w * c, 1, w * c, c)}
    frontend.layouts = nhwc_only
    with pytest.warns(RuntimeWarning, match='refused'):
        got, want = both_roads((2, 3, 4, 5), seed=2)
    for name, g, w in zip(NAMES, got, want):
        numpy.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)
    assert [g.kind for g in frontend.built] == ['batchnorm', 'batchnorm_backward']
    assert all(g.inputs[0 if g.kind == 'batchnorm' else 1].stride == [60, 1, 15, 3]
               for g in frontend.built)


def test_float64_and_off_stay_on_cupy(frontend):
    both_roads((2, 3, 4, 4), 'float64')
    with cudnn.off():
        got, want = both_roads((2, 3, 4, 4))
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert frontend.attempts == []


def test_through_the_engine_a_net_with_batch_norm_on_gpu0_equals_cpu0(frontend):
    x = numpy.random.default_rng(3).uniform(size=(4, 2, 6, 6)).astype('float32')
    net = d2l.nn.HybridSequential()
    net.add(d2l.nn.Conv2D(3, kernel_size=3, padding=1), d2l.nn.BatchNorm(),
            d2l.nn.Activation('relu'), d2l.nn.Flatten(), d2l.nn.Dense(2))
    net.initialize(d2l.nn.init.Normal(0.5), device=[d2l.cpu(0), d2l.gpu(0)])
    results = []
    for device in (d2l.cpu(0), d2l.gpu(0)):
        with autograd.record():
            loss = (net(np.array(x, device=device)) ** 2).sum()
        loss.backward()
        params = net.collect_params().values()
        results.append([loss.asnumpy()] + [p.data(device).asnumpy() for p in params]
                       + [p.grad(device).asnumpy() for p in params if p.grad_req != 'null'])
    for cpu, gpu in zip(*results):    # atol: the convolution's bias gradient is 0 but rounding
        numpy.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-4)
    kinds = [e.graph.kind for e in frontend.executions]
    assert 'batchnorm' in kinds and 'batchnorm_backward' in kinds


def test_the_gpu_check_compares_batch_norm_and_fails_where_cudnn_is_not_used(frontend):
    rows = cudnn_check.compare_batch_norm(d2l.gpu(0), cudnn_check.ODD_BATCH_NORM, repeats=2)
    assert all(r['ok'] for r in rows), cudnn_check.batch_norm_table(rows)
    with cudnn.off():
        rows = cudnn_check.compare_batch_norm(d2l.gpu(0), cudnn_check.ODD_BATCH_NORM, repeats=1)
    assert not any(r['ok'] for r in rows)


@pytest.mark.skipif(not d2l.num_gpus() or not cudnn.available(),
                    reason='runs where a GPU is here and the cuDNN frontend imports')
def test_on_a_real_gpu_cudnns_batch_norm_agrees_with_cupy():
    rows = cudnn_check.compare_batch_norm(d2l.gpu(0), cudnn_check.ODD_BATCH_NORM, repeats=1)
    assert all(r['ok'] for r in rows), cudnn_check.batch_norm_table(rows)
