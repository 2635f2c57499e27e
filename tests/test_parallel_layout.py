"""Data × tensor × pipeline parallelism on virtual devices, with and without sequence
parallelism: every layout trains as one device does, and each device holds and sends, to the
byte, what the calculator predicts."""
import dataclasses
import gc

import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, comm, np, npx
from d2lperf.model_parallel import Pipeline, parallel_gpt, predict, schedule, simulate
from d2lperf.model_parallel import bubble as simulated_bubble
from d2lperf.comm.all_to_all import bytes_each_sends
from d2lperf.comm.schedules import ALL_TO_ALL
from d2lperf.nn.moe import capacity
from model_parallel_helpers import HEADS, HIDDEN, SEQ, VOCAB, devices, gpt as layered_gpt

pytestmark = pytest.mark.chapter('parallel_layouts')

LAYERS, BATCH = 4, 8
LOSS = d2l.SoftmaxCrossEntropyLoss()
rng = numpy.random.default_rng(0)
TOKENS = rng.integers(0, VOCAB, (BATCH, SEQ))
LABELS = rng.integers(0, VOCAB, (BATCH, SEQ))
# (data, tensor, pipeline, schedule, chunks, micro-batches, sequence parallelism)
LAYOUTS = [(2, 2, 2, '1f1b', 1, 2, False), (1, 2, 2, 'interleaved', 2, 4, False),
           (2, 1, 4, 'gpipe', 1, 2, False), (4, 2, 1, '1f1b', 1, 1, False),
           (1, 1, 3, '1f1b', 1, 4, False), (8, 1, 1, '1f1b', 1, 1, False),
           (2, 2, 2, '1f1b', 1, 2, True), (1, 4, 3, 'gpipe', 1, 2, True),
           (1, 2, 2, 'interleaved', 2, 2, True)]
PLANNED = LAYOUTS[:3] + LAYOUTS[6:]


def gpt(layers=LAYERS):
    return layered_gpt(layers)


def one_device_losses(steps):
    net = gpt()
    trainer = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01}, kvstore=None)
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = LOSS(net(np.array(TOKENS)), np.array(LABELS)).sum()
        loss.backward()
        trainer.step(BATCH)
        losses.append(loss.item())
    return losses


def layout(d, t, p, name, v, sequence=False, layers=LAYERS):
    split = parallel_gpt(gpt(layers), devices(d * t * p), d, t, p, name, v, sequence=sequence)
    return split, d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 0.01},
                              kvstore=None)


@pytest.mark.parametrize('d, t, p, name, v, m, sequence', LAYOUTS)
def test_every_layout_trains_as_one_device(d, t, p, name, v, m, sequence):
    steps = 3
    split, trainer = layout(d, t, p, name, v, sequence)
    losses = []
    for _ in range(steps):
        parts = split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, m)
        trainer.update(BATCH)                   # forward_backward summed over the replicas
        assert len(parts) == d * m
        losses.append(sum(part.item() for part in parts))
    one = one_device_losses(steps)
    numpy.testing.assert_allclose(losses, one, rtol=1e-5)
    assert one[-1] < one[0]


# (data, context, tensor, pipeline, schedule, micro-batches, sequence parallelism, algorithm)
CONTEXT_LAYOUTS = [(1, 2, 1, 1, '1f1b', 1, False, 'ring'), (2, 2, 1, 2, '1f1b', 2, False, 'ring'),
                   (1, 2, 2, 2, 'gpipe', 2, True, 'all_gather'),
                   (1, 4, 1, 2, '1f1b', 2, False, 'ring'), (2, 2, 2, 1, '1f1b', 1, False, 'ulysses')]


@pytest.mark.parametrize('d, c, t, p, name, m, sequence, algorithm', CONTEXT_LAYOUTS)
def test_context_parallel_layouts_train_as_one_device(d, c, t, p, name, m, sequence, algorithm):
    """Context parallelism inside the grid (tp, cp, dp, pp, Megatron's order): each group of
    c·t devices splits the sequence in zig-zag chunks, and three steps of Adam give the one
    device's losses."""
    split = parallel_gpt(gpt(), devices(d * c * t * p), d, t, p, name, sequence=sequence,
                         context=c, context_algorithm=algorithm)
    trainer = d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 0.01},
                          kvstore=None)
    losses = []
    for _ in range(3):
        parts = split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, m)
        trainer.update(BATCH)
        losses.append(sum(part.item() for part in parts))
    numpy.testing.assert_allclose(losses, one_device_losses(3), rtol=1e-5)
    assert [len(group) for group in split.grid[0]] == [c * t] * d


