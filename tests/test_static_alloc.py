"""`hybridize(static_alloc=True, static_shape=True)` and the cache of compiled programs: what
a program is keyed on, when it is compiled again, and what a call allocates.
Run: D2LPERF_QUICK=1 pytest -q tests/test_static_alloc.py"""
import os
import re
import sys
import tracemalloc

import numpy
import pytest
from hypothesis import HealthCheck, given, settings

import d2lperf as d2l
from d2lperf import autograd, hybrid, np, nn
from d2lperf.hybrid import gpu as hybrid_gpu

from fakes import cupy as fake_cupy
from strategies.nets import build_net, net_specs, program_function, program_inputs, programs

pytestmark = pytest.mark.chapter('hybridize')
SETTINGS = settings(max_examples=int(os.environ.get('HYBRID_EXAMPLES', 50)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class SlicesAndSums(nn.HybridBlock):
    """A dense layer, then what a plain plan leaves to NumPy to allocate: a slice, a cast,
    a sum and a mean."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(256, activation='relu')

    def forward(self, x):
        h = self.dense(x)
        return (h[:, :128] * 2).sum(axis=1) + h.astype('float64').mean()


def slices_and_sums(batch=4, static_alloc=True):
    np.random.seed(0)
    net = SlicesAndSums()
    net.initialize()
    x = np.random.normal(size=(batch, 32))
    expected = net(x).asnumpy()
    if static_alloc:
        net.hybridize(static_alloc=True)
    else:
        net.hybridize()
    return net, x, expected


# -- the flags ---------------------------------------------------------------------------------

def test_static_shape_needs_static_alloc():
    with pytest.raises(ValueError, match='static_alloc=True'):
        nn.HybridSequential().hybridize(static_shape=True)


def test_the_flags_reach_every_hybrid_block_under_a_plain_one():
    outer = nn.Sequential()
    outer.add(SlicesAndSums())
    outer.initialize()
    outer.hybridize(static_alloc=True, static_shape=True)
    outer(np.ones((2, 32))).wait_to_read()
    assert outer[0]._compiled.static_alloc and outer[0].memory_plan().static_alloc


def test_static_alloc_plans_slices_casts_and_reductions_into_buffers():
    net, x, expected = slices_and_sums()
    numpy.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-5)
    code, plan = net.generated_code(), net.memory_plan()
    assert '_op(' not in code                         # no op allocating its own result
    assert 'sum(buf' in code and 'copyto(buf' in code and 'mean(buf' in code
    assert 'allocated by the op' not in str(plan)
    assert str(plan).endswith('still allocated per call: the outputs')
    net.hybridize()                                    # the default plan leaves them to NumPy
    net(x).wait_to_read()
    assert net.memory_plan().allocating() == ['astype', 'getitem', 'mean', 'sum']


def test_what_static_alloc_cannot_plan_is_named():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(2, kernel_size=3), nn.Dense(3))
    net.initialize()
    net.hybridize(static_alloc=True)
    net(np.ones((1, 1, 5, 5))).wait_to_read()
    assert net.memory_plan().allocating() == ['convolution']
    assert 'inside convolution' in str(net.memory_plan())


def gradients(net, x):
    with autograd.record():
        loss = (net(x) ** 2).sum()
    loss.backward()
    return [p.grad().asnumpy() for p in net.collect_params().values()]


@SETTINGS
@given(net_specs)
def test_random_nets_with_static_alloc_equal_the_imperative_ones(spec):
    net = build_net(spec)
    x = np.random.normal(size=(spec['batch'], spec['features']))
    expected, expected_grads = net(x).asnumpy(), gradients(net, x)
    net.hybridize(static_alloc=True, static_shape=True)
    for _ in range(2):                                 # the second call reuses every buffer
        numpy.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-5, atol=1e-6)
    for grad, expected_grad in zip(gradients(net, x), expected_grads):
        numpy.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(programs)
def test_static_plans_preserve_the_results_of_random_programs(spec):
    fn, args = program_function(spec), program_inputs(spec)
    graph = hybrid.optimize(hybrid.trace(fn, [np.array(a) for a in args]))
    expected = hybrid.evaluate(graph, numpy, args)
    program = hybrid.generate(graph, hybrid.plan_memory(graph, static_alloc=True), numpy)
    for _ in range(2):
        for r, e in zip(program.fn(*args), expected):
            numpy.testing.assert_allclose(r, e, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_outputs_of_two_calls_are_arrays_of_their_own():
    net, x, _ = slices_and_sums()
    first = net(x)
    expected = first.asnumpy()
    second = net(x * 2)
    second.wait_to_read()
    assert numpy.array_equal(first.asnumpy(), expected)
    assert not numpy.shares_memory(first.data, second.data)
    assert not numpy.array_equal(second.asnumpy(), expected)


# -- what a call allocates ---------------------------------------------------------------------

def bytes_allocated_by_one_call(net, x):
    """The most memory the compiled program held at once during one call, beyond what it held
    before, as Python's tracemalloc sees it (NumPy reports its arrays' data to it)."""
    net(x).wait_to_read()
    executable = net._compiled.last
    arrays = [x.data] + [p.data for p in executable.param_arrays()]
    executable.runner(*arrays)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        outputs = executable.runner(*arrays)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak - before - sum(out.nbytes for out in outputs)


def test_a_static_alloc_call_allocates_its_outputs_and_nothing_that_grows_with_the_batch():
    """NumPy's ufuncs take scratch buffers of their own where they broadcast or cast (the
    bias add, adding the float32 sum to the float64 mean), of at most NumPy's buffer size
    (8192 values) each: past that they stop growing, whatever the batch. Everything else a
    call allocates is its outputs."""
    extra, batches = {}, (numpy.getbufsize(), 2 * numpy.getbufsize())
    for static_alloc in (False, True):
        for batch in batches:
            net, x, _ = slices_and_sums(batch, static_alloc)
            extra[static_alloc, batch] = bytes_allocated_by_one_call(net, x)
    scratch = 2 * numpy.getbufsize() * 8
    assert all(extra[True, batch] < scratch for batch in batches), extra
    assert abs(extra[True, batches[1]] - extra[True, batches[0]]) < 4096, extra
    # without the flag, the slice's copy and the cast alone take 128 * 4 + 256 * 8 bytes a row
    assert all(extra[False, batch] > batch * (128 * 4 + 256 * 8) for batch in batches), extra


# -- the cache: what a program is keyed on, and when it is compiled again ---------------------

def test_the_same_signature_reuses_the_program():
    net, x, _ = slices_and_sums()
    for _ in range(3):
        net(x).wait_to_read()
    assert net._compiled.compiles == 1 and len(net._compiled.cache) == 1


@pytest.mark.parametrize('change', ['shape', 'dtype', 'recording'])
def test_a_new_shape_dtype_or_recording_is_a_new_entry(change):
    net, x, _ = slices_and_sums()
    net(x).wait_to_read()
    if change == 'shape':
        y = net(np.ones((7, 32)))
    elif change == 'dtype':
        y = net(x.astype('float64'))
    else:
        with autograd.record():
            y = net(x)
    y.wait_to_read()
    assert net._compiled.compiles == 2 and len(net._compiled.cache) == 2
    net(x).wait_to_read()                              # the first entry is still there
    assert net._compiled.compiles == 2


def test_parameters_of_another_dtype_recompile_the_program_in_place():
    """The inputs' signature alone does not say the parameters' dtype: a net cast to float64
    and called with float32 data ran the float32 program (float32 results)."""
    net = nn.HybridSequential()
    net.add(nn.Dense(4, activation='relu'), nn.Dense(2))
    net.initialize()
    x = np.random.normal(size=(3, 5))
    net.hybridize()
    net(x).wait_to_read()
    net.cast('float64')
    compiled = net(x)
    assert compiled.dtype == numpy.float64
    assert net._compiled.compiles == 2 and len(net._compiled.cache) == 1
    net.hybridize(False)
    imperative = net(x)
    assert imperative.dtype == compiled.dtype
    numpy.testing.assert_allclose(compiled.asnumpy(), imperative.asnumpy(), rtol=1e-12)


@pytest.mark.parametrize('replace', ['set_copies', 'set_data'])
def test_new_parameter_arrays_or_values_need_no_new_program(replace):
    net, x, _ = slices_and_sums()
    net(x).wait_to_read()
    weight = net.dense.weight
    if replace == 'set_copies':
        weight.set_copies([weight.data() * 2])
    else:
        weight.set_data(weight.data() * 2)
    compiled = net(x).asnumpy()
    assert net._compiled.compiles == 1
    net.hybridize(False)
    numpy.testing.assert_allclose(compiled, net(x).asnumpy(), rtol=1e-6)


def test_hybridize_again_starts_an_empty_cache():
    net, x, _ = slices_and_sums()
    net(x).wait_to_read()
    net.hybridize(static_alloc=True)
    assert net._compiled.cache == {} and net._compiled.compiles == 0
    net(x).wait_to_read()
    assert net._compiled.compiles == 1


# -- on a GPU: CUDA graphs, with a stand-in for CuPy ----------------------------------------

@pytest.fixture
def stand_in_cupy(monkeypatch):
    fake = fake_cupy.make_module()
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    fake.cuda.Stream(non_blocking=True).use()
    return fake


def dense_program():
    """relu(x w^T + b) with w and b the graph's parameters, for the GPU back end."""
    x, w, b = np.ones((2, 3)), np.ones((4, 3)), np.zeros(4)
    names = {id(w): 'w', id(b): 'b'}
    graph = hybrid.optimize(hybrid.trace(
        lambda data: d2l.npx.relu(d2l.npx.fully_connected(data, w, b)), [x], ['data'],
        lambda array: names.get(id(array))))
    plan = hybrid.plan_memory(graph, static_alloc=True)
    return hybrid_gpu.build_program(graph, plan, d2l.gpu(0)), [a.asnumpy() for a in (x, w, b)]


