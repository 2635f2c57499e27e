"""Buckets and ZeRO's stages train as one device with the whole batch does; the calculator's
memory and traffic are what the counter and the engine's records measure."""
import collections
import math

import numpy
import pytest

import d2lperf as d2l
from d2lperf import autograd, comm, nn, np, npx
from d2lperf.data_parallel import Buckets, Zero, plan_buckets, predict
from test_memory import settle

OPTIMIZERS = [('sgd', {'learning_rate': 0.1}),
              ('sgd', {'learning_rate': 0.1, 'momentum': 0.9}),
              ('adam', {'learning_rate': 0.01})]
rng = numpy.random.default_rng(0)
X = np.array(rng.standard_normal((24, 8)).astype('float32'))
y = np.array(rng.integers(0, 10, 24))
loss = d2l.SoftmaxCrossEntropyLoss()


def mlp(devices):
    net = nn.HybridSequential()
    net.add(nn.Dense(16, in_units=8, activation='relu'), nn.Dense(10, in_units=16))
    np.random.seed(0)
    net.initialize(init=d2l.nn.init.Normal(sigma=0.1), device=devices)
    return net


def train(devices, make, steps=5):
    net = mlp(devices)
    X_parts, y_parts = d2l.split_batch(X, y, devices)
    strategy = make(net)
    for _ in range(steps):
        strategy.step(lambda: [loss(net(a), b) for a, b in zip(X_parts, y_parts)], 24)
    return strategy


def buckets(*args, **kwargs):
    return lambda net: Buckets(net.collect_params(), *args, **kwargs)


STRATEGIES = {
    'one sum a parameter': lambda opt, kw: buckets(opt, kw, cap_bytes=1),
    'flat, after backward': lambda opt, kw: buckets(opt, kw, overlap=False),
    'buckets of 600 B': lambda opt, kw: buckets(opt, kw, cap_bytes=600),
    'ZeRO 1': lambda opt, kw: (lambda net: Zero(net, 1, opt, kw)),
    'ZeRO 2': lambda opt, kw: (lambda net: Zero(net, 2, opt, kw)),
    'ZeRO 3': lambda opt, kw: (lambda net: Zero(net, 3, opt, kw, algorithm='split')),
    'ZeRO 3, no prefetch': lambda opt, kw: (lambda net: Zero(net, 3, opt, kw, prefetch=0)),
}


@pytest.mark.parametrize('optimizer', OPTIMIZERS, ids=['sgd', 'momentum', 'adam'])
@pytest.mark.parametrize('name', list(STRATEGIES))
def test_every_strategy_trains_as_one_device_with_the_whole_batch(name, optimizer):
    one = train([d2l.cpu(1)], buckets(*optimizer)).weights()
    many = train([d2l.cpu(i) for i in (1, 2, 3)], STRATEGIES[name](*optimizer)).weights()
    assert one.keys() == many.keys()
    for key in one:
        numpy.testing.assert_allclose(many[key], one[key], atol=1e-5, rtol=0)
    # and the weights moved: the comparison is not between two untouched nets
    assert max(numpy.abs(one[k] - mlp([d2l.cpu(1)]).collect_params()[k].data().asnumpy()).max()
               for k in one) > 1e-3


def train_with_trainer(devices, optimizer, steps=5):
    net = mlp(devices)
    X_parts, y_parts = d2l.split_batch(X, y, devices)
    trainer = d2l.Trainer(net.collect_params(), *optimizer)
    for _ in range(steps):
        with d2l.autograd.record():
            losses = [loss(net(a), b) for a, b in zip(X_parts, y_parts)]
        for each in losses:
            each.backward()
        trainer.step(24)
    return {name: p.list_data()[0].asnumpy() for name, p in net.collect_params().items()
            if p.grad_req == 'write'}


