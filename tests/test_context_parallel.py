"""Context parallelism (model_parallel/context.py): attention with the sequence split over
devices, by the ring and by the all-gather, in both layouts, equal to one device forward and
backward; the work each device does under the causal mask, counted; the bytes the ring and the
all-gather move, read from the engine's records against their formulas."""
from fractions import Fraction

import numpy
import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, comm, np, npx, profiler
from d2lperf.model_parallel import context, predict

from strategies import checks
from strategies.comm import context_parallel_problems
from test_attention import output_and_gradients, relative_error
import model_parallel_helpers as helpers
from model_parallel_helpers import HEADS, HIDDEN, SEQ, VOCAB, devices as devices_from, gpt
from d2lperf.model_parallel import tensor_parallel
from d2lperf.model_parallel.layers import TensorGroup

pytestmark = pytest.mark.chapter('model_parallelism')

LAYOUTS, ALGORITHMS = ['zigzag', 'contiguous'], ['ring', 'all_gather']


def devices(c):
    return devices_from(c, first=0)



def assert_equals_one_device(shape, group, layout, algorithm, causal, seed=0):
    rng = numpy.random.default_rng(seed)
    values = [rng.normal(size=shape).astype(numpy.float32) for _ in range(3)]
    weights = rng.normal(size=shape).astype(numpy.float32)
    want = output_and_gradients(lambda q, k, v: npx.attention(q, k, v, causal=causal),
                                values, weights)
    got = output_and_gradients(
        lambda q, k, v: d2l.model_parallel.context_parallel_attention(
            q, k, v, group, causal=causal, layout=layout, algorithm=algorithm),
        values, weights)
    for name, a, b in zip(['out', 'dq', 'dk', 'dv'], got, want):
        assert a.dtype == numpy.float32
        error = relative_error(a, b) * numpy.abs(b).max() / max(numpy.abs(b).max(), CANCELLED)
        assert error < 1e-5, (name, relative_error(a, b))


# A gradient that cancels to almost nothing (two keys of nearly one score: dq ≈ 0) keeps the
# float32 rounding of its terms, whose size is that of the values (about 1): its error is
# measured against a tenth of that rather than against its own tiny largest value.
CANCELLED = 0.1


# -- equal to one device, forward and backward -------------------------------------------------

@pytest.mark.parametrize('c', [2, 4, 8])
@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('algorithm', ALGORITHMS)
@pytest.mark.parametrize('causal', [True, False])
def test_equals_one_device_forward_and_backward(c, layout, algorithm, causal):
    assert_equals_one_device((2, 2, 32, 8), devices(c), layout, algorithm, causal)


@pytest.mark.parametrize('c', [2, 4, 8])
@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('causal', [True, False])
def test_ulysses_equals_one_device_forward_and_backward(c, layout, causal):
    assert_equals_one_device((1, 8, 32, 4), devices(c), layout, 'ulysses', causal)


@checks(20)
@given(problem=context_parallel_problems(), seed=st.integers(0, 2 ** 16))
def test_any_split_equals_one_device(problem, seed):
    assert_equals_one_device(*problem, seed=seed)


@pytest.mark.parametrize('algorithm', context.ALGORITHMS)
def test_under_either_engine(engine_kind, algorithm):
    assert_equals_one_device((1, 4, 16, 4), devices(4), 'zigzag', algorithm, True)


@pytest.mark.parametrize('algorithm', context.ALGORITHMS)
def test_on_fake_gpus_the_sends_take_the_cupy_paths(fake_gpus, algorithm):
    """From the host to the GPUs, between them, and back."""
    assert_equals_one_device((1, 2, 16, 4), [d2l.gpu(0), d2l.gpu(1)], 'zigzag', algorithm,
                             True)


@pytest.mark.skipif(not d2l.num_gpus(), reason='needs a GPU and CuPy')
def test_on_the_gpus_here():
    group = d2l.try_all_gpus()
    assert_equals_one_device((1, 4 * len(group), 16 * len(group), 8), group, 'zigzag', 'ring',
                             True)


