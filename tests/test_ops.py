"""Tests of d2lperf.ops: the registry and what its facts let the compiler do.

The values of every op are checked in test_ndarray (infer against compute) and test_autograd
(gradients against finite differences); here, that an op is entered in one place only.
"""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import hybrid, np, npx, ops
from d2lperf.np.multiarray import apply
from d2lperf.ops.rules import same


@pytest.fixture
def cube():
    """An elementwise op with neither a NumPy ufunc nor a C expression, registered for one test."""
    op = ops.defop('cube_for_test', lambda xp, a: a * a * a, same,
                   lambda xp, g, out, a: (3 * g * a * a,), kind='elementwise')
    yield op
    del ops.REGISTRY[op.name]


def test_every_op_has_a_known_kind_and_c_expressions_only_where_fusable():
    assert all(op.kind in ops.OP_KINDS for op in ops.REGISTRY.values())
    for op in ops.REGISTRY.values():
        assert op.c_expr is None or op.kind == 'elementwise'
        assert op.ufunc is None or op.kind in ('elementwise', 'compare')
    assert ops.REGISTRY['relu'].c_expr and ops.REGISTRY['add'].ufunc == 'add'
    assert ops.REGISTRY['matmul'].ufunc is None          # a gufunc, but a contraction


def test_defop_refuses_unknown_kinds_duplicates_and_misplaced_c_expressions():
    with pytest.raises(ValueError, match='kind must be one of'):
        ops.defop('bad_kind_for_test', None, None, kind='fancy')
    with pytest.raises(ValueError, match='already registered'):
        ops.defop('add', None, None)
    with pytest.raises(ValueError, match='only elementwise'):
        ops.defop('bad_c_for_test', None, None, kind='opaque', c_expr='{a}')
    assert not any(name.endswith('_for_test') for name in ops.REGISTRY)


def test_a_new_elementwise_op_needs_only_its_defop(cube):
    """Registered once, it runs imperatively, differentiates, fuses and compiles."""
    x = np.array([[1.0, -2.0], [0.5, 3.0]])
    assert apply(cube.name, x).asnumpy().tolist() == [[1.0, -8.0], [0.125, 27.0]]

    def forward(a):
        return npx.relu(apply(cube.name, a + 1) * 2)
    graph = hybrid.optimize(hybrid.trace(forward, [x]))
    assert [n.op for n in graph.nodes if n.kind == 'fused'] == ['fused']
    assert [m.op for m in graph.nodes[-1].body] == ['add', cube.name, 'multiply', 'relu']
    program = hybrid.generate(graph, hybrid.plan_memory(graph), numpy)
    assert f'{cube.name}_op(xp, ' in program.source       # computed, then stored in place
    expected = numpy.maximum((x.asnumpy() + 1) ** 3 * 2, 0)
    numpy.testing.assert_allclose(program.fn(x.asnumpy())[0], expected)
    x.attach_grad()
    with d2l.autograd.record():
        y = apply(cube.name, x).sum()
    y.backward()
    numpy.testing.assert_allclose(x.grad.asnumpy(), 3 * x.asnumpy() ** 2)