@pytest.mark.parametrize('devices', [1, 2, 4])
@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('optimizer', OPTIMIZERS, ids=['sgd', 'momentum', 'adam'])
def test_zero_in_float16_keeps_float32_master_shards_and_trains_as_one_device(
        optimizer, stage, devices):
    """multi_precision under ZeRO: each device's optimizer keeps the float32 master of its own
    chunk only (the key is the unit and the device); the float16 weights follow it, to float16's
    rounding (2^-11 of each weight) of sums taken in another order."""
    def run(devices, make):
        net = mlp(devices)
        net.cast('float16')
        X_parts, y_parts = d2l.split_batch(X.astype('float16'), y, devices)
        strategy = make(net)
        for _ in range(5):
            strategy.step(lambda: [loss(net(a).astype('float32'), b)
                                   for a, b in zip(X_parts, y_parts)], 24)
        return strategy
    name, settings = optimizer
    mixed = (name, dict(settings, multi_precision=True))
    one = run([d2l.cpu(1)], buckets(*mixed)).weights()
    sharded = run([d2l.cpu(i + 1) for i in range(devices)], lambda net: Zero(net, stage, *mixed))
    many = sharded.weights()
    for key in one:
        assert many[key].dtype == numpy.float16
        numpy.testing.assert_allclose(many[key], one[key], atol=2e-3, rtol=0)
    masters = sharded.optimizer.masters.values()
    assert all(m.dtype == numpy.float32 for m in masters)
    assert sum(m.size for m in masters) == sum(w.size for w in many.values())   # Ψ in all


@pytest.mark.parametrize('name', ['buckets of 600 B', 'ZeRO 1', 'ZeRO 2', 'ZeRO 3'])
def test_rescale_grad_is_honoured_as_the_trainer_honours_it(name):
    """One update path: the user's rescale_grad times 1/batch_size, through every strategy."""
    devices = [d2l.cpu(i) for i in (1, 2, 3)]
    optimizer = ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'rescale_grad': 0.5})
    trainer = train_with_trainer(devices, optimizer)
    many = train(devices, STRATEGIES[name](*optimizer)).weights()
    unscaled = train(devices, STRATEGIES[name]('sgd', {'learning_rate': 0.1, 'momentum': 0.9}))
    for key in trainer:
        numpy.testing.assert_allclose(many[key], trainer[key], atol=1e-5, rtol=0)
    assert max(numpy.abs(unscaled.weights()[k] - trainer[k]).max() for k in trainer) > 1e-3


def test_every_way_trains_the_same_parameters_and_refuses_what_is_not_one():
    """One filter (`data_parallel.updates.trained`) for the Trainer, Buckets and Zero alike:
    batch norm's running statistics are not trained, and an array is not a Parameter."""
    net = nn.HybridSequential()
    net.add(nn.Dense(4, in_units=3), nn.BatchNorm())
    net.initialize(device=[d2l.cpu(0), d2l.cpu(1)])
    net(np.ones((2, 3), device=d2l.cpu(0)))                  # batch norm's shapes, deferred
    params = net.collect_params()
    trained = [p for p in params.values() if p.grad_req == 'write']
    assert 0 < len(trained) < len(params)
    for make in (d2l.Trainer, Buckets):
        assert make(params, 'sgd').params == trained
        with pytest.raises(TypeError, match='a list of Parameters'):
            make([np.ones(3)], 'sgd')
    assert Zero(net, 1, 'sgd').params == trained
    with pytest.raises(TypeError, match='the net'):
        Zero(params, 1, 'sgd')


def test_buckets_are_filled_in_reverse_order_up_to_the_cap():
    params = list(mlp([d2l.cpu(1)]).collect_params().values())   # 512, 64, 640, 40 bytes
    names = lambda buckets: [[params.index(p) for p in b] for b in buckets]
    assert names(plan_buckets(params, 1)) == [[3], [2], [1], [0]]
    assert names(plan_buckets(params, 600)) == [[3, 2], [1, 0]]
    assert names(plan_buckets(params, math.inf)) == [[3, 2, 1, 0]]


@pytest.mark.parametrize('bad', [0, -1, None, 'big'])
def test_a_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match=f'not {bad!r}'):
        plan_buckets([], bad)


@pytest.mark.parametrize('bad', [0, 4, '1'])
def test_a_zero_stage_is_one_two_or_three(bad):
    with pytest.raises(ValueError, match=f'not {bad!r}'):
        Zero(mlp([d2l.cpu(1)]), bad)
    with pytest.raises(ValueError, match='stage'):
        predict.memory_per_device(10, 2, bad if bad != 0 else 5)


@pytest.mark.parametrize('prefetch', [-1, 1.5, None])
def test_prefetch_counts_units(prefetch):
    with pytest.raises(ValueError, match=f'not {prefetch!r}'):
        Zero(mlp([d2l.cpu(1)]), 3, prefetch=prefetch)


