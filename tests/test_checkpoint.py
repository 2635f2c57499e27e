"""`autograd.checkpoint` with a parameter used in several checkpointed segments (a layer applied
again, weights tied): its gradient is the sum over every use, bit for bit the plain one."""
import numpy
import pytest
from hypothesis import given

from d2lperf import autograd, nn, np
from strategies import checks
from strategies.nets import tied_programs

pytestmark = pytest.mark.usefixtures('fresh_engine')


def dense_and_input():
    layer = nn.Dense(4, in_units=4, activation='relu')
    np.random.seed(0)
    layer.initialize(init=nn.init.Normal(sigma=0.5))
    x = np.random.normal(0, 1, size=(3, 4))
    return layer, x


def segments(layer, count, uses):
    """`count` checkpointed segments, each applying the layer `uses` times (once: the layer
    itself is the segment's block)."""
    def segment(x):
        for _ in range(uses):
            x = layer(x)
        return x
    block = layer if uses == 1 else segment
    return [lambda x: autograd.checkpoint(block, x)] * count


def gradients(layer, x, calls):
    x.attach_grad()
    with autograd.record():
        out = x
        for call in calls:
            out = call(out)
        loss = (out * out).sum()
    loss.backward()
    return {name: p.grad().asnumpy() for name, p in layer.collect_params().items()} | {
        'x': x.grad.asnumpy()}


@pytest.mark.parametrize('count, uses', [(2, 1), (3, 1), (2, 2)])
def test_a_parameter_in_several_segments_gets_the_sum_of_its_uses(engine_kind, count, uses):
    layer, x = dense_and_input()
    plain = gradients(layer, x, [layer] * (count * uses))
    again = gradients(layer, x, segments(layer, count, uses))
    for name in plain:
        numpy.testing.assert_array_equal(again[name], plain[name], err_msg=name)


@pytest.mark.parametrize('plain_first', [True, False])
def test_a_parameter_in_a_segment_and_outside_gets_the_sum_of_its_uses(plain_first):
    """The segment's walk and the walk around it each reach the parameter: the second adds."""
    layer, x = dense_and_input()
    inside = segments(layer, 1, 1)
    plain = gradients(layer, x, [layer, layer])
    again = gradients(layer, x, [layer] + inside if plain_first else inside + [layer])
    for name in plain:
        numpy.testing.assert_array_equal(again[name], plain[name], err_msg=name)


@pytest.mark.parametrize('calls', [[0, 1], [1, 0], [1, 1]])
def test_grad_req_add_accumulates_over_passes_with_checkpoints(calls):
    """With grad_req 'add', each backward pass adds the sum of all the parameter's uses (in
    segments or not) to what `.grad` held: two passes give twice one."""
    layer, x = dense_and_input()
    inside = segments(layer, 1, 1)[0]
    chain = [inside if checkpointed else layer for checkpointed in calls]
    once = gradients(layer, x, chain)
    for param in layer.collect_params().values():
        param.grad_req = 'add'
    gradients(layer, x, chain)
    twice = {name: p.grad().asnumpy() for name, p in layer.collect_params().items()}
    for name, g in twice.items():
        numpy.testing.assert_allclose(g, 2 * once[name], rtol=1e-6, err_msg=name)


@checks(max_examples=25)
@given(program=tied_programs)
def test_tied_layers_in_any_segments_get_the_plain_gradients(program):
    """Three layers of one width, called in any order, any number of times each, and the calls
    cut into checkpointed segments anywhere: every gradient equals the plain one, bit for bit."""
    width, calls = program['width'], program['calls']
    np.random.seed(program['seed'])
    layers = [nn.Dense(width, in_units=width, activation='tanh') for _ in range(3)]
    for layer in layers:
        layer.initialize(init=nn.init.Normal(sigma=0.5))
    x = np.random.normal(0, 1, size=(program['batch'], width))
    bounds = [0] + sorted(c for c in program['cuts'] if c < len(calls)) + [len(calls)]
    runs = [[layers[i] for i in calls[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]

    def run(chain):
        def block(h):
            for layer in chain:
                h = layer(h)
            return h
        return block

    def found(checkpointed):
        x.attach_grad()
        with autograd.record():
            out = x
            for chain in runs:
                out = autograd.checkpoint(run(chain), out) if checkpointed else run(chain)(out)
            loss = (out * out).sum()
        loss.backward()
        return [p.grad().asnumpy() for layer in layers for p in layer.collect_params().values()
                if p.grad() is not None] + [x.grad.asnumpy()]
    for again, plain in zip(found(True), found(False)):
        numpy.testing.assert_array_equal(again, plain)