# (data, context, tensor, pipeline, expert, micro-batches, experts, top_k, sequence parallelism)
EXPERT_LAYOUTS = [(2, 1, 1, 1, 2, 1, 4, 1, False), (4, 1, 1, 1, 4, 2, 4, 2, False),
                  (2, 2, 1, 2, 4, 2, 4, 2, False), (2, 1, 2, 1, 2, 1, 4, 1, True),
                  (2, 2, 2, 1, 2, 1, 4, 2, False)]


def experts_gpt(experts, top_k):
    """The test GPT with every second MLP a mixture, with room for every token (capacity
    factor E/k: an expert can take every token, on one device or on a share of them)."""
    np.random.seed(0)
    net = d2l.nn.GPT(VOCAB, LAYERS, HIDDEN, HEADS, SEQ, num_experts=experts, top_k=top_k)
    net.initialize(device=d2l.cpu(0))
    for mixture in net.mixtures():
        mixture.capacity_factor = experts / top_k
    return net


def trained_losses(split, trainer, m, steps=3):
    losses = []
    for _ in range(steps):
        parts = split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, m)
        trainer.update(BATCH)
        losses.append(sum(part.item() for part in parts))
    return losses


@pytest.mark.parametrize('d, c, t, p, e, m, experts, top_k, sequence', EXPERT_LAYOUTS)
def test_expert_parallel_layouts_train_as_one_device(d, c, t, p, e, m, experts, top_k,
                                                     sequence):
    """Expert parallelism carved out of the data and context ranks (tp-cp-ep-dp-pp): the
    replicas run in lockstep, tokens go to their experts' programs and back by all-to-all,
    and with no token dropped three steps of Adam give one device's losses."""
    net = experts_gpt(experts, top_k)
    one = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01}, kvstore=None)
    want = []
    for _ in range(3):
        with autograd.record():
            loss = LOSS(net(np.array(TOKENS)), np.array(LABELS)).sum()
        loss.backward()
        one.step(BATCH)
        want.append(loss.item())
    split = parallel_gpt(experts_gpt(experts, top_k), devices(d * c * t * p), d, t, p,
                         '1f1b', sequence=sequence, context=c, expert=e)
    trainer = d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 0.01},
                          kvstore=None)
    numpy.testing.assert_allclose(trained_losses(split, trainer, m), want, rtol=1e-5)


def test_an_experts_copies_live_on_its_expert_ranks_and_sum_there():
    """d = 4, e = 2, E = 4: expert j's parameters have copies on the two replicas whose
    expert rank (r mod 2) holds it, experts 2·rank and 2·rank + 1, and nowhere else; the
    router's on all four. After a step the copies hold the same gradient (summed over the
    two); each all-to-all sends (e - 1)/e of a program's E · capacity rows, there and back,
    forward and backward."""
    d, e, experts = 4, 2, 4
    split = parallel_gpt(experts_gpt(experts, 1), devices(d), d, expert=e)
    grid = [group[0] for group in split.grid[0]]
    params = split.collect_params()
    for name, param in params.items():
        if '.expert' in name:
            j = int(name.split('.expert')[1].split('.')[0])
            assert param.list_device() == [grid[r] for r in range(d) if r % e == j // 2], name
        else:
            assert param.list_device() == grid, name
    with d2l.profiler.profile() as records:
        split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, 1)
        npx.waitall()
    for name, param in params.items():
        grads = [g.asnumpy() for g in param.list_grad()]
        for g in grads[1:]:
            numpy.testing.assert_array_equal(g, grads[0], err_msg=name)
    buffer_bytes = experts * capacity(BATCH // d * SEQ, experts, 1, experts) * HIDDEN * 4
    sends = [x for x in comm.transfers_in(records)
             if x['action'] == 'send' and x['algorithm'] == ALL_TO_ALL]
    for device in grid:
        sent = sum(x['bytes'] for x in sends if x['source'] == device)
        mixtures = LAYERS // 2                    # each: there and back, forward and backward
        assert sent == mixtures * 4 * bytes_each_sends(buffer_bytes, e)


def measured(split, d, t, p, m):
    """Each device's bytes by kind after a step on the naive engine (which frees at once):
    held, the gradients before the update, the peak of activations, and what it sent."""
    d2l.engine.use('naive')
    try:
        gc.collect()
        for device in devices(d * t * p):
            d2l.device.reset_peak(device)
        split.pipeline.sent.clear()
        with d2l.profiler.profile() as records:
            split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, m)
        gc.collect()
        memory = {dev: d2l.device.memory(dev) for dev in devices(d * t * p)}
    finally:
        d2l.engine.use('threaded')
    piped = split.pipeline.sent
    sends = [x for x in comm.transfers_in(records) if x['action'] == 'send']
    table = {}
    for s, r in numpy.ndindex(p, d):
        group = split.grid[s][r]
        for i, dev in enumerate(group):
            mine = [x for x in sends if x['source'] == dev]
            table[s, r, i] = {
                'weights': memory[dev].by_kind['weights'],
                'gradients': memory[dev].by_kind['gradients'],
                'optimizer state': memory[dev].by_kind['optimizer state'],
                'activations': memory[dev].peak_by_kind['activations'],
                'tensor': sum(x['bytes'] for x in mine if x['target'] in group),
                'data': sum(x['bytes'] for x in mine if x['target'] not in group),
                'pipeline': piped[dev]}
    return table