def test_a_net_holding_parameters_of_its_own_is_refused():
    class Own(nn.Block):
        def __init__(self):
            super().__init__()
            self.scale = d2l.nn.Parameter('scale', shape=(1,))
            self.dense = nn.Dense(2, in_units=2)
    net = Own()
    net.initialize(device=[d2l.cpu(1), d2l.cpu(2)])
    with pytest.raises(ValueError, match='into a child block'):
        Zero(net, 3)


def test_released_weights_stop_counting_until_restored():
    device = d2l.cpu(3)
    settle()
    before = d2l.device.memory(device).by_kind['weights']
    weight = d2l.device.label(np.ones((10, 10), device=device), 'weights')
    held = lambda: d2l.device.memory(device).by_kind['weights'] - before
    assert held() == 400
    d2l.device.release(weight)
    d2l.device.release(weight)                     # twice: still subtracted once
    assert held() == 0
    d2l.device.restore(weight)
    d2l.device.restore(weight)
    assert held() == 400
    del weight
    settle()
    assert held() == 0


def test_release_and_restore_act_on_whole_arrays_and_give_back_what_they_took():
    """A view shares its base's memory: releasing part of it means nothing, so a row is refused
    (it once took all 40,000 bytes away and gave back 400)."""
    device = d2l.cpu(3)
    npx.waitall()
    before = d2l.device.memory(device).by_kind['weights']
    weight = d2l.device.label(np.ones((100, 100), device=device), 'weights')
    held = lambda: d2l.device.memory(device).by_kind['weights'] - before
    with pytest.raises(ValueError, match='view of 400 of the 40000 bytes.*release the array'):
        d2l.device.release(weight[0])
    assert held() == 40_000
    d2l.device.release(weight.reshape(-1))          # a view of the whole: the whole
    assert held() == 0
    with pytest.raises(ValueError, match='view of 400 of the 40000 bytes.*restore the array'):
        d2l.device.restore(weight[0])
    assert held() == 0
    d2l.device.restore(weight)
    assert held() == 40_000


def test_a_device_list_with_duplicates_is_refused():
    with pytest.raises(ValueError, match=r'\[cpu\(1\), cpu\(1\)\]'):
        mlp([d2l.cpu(1), d2l.cpu(1)])


def test_each_stage_sends_what_the_calculator_predicts():
    devices = [d2l.cpu(i) for i in (1, 2, 3, 4)]
    for stage, gathers, make in [(0, 1, buckets(cap_bytes=1)), (1, 1, lambda n: Zero(n, 1)),
                                 (2, 1, lambda n: Zero(n, 2)), (3, 2, lambda n: Zero(n, 3)),
                                 (3, 2, lambda n: Zero(n, 3, prefetch=0))]:
        net = mlp(devices)
        X_parts, y_parts = d2l.split_batch(X, y, devices)
        strategy = make(net)
        with d2l.profiler.profile() as records:
            strategy.step(lambda: [loss(net(a), b) for a, b in zip(X_parts, y_parts)], 24)
            npx.waitall()
        psi = sum(w.size for w in strategy.weights().values())
        assert comm.bytes_sent(records) / 4 == predict.bytes_sent_per_device(4 * psi, 4, stage,
                                                                             gathers)
        halves = 2 + (gathers == 2)
        assert comm.bytes_sent(records, 'reduce-scatter') == comm.bytes_sent(records) / halves


def test_between_steps_a_device_holds_its_chunk_of_the_states():
    devices = [d2l.cpu(i) for i in (1, 2)]
    held = {}
    for stage in (1, 2, 3):
        settle()
        before = d2l.device.memory(devices[0])
        strategy = train(devices, lambda net: Zero(net, stage, 'adam'), steps=1)
        settle()
        after = d2l.device.memory(devices[0])
        held[stage] = {k: after.by_kind[k] - before.by_kind[k] for k in d2l.device.MEMORY_KINDS}
        psi = sum(w.size for w in strategy.weights().values())
        predicted = predict.memory_per_device(psi, 2, stage, 'adam')
        if stage == 1:          # its full gradients are freed after the update (their peak is
            predicted['gradients'] = 0          # in the step: test_the_peak_...)
        for kind, value in predicted.items():      # 2 units, each chunk 0 or 1 value over
            assert abs(held[stage][kind] - value) <= 2 * 4, (stage, kind)
        del strategy
    assert held[2]['weights'] == 2 * held[3]['weights']


