"""Views: an array that may share memory with another shares its engine variable.

Reshape, transpose and indexing give views (`ndarray.alias`); a write to either array must
be ordered with every read of the other, imperative and hybridized, with autograd on.

Each race is made deterministic with a gate. A slow producer on cpu(1) waits for the gate;
the write it feeds (into the base, or through the view) and the read of the other array are
queued behind it; then an operation pushed last on the reader's worker opens the gate. A
read that is not ordered behind the write is ready at once and runs on that worker before
the gate opens, so it sees the old values every time, not by chance. The naive engine runs
each push at once, so there the gate is open from the start.
"""
import threading

import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, engine, nn, np, npx
from conftest import run_with_timeout

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU0, CPU1 = d2l.cpu(0), d2l.cpu(1)

# Each view made the same way from a (4, 4) NumPy array (m is numpy) and an NDArray (m is np).
VIEWS = {
    'reshape': lambda x, m: x.reshape(2, 8),
    'np.reshape to 1-d': lambda x, m: m.reshape(x, (16,)),
    'flatten': lambda x, m: npx.flatten(x) if m is np else x.reshape(4, -1),
    '.T': lambda x, m: x.T,
    'np.transpose': lambda x, m: m.transpose(x, (1, 0)),
    'rows': lambda x, m: x[1:3],
    'one row': lambda x, m: x[2],
    'ellipsis': lambda x, m: x[...],
    'view of a view': lambda x, m: x.reshape(2, 8).T[::2],
    'reshape of a transpose (NumPy copies)': lambda x, m: x.T.reshape(-1),
}
WRITES = {
    'v[...] = y + 1': lambda v, y: v.__setitem__(Ellipsis, y + 1),
    'v += y': lambda v, y: v.__iadd__(y),
}


def slow_producer(shape, value, kind, device=CPU1):
    """An array whose values a slow operation writes once the returned gate is open."""
    out = np.zeros(shape, device=device)
    gate = threading.Event()
    if kind == 'naive':
        gate.set()

    def fill():
        if not gate.wait(30):
            raise TimeoutError('the gate was never opened')
        out.data[...] = value
    engine.push(fill, [], [out.var], device, 'slow_producer')
    return out, gate


def open_last(gate, device):
    """Open `gate` from `device`'s compute worker, after every operation already ready there."""
    engine.push(gate.set, [], [], device, 'open_gate')


def ready_view(make, device=CPU0):
    """A (4, 4) base of zeros and a view of it, both computed before the race starts."""
    x = np.zeros((4, 4), device=device)
    view = make(x, np)
    view.wait_to_read()
    return x, view


def check(got, want):
    numpy.testing.assert_array_equal(got.asnumpy(), want)


# -- the race of issue 18, both directions, for every op that can alias --------------------

def write_base_read_view(make, kind, device=CPU0):
    x, view = ready_view(make, device)
    slow, gate = slow_producer((4, 4), 5.0, kind)
    x[:] = slow.copyto(device) + 1
    seen = view + 0
    open_last(gate, device)
    base = numpy.zeros((4, 4), numpy.float32)
    expected = make(base, numpy)
    base[:] = 6
    check(seen, expected)
    check(x, base)


def write_view_read_base(make, write, kind, device=CPU0):
    x, view = ready_view(make, device)
    slow, gate = slow_producer(view.shape, 5.0, kind)
    WRITES[write](view, slow.copyto(device))
    seen = x + 0
    open_last(gate, device)
    base = numpy.zeros((4, 4), numpy.float32)
    expected = make(base, numpy)
    WRITES[write](expected, numpy.full(expected.shape, 5, numpy.float32))
    check(seen, base)
    check(view, expected)


@pytest.mark.parametrize('name', sorted(VIEWS))
def test_a_read_of_a_view_waits_for_a_write_to_its_base(engine_kind, name):
    run_with_timeout(lambda: write_base_read_view(VIEWS[name], engine_kind), 60)


@pytest.mark.parametrize('write', sorted(WRITES))
@pytest.mark.parametrize('name', sorted(VIEWS))
def test_a_read_of_the_base_waits_for_a_write_through_a_view(engine_kind, name, write):
    run_with_timeout(lambda: write_view_read_base(VIEWS[name], write, engine_kind), 60)


@pytest.mark.parametrize('name', ['reshape', '.T', 'rows', 'view of a view'])
def test_views_on_a_fake_gpu_are_ordered_both_ways(fake_gpus, name):
    """The CuPy path: the same code, with xp=cupy and the GPU's streams."""
    run_with_timeout(lambda: write_base_read_view(VIEWS[name], 'threaded', d2l.gpu(0)), 60)
    run_with_timeout(lambda: write_view_read_base(VIEWS[name], 'v += y', 'threaded',
                                                  d2l.gpu(0)), 60)


def test_a_view_made_while_its_base_is_written_sees_the_write(engine_kind):
    """The view is made (not only read) after the write: it is filled in behind it."""
    def race():
        x = np.zeros((4, 4))
        slow, gate = slow_producer((4, 4), 2.0, engine_kind)
        x += slow.copyto(CPU0)
        view = x.reshape(16)[3:5]
        open_last(gate, CPU0)
        check(view, numpy.full(2, 2, numpy.float32))
    run_with_timeout(race, 60)