def assert_planned(d, t, p, name, v, m, sequence, layers=LAYERS):
    split, trainer = layout(d, t, p, name, v, sequence, layers)
    split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, m)     # allocate
    trainer.update(BATCH)
    sizes = predict.GPTSizes.of(gpt(layers))
    for (s, r, i), seen in measured(split, d, t, p, m).items():
        plan = predict.device_plan(sizes, d, t, p, s, i, name, m, BATCH, v,
                                   sequence=sequence)
        assert seen == {kind: plan[kind] for kind in seen}, (s, r, i)


@pytest.mark.parametrize('d, t, p, name, v, m, sequence', PLANNED)
def test_each_device_holds_and_sends_what_the_calculator_predicts(d, t, p, name, v, m,
                                                                  sequence):
    assert_planned(d, t, p, name, v, m, sequence)


@pytest.mark.parametrize('layers, d, t, p, name, v, m', [
    (2, 1, 2, 4, '1f1b', 1, 4), (2, 1, 4, 4, 'gpipe', 1, 4), (4, 1, 2, 2, 'interleaved', 3, 4)])
def test_an_embedding_alone_in_its_part_keeps_its_whole_sum(layers, d, t, p, name, v, m):
    """With sequence parallelism a device's tokens are a view of the embedding's whole sum.
    Where the embedding is a pipeline part of its own, that view is the part's output, kept
    for its gradient, while the first layer, on the next stage, keeps a copy: the embedding's
    stage holds the whole sum."""
    assert_planned(d, t, p, name, v, m, True, layers)


@pytest.mark.parametrize('t, v, sequence', [(2, 3, True), (1, 2, False), (1, 3, False)])
def test_one_stage_interleaved_sends_nothing_between_stages(t, v, sequence):
    """Its chunks all live on its own devices: nothing crosses to another stage."""
    assert predict.stage_crossings(1, v, 0) == 0
    assert_planned(1, t, 1, 'interleaved', v, 4, sequence)


def test_the_calculator_counts_the_small_gpts_parameters():
    net = gpt()
    assert predict.GPTSizes.of(net).params() == sum(
        p.data().size for p in net.collect_params().values())


@pytest.mark.parametrize('p, m, v', [(2, 2, 1), (4, 8, 1), (3, 5, 1), (2, 4, 2), (4, 8, 2)])
def test_the_bubble_formula_is_the_simulated_schedules(p, m, v):
    name = 'interleaved' if v > 1 else 'gpipe'
    idle, _ = simulated_bubble(simulate(schedule(name, p, m, v)))
    assert idle == pytest.approx(predict.bubble(p, m, v))


CLUSTER = predict.Cluster(64, 8, 80e9, 150e12, 300e9, 25e9)


def test_gpt3_on_a_cluster_fits_only_with_model_parallelism():
    """175 billion parameters (Brown et al., 2020); 512 devices of 80 GB: data parallelism
    alone holds Megatron-LM's 18 bytes of each parameter on every device, 3.2 TB, and no
    layout that does not split the model by at least 16 fits."""
    assert predict.GPT3.params() == pytest.approx(175e9, rel=0.01)
    rows = dict(predict.layouts(predict.GPT3, CLUSTER, batch=1536))
    assert rows[512, 1, 1]['states'] == pytest.approx(18 * predict.GPT3.params())
    assert not rows[512, 1, 1]['fits']
    assert all(t * p >= 16 for (d, t, p), row in rows.items() if row['fits'])
    best = predict.layouts(predict.GPT3, CLUSTER, batch=1536)[0]
    assert best[1]['fits']


