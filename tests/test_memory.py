"""Memory by kind on each device (`d2l.device.memory`): exact byte counts.

Other tests may still hold arrays, so each test reads its devices first (`held`) and checks
the change since (`change`). `settle` makes the counts final: every operation finished, and
none left in a worker's hands (a worker drops an operation, and the arrays its function
holds, just after completing it), then unreachable cycles collected.
"""
import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, device, engine, nn, np, optimizer
from d2lperf.device import ledger
from strategies import checks

pytestmark = pytest.mark.usefixtures('fresh_engine')

CPU1, CPU2 = d2l.cpu(1), d2l.cpu(2)
DEVICES = (CPU1, CPU2)


def finish_operations():
    """Wait for every operation, then for one no-op on every lane: its worker has dropped the
    operation before it, and with it the arrays that operation's function held."""
    engine.wait_all()
    workers = getattr(engine.current(), 'workers', None)
    for dev, lane in list(workers.lanes) if workers is not None else ():
        engine.push(lambda: None, [], [], dev, 'settle', lane)
    engine.wait_all()


def settle():
    finish_operations()
    gc.collect()


def held(dev):
    settle()
    return device.memory(dev)


def change(before, dev):
    """The bytes by kind that `dev` holds now beyond `before`, kinds that did not change left
    out."""
    now = held(dev).by_kind
    return {kind: now[kind] - before.by_kind[kind] for kind in device.MEMORY_KINDS
            if now[kind] != before.by_kind[kind]}


def test_arrays_count_on_their_device_from_creation_until_freed(engine_kind):
    before1, before2 = held(CPU1), held(CPU2)
    a = np.ones((3, 4), 'float32', device=CPU1)
    b = np.zeros((10,), 'float64', device=CPU2)
    assert change(before1, CPU1) == {'temporaries': 48}
    assert change(before2, CPU2) == {'temporaries': 80}
    c = a + 1
    d = c.copyto(CPU2).astype('float16')            # the float32 copy is freed at once
    assert change(before1, CPU1) == {'temporaries': 96}
    assert change(before2, CPU2) == {'temporaries': 80 + 24}
    del a
    assert change(before1, CPU1) == {'temporaries': 48}
    del b, c
    assert change(before1, CPU1) == {}
    assert change(before2, CPU2) == {'temporaries': 24}
    del d
    assert change(before2, CPU2) == {}              # each array subtracted once, no more
    assert held(CPU1).total == before1.total and held(CPU2).total == before2.total


def test_a_view_is_not_counted_again_and_keeps_its_base_counted(engine_kind):
    before = held(CPU1)
    base = np.ones((4, 6), 'float32', device=CPU1)
    views = [base[1], base.reshape(6, 4), base.T, base[1:3].reshape(-1)]
    assert change(before, CPU1) == {'temporaries': 96}
    del base
    assert change(before, CPU1) == {'temporaries': 96}
    last = views.pop()
    views.clear()
    assert change(before, CPU1) == {'temporaries': 96}
    del last
    assert change(before, CPU1) == {}


def test_a_label_moves_the_bytes_of_the_memory_an_array_shares():
    before = held(CPU1)
    base = np.ones((5,), 'float32', device=CPU1)
    view = base[1:]
    assert device.label(view, 'weights') is view
    assert change(before, CPU1) == {'weights': 20}
    device.label(base, 'optimizer state')
    device.label(base, 'optimizer state')
    assert change(before, CPU1) == {'optimizer state': 20}
    empty = device.label(np.ones((0, 3), device=CPU1), 'weights')
    assert change(before, CPU1) == {'optimizer state': 20}
    del base, view, empty
    assert change(before, CPU1) == {}


def test_an_unknown_kind_or_a_device_that_is_none_are_refused():
    x = np.ones((2,), device=CPU1)
    with pytest.raises(ValueError, match=r"'weight' is not a kind.*'weights', 'master weights'"):
        device.label(x, 'weight')
    with pytest.raises(TypeError, match=r'needs a Device such as d2l.cpu\(1\)'):
        device.memory('cpu(1)')
    with pytest.raises(TypeError, match='reset_peak needs a Device'):
        device.reset_peak(1)


def test_a_device_never_used_holds_nothing_and_prints_in_mebibytes():
    unused = device.memory(d2l.cpu(97))
    assert unused.by_kind == dict.fromkeys(device.MEMORY_KINDS, 0) == unused.at_peak
    assert unused.total == unused.peak == 0
    text = str(device.memory(CPU1))
    assert text.startswith('cpu(1): ') and 'MiB held, peak' in text
    assert all(kind in text for kind in device.MEMORY_KINDS) and repr(device.memory(CPU1)) == text