def test_a_new_parameter_array_means_a_new_capture(stand_in_cupy):
    program, (x, w, b) = dense_program()
    for _ in range(3):
        numpy.testing.assert_allclose(program.runner(x, w, b)[0], numpy.full((2, 4), 3.0))
    replay = program.runner.chosen
    assert program.runner.name == 'CUDA graph' and replay.captures == 1
    w2 = w * 2                                           # a new array: the graph read w's
    numpy.testing.assert_allclose(program.runner(x, w2, b)[0], numpy.full((2, 4), 6.0))
    assert replay.captures == 2
    w2[...] = 3                                          # new values in the same array
    numpy.testing.assert_allclose(program.runner(x, w2, b)[0], numpy.full((2, 4), 9.0))
    assert replay.captures == 2


def test_gpu_programs_with_static_alloc_agree_with_numpy(stand_in_cupy):
    """Under static_alloc a reduction writes into a buffer on a GPU too (CuPy's `out=`); the
    program is not captured, CuPy's reductions may take scratch memory of their own."""
    args = [numpy.arange(12, dtype=numpy.float32).reshape(3, 4)]
    graph = hybrid.optimize(hybrid.trace(lambda x: (x * 2).sum(axis=1) + x[:, 1],
                                         [np.array(a) for a in args]))
    program = hybrid_gpu.build_program(graph, hybrid.plan_memory(graph, static_alloc=True),
                                       d2l.gpu(0))
    expected = hybrid.evaluate(graph, numpy, args)
    for _ in range(2):
        numpy.testing.assert_allclose(program.runner(*args)[0], expected[0])
    assert 'sum(' in program.source and '_op(' not in program.source
    assert program.runner.notes == ['CUDA graph: not captured, sum allocate memory while '
                                    'they run']