@pytest.mark.parametrize('t', [1, 2, 8, 96])
def test_a_layers_activations_are_korthikantis(t):
    """Korthikanti et al. (2022), Table 2: sbh(10 + 24/t + 5as/(ht)) bytes with tensor
    parallelism alone, sbh(34 + 5as/h)/t with sequence parallelism too."""
    gpt3, b = predict.GPT3, 2
    s, h, a = gpt3.seq, gpt3.hidden, gpt3.heads
    alone = predict.layer_activations(gpt3, b, t, sequence=False)
    assert alone == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert predict.layer_activations(gpt3, b, t) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h) / t)


def test_without_sequence_parallelism_gpt3_at_t8_keeps_56_gb_of_activations():
    """L layers' worth on 1F1B's first stage: 96 · sbh(10 + 3 + 10) = 55.6 GB, not the
    275 GB of the unsplit count."""
    costs = predict.layout_costs(predict.GPT3, CLUSTER, 8, 8, 8, 1536, sequence=False)
    assert costs['activations'] / 1e9 == pytest.approx(55.6, abs=0.05)


def test_sequence_parallelism_divides_a_boundarys_bytes_by_t():
    """A stage sends each device's tokens only, 1/t of a micro-batch's activations, as
    `device_plan` counts them."""
    kept = predict.layout_costs(predict.GPT3, CLUSTER, 8, 8, 8, 1536, sequence=False)
    split = predict.layout_costs(predict.GPT3, CLUSTER, 8, 8, 8, 1536)
    assert split['pipeline'] < kept['pipeline']
    microbatches, boundary = 1536 // 8, 2 * predict.GPT3.seq * predict.GPT3.hidden
    assert split['pipeline'] == pytest.approx(
        2 * microbatches * (CLUSTER.alpha + boundary / 8 / CLUSTER.network))


def test_the_distributed_optimizer_holds_6_plus_12_over_d_bytes_a_parameter():
    """ZeRO-1 over the d replicas (Megatron-LM's distributed optimizer): 16 × 8 × 4 then fits
    in 80 GB, and 8 × 8 × 8 too, where neither does with the optimizer whole."""
    for d, t, p in [(16, 8, 4), (8, 8, 8)]:
        whole = predict.layout_costs(predict.GPT3, CLUSTER, d, t, p, 1536)
        sharded = predict.layout_costs(predict.GPT3, CLUSTER, d, t, p, 1536, zero_stage=1)
        values = predict.GPT3.params() / (t * p)
        assert whole['states'] == pytest.approx(18 * values)
        assert sharded['states'] == pytest.approx((6 + 12 / d) * values)
        assert not whole['fits'] and sharded['fits']
        assert sharded['data'] < whole['data']     # 16-bit weights gathered, not gradients
    assert predict.layout_costs(predict.GPT3, CLUSTER, 16, 8, 4, 1536, zero_stage=1)[
        'held'] / 1e9 == pytest.approx(71.4, abs=0.05)
    with pytest.raises(ValueError, match='zero_stage=1'):
        predict.layout_costs(predict.GPT3, CLUSTER, 16, 8, 4, 1536, zero_stage=3)