def test_the_peak_and_the_kinds_at_the_peak_until_it_is_reset():
    settle()
    device.reset_peak(CPU1)
    start = device.memory(CPU1)
    assert start.peak == start.total and start.at_peak == start.by_kind
    small = np.ones((256,), 'float32', device=CPU1)             # 1 KiB
    large = np.ones((512,), 'float32', device=CPU1)             # 2 KiB
    del large
    device.label(small, 'weights')
    now = held(CPU1)
    assert now.total == start.total + 1024 and now.peak == start.total + 3072
    assert now.at_peak == dict(start.by_kind, temporaries=start.by_kind['temporaries'] + 3072)
    device.reset_peak()                                         # every device
    for dev in DEVICES:
        after = device.memory(dev)
        assert after.peak == after.total and after.at_peak == after.by_kind


def test_a_parameter_on_two_devices_counts_its_weight_and_gradient_on_each():
    before = {dev: held(dev) for dev in DEVICES}
    weight, bias = nn.Parameter('weight', (4, 3)), nn.Parameter('bias', (5,), grad_req='null')
    weight.initialize(device=[CPU1, CPU2])
    bias.initialize(device=[CPU1, CPU2])
    for dev in DEVICES:
        assert change(before[dev], dev) == {'weights': 48 + 20, 'gradients': 48}
    del weight, bias
    for dev in DEVICES:
        assert change(before[dev], dev) == {}


def test_optimizer_states_count_as_optimizer_state():
    before1, before2 = held(CPU1), held(CPU2)
    weight, grad = np.ones((5,), device=CPU1), np.ones((5,), device=CPU1)
    sgd = optimizer.SGD(learning_rate=0.1, momentum=0.9)
    sgd.update('w', weight, grad)
    assert change(before1, CPU1) == {'temporaries': 40, 'optimizer state': 20}
    adam = optimizer.Adam()
    adam.update('w', weight, grad)
    assert change(before1, CPU1) == {'temporaries': 40, 'optimizer state': 20 + 2 * 20}
    restored_sgd, restored_adam = optimizer.SGD(momentum=0.9), optimizer.Adam()
    restored_sgd.set_states(sgd.get_states(), lambda key: CPU2)
    restored_adam.set_states(adam.get_states(), lambda key: CPU2)
    assert change(before2, CPU2) == {'optimizer state': 20}     # Adam's wait for their weight
    restored_adam.update('w', weight.copyto(CPU2), grad.copyto(CPU2))
    assert change(before2, CPU2) == {'optimizer state': 20 + 2 * 20}
    del sgd, adam, restored_sgd, restored_adam, weight, grad
    assert change(before1, CPU1) == {} and change(before2, CPU2) == {}


def test_what_the_tape_keeps_for_backward_counts_as_activations_until_backward():
    net = nn.Sequential()
    net.add(nn.Dense(8, activation='relu', in_units=4), nn.Dense(2, in_units=8))
    net.initialize(device=CPU1)
    before = held(CPU1)
    x = np.ones((5, 4), 'float32', device=CPU1)
    with autograd.record():
        loss = (net(x) ** 2).sum()
    # kept: x and every array after it that an operation read (dense 5x8, relu 5x8, dense
    # 5x2, its square 5x2); the weights stay weights, and the loss is nobody's input
    assert change(before, CPU1) == {'activations': 4 * (5 * 4 + 5 * 8 + 5 * 8 + 5 * 2 + 5 * 2),
                                    'temporaries': 4}
    loss.backward()
    assert change(before, CPU1) == {'activations': 4 * 5 * 4, 'temporaries': 4}    # x, loss
    del x, loss
    assert change(before, CPU1) == {}


def test_an_array_freed_on_an_engine_worker_is_subtracted():
    before = held(CPU1)
    box = [np.ones((16,), device=CPU1)]
    finish_operations()
    freed_on, done = [], threading.Event()
    weakref.finalize(box[0], lambda: freed_on.append(threading.get_ident()))
    engine.push(lambda: (box.clear(), done.set()), [], [engine.Var()], CPU1, 'free')
    assert done.wait(30)
    assert freed_on and freed_on != [threading.get_ident()]
    assert change(before, CPU1) == {}


def test_frees_on_a_worker_while_this_thread_makes_arrays_lose_no_change():
    before1, before2 = held(CPU1), held(CPU2)
    box = [[np.ones((2,), device=CPU1) for _ in range(20_000)]]
    engine.wait_all()
    engine.push(box.clear, [], [engine.Var()], CPU1, 'free 20000 arrays')
    kept = [np.ones((3,), device=CPU2) for _ in range(20_000)]
    assert change(before1, CPU1) == {}
    assert change(before2, CPU2) == {'temporaries': 20_000 * 12}
    del kept
    assert change(before2, CPU2) == {}