def test_the_calculator_reproduces_zeros_figure_1():
    # 7.5B parameters on 64 devices, mixed-precision Adam: 2 + 2 + K = 12 bytes a parameter
    totals = [predict.model_states(7.5e9, 64, stage)['total'] / 1e9 for stage in predict.STAGES]
    assert [round(gb, 1) for gb in totals] == [120.0, 31.4, 16.6, 1.9]
    mixed = predict.bytes_per_kind('adam', 2, multi_precision=True)
    assert mixed == {'weights': 2, 'gradients': 2, 'optimizer state': 8, 'master weights': 4}
    assert [predict.model_states(7.5e9, 64, stage, mixed)['total'] for stage in
            predict.STAGES] == pytest.approx([gb * 1e9 for gb in totals])


@pytest.mark.parametrize('devices', [1, 2, 8, 64])
def test_the_calculator_reproduces_megatrons_distributed_optimizer(devices):
    # bf16 weights, float32 gradients (accumulated in float32), float32 master and Adam's two
    # values: 18 bytes a parameter, 6 + 12/d a device with the optimizer sharded (stage 1)
    megatron = {'weights': 2, 'gradients': 4, 'master weights': 4, 'optimizer state': 8}
    assert predict.model_states(1000, 1, 0, megatron)['total'] == 18 * 1000
    assert predict.model_states(1000, devices, 1, megatron)['total'] == pytest.approx(
        (6 + 12 / devices) * 1000)


def test_the_calculator_refuses_a_kind_it_cannot_predict():
    with pytest.raises(ValueError, match='activations depend on the batch'):
        predict.model_states(10, 2, 1, {'weights': 4, 'activations': 4})


def test_the_calculator_follows_zeros_table():
    plain = predict.memory_per_device(100, 4, 0, 'adam', bytes_per_value=1)
    assert plain == {'weights': 100, 'gradients': 100, 'optimizer state': 200}
    assert sum(predict.memory_per_device(100, 4, 1, 'adam', 1).values()) == 250
    assert sum(predict.memory_per_device(100, 4, 2, 'adam', 1).values()) == 175
    assert sum(predict.memory_per_device(100, 4, 3, 'adam', 1).values()) == 100
    assert predict.bytes_sent_per_device(400, 4, 3, gathers=2) == 900
    assert predict.overlapped_end([0, 1, 5], [2, 2, 1]) == 6


def test_communication_seconds_add_the_two_halves_of_an_allreduce():
    topology = comm.cost.Topology('t', 4, 1e9, 1e9, None, 1e-5)
    allreduce = comm.cost.allreduce_time('ring', 4e6, topology)
    assert predict.communication_seconds([4e6], 4, 1, 1e-5, 1e-9) == pytest.approx(allreduce)


WIDTHS = [32, 64, 48, 16, 10]              # four units of 8448, 12480, 3136 and 680 bytes


def wide_net(devices):
    net = nn.HybridSequential()
    for fan_in, fan_out in zip(WIDTHS[:-1], WIDTHS[1:]):
        net.add(nn.Dense(fan_out, in_units=fan_in, activation='relu'))
    np.random.seed(0)
    net.initialize(init=d2l.nn.init.Normal(sigma=0.1), device=devices)
    return net


def own_peaks(stage, prefetch=1):
    """Each kind's own peak on the first of two devices in a second step, above what it held
    before the step."""
    devices = [d2l.cpu(1), d2l.cpu(2)]
    net = wide_net(devices)
    inputs = np.array(numpy.random.default_rng(1).standard_normal((4, 32)).astype('float32'))
    X_parts, y_parts = d2l.split_batch(inputs, y[:4], devices)
    strategy = Zero(net, stage, 'adam', prefetch=prefetch)
    forward = lambda: [loss(net(a), b) for a, b in zip(X_parts, y_parts)]
    strategy.step(forward, 4)
    settle()
    d2l.device.reset_peak()
    before = d2l.device.memory(devices[0])
    strategy.step(forward, 4)
    settle()
    after = d2l.device.memory(devices[0])
    return {k: after.peak_by_kind[k] - before.by_kind[k] for k in ('weights', 'gradients')}