def test_the_output_comes_back_to_qs_device_in_qs_dtype():
    q = np.array(numpy.ones((1, 1, 8, 2), numpy.float32), device=d2l.cpu(3))
    out = d2l.model_parallel.context_parallel_attention(q, q, q, devices(2))
    assert out.device == d2l.cpu(3) and out.dtype == numpy.float32
    numpy.testing.assert_allclose(out.asnumpy(), 1, rtol=1e-6)


@pytest.mark.parametrize('kwargs, words', [
    ({'layout': 'striped'}, "unknown layout='striped'"),
    ({'algorithm': 'striped'}, "unknown algorithm='striped'"),
    ({'seq': 12}, 'a sequence of 12 does not cut into 8 equal chunks'),
    ({'group': []}, 'at least one device'),
    ({'algorithm': 'ulysses', 'group': devices(3), 'seq': 12},
     'Ulysses splits the 4 heads over 3 devices'),
])
def test_bad_input_is_refused_by_name(kwargs, words):
    q = np.ones((1, 4, kwargs.pop('seq', 16), 2))
    with pytest.raises(ValueError, match=words):
        d2l.model_parallel.context_parallel_attention(q, q, q, kwargs.pop('group', devices(4)),
                                                      **kwargs)


# -- the work each device does ------------------------------------------------------------------

@pytest.mark.parametrize('c, ratio', [(2, 1.5), (4, 1.75), (8, 1.875)])
def test_contiguous_shards_give_the_last_device_2_minus_1_over_c_of_the_mean(c, ratio):
    work = context.counted_work(c, 'contiguous')
    assert context.imbalance(work) == ratio == 2 - 1 / c
    assert max(work) == work[-1]


@checks(100)                    # no deadline: a busy machine's timing fails nothing here
@given(c=st.integers(1, 64))
def test_for_any_c_contiguous_is_2_minus_1_over_c_and_the_zigzag_even(c):
    assert context.imbalance(context.counted_work(c, 'contiguous')) == 2 - Fraction(1, c)
    assert context.imbalance(context.counted_work(c, 'zigzag')) == 1


@pytest.mark.parametrize('c', [1, 2, 3, 4, 8, 16])
def test_the_zigzag_balances_the_causal_mask(c):
    work = context.counted_work(c, 'zigzag')
    assert context.imbalance(work) <= 1.05
    assert sum(work) == sum(context.counted_work(c, 'contiguous')) == 0.5   # half the scores


@pytest.mark.parametrize('layout', LAYOUTS)
def test_without_a_mask_every_device_computes_its_share_of_every_score(layout):
    assert context.counted_work(4, layout, causal=False) == [0.25] * 4


@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('algorithm', ALGORITHMS)
def test_each_device_runs_the_blocks_that_are_counted(layout, algorithm):
    """The count is of what runs: each device's compute lane runs one attention a block."""
    c, group = 4, devices(4)
    q = np.ones((1, 1, 32, 2))
    npx.waitall()
    with profiler.profile() as records:
        d2l.model_parallel.context_parallel_attention(q, q, q, group, layout=layout,
                                                      algorithm=algorithm)
        npx.waitall()
    for rank, device in enumerate(group):
        ran = [r for r in records if r.name == 'attention' and r.worker == f'{device} compute']
        assert len(ran) == len(context.attention_blocks(rank, c, layout))
    busy = context.busy_per_device(records, group)
    assert len(busy) == c and all(b > 0 for b in busy)


# -- the bytes that move, from the records ------------------------------------------------------