def test_an_array_freed_while_released_is_taken_off_once_and_keeps_a_later_label():
    before = held(CPU1)
    weight = device.release(device.label(np.ones((4,), 'float32', device=CPU1), 'weights'))
    assert change(before, CPU1) == {}
    device.label(weight, 'gradients')                   # released: nothing to move yet
    assert change(before, CPU1) == {}
    device.restore(weight)
    assert change(before, CPU1) == {'gradients': 16}
    device.release(weight)
    del weight
    assert change(before, CPU1) == {}


def test_only_the_variables_that_hold_memory_are_held():
    """The ledger's fields are declared once, by `Held`, and HeldVar adds the engine's."""
    var = np.ones((2,), device=CPU1).var
    assert isinstance(var, device.Held) and isinstance(var, engine.Var)
    assert not hasattr(var, '__dict__') and set(device.Held.FIELDS) <= set(dir(var))
    assert not isinstance(engine.Var(), device.Held)


def test_pending_changes_are_added_up_as_arrays_are_made():
    arrays = [np.ones((1,), device=CPU1) for _ in range(3 * ledger.FOLD_AFTER)]
    assert len(ledger.memory_changes) <= 2 * ledger.FOLD_AFTER
    del arrays


def test_a_change_is_one_integer_that_allocates_nothing_to_collect():
    """Making and freeing an array's variable appends two int64s: no object the garbage
    collector would count, so that the changes pending never set off a collection."""
    from d2lperf.np.multiarray import HeldVar
    np.ones((1,), device=CPU1).wait_to_read()
    ledger.fold_changes()
    assert ledger.memory_changes.typecode == 'q' and not ledger.memory_changes
    var = HeldVar(CPU1, 12)
    del var
    made, freed = ledger.memory_changes[-2:]
    where = ledger.account(CPU1, 'temporaries')
    assert divmod(made, ledger.ACCOUNTS) == (12, where)
    assert divmod(freed, ledger.ACCOUNTS) == (-12, where)


def test_an_array_larger_than_a_change_carries_counts_to_the_byte():
    """An array accepted for its shape alone may hold more bytes than one change carries
    (`ledger.LARGEST`, 128 TiB): it is counted in parts, with the same sums and peaks."""
    from d2lperf.np.multiarray import HeldVar
    dev = d2l.cpu(3)
    before = held(dev)
    device.reset_peak(dev)
    var = HeldVar(dev, 3 * ledger.LARGEST + 5)
    var.label('weights')
    now = held(dev)
    assert change(before, dev) == {'weights': 3 * ledger.LARGEST + 5}
    assert now.peak - before.total == now.peak_by_kind['weights'] - before.by_kind['weights'] == (
        3 * ledger.LARGEST + 5)
    del var
    assert change(before, dev) == {}
    device.reset_peak(dev)


def added_one_at_a_time(changes):
    """The ledger's sums, added change by change: the meaning `Ledger.add` keeps in batches."""
    by_kind = dict.fromkeys(device.MEMORY_KINDS, 0)
    total = peak = 0
    at_peak, peak_by_kind = dict(by_kind), dict(by_kind)
    for number, nbytes in changes:
        kind = device.MEMORY_KINDS[number]
        by_kind[kind] += nbytes
        total += nbytes
        if nbytes > 0:
            peak_by_kind[kind] = max(peak_by_kind[kind], by_kind[kind])
            if total > peak:
                peak, at_peak = total, dict(by_kind)
    return by_kind, total, peak, at_peak, peak_by_kind


@checks(60)
@given(changes=st.lists(st.tuples(st.integers(0, len(device.MEMORY_KINDS) - 1),
                                  st.integers(-2 ** 40, 2 ** 40)), max_size=40),
       cuts=st.lists(st.integers(0, 40), max_size=4))
def test_changes_added_in_batches_give_the_sums_and_peaks_of_one_at_a_time(changes, cuts):
    import numpy
    book = ledger.Ledger()
    for start, end in zip([0, *sorted(cuts)], [*sorted(cuts), len(changes)]):
        batch = changes[start:end]
        if batch:
            kinds, sizes = numpy.array(batch, numpy.int64).reshape(-1, 2).T
            book.add(sizes, kinds)
    assert (book.by_kind, book.total, book.peak, book.at_peak, book.peak_by_kind) == (
        added_one_at_a_time(changes))


