"""The compiler: tracing, the IR, each pass, memory planning, code generation, autograd,
export and the validating loader. Run: D2LPERF_QUICK=1 pytest -q tests/test_hybrid.py"""
import json
import os
import re
import sys
import zipfile
from unittest import mock

import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import d2lperf as d2l
from d2lperf import autograd, engine, hybrid, np, npx, nn
from d2lperf.hybrid import Spec, TraceError
from d2lperf.hybrid import gpu as hybrid_gpu

from fakes import cupy as fake_cupy
from strategies.nets import build_net, net_specs, program_function, program_inputs, programs

SETTINGS = settings(max_examples=int(os.environ.get('HYBRID_EXAMPLES', 100)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def get_net(widths=(256, 128, 2)):
    net = nn.HybridSequential()
    for i, units in enumerate(widths):
        net.add(nn.Dense(units, activation='relu' if i < len(widths) - 1 else None))
    net.initialize()
    return net


def mlp_and_input(batch=2, features=6):
    np.random.seed(1)
    return get_net((5, 4, 2)), np.random.normal(size=(batch, features))


def fancy_func(a, b, c, d):
    e, f = a + b, c + d
    return e + f


# -- tracing ---------------------------------------------------------------------------------

def test_hybridized_output_equals_imperative():
    net, x = mlp_and_input()
    before = net(x).asnumpy()
    net.hybridize()
    assert numpy.array_equal(net(x).asnumpy(), before)
    assert numpy.array_equal(net(x).asnumpy(), before)


class Printing(nn.HybridBlock):
    def __init__(self):
        super().__init__()
        self.hidden, self.output = nn.Dense(4), nn.Dense(2)

    def forward(self, x):
        print('x:', x)
        return self.output(npx.relu(self.hidden(x)))


def test_every_method_of_an_array_is_a_method_of_a_symbol():
    """A method added to NDArray alone would pass tracing silently as an AttributeError deep in
    a user's forward: Symbol must share it (ArrayMethods) or say why it cannot while tracing."""
    from d2lperf.hybrid.trace import Symbol
    from d2lperf.np.multiarray import ArrayMethods, NDArray
    slots = set(NDArray.__slots__)
    own = {name for name in vars(NDArray) if name not in slots
           and name not in ('__module__', '__doc__', '__slots__', '__init__', '__dict__')}
    assert not set(vars(ArrayMethods)) & own - {'__hash__'}
    assert own - set(vars(Symbol)) == set()
    assert issubclass(Symbol, ArrayMethods)


def test_print_shows_the_symbol_once_per_trace(capsys):
    net = Printing()
    net.initialize()
    x = np.ones((1, 3))
    net(x)
    assert 'x: array(' in capsys.readouterr().out
    net.hybridize()
    net(x)
    assert capsys.readouterr().out == 'x: <Symbol data: float32[1, 3]>\n'
    net(x)
    assert capsys.readouterr().out == ''
    net(np.ones((5, 3)))                               # a new shape traces again
    assert capsys.readouterr().out == 'x: <Symbol data: float32[5, 3]>\n'
    net(np.ones((5, 3), dtype='float64'))              # and so does a new dtype
    assert 'float64[5, 3]' in capsys.readouterr().out
    assert len(net._compiled.cache) == 3


def test_trace_of_a_plain_function_is_a_typed_program():
    graph = hybrid.trace(fancy_func, [Spec(())] * 4)
    text = str(graph)
    assert text.splitlines()[0] == ('graph(%a: float32[], %b: float32[], %c: float32[], '
                                    '%d: float32[]):')
    assert '%add2: float32[] = add(%add0, %add1)' in text
    assert text.splitlines()[-1] == '    return %add2'


@pytest.mark.parametrize('body, words', [
    (lambda x: x.asnumpy(), 'asnumpy() needs the value'),
    (lambda x: x.item(), 'item() needs the value'),
    (lambda x: x if x.sum() > 0 else -x, 'Python control flow'),
    (lambda x: [x for _ in range(int(x.sum()))], 'int() needs the value'),
    (lambda x: float(x.max()), 'float() needs the value'),
])
def test_what_needs_values_cannot_be_traced(body, words):
    with pytest.raises(TraceError, match=re.escape(words)):
        hybrid.trace(body, [Spec((2, 3))])


def in_place_add(x):
    x += 1
    return x


def slice_assign(x):
    x[0] = 1.0
    return x


@pytest.mark.parametrize('body', [in_place_add, slice_assign])
def test_in_place_mutation_is_refused_with_the_functional_form(body):
    with pytest.raises(TraceError, match=r'in-place .* Write `x = x \+ y`'):
        hybrid.trace(body, [Spec((2, 3))])


def test_control_flow_on_shapes_and_np_where_do_trace():
    def forward(x):
        y = x * 2 if x.shape[0] > 1 else x
        return np.where(y > 0, y, 0.1 * y)
    x = np.array([[1.0, -2.0], [3.0, -4.0]])
    graph = hybrid.trace(forward, [x])
    assert [n.op for n in graph.nodes if n.kind == 'call'] == ['multiply', 'greater',
                                                               'multiply', 'where']
    (out,) = hybrid.evaluate(graph, numpy, [x.asnumpy()])
    assert numpy.allclose(out, [[2, -0.4], [6, -0.8]])


def test_forward_must_return_traced_arrays():
    with pytest.raises(TraceError, match='must return arrays'):
        hybrid.trace(lambda x: 3.0, [Spec((2,))])


# -- passes: each preserves results and does its job -------------------------------------------

def traced(fn, *shapes):
    return hybrid.trace(fn, [Spec(s) for s in shapes])


def ops(graph):
    return [n.op for n in graph.nodes if n.kind in ('call', 'fused')]


def test_dead_code_elimination_drops_unused_nodes_only():
    def forward(x):
        unused = x.exp() * 2  # noqa: F841 - dead on purpose
        return npx.relu(x)
    graph = traced(forward, (3,))
    assert ops(graph) == ['exp', 'multiply', 'relu']
    assert ops(hybrid.eliminate_dead_code(graph)) == ['relu']
    assert ops(graph) == ['exp', 'multiply', 'relu']        # passes never change their input


def test_common_subexpressions_are_merged_but_never_random_ops():
    def forward(x):
        mask1 = d2l.np.multiarray.apply('dropout_mask', x, rate=0.5)
        mask2 = d2l.np.multiarray.apply('dropout_mask', x, rate=0.5)
        return (x.exp() + x.exp()) * mask1 * mask2 * 1 * 1.0 * True
    graph = hybrid.eliminate_common_subexpressions(traced(forward, (3,)))
    assert ops(graph).count('exp') == 1
    assert ops(graph).count('dropout_mask') == 2
    assert ops(graph).count('multiply') == 5            # 1, 1.0 and True stay apart


def test_constant_folding_computes_known_values_once():
    graph = hybrid.bind(traced(fancy_func, (), (), (), ()), a=1, b=2, c=3, d=4)
    folded = hybrid.eliminate_dead_code(hybrid.fold_constants(graph))
    assert [n.kind for n in folded.nodes] == ['constant']
    assert folded.nodes[0].value == 10
    assert 'constant(10.0)' in str(folded)


def test_folding_never_folds_random_ops():
    def forward(x, c):
        return x + d2l.np.multiarray.apply('dropout_mask', c * 2, rate=0.5)
    graph = hybrid.bind(traced(forward, (3,), (3,)), c=[1.0, 2.0, 3.0])
    assert ops(hybrid.fold_constants(graph)) == ['dropout_mask', 'add']   # c * 2 is folded


def test_fusion_makes_dot_bias_relu_one_step():
    def forward(x, w, b):
        return npx.relu(np.dot(x, w.T) + b)
    fused = hybrid.optimize(traced(forward, (1, 4), (3, 4), (3,)))
    assert ops(fused) == ['transpose', 'fused']
    assert [m.op for m in fused.nodes[-1].body] == ['dot', 'add', 'relu']


def test_fusion_stops_at_outputs_and_at_values_used_twice():
    graph = hybrid.fuse_elementwise(traced(lambda x: (x.exp(), npx.relu(x.exp() * 2)), (3,)))
    assert ops(graph) == ['exp', 'fused']               # the first exp is an output
    def forward(x):
        y = x.exp()
        return npx.relu(y) + y.exp()
    graph = hybrid.fuse_elementwise(traced(forward, (3,)))
    assert ops(graph) == ['exp', 'exp', 'fused']        # y is read twice: it ends no chain
    assert [m.op for m in graph.nodes[-1].body] == ['relu', 'add']


def test_memory_plan_reuses_dead_buffers_and_writes_in_place():
    def forward(x):
        a = (x * 2).sum(axis=1, keepdims=True)           # owned: sum allocates its result
        b = x * 3 + a                                    # fused, into a buffer
        c = np.dot(b, b.T)                               # b dies here: c cannot overwrite it
        return npx.relu(np.dot(c, c))
    plan = hybrid.plan_memory(hybrid.optimize(traced(forward, (4, 4))))
    kinds = [plan.slots[n].kind for n in plan.graph.nodes if n in plan.slots]
    assert kinds[-1] == 'fresh'
    assert len(plan.buffers) < len([k for k in kinds if k == 'buffer'])   # a buffer is reused
    text = str(plan)
    assert text.startswith('memory plan:') and 'new array per call' in text


def test_in_place_when_the_input_dies():
    graph = hybrid.plan_memory(traced(lambda x: npx.relu(np.dot(x, x) + 1).exp() * 2, (3, 3)))
    assert graph.in_place                                # some step overwrites its input


@SETTINGS
@given(programs)
def test_every_pass_and_the_generated_code_preserve_results(spec):
    fn, args = program_function(spec), program_inputs(spec)
    graph = hybrid.trace(fn, [np.array(a) for a in args])
    expected = hybrid.evaluate(graph, numpy, args)
    stages = [hybrid.fold_constants, hybrid.eliminate_common_subexpressions,
              hybrid.eliminate_dead_code, hybrid.fuse_elementwise]
    for stage in stages:                                 # each pass alone
        close(hybrid.evaluate(stage(graph), numpy, args), expected)
    for stage in stages:                                 # and all of them, in order
        graph = stage(graph)
        close(hybrid.evaluate(graph, numpy, args), expected)
    program = hybrid.generate(graph, hybrid.plan_memory(graph), numpy)
    for _ in range(2):                                   # buffers are reused across calls
        close(program.fn(*args), expected)


def close(results, expected):
    assert len(results) == len(expected)
    for r, e in zip(results, expected):
        assert r.shape == e.shape and r.dtype == e.dtype
        numpy.testing.assert_allclose(r, e, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_generated_code_calls_numpy_with_out_buffers():
    net, x = mlp_and_input(batch=1)
    net.hybridize()
    net(x)
    code = net.generated_code()
    assert 'matmul(x0, p0.T, out=buf0)' in code and 'maximum(buf0, 0, out=buf0)' in code
    assert code.count('empty(') == 1                     # only the output is allocated per call


def test_outputs_are_fresh_arrays_each_call():
    net, x = mlp_and_input()
    net.hybridize()
    first = net(x)
    expected = first.asnumpy()
    second = net(x * 2)
    net(x * 3).wait_to_read()
    assert numpy.array_equal(first.asnumpy(), expected)
    assert not numpy.array_equal(second.asnumpy(), expected)


def test_a_hybridized_call_is_one_engine_operation():
    net, x = mlp_and_input()
    net.hybridize()
    net(x).wait_to_read()
    with d2l.profiler.profile() as records:
        net(x)
    assert [r.name for r in records] == ['HybridSequential']


def test_one_slow_run_does_not_send_the_next_call_to_the_lane():
    """A program short in one of its last two runs runs on the caller (`push_short`): one run
    slowed down by the machine changes nothing, two in a row send calls to the lane. The
    program's clock is a fake one, so the test reads the rule and not the machine's load."""
    short = hybrid.runtime.SHORT_SECONDS
    clock = {'now': 0.0, 'a run takes': short / 10}

    def tick():                    # read at a run's start and end: it takes what is set
        clock['now'] += clock['a run takes']
        return clock['now']
    net, x = mlp_and_input()
    net.hybridize()
    with mock.patch.object(hybrid.runtime, 'perf_counter', tick):
        net(x).wait_to_read()
        net(x).wait_to_read()
        executable = net._compiled.last
        assert executable.seconds < short
        executable.last_seconds = 2 * short             # as if the last run had stalled
        net(x).wait_to_read()
        assert executable.seconds < short
        clock['a run takes'] = 4 * short
        net(x).wait_to_read()
        assert executable.seconds < short               # one slow run
        net(x).wait_to_read()
        assert executable.seconds >= short              # two: the next call goes to the lane


def test_naive_engine_runs_compiled_code_too():
    net, x = mlp_and_input()
    expected = net(x).asnumpy()
    engine.use('naive')
    try:
        net.hybridize()
        assert numpy.array_equal(net(x).asnumpy(), expected)
    finally:
        engine.use('threaded')


def test_nested_hybrid_blocks_and_plain_blocks():
    outer = nn.Sequential()                              # plain: its children compile alone
    inner = get_net((3, 2))
    outer.add(inner, nn.Dense(2))
    outer.initialize()
    x = np.ones((2, 4))
    expected = outer(x).asnumpy()
    outer.hybridize()
    assert numpy.allclose(outer(x).asnumpy(), expected)
    assert inner._compiled is not None and outer[1]._compiled is not None


def test_hybridize_before_the_first_call_infers_deferred_shapes():
    np.random.seed(3)
    net = get_net((4, 2)).hybridize()
    x = np.ones((3, 5))
    y = net(x)
    assert y.shape == (3, 2) and net[0].weight.shape == (4, 5)
    net.hybridize(False)
    numpy.testing.assert_allclose(net(x).asnumpy(), y.asnumpy(), rtol=1e-6)


def test_reinitialized_parameters_are_picked_up():
    net, x = mlp_and_input()
    net.hybridize()
    before = net(x).asnumpy()
    net.initialize(force_reinit=True)
    after = net(x).asnumpy()
    assert not numpy.allclose(before, after)
    net.hybridize(False)
    numpy.testing.assert_allclose(net(x).asnumpy(), after, rtol=1e-6)


@pytest.mark.parametrize('replace', ['set_copies', 'set_data', 'cast'])
def test_parameters_given_new_arrays_or_values_are_seen_by_the_next_call(replace):
    """Compiled code keeps the arrays it read until a parameter gets new ones
    (`Parameter.replacements`); values written in place need no new read at all."""
    net, x = mlp_and_input()
    net.hybridize()
    net(x).wait_to_read()
    weight = net[0].weight
    if replace == 'set_copies':
        weight.set_copies([weight.data() * 2])
    elif replace == 'set_data':
        weight.set_data(weight.data() * 2)
    else:
        net.cast('float64')
        x = x.astype('float64')
    compiled = net(x).asnumpy()
    net.hybridize(False)
    numpy.testing.assert_allclose(compiled, net(x).asnumpy(), rtol=1e-6)


class TwoInTwoOut(nn.HybridBlock):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(3)

    def forward(self, a, b):
        h = self.dense(a) + b
        return h, h.sum(axis=1)


def test_several_inputs_and_outputs():
    net = TwoInTwoOut()
    net.initialize()
    a, b = np.ones((2, 4)), np.ones((2, 3))
    expected = [y.asnumpy() for y in net(a, b)]
    net.hybridize()
    outputs = net(a, b)
    assert isinstance(outputs, tuple) and len(outputs) == 2
    for y, e in zip(outputs, expected):
        numpy.testing.assert_allclose(y.asnumpy(), e, rtol=1e-6)
    assert '%data0' in str(net.traced_graph()) and '%data1' in str(net.traced_graph())


def test_each_device_gets_its_own_compiled_program():
    net = get_net((3, 2))
    net.initialize(device=[d2l.cpu(0), d2l.cpu(1)], force_reinit=True)
    net.hybridize()
    x0, x1 = np.ones((2, 4), device=d2l.cpu(0)), np.ones((2, 4), device=d2l.cpu(1))
    y0, y1 = net(x0), net(x1)
    assert y1.device == d2l.cpu(1) and len(net._compiled.cache) == 2
    numpy.testing.assert_allclose(y0.asnumpy(), y1.asnumpy(), rtol=1e-6)


# -- random networks: hybridized == imperative, values and gradients ---------------------------

def forward_and_grads(net, x):
    with autograd.record():
        y = net(x)
        loss = (y * y).sum()
    loss.backward()
    return y.asnumpy(), [p.grad().asnumpy() for p in net.collect_params().values()]


@SETTINGS
@given(net_specs)
def test_random_nets_same_outputs_and_gradients_hybridized(spec):
    net = build_net(spec)
    x = np.random.normal(size=(spec['batch'], spec['features']))
    expected = net(x).asnumpy()
    y0, grads0 = forward_and_grads(net, x)
    net.hybridize()
    numpy.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-5, atol=1e-6)
    y1, grads1 = forward_and_grads(net, x)
    numpy.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
    for g0, g1 in zip(grads0, grads1):
        numpy.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-6)


def test_training_a_hybridized_net_matches_the_imperative_one():
    losses = []
    for hybridize in (False, True):
        net, x = mlp_and_input(batch=8)
        label = np.ones((8, 2))
        net.hybridize(hybridize)
        trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
        loss = nn.L2Loss()
        for _ in range(3):
            with autograd.record():
                value = loss(net(x), label)
            value.backward()
            trainer.step(8)
        losses.append(value.asnumpy())
    numpy.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_dropout_is_random_while_training_and_identity_otherwise():
    net = nn.HybridSequential()
    net.add(nn.Dropout(0.5))
    net.hybridize()
    x = np.ones((4, 100))
    assert numpy.array_equal(net(x).asnumpy(), x.asnumpy())
    x.attach_grad()
    with autograd.record():
        y = net(x)
    values = set(numpy.unique(y.asnumpy()).tolist())
    assert values == {0.0, 2.0}
    y.backward()
    assert numpy.array_equal(x.grad.asnumpy(), y.asnumpy())   # d(x * mask)/dx = mask


# -- export and import -------------------------------------------------------------------------

def exported(tmp_path, net=None, x=None):
    if net is None:
        net, x = mlp_and_input()
    net.hybridize()
    y = net(x)
    files = net.export(str(tmp_path / 'models' / 'my_mlp'))
    return net, x, y, files


def test_export_writes_the_two_files(tmp_path):
    _, _, _, (symbol, params) = exported(tmp_path)
    assert symbol.endswith('models/my_mlp-symbol.json') and params.endswith('my_mlp-0000.params')
    document = json.loads(open(symbol).read())
    assert document['format_version'] == hybrid.FORMAT_VERSION
    assert document['nodes'][0] == {'op': 'null', 'name': 'data', 'kind': 'input', 'inputs': [],
                                    'shape': [2, 6], 'dtype': 'float32'}
    assert {'arg_nodes', 'heads'} <= set(document)
    with numpy.load(params, allow_pickle=False) as arrays:
        assert sorted(arrays.files) == sorted(n['name'] for n in document['nodes']
                                              if n['op'] == 'null' and n['kind'] == 'param')
    assert [p for p in os.listdir(tmp_path / 'models') if p.startswith('.')] == []


def test_export_refuses_a_block_that_was_not_traced(tmp_path):
    net, x = mlp_and_input()
    net(x)
    with pytest.raises(RuntimeError, match='hybridize'):
        net.export(str(tmp_path / 'm'))
    net.hybridize()
    with pytest.raises(RuntimeError, match='run it once'):
        net.export(str(tmp_path / 'm'))


def test_imports_rebuilds_a_block_with_identical_outputs(tmp_path):
    _, x, y, (symbol, params) = exported(tmp_path)
    block = nn.SymbolBlock.imports(symbol, ['data'], params, device=d2l.cpu())
    assert numpy.array_equal(block(x).asnumpy(), y.asnumpy())
    assert block(np.ones((7, 6))).shape == (7, 2)                 # another batch size
    assert sorted(block.collect_params()) == sorted(mlp_and_input()[0].collect_params())


@settings(max_examples=10, deadline=None)
@given(net_specs)
def test_export_import_round_trip_on_random_nets(tmp_path_factory, spec):
    net = build_net(spec)
    x = np.random.normal(size=(spec['batch'], spec['features']))
    _, _, y, files = exported(tmp_path_factory.mktemp('m'), net, x)
    block = nn.SymbolBlock.imports(files[0], ['data'], files[1])
    assert numpy.array_equal(block(x).asnumpy(), y.asnumpy())


def test_export_is_atomic(tmp_path, monkeypatch):
    _, x, _, (symbol, params) = exported(tmp_path)
    before = open(params, 'rb').read()
    net, _ = mlp_and_input()
    net.hybridize()
    net(x)

    def crash(file, arrays):
        file.write(b'half a file')
        raise KeyboardInterrupt('power cut')
    monkeypatch.setattr(hybrid.serialize, 'write_npz', crash)
    with pytest.raises(KeyboardInterrupt):
        net.export(str(tmp_path / 'models' / 'my_mlp'))
    assert open(params, 'rb').read() == before
    assert sorted(os.listdir(tmp_path / 'models')) == ['my_mlp-0000.params', 'my_mlp-symbol.json']


# -- the loader trusts nothing --------------------------------------------------------------------

def rewrite(symbol, change):
    document = json.loads(open(symbol).read())
    change(document)
    with open(symbol, 'w') as file:
        json.dump(document, file)


def node_named(document, name):
    return next(n for n in document['nodes'] if n['name'] == name)


def set_op(name, op):
    return lambda d: node_named(d, name).update(op=op)


HOSTILE_SYMBOLS = {
    'unknown op': (set_op('relu0', 'os.system'), 'unknown op'),
    'fused op': (set_op('relu0', 'fused'), 'unknown op'),
    'newer format': (lambda d: d.update(format_version=99), 'newer d2lperf'),
    'not our format': (lambda d: d.pop('format'), 'not a d2lperf symbol file'),
    'string attribute': (lambda d: node_named(d, 'relu0').update(
        attrs={'axis': "__import__('os')"}), 'attributes'),
    'code in attribute': (lambda d: node_named(d, 'fully_connected0').update(
        attrs={'dtype': "float32'); import os; ('"}), 'attributes'),
    'later input': (lambda d: node_named(d, 'relu0').update(inputs=[7]), 'earlier node'),
    'self input': (lambda d: node_named(d, 'relu0').update(inputs=[4]), 'earlier node'),
    'wrong declared shape': (lambda d: node_named(d, 'relu0').update(shape=[2, 9]), 'declares'),
    'name with a newline': (lambda d: node_named(d, 'relu0').update(name='x\nimport os'),
                            'plain name'),
    'bad dtype': (lambda d: node_named(d, 'relu0').update(dtype='object'), 'dtype'),
    'huge shape': (lambda d: node_named(d, 'data').update(shape=[2**40, 2**40]), 'elements'),
    'no heads': (lambda d: d.update(heads=[]), 'heads'),
    'null with inputs': (lambda d: node_named(d, '0.weight').update(inputs=[0]), 'argument'),
    'duplicate names': (lambda d: node_named(d, 'relu0').update(name='data'), 'two nodes'),
    'scalar object': (lambda d: node_named(d, 'relu0').update(inputs=[{'scalar': 'x'}]),
                      'earlier node'),
}


@pytest.mark.parametrize('case', sorted(HOSTILE_SYMBOLS))
def test_hostile_symbol_files_are_rejected(tmp_path, case):
    change, words = HOSTILE_SYMBOLS[case]
    _, _, _, (symbol, params) = exported(tmp_path)
    rewrite(symbol, change)
    with pytest.raises(ValueError, match=words):
        nn.SymbolBlock.imports(symbol, ['data'], params)


@pytest.mark.parametrize('text, words', [
    ('{"format": "d2lperf-symbol", "nodes": [', 'not valid JSON'),
    ('[' * 100000 + ']' * 100000, 'not valid JSON|not a d2lperf'),
    ('\xff\xfe', 'not valid JSON'),
])
def test_bad_json_is_a_value_error(tmp_path, text, words):
    _, _, _, (symbol, params) = exported(tmp_path)
    with open(symbol, 'w', encoding='latin-1') as file:
        file.write(text)
    with pytest.raises(ValueError, match=words):
        nn.SymbolBlock.imports(symbol, ['data'], params)


def test_unknown_input_name_is_rejected(tmp_path):
    _, _, _, (symbol, params) = exported(tmp_path)
    with pytest.raises(ValueError, match='no argument node named'):
        nn.SymbolBlock.imports(symbol, ['image'], params)


def write_arrays(path, arrays, pickle=False):
    with zipfile.ZipFile(path, 'w') as archive:
        for name, value in arrays.items():
            with archive.open(f'{name}.npy', 'w') as member:
                numpy.lib.format.write_array(member, value, allow_pickle=pickle)


@pytest.mark.parametrize('case, words', [
    ('missing', 'missing parameter'), ('wrong shape', 'has shape'),
    ('wrong dtype', 'float64 in the file'), ('extra', 'no node uses'),
    ('pickle', 'not a readable parameter file'), ('truncated', 'not a readable'),
    ('npy', 'not an .npz'),
])
def test_bad_parameter_files_are_rejected(tmp_path, case, words):
    _, _, _, (symbol, params) = exported(tmp_path)
    with numpy.load(params, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    if case == 'missing':
        arrays.pop('1.weight')
    elif case == 'wrong shape':
        arrays['1.weight'] = arrays['1.weight'][:2]
    elif case == 'wrong dtype':
        arrays['1.weight'] = arrays['1.weight'].astype('float64')
    elif case == 'extra':
        arrays['surprise'] = numpy.zeros(3)
    elif case == 'pickle':
        arrays['1.weight'] = numpy.array([{'a': 1}], dtype=object)
    if case == 'truncated':
        data = open(params, 'rb').read()
        open(params, 'wb').write(data[:len(data) // 2])
    elif case == 'npy':
        numpy.save(open(params, 'wb'), arrays['0.bias'])
    else:
        write_arrays(params, arrays, pickle=case == 'pickle')
    with pytest.raises(ValueError, match=words):
        nn.SymbolBlock.imports(symbol, ['data'], params)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 30) | st.floats()
                           | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=6)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_symbol_files_load_cleanly_or_raise_value_error(tmp_path, data):
    path = tmp_path / 'fuzz'
    path.mkdir(exist_ok=True)
    net, x = mlp_and_input()
    _, _, _, (symbol, params) = exported(path, net, x)
    document = json.loads(open(symbol).read())
    entry = data.draw(st.sampled_from(document['nodes']))
    key = data.draw(st.sampled_from(['op', 'name', 'attrs', 'inputs', 'shape', 'dtype', 'kind']))
    entry[key] = data.draw(json_values)
    with open(symbol, 'w') as file:
        json.dump(document, file)
    try:
        block = nn.SymbolBlock.imports(symbol, ['data'], params)
    except ValueError:
        return
    block(x).wait_to_read()


# -- the GPU code path, run by NumPy standing in for CuPy ---------------------------------

@pytest.fixture
def stand_in_cupy(monkeypatch):
    """`import cupy` finds tests/fakes/cupy.py; this thread computes on a stream of its own
    (a CUDA graph cannot capture the legacy default stream)."""
    fake = fake_cupy.make_module()
    monkeypatch.setitem(sys.modules, 'cupy', fake)
    fake.cuda.Stream(non_blocking=True).use()
    return fake


def test_gpu_code_generation_with_a_stand_in_for_cupy(stand_in_cupy):

    def forward(x, w1, b1, w2, b2, r):
        h = npx.relu(npx.fully_connected(x, w1, b1))
        h = np.tanh(npx.fully_connected(h, w2, b2) + r)
        return npx.sigmoid(h * 2 - 1) + 0.5
    rng = numpy.random.default_rng(0)
    args = [rng.normal(size=s).astype(numpy.float32)
            for s in [(3, 5), (4, 5), (4,), (2, 4), (2,), (3, 2)]]
    graph = hybrid.optimize(hybrid.trace(forward, [np.array(a) for a in args]))
    program = hybrid_gpu.build_program(graph, hybrid.plan_memory(graph), d2l.gpu(0))
    assert len(program.kernels) == 2 and 'd2lperf_dense' in str(program)
    expected = hybrid.evaluate(graph, numpy, args)
    for _ in range(3):
        close(program.runner(*args), expected)
    assert program.runner.name == 'CUDA graph', program.runner.notes
    close(program.fn(*args), expected)                   # the fused kernels, without the graph


def test_gpu_large_batches_use_cublas_and_no_graph(stand_in_cupy):
    args = [numpy.ones((100, 3), numpy.float32), numpy.ones((4, 3), numpy.float32),
            numpy.zeros(4, numpy.float32)]
    graph = hybrid.optimize(hybrid.trace(lambda x, w, b: npx.relu(npx.fully_connected(x, w, b)),
                                         [np.array(a) for a in args]))
    program = hybrid_gpu.build_program(graph, hybrid.plan_memory(graph), d2l.gpu(0))
    close(program.runner(*args), [numpy.full((100, 4), 3, numpy.float32)])
    assert program.runner.name == 'fused kernels'
    assert 'cuBLAS' in program.runner.notes[0]


@SETTINGS
@given(programs)
def test_gpu_kernels_preserve_results_on_random_programs(spec):
    fake = fake_cupy.make_module()
    with mock.patch.dict(sys.modules, {'cupy': fake}):
        fake.cuda.Stream(non_blocking=True).use()
        fn, args = program_function(spec), program_inputs(spec)
        graph = hybrid.optimize(hybrid.trace(fn, [np.array(a) for a in args]))
        expected = hybrid.evaluate(graph, numpy, args)
        program = hybrid_gpu.build_program(graph, hybrid.plan_memory(graph), d2l.gpu(0))
        close(program.fn(*args), expected)
        close(program.runner(*args), expected)
        close(program.runner(*args), expected)
        assert all('cuBLAS' in note or 'allocate' in note for note in program.runner.notes), \
            program.runner.notes


@pytest.mark.skipif(d2l.num_gpus() == 0, reason='needs a GPU and CuPy')
def test_on_a_real_gpu_fused_kernels_and_cuda_graphs_agree_with_imperative():
    device = d2l.gpu(0)
    for batch in (1, 256):
        net = get_net()
        net.initialize(device=device, force_reinit=True)
        x = np.random.normal(size=(batch, 512), device=device)
        expected = net(x).asnumpy()
        net.hybridize()
        for _ in range(3):
            numpy.testing.assert_allclose(net(x).asnumpy(), expected, rtol=1e-4, atol=1e-5)
        runner = net._compiled.last.runner
        if batch == 1:
            # CuPy versions that refuse cuBLAS inside a stream capture (CuPy 14 on CUDA 13
            # does) leave the fused kernels; the note must say so.
            refused = any('during stream capture' in note for note in runner.notes)
            assert runner.name == ('fused kernels' if refused else 'CUDA graph'), runner.notes
        else:
            assert runner.name == 'fused kernels', runner.notes


class SlicesItsParameter(nn.HybridBlock):
    """A forward that computes from a parameter alone (`w[:n]`, `(w * 2).sum()`) before it
    meets the input: the compiler must trace that too, not fold it into a constant."""

    def __init__(self):
        super().__init__()
        self.w = d2l.nn.Parameter('w', (5, 3))

    def forward(self, x):
        return x * self.w.data()[:x.shape[0]] + (self.w.data() * 2).sum()


@pytest.mark.parametrize('hybridize', [False, True])
def test_what_a_forward_computes_from_a_parameter_alone_follows_the_parameter(hybridize):
    np.random.seed(0)
    block = SlicesItsParameter()
    block.initialize(init=d2l.nn.init.Normal(1.0))
    if hybridize:
        block.hybridize()
    x = np.ones((4, 3))
    with autograd.record():
        loss = block(x).sum()
    loss.backward()
    expected = numpy.full((5, 3), 24.0)         # 2 from the sum, for each of the 12 outputs
    expected[:4] += 1.0                           # and x from the slice
    numpy.testing.assert_allclose(block.w.grad().asnumpy(), expected)
    block.w.data()[:] = block.w.data() + 1        # a new value: the compiled code must see it
    w = block.w.data().asnumpy()
    numpy.testing.assert_allclose(block(x).asnumpy(), w[:4] + 2 * w.sum(), rtol=1e-5)