def profiled_sends(shape, group, layout, algorithm, backward=True, causal=True):
    """The sends of one forward (and backward) pass, from the engine's records."""
    q = np.array(numpy.random.default_rng(0).normal(size=shape).astype(numpy.float32))
    q.attach_grad()
    npx.waitall()
    with profiler.profile() as records:
        with autograd.record():
            out = d2l.model_parallel.context_parallel_attention(
                q, q, q, group, causal=causal, layout=layout, algorithm=algorithm)
        if backward:
            out.backward()
        npx.waitall()
    return [t for t in comm.transfers_in(records) if t['action'] == 'send']


def ring_sends(c, layout, causal, phase):
    """{(step, source): (bytes, targets)} of the ring's sends in one phase."""
    sends = profiled_sends((2, 3, 32, 4), devices(c), layout, 'ring', causal=causal)
    found = {}
    for t in sends:
        if t['algorithm'] == 'ring attention' and t['phase'] == phase:
            sent, targets = found.get((t['step'], t['source']), (0, set()))
            found[t['step'], t['source']] = sent + t['bytes'], targets | {t['target']}
    return found


@pytest.mark.parametrize('c', [2, 4, 8])
@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('causal', [True, False])
def test_each_step_of_the_ring_sends_its_formula_to_the_next_device(c, layout, causal):
    group, per_step = devices(c), context.ring_bytes_per_step((2, 3, 32, 4), c)
    assert per_step == 2 * 2 * 3 * (32 // c) * 4 * 4          # keys and values, float32
    assert ring_sends(c, layout, causal, 'forward') == {
        (step, device): (per_step, {group[(rank + 1) % c]})
        for step in range(1, c) for rank, device in enumerate(group)}


@pytest.mark.parametrize('c', [2, 4, 8])
@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('causal', [True, False])
def test_backward_sends_the_gradients_back_round_the_ring(c, layout, causal):
    """Without a mask every chunk's gradient goes back each step, as many bytes as forward;
    under the causal mask a chunk no later device attends to has none to send back."""
    group, shape = devices(c), (2, 3, 32, 4)
    expected = context.ring_gradient_bytes(shape, c, layout, causal)
    assert ring_sends(c, layout, causal, 'backward') == {
        (step, group[rank]): (sent, {group[rank - 1]}) for (step, rank), sent in expected.items()}
    if not causal:
        assert set(expected.values()) == {context.ring_bytes_per_step(shape, c)}
        assert len(expected) == c * (c - 1)


@pytest.mark.parametrize('c', [2, 4, 8])
def test_the_all_gather_brings_each_device_its_formula(c):
    shape, group = (1, 2, 32, 4), devices(c)
    sends = [t for t in profiled_sends(shape, group, 'zigzag', 'all_gather', backward=False)
             if t['algorithm'] == 'all-gather attention']
    for device in group:
        received = sum(t['bytes'] for t in sends if t['target'] == device)
        assert received == context.all_gather_bytes(shape, c) == (c - 1) * \
            context.ring_bytes_per_step(shape, c)


@pytest.mark.parametrize('c', [2, 4, 8])
def test_ulysses_all_to_alls_send_their_formula_2_over_c_of_the_rings(c):
    shape, group = (1, 8, 32, 4), devices(c)
    sends = [t for t in profiled_sends(shape, group, 'zigzag', 'ulysses', backward=False)
             if t['algorithm'] == 'ulysses attention']
    for device in group:
        sent = sum(t['bytes'] for t in sends if t['source'] == device)
        assert sent == context.ulysses_bytes(shape, c) == 2 / c * (c - 1) * \
            context.ring_bytes_per_step(shape, c)


def test_a_send_returns_its_gradient_the_way_it_came():
    x = np.array([1.0, 2.0])
    x.attach_grad()
    npx.waitall()
    with profiler.profile() as records:
        with autograd.record():
            y = comm.send(x, d2l.cpu(1), 'test', 0, 0)
            (y * np.array([3.0, 4.0], device=d2l.cpu(1))).sum().backward()
        npx.waitall()
    assert y.device == d2l.cpu(1)
    numpy.testing.assert_array_equal(x.grad.asnumpy(), [3.0, 4.0])
    assert x.grad.device == d2l.cpu(0)
    assert comm.bytes_sent(records, 'forward') == comm.bytes_sent(records, 'backward') == 8


# -- the calculator -----------------------------------------------------------------------------

CLUSTER = predict.Cluster(64, 8, 80e9, 150e12, 300e9, 25e9)


@pytest.mark.parametrize('c', [2, 4, 8])
def test_the_calculator_divides_activations_by_c(c):
    whole = predict.layout_costs(predict.GPT3, CLUSTER, 8, 8, 8, 1536)
    split = predict.layout_costs(predict.GPT3, CLUSTER, 8, 8, 8, 1536, context=c)
    assert split['activations'] == pytest.approx(whole['activations'] / c)
    assert split['states'] == whole['states'] and whole['context'] == 0


def test_the_calculator_prices_the_ring_from_its_bytes_per_step():
    """Per layer and micro-batch: c - 1 steps forward, twice as many backward, each sending a
    device's keys and values of 1/c of the tokens and 1/t of the heads, in 16 bits."""
    gpt3, c, t, p = predict.GPT3, 4, 2, 8
    costs = predict.layout_costs(gpt3, CLUSTER, 8, t, p, 1536, context=c)
    step_bytes = 2 * 1 * (gpt3.heads // t) * (gpt3.seq // c) * (gpt3.hidden // gpt3.heads) * 2
    assert step_bytes == context.ring_bytes_per_step(
        (1, gpt3.heads // t, gpt3.seq, gpt3.hidden // gpt3.heads), c, 'float16')
    microbatches, layers_here = 1536 // 8, gpt3.layers // p
    assert costs['context'] == pytest.approx(3 * (c - 1) * microbatches * layers_here * (
        CLUSTER.alpha + step_bytes / CLUSTER.nvlink))


def test_the_layout_search_fills_the_cluster_with_d_t_p_c():
    plain = dict(predict.layouts(predict.GPT3, CLUSTER, batch=1536))
    rows = dict(predict.layouts(predict.GPT3, CLUSTER, batch=1536, context=2))
    assert rows and all(d * t * p * 2 == CLUSTER.devices for d, t, p in rows)
    for (d, t, p), row in rows.items():
        assert row['activations'] == pytest.approx(plain[2 * d, t, p]['activations'] / 2)


# -- inside the GPT: a context-parallel spec in the grid ----------------------------------------

GPT_LAYERS, GPT_BATCH = 2, 2
rng = numpy.random.default_rng(1)
TOKENS = rng.integers(0, VOCAB, (GPT_BATCH, SEQ))
LABELS = rng.integers(0, VOCAB, (GPT_BATCH, SEQ))


def split_step(split):
    return helpers.split_step(split, TOKENS, LABELS)


def gradients(split, rank):
    return {name.split('.', 1)[1]: param.grad(split.devices[rank]).asnumpy()
            for name, param in split.collect_params().items()
            if name.startswith(f'rank{rank}.') and param.grad_req != 'null'}


@pytest.mark.parametrize('t, c, algorithm, sequence', [
    (1, 2, 'ring', False), (1, 4, 'ring', False), (2, 2, 'ring', False),
    (1, 2, 'all_gather', False), (2, 2, 'all_gather', True), (2, 2, 'ulysses', False),
    (1, 2, 'ring', True)])
def test_a_context_parallel_gpt_equals_the_tensor_parallel_one(t, c, algorithm, sequence):
    """c groups of t devices, each holding zig-zag chunks of the sequence, give the logits of
    one device and, on each device, the gradients of the same share split over t devices
    alone (which test_tensor_parallel holds to one device)."""
    home = d2l.cpu(9)
    whole = gpt(GPT_LAYERS, home)
    want = whole(np.array(TOKENS, device=home)).asnumpy()
    alone = tensor_parallel(whole, devices_from(t, first=10), sequence=sequence)
    split_step(alone)
    split = tensor_parallel(whole, devices_from(c * t), sequence=sequence, context=c,
                            context_algorithm=algorithm)
    for logits in split_step(split):
        numpy.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
    for rank in range(c * t):
        got, expected = gradients(split, rank), gradients(alone, rank % t)
        assert got.keys() == expected.keys()
        for name in got:
            numpy.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=0,
                                          err_msg=f'rank {rank}: {name}')


def grid_sends(c, t, backward):
    split = tensor_parallel(gpt(GPT_LAYERS), devices_from(c * t), context=c)
    npx.waitall()
    with profiler.profile() as records:
        if backward:
            split_step(split)
        else:
            split(np.array(TOKENS))
        npx.waitall()
    return [x for x in comm.transfers_in(records)
            if x['action'] == 'send' and x['algorithm'] == 'ring attention']


@pytest.mark.parametrize('c, t', [(2, 1), (4, 1), (2, 2)])
def test_the_gpts_ring_sends_its_formula_each_layer(c, t):
    """Forward, each device sends its keys and values c - 1 times a layer. A training step
    sends them round once more (backward runs the ring again from q, k and v, all the
    forward keeps) and sends the gradients back, the causal mask's share of them."""
    shape = (GPT_BATCH, HEADS // t, SEQ, HIDDEN // HEADS)
    per_step = context.ring_bytes_per_step(shape, c)
    forward = grid_sends(c, t, backward=False)
    assert sum(x['bytes'] for x in forward) == GPT_LAYERS * t * c * (c - 1) * per_step
    step = grid_sends(c, t, backward=True)
    assert sum(x['bytes'] for x in step if x['phase'] == 'forward') == \
        2 * GPT_LAYERS * t * c * (c - 1) * per_step
    assert sum(x['bytes'] for x in step if x['phase'] == 'backward') == \
        GPT_LAYERS * t * sum(context.ring_gradient_bytes(shape, c).values())


def test_a_split_that_cannot_run_is_named():
    net = gpt(GPT_LAYERS)
    with pytest.raises(ValueError, match='context=3 must be a whole number'):
        tensor_parallel(net, devices_from(4), context=3)
    with pytest.raises(ValueError, match="unknown context_algorithm='p2p'"):
        tensor_parallel(net, devices_from(4), context=2, context_algorithm='p2p')
    with pytest.raises(ValueError, match='Ulysses splits the 2 heads a device holds over 4'):
        tensor_parallel(net, devices_from(8), context=4, context_algorithm='ulysses')
    split = tensor_parallel(net, devices_from(2), context=2)
    with pytest.raises(ValueError, match='a sequence of 6 does not cut into 4 equal chunks'):
        split(np.array(TOKENS[:, :6]))
    numpy.testing.assert_allclose(split(np.array(TOKENS))[1].asnumpy(),
                                  net(np.array(TOKENS)).asnumpy(), atol=1e-5)


def test_a_program_that_never_meets_its_peers_is_named_not_waited_for():
    """Programs that meet in more than one group hand their turn on until their meeting is
    complete; one whose peer ended without coming raises, rather than waiting forever."""
    group = TensorGroup(2, context=2)

    def program(rank, x):
        if rank != 3:                               # rank 3 never comes to its tensor group
            x = group.meet(x, lambda xs: [a + 1 for a in xs])
        return x
    with pytest.raises(RuntimeError, match=r'meetings \[\(2, 3\)\] never complete'):
        group.run(program, [np.ones(1, device=d) for d in devices_from(4)], (1, 4))
    outs = group.run(lambda rank, x: group.meet(x, lambda xs: xs[::-1],
                                                group.context_peers(rank)),
                     [np.full(1, r, device=d) for r, d in enumerate(devices_from(4))], (1, 4))
    assert [out.item() for out in outs] == [2, 3, 0, 1]