def test_arrays_freed_at_interpreter_exit_raise_nothing():
    code = textwrap.dedent('''
        import d2lperf as d2l
        from d2lperf import np
        kept = [np.ones((3,), device=d2l.cpu(i % 2)) for i in range(100)]
        view = kept[0][1:]
    ''')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and 'Exception ignored' not in done.stderr, done.stderr


# -- a property: random programs of arrays, against a model of the memory they hold --

DTYPES = {'float16': 2, 'float32': 4, 'float64': 8, 'int32': 4}
steps = st.one_of(
    st.tuples(st.just('create'), st.sampled_from(DEVICES),
              st.lists(st.integers(0, 4), max_size=3).map(tuple), st.sampled_from(list(DTYPES))),
    st.tuples(st.just('view'), st.integers(0, 40), st.sampled_from(['index', 'reshape', 'T'])),
    st.tuples(st.just('free'), st.integers(0, 40)),
    st.tuples(st.just('label'), st.integers(0, 40), st.sampled_from(device.MEMORY_KINDS)))


class Model:
    """What the arrays of a program hold: `handles` pairs each live array with its block of
    memory ({'device', 'kind', 'bytes'}), which views share; the peak by device as it goes."""

    def __init__(self):
        self.handles = []
        self.peak = dict.fromkeys(DEVICES, 0)
        self.at_peak = {dev: dict.fromkeys(device.MEMORY_KINDS, 0) for dev in DEVICES}
        self.peak_by_kind = {dev: dict.fromkeys(device.MEMORY_KINDS, 0) for dev in DEVICES}

    def run(self, step):
        getattr(self, step[0])(*step[1:])
        by_kind = self.by_kind()
        for dev in DEVICES:
            for kind, held_now in by_kind[dev].items():
                self.peak_by_kind[dev][kind] = max(self.peak_by_kind[dev][kind], held_now)
            if sum(by_kind[dev].values()) > self.peak[dev]:
                self.peak[dev], self.at_peak[dev] = sum(by_kind[dev].values()), by_kind[dev]

    def create(self, dev, shape, dtype):
        block = {'device': dev, 'kind': 'temporaries', 'bytes': DTYPES[dtype]}
        for n in shape:
            block['bytes'] *= n
        self.handles.append((np.zeros(shape, dtype, device=dev), block))

    def view(self, i, how):
        if not self.handles:
            return
        array, block = self.handles[i % len(self.handles)]
        if how == 'index' and array.shape and array.shape[0]:
            self.handles.append((array[0], block))
        else:
            self.handles.append((array.T if how == 'T' else array.reshape(-1), block))

    def free(self, i):
        if self.handles:
            del self.handles[i % len(self.handles)]

    def label(self, i, kind):
        if self.handles:
            array, block = self.handles[i % len(self.handles)]
            device.label(array, kind)
            block['kind'] = kind

    def by_kind(self):
        blocks = {id(block): block for _, block in self.handles}.values()
        held_now = {dev: dict.fromkeys(device.MEMORY_KINDS, 0) for dev in DEVICES}
        for block in blocks:
            held_now[block['device']][block['kind']] += block['bytes']
        return held_now


@checks(40)
@given(program=st.lists(steps, max_size=30))
def test_the_counts_follow_a_model_of_the_program(engine_kind, program):
    settle()
    device.reset_peak()
    before = {dev: device.memory(dev) for dev in DEVICES}
    model = Model()
    for step in program:
        model.run(step)
        finish_operations()         # so that a freed array is freed before the next step
    expected = model.by_kind()
    for dev in DEVICES:
        now = device.memory(dev)
        assert {k: now.by_kind[k] - before[dev].by_kind[k] for k in device.MEMORY_KINDS} == expected[dev]
        assert now.peak - before[dev].total == model.peak[dev]
        assert {k: now.at_peak[k] - before[dev].by_kind[k] for k in device.MEMORY_KINDS} == (
            model.at_peak[dev])
        assert {k: now.peak_by_kind[k] - before[dev].by_kind[k]
                for k in device.MEMORY_KINDS} == model.peak_by_kind[dev]


def test_the_ledger_is_a_module_of_its_own_behind_the_contract_names():
    """device/ledger.py holds the ledger, device/devices.py the devices; d2l.device.memory and
    reset_peak (contract names) and label (every layer's) are the ledger's."""
    from d2lperf.device import devices
    assert (d2l.device.memory, d2l.device.reset_peak, d2l.device.label) == (
        ledger.memory, ledger.reset_peak, ledger.label)
    assert not {'memory', 'reset_peak', 'Held', 'label', 'MEMORY_KINDS'} & set(vars(devices))