# -- in-place updates that read what they write, through a view -----------------------------

ALIASED = {
    'x += x.T': lambda x, m: x.__iadd__(x.T),
    'x -= x.reshape(16)[::-1].reshape(4, 4)': lambda x, m: x.__isub__(
        x.reshape(16)[::-1].reshape(4, 4)),
    'x[0:2] = x.reshape(2, 8)[:, ::2]': lambda x, m: x.__setitem__(
        slice(0, 2), x.reshape(2, 8)[:, ::2]),
    'v = x.T; v *= x': lambda x, m: x.T.__imul__(x),
}


@pytest.mark.parametrize('statement', sorted(ALIASED))
def test_updates_that_read_their_target_through_a_view(engine_kind, statement):
    host = numpy.arange(16.0).reshape(4, 4)
    x = np.array(host)
    run_with_timeout(lambda: (ALIASED[statement](x, np), x.wait_to_read()), 30)
    ALIASED[statement](host, numpy)
    check(x, host)


# -- autograd: views are recorded on the tape ------------------------------------------------

def test_gradients_flow_through_views():
    host = numpy.arange(1.0, 17.0, dtype=numpy.float32).reshape(4, 4)
    x = np.array(host)
    x.attach_grad()
    with autograd.record():
        v = x.reshape(2, 8).T[1:5]          # rows 1..4 of the (8, 2) transpose
        loss = (v * v).sum() + x[0].sum()
    loss.backward()
    expected = numpy.zeros((2, 8), numpy.float32)
    expected.T[1:5] = 2 * host.reshape(2, 8).T[1:5]
    expected = expected.reshape(4, 4)
    expected[0] += 1
    check(x.grad, expected)


def test_a_write_through_a_view_of_a_recorded_array_is_refused():
    x = np.ones((4, 4))
    x.attach_grad()
    with autograd.record():
        v = x.reshape(16)
        with pytest.raises(RuntimeError, match='autograd is recording'):
            v += 1
        with pytest.raises(RuntimeError, match='autograd is recording'):
            x.T[0] = 3
    check(x, numpy.ones((4, 4), numpy.float32))


# -- hybridized: views inside the program and among its outputs -----------------------------

class Views(nn.HybridBlock):
    """A block whose outputs are views of its input, of a buffer, and of each other."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(16)

    def forward(self, x):
        h = self.dense(x).reshape(4, 4) + 1
        g = h * 3                                   # a workspace buffer that dies where it
        mixed = ((g * 2 + g.T) * 0.5).sum(axis=0)   # is read through its own transpose
        return mixed, h.T, x.T, x.reshape(-1)[2:6], h, h.reshape(2, 8), h.reshape(2, 8)


def views_block_and_input():
    net = Views()
    np.random.seed(3)
    net.initialize()
    return net, np.array(numpy.arange(16.0, dtype=numpy.float32).reshape(1, 16) / 16)


def test_hybridized_views_agree_with_imperative(engine_kind):
    net, x = views_block_and_input()
    expected = [y.asnumpy() for y in net(x)]
    net.hybridize()
    for _ in range(2):                              # the second call reuses the buffers
        for got, want in zip(net(x), expected):
            numpy.testing.assert_allclose(got.asnumpy(), want, rtol=1e-6)


def test_hybridized_outputs_own_their_memory(engine_kind):
    """Writing into one output changes no other output, nor the input, nor a later call's
    outputs; and no later call changes an earlier call's outputs."""
    net, x = views_block_and_input()
    net.hybridize()
    first = net(x)
    kept = [y.asnumpy() for y in first]
    host = x.asnumpy()
    second = net(x * 2)
    for i, y in enumerate(first):
        y[...] = -7
        y.wait_to_read()
        for got, want in zip(first[i + 1:], kept[i + 1:]):
            check(got, want)
    check(x, host)
    for got, want in zip(net(x), kept):
        numpy.testing.assert_allclose(got.asnumpy(), want, rtol=1e-6)
    assert all((y.asnumpy() != -7).all() for y in second)


def test_a_recorded_hybridized_call_copies_outputs_that_alias(engine_kind):
    net, x = views_block_and_input()
    net.hybridize()
    x.attach_grad()
    with autograd.record():
        outputs = net(x)
        loss = sum(y.sum() for y in outputs[:3])
    loss.backward()
    outputs[2][...] = 0                             # x.T, handed out: not x itself
    assert x.asnumpy().any()
    grad = x.grad.asnumpy()
    net.hybridize(False)
    x.attach_grad()
    with autograd.record():
        outputs = net(x)
        loss = sum(y.sum() for y in outputs[:3])
    loss.backward()
    numpy.testing.assert_allclose(grad, x.grad.asnumpy(), rtol=1e-5)


def test_a_hybridized_call_on_a_view_waits_for_a_write_to_its_base(engine_kind):
    net, x = views_block_and_input()
    net.hybridize()
    want = net(x)[0].asnumpy()

    def race():
        base = np.zeros((16,))
        slow, gate = slow_producer((16,), 0.0, engine_kind)
        base[:] = slow.copyto(CPU0) + x.reshape(-1)
        got = net(base.reshape(1, 16))[0]
        open_last(gate, CPU0)
        numpy.testing.assert_allclose(got.asnumpy(), want, rtol=1e-6)
    run_with_timeout(race, 60)