@pytest.mark.parametrize('prefetch', [0, 1, 2])
def test_stage_three_holds_its_shards_and_prefetch_plus_one_units_whole(engine_kind, prefetch):
    units = [(a * b + b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:])]
    window = max(sum(units[i:i + prefetch + 1]) for i in range(len(units)))
    assert own_peaks(3, prefetch)['weights'] == window        # above the shards, to the byte


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_a_gradient_is_held_only_until_its_unit_is_sent(stage):
    """On the naive engine (every operation done when pushed, so freed memory is freed at
    once), stages 2 and 3 hold above their shards only the largest unit's gradients twice:
    as backward made them and packed flat to send. Stage 1 keeps every gradient until the
    update, packed a unit at a time: at the peak, the first unit's (which backward reaches
    last) once more, while it is packed."""
    d2l.engine.use('naive')
    try:
        peaks = own_peaks(stage)
    finally:
        d2l.engine.use('threaded')
    units = [(a * b + b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:])]
    assert peaks['gradients'] == (sum(units) + units[0] if stage == 1 else 2 * max(units))


@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('sync', [True, False])
def test_accumulating_micro_batches_equals_one_step_on_their_whole(stage, sync):
    """Two micro-batches then one update equal one step on both: summed at the owners after
    each micro-batch (sync), or kept whole on each device and sent once (no_sync)."""
    devices = [d2l.cpu(i) for i in (1, 2, 3)]

    def run(micro):
        net = mlp(devices)
        strategy = Zero(net, stage, 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
        for _ in range(3):
            for rows in numpy.array_split(numpy.arange(24), micro):
                X_parts, y_parts = d2l.split_batch(X[rows[0]:rows[-1] + 1],
                                                   y[rows[0]:rows[-1] + 1], devices)
                strategy.accumulate(lambda: [loss(net(a), b) for a, b in zip(X_parts, y_parts)],
                                    sync=sync)
            strategy.update(24)
        return strategy.weights()
    whole, halves = run(1), run(2)
    for key in whole:
        numpy.testing.assert_allclose(halves[key], whole[key], atol=1e-5, rtol=0)


@pytest.mark.parametrize('stage', [1, 2, 3])
def test_without_sync_autograd_adds_each_micro_batch_into_the_parameters_grad(stage):
    """no_sync's accumulation is autograd's (`autograd.adding`): between micro-batches each
    device's gradients stay on its parameters, the sum of the micro-batches so far, to the bit
    what one device's backward passes give added up; no gradient is held anywhere else."""
    devices = [d2l.cpu(1), d2l.cpu(2)]
    net, reference = mlp(devices), mlp(devices)
    strategy = Zero(net, stage, 'sgd')
    expected = collections.defaultdict(int)
    for rows in (slice(0, 12), slice(12, 24)):
        X_parts, y_parts = d2l.split_batch(X[rows], y[rows], devices)
        strategy.accumulate(lambda: [loss(net(a), b) for a, b in zip(X_parts, y_parts)],
                            sync=False)
        with autograd.record():
            losses = [loss(reference(a), b) for a, b in zip(X_parts, y_parts)]
        for one in losses:
            one.backward()
        for name, param in reference.collect_params().items():
            for d, grad in enumerate(param.list_grad()):
                expected[name, d] = expected[name, d] + grad.asnumpy()
    for name, param in net.collect_params().items():
        for d, grad in enumerate(param.list_grad()):
            numpy.testing.assert_array_equal(grad.asnumpy(), expected[name, d])
    if stage == 1:
        assert all(unit.full_grads is None for unit in strategy.units)


@pytest.mark.parametrize('sync', [True, False])
def test_no_sync_sends_once_and_holds_every_gradient_whole(sync):
    """FSDP's trade, measured: without sync a device sends a step's gradients once, and holds
    them whole meanwhile; with it, each micro-batch sends and only shards stay."""
    devices = [d2l.cpu(1), d2l.cpu(2)]
    net = wide_net(devices)
    inputs = np.array(numpy.random.default_rng(1).standard_normal((8, 32)).astype('float32'))
    strategy = Zero(net, 2, 'sgd')
    units = [(a * b + b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:])]
    micro = 4
    settle()
    before = d2l.device.memory(devices[0]).by_kind['gradients']
    with d2l.profiler.profile() as records:
        for part in range(micro):
            X_parts, y_parts = d2l.split_batch(inputs[2 * part:2 * part + 2], y[:2], devices)
            strategy.accumulate(lambda: [loss(net(a), b) for a, b in zip(X_parts, y_parts)],
                                sync=sync or part == micro - 1)
            settle()
            if part == 0:
                between = d2l.device.memory(devices[0]).by_kind['gradients'] - before
        strategy.update(8)
        npx.waitall()
    reductions, n = (micro if sync else 1), len(devices)
    # each reduction: every device sends the (n - 1)/n of each unit that others own
    assert comm.bytes_sent(records, 'reduce-scatter') == reductions * n * sum(units) * (n - 1) / n
    assert between == (0 if sync else sum(units))


