"""Pipeline parallelism on virtual devices: every schedule trains as one device does, and a
stage holds the activations of as many micro-batches as its schedule says."""
import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, nn, np
from d2lperf.model_parallel import Part, Pipeline, Stage, held_microbatches, schedule
from d2lperf.model_parallel import TensorParallelGPT
from model_parallel_helpers import SEQ, VOCAB, devices, gpt
from test_memory import settle

pytestmark = pytest.mark.chapter('model_parallelism')

WIDTH, LAYERS, BATCH = 16, 6, 24
rng = numpy.random.default_rng(0)
X = rng.standard_normal((BATCH, WIDTH)).astype('float32')
Y = rng.integers(0, 10, BATCH)
LOSS = d2l.SoftmaxCrossEntropyLoss()


def mlp(layers=LAYERS):
    net = nn.Sequential()
    for _ in range(layers - 1):
        net.add(nn.Dense(WIDTH, in_units=WIDTH, activation='relu'))
    net.add(nn.Dense(10, in_units=WIDTH))
    np.random.seed(0)
    net.initialize(init=d2l.nn.init.Normal(sigma=0.3))
    return net


def trained_on_one_device(steps=2):
    net = mlp()
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    for _ in range(steps):
        with autograd.record():
            loss = LOSS(net(np.array(X)), np.array(Y)).sum()
        loss.backward()
        trainer.step(BATCH)
    return [p.data().asnumpy() for p in net.collect_params().values()]


def trained_in_a_pipeline(devices, name, micro, chunks=1, steps=2, sizes=None):
    net = mlp()
    pipeline = Pipeline(net, devices, name, chunks, sizes)
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    inputs = [np.array(part) for part in numpy.array_split(X, micro)]
    labels = [np.array(part) for part in numpy.array_split(Y, micro)]
    for _ in range(steps):
        pipeline.forward_backward(inputs, labels, LOSS)
        trainer.step(BATCH)
    return [p.data().asnumpy() for p in net.collect_params().values()], pipeline


@pytest.mark.parametrize('name, devices, micro, chunks', [
    ('gpipe', 1, 1, 1), ('gpipe', 2, 3, 1), ('1f1b', 3, 4, 1), ('1f1b', 4, 5, 1),
    ('interleaved', 2, 4, 2), ('interleaved', 3, 3, 2)])
def test_every_schedule_trains_as_one_device(name, devices, micro, chunks):
    one = trained_on_one_device()
    many, pipeline = trained_in_a_pipeline([d2l.cpu(i + 1) for i in range(devices)], name,
                                           micro, chunks)
    for a, b in zip(many, one):
        numpy.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert max(numpy.abs(a - b).max() for a, b in zip(one, [
        p.data().asnumpy() for p in mlp().collect_params().values()])) > 1e-3


def test_each_part_lives_on_its_device():
    _, pipeline = trained_in_a_pipeline([d2l.cpu(1), d2l.cpu(2)], 'interleaved', 2, chunks=2,
                                        steps=1)
    assert [len(part) for part in pipeline.stages] == [2, 2, 1, 1]
    for k, part in enumerate(pipeline.stages):
        for layer in part:
            for param in layer.collect_params().values():
                assert param.list_device() == [d2l.cpu(1 + k % 2)]


@pytest.mark.parametrize('name', ['gpipe', '1f1b'])
def test_a_stage_holds_the_micro_batches_its_schedule_says(name):
    """On the naive engine (what is freed is freed at once), each stage's peak of activations
    is the micro-batches in flight times one micro-batch's."""
    devices, micro = [d2l.cpu(1), d2l.cpu(2), d2l.cpu(3)], 6
    d2l.engine.use('naive')
    try:
        net = mlp()
        pipeline = Pipeline(net, devices, name)
        inputs = [np.array(part) for part in numpy.array_split(X, micro)]
        labels = [np.array(part) for part in numpy.array_split(Y, micro)]
        pipeline.forward_backward(inputs[:1], labels[:1], LOSS)      # one micro-batch alone
        settle()
        d2l.device.reset_peak()
        before = [d2l.device.memory(d).by_kind['activations'] for d in devices]
        pipeline.forward_backward(inputs[:1], labels[:1], LOSS)
        settle()
        one = [d2l.device.memory(d).peak_by_kind['activations'] - b
               for d, b in zip(devices, before)]
        d2l.device.reset_peak()
        pipeline.forward_backward(inputs, labels, LOSS)
        settle()
        held = [d2l.device.memory(d).peak_by_kind['activations'] - b
                for d, b in zip(devices, before)]
    finally:
        d2l.engine.use('threaded')
    counts = [held_microbatches(actions) for actions in schedule(name, 3, micro)]
    assert min(one) > 0 and held == [c * o for c, o in zip(counts, one)]
    assert counts == ([micro] * 3 if name == 'gpipe' else [3, 2, 1])


