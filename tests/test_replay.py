"""Tests of d2lperf.comm.replay: an allreduce's chunks replayed from the profile of a real run
end where the algorithm says they do, and the drawings have a mark for every step, chunk and
transfer."""
import matplotlib
import pytest

import d2lperf as d2l
from d2lperf import comm, np, npx, profiler

matplotlib.use('Agg')
pytestmark = [pytest.mark.usefixtures('fresh_engine'), pytest.mark.chapter('parameter_servers')]


def run_and_replay(algorithm, n, size=64):
    devices = [d2l.cpu(i + 1) for i in range(n)]
    arrays = [np.full((size,), 10.0 ** j, device=d) for j, d in enumerate(devices)]
    npx.waitall()
    with profiler.profile() as records:
        comm.allreduce(arrays, algorithm)
        npx.waitall()
    transfers = comm.transfers_in(records)
    names = [str(d) for d in devices]
    return transfers, names, comm.chunk_states(transfers, names)


@pytest.mark.parametrize('n', [2, 3, 4])
def test_the_ring_reduce_scatters_then_all_gathers(n):
    _, _, (steps, states) = run_and_replay('ring', n)
    assert steps == [('reduce-scatter', s) for s in range(1, n)] + [
        ('all-gather', s) for s in range(1, n)]
    after_reduce_scatter = states[n - 2]
    assert all(sum(len(chunk) == n for chunk in row) == 1 for row in after_reduce_scatter)
    assert all(chunk == set(range(n)) for row in states[-1] for chunk in row)


@pytest.mark.parametrize('algorithm', ['naive', 'split', 'tree', 'ring2'])
def test_every_chunk_ends_with_every_contribution(algorithm):
    n = 4
    _, _, (steps, states) = run_and_replay(algorithm, n)
    assert len(steps) == len(comm.schedule(algorithm, n).steps)
    assert all(chunk == set(range(n)) for row in states[-1] for chunk in row)
    assert all(any(len(chunk) < n for row in state for chunk in row) for state in states[:-1])


def bars(ax):
    return sum(len(collection.get_paths()) for collection in ax.collections)


def test_the_drawings_have_a_mark_for_every_step_chunk_and_transfer():
    transfers, names, (steps, states) = run_and_replay('ring', 4)
    fig = comm.draw_chunk_states(steps, states, names)
    assert len(fig.axes) == len(steps) == 6
    assert all(len(ax.texts) == 4 * 4 for ax in fig.axes)
    assert fig.axes[-1].texts[0].get_text() == '0123'
    ax = comm.draw_transfers(transfers, names)
    assert bars(ax) == len(transfers)
    assert [t.get_text() for t in ax.get_yticklabels()] == [f'into {n}' for n in names]
    assert len(ax.get_legend().get_texts()) == len(steps)
    matplotlib.pyplot.close('all')