@pytest.mark.parametrize('static_alloc', [False, True])
def test_under_static_alloc_a_program_with_slices_and_casts_is_captured(stand_in_cupy,
                                                                       static_alloc):
    """A slice or a cast allocated its result, which kept the program out of a CUDA graph;
    written into a buffer (`copyto`), it is captured and replayed."""
    args = [numpy.arange(12, dtype=numpy.float32).reshape(3, 4)]
    graph = hybrid.optimize(hybrid.trace(
        lambda x: x[:, 1:3].astype('float64') * 2 + 1, [np.array(a) for a in args]))
    plan = hybrid.plan_memory(graph, static_alloc=static_alloc)
    program = hybrid_gpu.build_program(graph, plan, d2l.gpu(0))
    expected = args[0][:, 1:3].astype(numpy.float64) * 2 + 1
    for _ in range(3):
        numpy.testing.assert_array_equal(program.runner(*args)[0], expected)
    if static_alloc:
        assert program.runner.name == 'CUDA graph', program.runner.notes
    else:
        assert program.runner.notes == ['CUDA graph: not captured, astype, getitem allocate '
                                        'memory while they run']


class SoftmaxThenScale(nn.HybridBlock):
    def forward(self, x):
        return (d2l.npx.softmax(x) * 2 + 1).sum(axis=1)


@pytest.mark.parametrize('static_alloc', [False, True])
def test_a_step_written_in_place_of_a_value_its_op_allocated(static_alloc):
    """The scaling overwrites softmax's own array in place: it must be emitted as a step into
    that array, with either plan."""
    net, x = SoftmaxThenScale(), np.random.normal(size=(3, 4))
    expected = net(x).asnumpy()
    net.hybridize(static_alloc=static_alloc)
    numpy.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-6)
    assert len(net.memory_plan().in_place) == 1


@pytest.mark.parametrize('body, words', [
    (lambda x: (x.wait_to_read(), x * 2)[1], 'wait_to_read() needs the value'),
    (lambda x: x.copyto(d2l.cpu(1)), 'copyto(cpu(1)) of the traced value'),
])
def test_what_no_graph_can_hold_is_refused_by_name_when_traced(body, words):
    """A wait or a copy to another device never reaches a compiled program, so none reaches
    a CUDA graph either: the trace refuses it, naming it (an allocation is refused at capture
    time, in the runner's notes: see above)."""
    with pytest.raises(hybrid.TraceError, match=re.escape(words)):
        hybrid.trace(body, [hybrid.Spec((2, 3))])
