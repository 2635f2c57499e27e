"""Pipeline schedules as data: each is a valid order, and implies the bubble and the memory the
papers give (GPipe, 1F1B, Megatron's interleaved 1F1B)."""
import collections

import pytest
from hypothesis import given, strategies as st

from d2lperf import model_parallel
from d2lperf.model_parallel import bubble, held_microbatches, schedule, simulate
from d2lperf.model_parallel.schedules import in_order

pytestmark = pytest.mark.chapter('model_parallelism')

layouts = st.integers(1, 6).flatmap(lambda p: st.tuples(
    st.just(p), st.integers(1, 4).map(lambda k: k * p), st.integers(1, 3)))


@given(layouts, st.sampled_from(model_parallel.SCHEDULES))
def test_every_stage_runs_each_pass_once_and_each_backward_after_its_forward(layout, name):
    p, m, v = layout
    v = v if name == 'interleaved' else 1
    plan = schedule(name, p, m, v)
    assert len(plan) == p
    for s, actions in enumerate(plan):
        assert collections.Counter(actions) == collections.Counter(
            model_parallel.Action(kind, i, c, s + c * p) for kind in 'FB' for i in range(m)
            for c in range(v))
        seen = set()
        for action in actions:
            if action.kind == 'B':
                assert action._replace(kind='F') in seen
            seen.add(action)
    simulate(plan)                       # and no stage waits for what comes after it


@given(layouts, st.sampled_from(model_parallel.SCHEDULES))
def test_in_order_runs_each_stage_in_its_order_and_each_pass_after_what_it_needs(layout, name):
    """The executor's order: every action once, each stage's in the schedule's order, a
    forward after the part before's, a backward after its forward and the part after's."""
    p, m, v = layout
    v = v if name == 'interleaved' else 1
    plan = schedule(name, p, m, v)
    order = list(in_order(plan))
    assert sorted(order) == sorted(a for actions in plan for a in actions)
    for s, actions in enumerate(plan):
        assert [a for a in order if a.stage % p == s] == actions
    ran, last = set(), p * v - 1
    for action in order:
        k, i = action.stage, action.microbatch
        if action.kind == 'F':
            assert k == 0 or ('F', i, k - 1) in ran
        else:
            assert ('F', i, k) in ran and (k == last or ('B', i, k + 1) in ran)
        ran.add((action.kind, i, k))


@pytest.mark.parametrize('name', ['gpipe', '1f1b'])
@pytest.mark.parametrize('p, m', [(1, 1), (2, 3), (4, 4), (4, 8), (3, 7), (8, 32)])
def test_the_bubble_is_p_minus_one_over_m_plus_p_minus_one(name, p, m):
    share_of_time, _ = bubble(simulate(schedule(name, p, m), forward=1.0, backward=2.0))
    assert share_of_time == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize('p, m, v', [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (3, 9, 2)])
def test_interleaving_divides_the_bubble_by_the_chunks(p, m, v):
    _, share_of_ideal = bubble(simulate(schedule('interleaved', p, m, v), 1.0, 2.0))
    assert share_of_ideal == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize('p, m', [(4, 8), (4, 2), (3, 3), (5, 12)])
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p_minus_s(p, m):
    assert [held_microbatches(actions) for actions in schedule('gpipe', p, m)] == [m] * p
    assert [held_microbatches(actions) for actions in schedule('1f1b', p, m)] == [
        min(p - s, m) for s in range(p)]


@pytest.mark.parametrize('args, message', [
    (('zigzag', 2, 4), "unknown schedule 'zigzag'"),
    (('1f1b', 0, 4), 'stages is a whole number of at least 1, not 0'),
    (('gpipe', 2, 2.5), 'microbatches is a whole number of at least 1, not 2.5'),
    (('1f1b', 2, 4, 2), "use 'interleaved'"),
    (('interleaved', 4, 6, 2), '6 micro-batches do not divide among 4 stages'),
])
def test_a_bad_setting_names_the_value_and_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        schedule(*args)