@pytest.mark.parametrize('zero_stage', [0, 1])
def test_tensor_parallelism_up_to_a_machine_falls_out_of_the_counting(zero_stage):
    """Narayanan et al.'s rule, from the prices alone: a tensor group wider than a machine
    runs its allreduces at the network's speed and is the slowest of all that fit; t below a
    machine's GPUs keeps too many activations to fit (memory, not the link, sets t)."""
    rows = predict.layouts(predict.GPT3, CLUSTER, batch=1536, zero_stage=zero_stage)
    assert any(t > CLUSTER.per_machine for (d, t, p), row in rows if row['fits'])
    (_, best_t, _), best = rows[0]
    assert best['fits'] and best_t == CLUSTER.per_machine
    wider = [row['step'] for (d, t, p), row in rows if t > CLUSTER.per_machine]
    assert min(wider) > 2 * best['step']
    assert not any(row['fits'] for (d, t, p), row in rows if t < CLUSTER.per_machine)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match='7 devices do not make a grid of data 2 × tensor 2'):
        parallel_gpt(gpt(), devices(7), 2, 2, 2)
    with pytest.raises(ValueError, match='4 attention heads do not split among 3 devices'):
        parallel_gpt(gpt(), devices(3), 1, 3, 1)
    with pytest.raises(ValueError, match='6 layers do not split into 8 parts'):
        parallel_gpt(gpt(), devices(8), 1, 1, 8)
    split, _ = layout(2, 1, 2, '1f1b', 1)
    with pytest.raises(ValueError, match='a batch of 8 does not split into 2 replicas × 3'):
        split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, 3)
    with pytest.raises(ValueError, match='not a mix'):
        Pipeline(gpt(), [d2l.cpu(1), [d2l.cpu(2)]])


def test_a_replicated_parameter_is_one_parameter_with_a_copy_a_replica():
    """As a data-parallel net's: each weight of a stage's rank is one Parameter with a copy on
    that rank's device in each replica, named as the GPT names it after its place
    (`stage1.rank0.3.mlp.dense1.weight`); after a step every copy holds the sum."""
    d, t, p = 2, 2, 2
    split, _ = layout(d, t, p, '1f1b', 1)
    params = split.collect_params()
    whole = list(gpt().collect_params())
    for s, i in numpy.ndindex(p, t):
        place = f'stage{s}.rank{i}.'
        mine = {name.removeprefix(place): param for name, param in params.items()
                if name.startswith(place)}
        assert list(mine) == [name for name in whole if int(name.split('.')[0]) in
                              ((0, 1, 2) if s == 0 else (3, 4, 5))]
        for param in mine.values():
            assert param.list_device() == [split.grid[s][r][i] for r in range(d)]
    assert split.pipeline.params() == list(params.values())
    split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, 2)
    for name, param in params.items():
        if param.grad_req == 'write':
            first, second = (grad.asnumpy() for grad in param.list_grad())
            numpy.testing.assert_array_equal(first, second, err_msg=name)


def test_the_replicas_sum_through_the_same_buffers_every_step():
    """The flat buffers of the sum over the replicas are made once (`comm.FlatBufferSum`):
    each step packs the gradients into the arrays the step before packed them into."""
    split, _ = layout(2, 2, 1, '1f1b', 1)
    packed = []
    for _ in range(2):
        with d2l.profiler.profile() as records:
            split.forward_backward(np.array(TOKENS), np.array(LABELS), LOSS, 1)
            npx.waitall()
        packed.append({v for r in records if r.name.endswith(' pack') for v in r.writes})
    assert packed[0] and packed[0] == packed[1]


def test_the_calculator_counts_the_model_it_is_given(monkeypatch):
    """Change the GPT (an MLP twice as wide as GPT-2's) and the count follows, whole and
    split: nothing in the calculator spells out a layer's parameters."""
    from d2lperf.nn import transformer
    defaults = transformer.MLP.__init__.__defaults__
    monkeypatch.setattr(transformer.MLP.__init__, '__defaults__', (8,) + defaults[1:])
    sizes = predict.GPTSizes(VOCAB, 3, 16, 4, SEQ - 1)       # sizes no other test counted
    net = transformer.GPT(*dataclasses.astuple(sizes))
    net.initialize()
    assert sizes.params() == sum(p.data().size for p in net.collect_params().values())
    split = d2l.model_parallel.tensor_parallel(net, devices(2))
    for rank, held in enumerate(split.ranks):
        for unit, block in enumerate(held.units):
            params = block.collect_params().values()
            assert predict.unit_values(sizes, unit, 2, rank=rank) == sum(
                p.data().size for p in params)
            assert predict.unit_values(sizes, unit, 2, True, rank) == sum(
                p.data().size for p in params if p.grad_req != 'null')


def test_model_parallel_imports_nothing_from_data_parallel():
    """The calculator's counts of model states come from nn.footprint, below both, and the
    layout's sum over replicas is comm's flat-buffer sum, as data parallelism's is."""
    import ast
    import pathlib
    folder = pathlib.Path(d2l.model_parallel.__file__).parent
    reaching = [f'{path.name}: {node.module}' for path in folder.glob('*.py')
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith('data_parallel') and node.level == 2]
    assert reaching == []