def test_uneven_sizes_and_a_net_too_shallow_are_named():
    with pytest.raises(ValueError, match='6 layers do not split into 8 parts'):
        Pipeline(mlp(), [d2l.cpu(i) for i in range(1, 5)], 'interleaved', chunks=2)
    with pytest.raises(ValueError, match=r'sizes \[4, 1\] must give'):
        Pipeline(mlp(), [d2l.cpu(1), d2l.cpu(2)], sizes=[4, 1])
    _, pipeline = trained_in_a_pipeline([d2l.cpu(1), d2l.cpu(2)], '1f1b', 3, sizes=[5, 1],
                                        steps=1)
    assert [len(part) for part in pipeline.stages] == [5, 1]


def gradients_of_a_bfloat16_mlp(devices):
    """Each parameter's gradient of a bfloat16 MLP, over `devices` (None: one device)."""
    net = mlp().cast('bfloat16')
    x, y = np.array(X).astype('bfloat16'), np.array(Y)
    if devices is None:
        with autograd.record():
            loss = LOSS(net(x), y).sum()
        loss.backward()
    else:
        Pipeline(net, devices, 'gpipe').forward_backward([x], [y], LOSS)
    return [p.grad().asnumpy().astype('float32') for p in net.collect_params().values()]


def test_a_bfloat16_net_takes_gradients_across_stages():
    """bfloat16 (ml_dtypes' kind 'V', not 'f') is differentiable: the copy a stage receives
    takes a gradient, and the stage before gets it."""
    one = gradients_of_a_bfloat16_mlp(None)
    split = gradients_of_a_bfloat16_mlp([d2l.cpu(1), d2l.cpu(2)])
    assert numpy.abs(one[0]).max() > 1e-2
    for a, b in zip(split, one):
        numpy.testing.assert_array_equal(a, b)


def micro_batches(micro):
    return ([np.array(part) for part in numpy.array_split(X, micro)],
            [np.array(part) for part in numpy.array_split(Y, micro)])


@pytest.mark.parametrize('name, devices, micro, chunks', [
    ('gpipe', 2, 3, 1), ('1f1b', 3, 4, 1), ('interleaved', 2, 4, 2)])
def test_the_gradients_are_the_micro_batches_summed_in_order_bit_for_bit(name, devices, micro,
                                                                         chunks):
    """Each micro-batch's gradient on one device, added in the order of the micro-batches
    (autograd's grad_req 'add' over the step), is bit for bit the pipeline's `.grad`."""
    inputs, labels = micro_batches(micro)
    net = mlp()
    total = None
    for x, y in zip(inputs, labels):
        with autograd.record():
            loss = LOSS(net(x), y).sum()
        loss.backward()
        each = [p.grad().asnumpy() for p in net.collect_params().values()]
        total = each if total is None else [t + g for t, g in zip(total, each)]
    net = mlp()
    Pipeline(net, [d2l.cpu(i + 1) for i in range(devices)], name, chunks).forward_backward(
        inputs, labels, LOSS)
    params = net.collect_params().values()
    for a, b in zip((p.grad().asnumpy() for p in params), total):
        numpy.testing.assert_array_equal(a, b)
    assert all(p.grad_req == 'write' for p in params)      # the step's 'add' is undone


def test_replicas_in_a_stage_group_add_into_their_own_copies_of_the_same_parameters():
    """`data=2`: each stage group holds both replicas' devices, run in lockstep on half of
    each micro-batch; each parameter is one Parameter with a copy a replica, and each
    replica's copies get the gradients of its half alone (the sum over replicas is the
    caller's: `ParallelGPT`)."""
    tokens = numpy.random.default_rng(3).integers(0, VOCAB, (4, SEQ))
    labels = numpy.random.default_rng(4).integers(0, VOCAB, (4, SEQ))
    net = gpt(2)
    both = Pipeline(net, [devices(2, 1), devices(2, 3)], '1f1b', data=2)
    assert both.params() == list(both.stages[0].collect_params().values()) + \
        list(both.stages[1].collect_params().values())
    for name, param in both.collect_params().items():
        stage = int(name.split('.')[0].removeprefix('stage'))
        assert param.list_device() == devices(2, 1 + 2 * stage)
    micro = [np.array(tokens[:2]), np.array(tokens[2:])]
    losses = both.forward_backward(micro, [np.array(labels[:2]), np.array(labels[2:])], LOSS)
    assert len(losses) == 4                      # two micro-batches × two replicas
    for replica in range(2):
        alone = Pipeline(gpt(2), [devices(1, 5), devices(1, 6)], '1f1b')
        rows = [slice(replica, replica + 1), slice(2 + replica, 3 + replica)]
        alone.forward_backward([np.array(tokens[r]) for r in rows],
                               [np.array(labels[r]) for r in rows], LOSS)
        for (name, param), own in zip(both.collect_params().items(),
                                      alone.collect_params().values(), strict=True):
            numpy.testing.assert_allclose(param.list_grad()[replica].asnumpy(),
                                          own.grad().asnumpy(), atol=1e-6, err_msg=name)


