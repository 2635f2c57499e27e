"""The data-parallel calculator against the memory counter: each kind's peak during a ZeRO
step, to the byte, and the peak that rises with the stage when one unit is most of the model."""
import gc

import numpy
import pytest
from hypothesis import given, strategies as st

from strategies import checks

import d2lperf as d2l
from d2lperf import nn, np, npx
from d2lperf.data_parallel import Buckets, Zero, predict

pytestmark = pytest.mark.chapter('data_parallel_at_scale')

DEVICES = [d2l.cpu(i + 1) for i in range(4)]
ADAM = ('adam', {'learning_rate': 1e-3})

INPUTS, BATCH, KINDS = 32, 16, ('weights', 'gradients', 'optimizer state')


def wide_mlp(widths):
    net = nn.Sequential()
    for width in widths[:-1]:
        net.add(nn.Dense(width, activation='relu'))
    net.add(nn.Dense(widths[-1]))
    np.random.seed(0)
    net.initialize(device=DEVICES)
    return net


def held():
    gc.collect()
    npx.waitall()
    return d2l.device.memory(DEVICES[0])


def strategy(net, stage, prefetch):
    if stage == 0:
        return Buckets(net.collect_params(), *ADAM, cap_bytes=1)
    return Zero(net, stage, *ADAM, prefetch=prefetch)


def measured_peaks(widths, stage, prefetch=1):
    """Device 0's peak of each kind, and of everything, during a second step (naive engine),
    above what it held before the net was made; and each unit's parameter sizes."""
    rng = numpy.random.default_rng(0)
    x = np.array(rng.normal(size=(BATCH, INPUTS)).astype('float32'))
    y = np.array(rng.integers(0, widths[-1], BATCH))
    loss = d2l.SoftmaxCrossEntropyLoss()
    d2l.engine.use('naive')
    try:
        before = held()
        net = wide_mlp(widths)
        xs, ys = d2l.split_batch(x, y, DEVICES)
        net(xs[0]).wait_to_read()
        step = strategy(net, stage, prefetch)
        forward = lambda: [loss(net(a), b) for a, b in zip(xs, ys)]
        step.step(forward, BATCH)
        held()
        d2l.device.reset_peak()
        step.step(forward, BATCH)
        after = held()
    finally:
        d2l.engine.use('threaded')
    units = [[p.list_data()[0].size for p in child.collect_params().values()]
             for child in net.children()]
    peaks = {kind: after.peak_by_kind[kind] - before.by_kind[kind] for kind in KINDS}
    return units, peaks, after.peak - before.total


WIDE = (64, 1024, 10)     # the middle unit holds 84% of the weights


@pytest.mark.parametrize('stage, prefetch', [(0, 1), (1, 1), (2, 1), (3, 0), (3, 1)])
def test_each_kinds_peak_is_predicted_to_the_byte(stage, prefetch):
    units, peaks, _ = measured_peaks(WIDE, stage, prefetch)
    predicted = predict.peak_states(units, len(DEVICES), stage, 'adam', prefetch)
    assert peaks == {kind: predicted[kind] for kind in KINDS}


def test_the_peak_rises_with_the_stage_when_one_unit_is_most_of_the_model():
    """Between steps each stage holds less (`model_states`); at the peak the largest unit's
    terms (sent twice at stages 2 and 3, gathered with the next at stage 3) outgrow what the
    stage shards, measured and predicted alike."""
    runs = {(stage, prefetch): measured_peaks(WIDE, stage, prefetch)
            for stage, prefetch in [(1, 1), (2, 1), (3, 0), (3, 1)]}
    units = runs[1, 1][0]
    psi = sum(map(sum, units))
    assert max(map(sum, units)) / psi > 0.8
    between = [predict.memory_per_device(psi, 4, stage) for stage in (1, 2, 3)]
    assert sum(between[0].values()) > sum(between[1].values()) > sum(between[2].values())
    totals = [runs[key][2] for key in runs]
    assert totals == sorted(totals) and totals[0] < totals[-1], totals
    predicted = [predict.peak_states(units, 4, stage, 'adam', prefetch)['total']
                 for stage, prefetch in runs]
    assert predicted == sorted(predicted) and predicted[0] < predicted[-1], predicted


def test_many_small_units_make_the_peak_fall_with_the_stage():
    units = [[1000, 10]] * 48
    totals = [predict.peak_states(units, 64, stage)['total'] for stage in predict.STAGES]
    assert totals == sorted(totals, reverse=True)


UNITS = st.lists(st.lists(st.integers(1, 10**6), min_size=1, max_size=4), min_size=1,
                 max_size=12)


@checks(200)
@given(UNITS, st.integers(1, 512), st.sampled_from(predict.STAGES), st.integers(0, 3))
def test_a_step_never_holds_less_than_between_steps(units, devices, stage, prefetch):
    """Each kind's peak is at least what `model_states` says a device holds between steps,
    and at most one unit more than unsharded training holds, the prefetched units aside."""
    psi = sum(map(sum, units))
    peaks = predict.peak_states(units, devices, stage, 'adam', prefetch)
    between = predict.memory_per_device(psi, devices, stage, 'adam')
    for kind in ('weights', 'gradients', 'optimizer state'):
        assert peaks[kind] >= between[kind] - 1e-6 * psi
    largest = 4 * max(map(sum, units))
    assert peaks['gradients'] <= 4 * psi + 2 * largest + 4 * len(units)
    assert peaks['optimizer state'] <= 8 * psi