@pytest.mark.parametrize('devices', [1, 2, 4])
@pytest.mark.parametrize('stage', [1, 2, 3])
@pytest.mark.parametrize('optimizer', OPTIMIZERS, ids=['sgd', 'momentum', 'adam'])
def test_zero_with_checkpointed_units_trains_as_one_device(devices, stage, optimizer):
    """Recomputation inside ZeRO: each unit runs under `autograd.checkpoint`, so stage 3
    gathers a unit three times a step (forward, and again for the forward recomputed in
    backward, whose hook gathers once more before that backward): the weights still end as
    one device's, to float32 rounding of sums taken in another order."""
    def run(devices, make, checkpointed):
        net = wide_net(devices)
        inputs = np.array(numpy.random.default_rng(1).standard_normal((8, 32)).astype('float32'))
        X_parts, y_parts = d2l.split_batch(inputs, y[:8], devices)

        def forward_one(x):
            for unit in net.children():
                x = d2l.autograd.checkpoint(unit, x) if checkpointed else unit(x)
            return x
        strategy = make(net)
        for _ in range(3):
            strategy.step(lambda: [loss(forward_one(a), b) for a, b in zip(X_parts, y_parts)],
                          8)
        return strategy.weights()
    one = run([d2l.cpu(1)], buckets(*optimizer), False)
    many = run([d2l.cpu(i + 1) for i in range(devices)],
               lambda net: Zero(net, stage, *optimizer), True)
    for key in one:
        numpy.testing.assert_allclose(many[key], one[key], atol=1e-5, rtol=0)


def one_weight_trainer(rescale_grad, **trainer_kwargs):
    """A Trainer over one weight w = [1, 1] on cpu(1) and cpu(2), whose loss sum(w) gives every
    copy the gradient [1, 1]: the devices' sum is [2, 2]."""
    w = nn.Parameter('w', shape=(2,))
    w.initialize(init=d2l.nn.init.Constant(1), device=[d2l.cpu(1), d2l.cpu(2)])
    trainer = d2l.Trainer([w], 'sgd', {'learning_rate': 1.0, 'rescale_grad': rescale_grad},
                          **trainer_kwargs)

    def step(batch_size):
        with d2l.autograd.record():
            losses = [copy.sum() for copy in w.list_data()]
        for each in losses:
            each.backward()
        trainer.step(batch_size)
    return w, trainer, step


@pytest.mark.parametrize('store', ['device', 'local'])
@pytest.mark.parametrize('on_store', [False, True], ids=['update on the devices', 'in the store'])
def test_a_step_scales_by_its_own_batch_size_and_leaves_the_users_rescale_grad(store, on_store):
    """MXNet's step(batch_size): the summed gradient times rescale_grad / batch_size, the batch
    size of each step its own. The step's scale is passed to the update: the optimizer's
    rescale_grad stays what the user set (steps once overwrote it with 0.5 / batch_size)."""
    w, trainer, step = one_weight_trainer(0.5, kvstore=store, update_on_kvstore=on_store)
    step(4)                                     # w = 1 - 2 * 0.5 / 4
    step(2)                                     # then - 2 * 0.5 / 2
    for copy in w.list_data():
        assert copy.asnumpy().tolist() == [1 - 0.25 - 0.5] * 2
    assert trainer.optimizer.rescale_grad == 0.5


@pytest.mark.parametrize('name', ['buckets of 600 B', 'ZeRO 1', 'ZeRO 3'])
def test_buckets_and_zero_leave_the_users_rescale_grad(name):
    optimizer = ('sgd', {'learning_rate': 0.1, 'rescale_grad': 0.5})
    strategy = train([d2l.cpu(1), d2l.cpu(2)], STRATEGIES[name](*optimizer), steps=1)
    assert strategy.optimizer.rescale_grad == 0.5