def test_a_net_set_to_add_accumulates_over_pipeline_steps():
    """Parameters the user set to grad_req 'add' keep adding over steps, until zero_grad()."""
    inputs, labels = micro_batches(2)
    net = mlp()
    pipeline = Pipeline(net, [d2l.cpu(1), d2l.cpu(2)], '1f1b')
    pipeline.forward_backward(inputs, labels, LOSS)
    once = [p.grad().asnumpy() for p in net.collect_params().values()]
    for param in net.collect_params().values():
        param.grad_req = 'add'
    pipeline.forward_backward(inputs, labels, LOSS)
    for param, g in zip(net.collect_params().values(), once):
        numpy.testing.assert_allclose(param.grad().asnumpy(), g + g, rtol=1e-6, atol=1e-7)
        assert param.grad_req == 'add'
    net.collect_params().zero_grad()
    pipeline.forward_backward(inputs, labels, LOSS)
    for param, g in zip(net.collect_params().values(), once):
        numpy.testing.assert_array_equal(param.grad().asnumpy(), g)


def test_every_part_is_a_declared_stage_built_once_from_the_devices():
    """A Device per stage gives Parts, a group per stage TensorParallelGPTs: both Stages,
    which a pipeline calls through the interface alone; a Stage that leaves one out cannot
    be made."""
    one = Pipeline(mlp(), [d2l.cpu(1), d2l.cpu(2)], schedule='gpipe')
    assert all(isinstance(stage, Part) for stage in one.stages)
    grouped = Pipeline(gpt(2), [devices(2, 1), devices(2, 3)], schedule='1f1b')
    assert all(isinstance(stage, TensorParallelGPT) for stage in grouped.stages)
    assert all(isinstance(stage, Stage) for stage in one.stages + grouped.stages)

    class NoBackward(Stage):
        devices = [d2l.cpu(1)]

        def forward(self, xs, shape):
            return xs

        def collect_params(self):
            return {}

        def replica(self, devices):
            return self
    with pytest.raises(TypeError, match='backward'):
        NoBackward()
    with pytest.raises(TypeError, match="'name'"):
        Pipeline(mlp(), [d2l.cpu(1), d2l.cpu(2)], name='gpipe')


@pytest.mark.parametrize('chunks', [1, 2])
def test_a_part_names_its_parameters_as_the_whole_net_after_its_place(chunks):
    """One scheme for every model-like thing that is not a Block: the whole net's
    `collect_params()` name after the place that holds it (the stage, the tensor-parallel
    rank). A Part holds the net's own parameters; a tensor-parallel rank's share of a GPT is
    named as the GPT's unit it shares."""
    net = mlp(4)
    whole = dict(net.collect_params())
    one = Pipeline(net, [d2l.cpu(1), d2l.cpu(2)], 'interleaved' if chunks > 1 else 'gpipe',
                   chunks)
    named = one.collect_params()
    assert {name.split('.', 1)[1]: param for name, param in named.items()} == whole
    for name, param in named.items():
        stage = int(name.split('.')[0].removeprefix('stage'))
        assert param.list_device() == [d2l.cpu(1 + stage)]
    assert one.params() == list(named.values())
    net = gpt(2)
    gpt_names = list(net.collect_params())
    grouped = Pipeline(net, [devices(2, 1), devices(2, 3)], schedule='1f1b')
    names = list(grouped.collect_params())
    for s, r in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        place = f'stage{s}.rank{r}.'
        mine = [name.removeprefix(place) for name in names if name.startswith(place)]
        assert mine == [name for name in gpt_names if int(name.split('.')[0]) in
                        ((0, 1) if s == 0 else (2, 3))]
        stage = grouped.stages[s]
        assert list(stage.ranks[r].collect_params()) == mine
        assert [name for name in stage.collect_params() if name.startswith(f'rank{r}.')] == \
            [f'rank{r}.{name}' for name in mine]


def test_a_step_runs_without_the_schedules_timing(monkeypatch):
    """The executor follows each stage's actions and their dependencies, not the unit-cost
    simulator's start times (which broke ties by stage): a step runs with it gone."""
    def no_timing(*args, **kwargs):
        raise AssertionError('a step asked the simulator for times')
    monkeypatch.setattr(d2l.model_parallel.schedules, 'simulate', no_timing)
    monkeypatch.setattr(d2l.model_parallel.pipeline, 'simulate', no_timing, raising=False)
    inputs, labels = micro_batches(4)
    losses = Pipeline(mlp(), [d2l.cpu(1), d2l.cpu(2)], 'interleaved', 2).forward_backward(
        inputs, labels, LOSS)
    net = mlp()
    with autograd.record():
        whole = [LOSS(net(x), y).sum() for x, y in zip(inputs, labels)]
    numpy.testing.assert_allclose([l.item() for l in losses], [l.item() for l in whole],
                                  rtol=1e-6)
