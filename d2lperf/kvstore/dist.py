"""The distributed store's worker side: worker processes push gradients to server processes
and pull weights (MXNet's roles, each an MPI rank; the engine's threads are another thing).

One MPI job holds every process; the rank decides the role. The last S ranks are servers
(S = D2LPERF_NUM_SERVERS, which `d2lperf.launch -s` sets; 1 when unset), the others workers.
`create_dist` never returns on a server: it runs the server loop (`server.py`) and ends
the process once every worker has said goodbye (`close`, called at exit). On a worker it
returns the store, whose `rank` and `num_workers` count workers only.

Every value is sliced across all servers (chunk s of the flattened array lives on server s).
With an optimizer (`set_optimizer`), the servers run the update: the workers send only its
hyperparameters, as numbers. In dist_sync a server applies a round once every worker has
pushed the key, so n workers of batch b each take the step that one process would take at
batch n·b when the optimizer's rescale_grad is 1/(n·b): gradients are summed, not averaged
(`train_mnist` calls `Trainer.step(n·b)`). Every worker makes the same calls: one that any
worker refuses is refused on every worker (`agree_on_failure`), so none is left waiting for
the others.
dist_device_sync first sums a worker's values on its first value's device, dist_sync on the
host; dist_async applies each push as it arrives.

Every wait (for every rank to start, for a server's answer, for a send to leave, at the
workers' barrier) gives up after D2LPERF_TIMEOUT seconds with a `DeadlineError` naming the
rank waited for, the key and the command (`protocol.wait_until`); uncaught, it ends the
process, and the launcher the job. In dist_sync, a pull that waits for a round a departed
worker never pushed into is refused (`IncompleteRoundError`, naming that worker). A server
that fails tells every worker before it exits: a worker waiting on it raises `ServerError`
with the server's error. The servers' SGD updates floating-point keys only: an integer key
is refused at `init` (or `set_optimizer`), as each step would be rounded to a whole number.
Taught in "Parameter Servers".

No doctest here: an example needs an MPI job of workers and servers, which doctest cannot
start. tests/mpi/test_kvstore_dist.py runs every method below under `d2lperf.launch`; the
examples of `base.KVStoreBase` show the same calls on one process.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import zipfile
from typing import TYPE_CHECKING

import numpy

from .. import engine
from ..np.multiarray import NDArray, from_host
from ..optimizer import SGD
from ..utils import atomic_write
from . import DIST_TYPES as TYPES
from .base import KVStoreBase
from .keys import describe, state_name
from .protocol import (VALUE_DTYPES, IncompleteRoundError, ProtocolError, ServerError, as_text,
                       key_id, log, receive, roll_call, send, start_mpi, text_of,
                       wait_for_request, wait_for_sends)

if TYPE_CHECKING:
    from mpi4py import MPI

    from .base import Key, Keys, Values

_created = {}      # the one store of this process: creating a second would split MPI again
SERVER_HEAD_START = 1.0   # seconds a worker waits before raising a server's failure (`answer`)


@KVStoreBase.register(*TYPES)
def create_dist(name: str) -> DistKVStore:
    """The distributed store `name` on a worker; on a server, serve and exit."""
    if name not in TYPES:
        raise ValueError(f'unknown distributed key-value store {name!r}; choose one of {TYPES}')
    if _created:
        store = next(iter(_created.values()))
        if store.type != name:
            raise ValueError(f'this process already joined a {store.type!r} job; one '
                             f'process runs one distributed store, not also {name!r}')
        return store
    try:
        MPI = start_mpi()
    except ImportError as error:
        raise ImportError("the distributed key-value store needs mpi4py: pip install -e "
                          "'.[mpi]', and start the job with python -m d2lperf.launch") from error
    end_on_uncaught_error()
    world = MPI.COMM_WORLD
    servers = num_servers(world.size)
    first_server = world.size - servers
    roll_call(world, lambda missing: f'rank {world.rank} waited for '
                                     f'{rank_names(missing, first_server)} to reach '
                                     f'd2l.kvstore.create({name!r})')
    worker_comm = world.Split(int(world.rank >= first_server), world.rank)  # workers alone
    if world.rank >= first_server:
        from .server import run_server
        run_server(world, name != 'dist_async', first_server)
    _created[name] = store = DistKVStore(name, world, worker_comm, servers)
    atexit.register(store.close)
    return store


def rank_names(ranks, first_server):
    """'worker rank 1, server rank 3': ranks of the world, with their roles."""
    return ', '.join(f'{"server" if rank >= first_server else "worker"} rank {rank}'
                     for rank in ranks)


def end_on_uncaught_error():
    """Make an uncaught exception end this process once Python has printed it: MPICH's
    MPI_Finalize, which mpi4py calls at exit, waits for every rank, so a failed worker would
    sit there, alive, and the launcher never learn it failed. Exiting at once, unfinalized,
    as a dead rank does, lets the launcher name it and end the job."""
    shown = sys.excepthook

    def show_and_exit(kind, error, traceback):
        shown(kind, error, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.excepthook = show_and_exit


def num_servers(world_size):
    text = os.environ.get('D2LPERF_NUM_SERVERS', '1')
    if not text.isdigit() or not 1 <= int(text) < world_size:
        raise ValueError(f'D2LPERF_NUM_SERVERS={text!r}, but a job of {world_size} processes '
                         f'needs between 1 and {world_size - 1} servers (and one worker at '
                         'least): start it with python -m d2lperf.launch -n WORKERS -s SERVERS')
    return int(text)


class DistKVStore(KVStoreBase):
    """The worker's side: checks every call, then talks to the servers."""

    def __init__(self, type: str, world: MPI.Comm, worker_comm: MPI.Comm,
                 servers: int) -> None:
        self.type, self.world, self.worker_comm = type, world, worker_comm
        self.rank, self.num_workers = worker_comm.Get_rank(), worker_comm.Get_size()
        self.servers = list(range(world.Get_size() - servers, world.Get_size()))
        self.keys = {}            # key -> (key id, shape, dtype)
        self.closed = False

    def init(self, key: Keys, value: Values) -> None:
        """Give each key its first value; every worker calls it, worker 0's values are kept.

        All or nothing: if any worker refuses any key, every worker raises (none is left
        waiting for the others) and the store is left as it was."""
        self.check_open()
        refusal, new = None, []
        try:
            new = self.new_keys(self.typed_pairs(key, value))
        except Exception as error:      # noqa: BLE001 - every worker must learn of it, below
            refusal = error
        about = f'init of {key!r}'
        if self.agree_on_failure(refusal is not None, about):
            raise refusal or ValueError('another worker refused this init; its error says why')
        if self.rank == 0:
            for one_key, identity, value in new:    # its name first: for the servers' errors
                about = f'init of key {one_key!r}'
                self.to_servers('name', identity, as_text(state_name(one_key)), about,
                                sliced=False)
                self.to_servers('init', identity, value, about)
                self.wait_for_acks(about)
        for one_key, identity, value in new:
            self.keys[one_key] = (identity, value.shape, value.dtype)
        self.note_first_key([one_key for one_key, _, _ in new])
        self.meet(about)

    def new_keys(self, pairs):
        """[(key, key id, host value)] of an init, once every key passed every check. Only
        worker 0 sends values: the others keep an empty array of the value's shape and dtype."""
        new = []
        for key, values in pairs:
            identity = key_id(key)
            if key in self.keys or key in [known for known, _, _ in new]:
                raise ValueError(f'key {key!r} is already initialized; init a key once, then '
                                 'push and pull it')
            if identity in [known[0] for known in self.keys.values()] + [i for _, i, _ in new]:
                raise ValueError(f'key {key!r} has the same id as another key; rename it')
            host = host_copy(values[0]) if self.rank == 0 else \
                numpy.empty(values[0].shape, values[0].dtype)
            if host.dtype not in VALUE_DTYPES:
                raise ValueError(f'the store holds {[d.name for d in VALUE_DTYPES]}, not '
                                 f'{host.dtype} (key {key!r}): cast the value with .astype first')
            if self.optimizer is not None:
                check_updatable(key, host.dtype)
            new.append((key, identity, host))
        return new

    def push(self, key: Keys, value: Values) -> None:
        """Send `value` (an array or a list, one per device) to the servers, summed."""
        checked = [(key, values, self.check(key, values))
                   for key, values in self.typed_pairs(key, value)]
        for key, values, (identity, shape, dtype) in checked:
            started = time.perf_counter()
            total = self.local_sum(values)
            self.to_servers('push', identity, total, f'push of key {key!r}')
            log(self.rank, f'push key {key!r} (id {identity})', total.nbytes, started)

    def pull(self, key: Keys, out: Values) -> None:
        """Copy the stored value of `key` into `out` (an array or a list of them).

        Each output gets the whole value or keeps its own: a refused answer (ProtocolError)
        never leaves it half-written. With one server the answer is one message, checked
        before it lands, so it is received straight into a lone host output; with several,
        their slices land in a buffer of our own, copied out once every slice has arrived."""
        checked = [(key, outs, self.check(key, outs)) for key, outs in self.typed_pairs(key, out)]
        for key, outs, (identity, shape, dtype) in checked:
            started = time.perf_counter()
            for server in self.servers:
                self.request(server, 'pull', identity, f'pull of key {key!r}')
            direct = len(outs) == 1 and len(self.servers) == 1
            own = writable_buffer(outs[0], shape, dtype) if direct else None
            value = own if own is not None else numpy.empty(shape, dtype)
            self.receive_slices(key, value)
            if own is None:          # the received buffer is ours: wrapped, not copied
                for target in outs:
                    target[...] = from_host(value, target.device)
            log(self.rank, f'pull key {key!r} (id {identity})', value.nbytes, started)

    def pushpull(self, key: Keys, value: Values, out: Values | None = None) -> None:
        """Push every key, then pull every key into `out` (by default into the pushed arrays):
        an array that serves several keys is pushed for each before a pull overwrites it."""
        for one_key, outs in self.typed_pairs(key, out) if out is not None else ():
            self.check(one_key, outs)           # a refused output is refused before the push
        self.push(key, value)
        self.pull(key, value if out is None else out)

    def set_optimizer(self, optimizer: SGD) -> None:
        """Have the servers update with `optimizer` (an SGD); only its numbers travel."""
        if not isinstance(optimizer, SGD):
            raise TypeError(f'the servers run d2lperf.optimizer.SGD, not {optimizer!r}')
        self.check_open()
        for key, (_, _, dtype) in self.keys.items():
            check_updatable(key, dtype)
        self.optimizer = optimizer
        numbers = numpy.array([optimizer.learning_rate, optimizer.momentum, optimizer.wd,
                               optimizer.rescale_grad], numpy.float64)
        if self.rank == 0:
            self.to_servers('optimizer', 0, numbers, 'set_optimizer', sliced=False)
            self.wait_for_acks('set_optimizer')
        self.meet('set_optimizer')

    def barrier(self) -> None:
        """Wait until every worker got here."""
        self.meet('barrier')

    def meet(self, about, collective=None, buffer=None):
        """Wait until every worker has started `collective` (by default a barrier), within
        D2LPERF_TIMEOUT; `buffer`, the collective's, is kept if it is given up on."""
        others = [rank for rank in range(self.num_workers) if rank != self.rank]
        whom = (f'worker rank {others[0]}' if len(others) == 1 else
                f'the other workers (ranks {", ".join(map(str, others))})')
        wait_for_request(self.worker_comm.Ibarrier() if collective is None else collective,
                         f'rank {self.rank} waited for {whom} to reach {about}', buffer)

    def save_optimizer_states(self, path: str) -> None:
        """Worker 0 gathers the servers' momentum into one .npz (written atomically); if it
        cannot, every worker raises."""
        self.check_open()
        self.optimizer_or_error()
        about = f'save_optimizer_states({path!r})'
        self.meet(about)                # every worker's pulls are done: the rounds are complete
        refusal = None
        if self.rank == 0:
            try:
                arrays = self.gather_states(about)
                atomic_write(path, lambda file: numpy.savez(file, **arrays))
            except Exception as error:  # noqa: BLE001 - every worker must learn of it, below
                refusal = error
        if self.agree_on_failure(refusal is not None, about):
            raise refusal or OSError(f'worker 0 could not save optimizer states to {path!r}; '
                                     'its error says why')

    def gather_states(self, about):
        """{state name: momentum} of every key, each put together from the servers' slices."""
        chunks = {}
        for server in self.servers:
            self.request(server, 'get_states', 0, about)
            for identity, chunk in self.receive_states(server, about):
                chunks.setdefault(identity, []).append(chunk)
        return {state_name(key): numpy.concatenate(chunks[identity]).reshape(shape)
                for key, (identity, shape, _) in self.keys.items() if identity in chunks}

    def load_optimizer_states(self, path: str) -> None:
        """Send the states of a .npz that save_optimizer_states wrote to the servers."""
        self.check_open()
        about = f'load_optimizer_states({path!r})'
        refusal = None
        if self.rank == 0:
            try:
                states = self.read_states(path)
            except (ValueError, OSError) as error:
                refusal = error
            else:
                for index, server in enumerate(self.servers):
                    for identity, state in states.items():
                        self.request(server, 'set_state', identity, about,
                                     self.slice_of(state, index))
                    self.request(server, 'end', 0, about)
                self.wait_for_acks(about)
        if self.agree_on_failure(refusal is not None, about):
            raise refusal or ValueError(f'worker 0 refused optimizer states {path!r}; '
                                        'its error says why')

    def close(self) -> None:
        """Say goodbye to the servers (they exit when every worker has); called at exit."""
        if not self.closed:
            self.closed = True
            for server in self.servers:
                self.request(server, 'bye', 0, 'bye')

    # The checks every call makes before anything travels.

    def check_open(self):
        if self.closed:
            raise RuntimeError('this key-value store is closed; its servers have left')

    def check(self, key: Key, arrays: list[NDArray]) -> tuple[int, tuple, numpy.dtype]:
        if key not in self.keys:
            raise KeyError(f'key {key!r} was never initialized: call kv.init({key!r}, value) '
                           'on every worker first')
        self.check_open()
        identity, shape, dtype = self.keys[key]
        for array in arrays:
            if tuple(array.shape) != shape or numpy.dtype(array.dtype) != dtype:
                raise ValueError(f'key {key!r} holds shape {shape} {dtype}, not shape '
                                 f'{tuple(array.shape)} {numpy.dtype(array.dtype)}')
        return identity, shape, dtype

    def read_states(self, path):
        """{key id: state} of a states file, all checked against the keys and the optimizer."""
        if self.optimizer is None:
            raise ValueError('set an optimizer (kv.set_optimizer) before loading its states')
        names = {state_name(key): key for key in self.keys}
        states = {}
        try:
            saved = numpy.load(path, allow_pickle=False)
        except (EOFError, zipfile.BadZipFile, ValueError) as error:
            raise ValueError(f'{path} is not an .npz of optimizer states ({error}): write it '
                             'with kv.save_optimizer_states') from error
        if not hasattr(saved, 'files'):
            raise ValueError(f'{path} holds one array, not the .npz of optimizer states that '
                             'kv.save_optimizer_states writes')
        with saved:
            for name in saved.files:
                if name not in names:
                    raise ValueError(f'{path} holds a state for {name!r}, which this store '
                                     f'does not have (its keys: {sorted(names)})')
                identity, shape, dtype = self.keys[names[name]]
                state = saved[name]
                if state.shape != shape or state.dtype != dtype:
                    raise ValueError(f'{path}: the state for {name!r} is shape {state.shape} '
                                     f'{state.dtype}; the key holds {shape} {dtype}')
                states[identity] = state
        if states and self.optimizer.momentum == 0:
            raise ValueError(f'{path} holds momentum, but this SGD has momentum=0: set the '
                             'optimizer the states were saved with')
        return states

    def agree_on_failure(self, failed, about):
        """Whether any worker failed, told to every worker within D2LPERF_TIMEOUT, so that none
        is left waiting for the others."""
        from mpi4py import MPI
        flag = numpy.array([int(failed)], numpy.int64)
        self.meet(about, self.worker_comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX), flag)
        return bool(flag[0])

    # Messages.

    def local_sum(self, values):
        """One host array: the sum of this worker's values, on a device or on the host. A lone
        host value is sent from its own buffer (the send completes before push returns)."""
        if len(values) == 1:
            return host_view(values[0])
        if self.type == 'dist_device_sync' and isinstance(values[0], NDArray):
            total = values[0].copy()
            for value in values[1:]:
                total += value.copyto(total.device)
            return host_view(total)
        total = host_copy(values[0])
        if not isinstance(values[0], NDArray):        # asnumpy copied already; this did not
            total = total.copy()
        for value in values[1:]:
            total += host_copy(value)
        return total

    def slice_of(self, array, index):
        return numpy.array_split(array.reshape(-1), len(self.servers))[index]

    def to_servers(self, command, identity, array, about, sliced=True):
        pending = [send(self.world, server, command, identity,
                        self.slice_of(array, index) if sliced else array)
                   for index, server in enumerate(self.servers)]
        wait_for_sends([request for requests, _ in pending for request in requests],
                       self.waited(self.servers, 'take', about))

    def request(self, server, command, identity, about, array=None):
        requests, _buffers = send(self.world, server, command, identity, array)
        wait_for_sends(requests, self.waited([server], 'take', about))

    def waited(self, servers, verb, about):
        """What a DeadlineError says this worker waited for: `servers` to `verb` `about`."""
        whom = (f'server rank {servers[0]}' if len(servers) == 1 else
                f'the servers (ranks {servers[0]} to {servers[-1]})')
        return f'rank {self.world.Get_rank()} waited for {whom} to {verb} its {about}'

    def answer(self, server, about, into=None, for_message=None):
        """(command, key id, array, sender) of `server`'s next message to this worker, which
        answers its `about`; ServerError if it is the server's last word: why it failed."""
        got, key, array, sender = receive(self.world, server, into, for_message,
                                          waiting_for=self.waited([server], 'answer', about))
        if got == 'failed':
            # The server exits right after telling us: let its exit reach the launcher first,
            # so that the launcher names the rank that failed, not this one.
            time.sleep(SERVER_HEAD_START)
            raise ServerError(f"rank {self.world.Get_rank()}'s {about} will never be "
                              f'answered: {text_of(array)}')
        return got, key, array, sender

    def key_name(self, identity):
        """How an error names the key of id `identity`: by the key itself where it is ours."""
        names = {known[0]: key for key, known in self.keys.items()}
        return (f'key {names[identity]!r}' if identity in names else
                f"key id {identity} (not one of this store's keys)")

    def expect(self, server, command, identity, about):
        got, key, array, sender = self.answer(server, about)
        if got != command or (identity is not None and key != identity):
            wanted = '' if identity is None else f' for {self.key_name(identity)}'
            raise ProtocolError(f'rank {sender} answered {got!r} for {self.key_name(key)}; '
                                f'this worker waited for {command!r}{wanted}')
        return key, array

    def receive_slices(self, key, value):
        """Every server's slice of `key` into `value`; after a refused slice the others are
        still taken, so each channel stays in step, and the first refusal is raised."""
        slices = numpy.array_split(value.reshape(-1), len(self.servers))
        refusal = None
        for server, part in zip(self.servers, slices):
            try:
                self.receive_value(server, key, part)
            except (ProtocolError, IncompleteRoundError) as error:
                refusal = refusal or error
        if refusal is not None:
            raise refusal

    def receive_value(self, server, name, part):
        """Receive `server`'s slice of the value of key `name` into `part`, a slice of the
        pull's buffer."""
        identity = self.keys[name][0]
        about = f'pull of key {name!r}'
        if self.type != 'dist_async':
            about += ", which waits for every worker's push"
        got, key, value, sender = self.answer(server, about, part, ('value', identity))
        if got == 'refused' and key == identity and value is not None and value.size == 3:
            departed, its_pushes, pushes = (int(number) for number in value)
            raise IncompleteRoundError(
                f'rank {server} refused the pull of key {name!r} by rank '
                f'{self.world.Get_rank()}: worker rank {departed} left after {its_pushes} '
                f'pushes of it, and this worker pushed {pushes}, so the round can never be '
                'complete. In dist_sync every worker pushes every key the same number of '
                'times (give each the same number of batches)')
        if got != 'value' or key != identity:
            raise ProtocolError(f'rank {sender} answered {got!r} for {self.key_name(key)}; this '
                                f'worker waited for a value of key {name!r}')
        if value is not part:
            raise ProtocolError(f'rank {server} sent {describe(value)} for a slice of shape '
                                f'{part.shape} {part.dtype}')

    def receive_states(self, server, about):
        while True:
            got, key, array, sender = self.answer(server, about)
            if got == 'end':
                return
            if got != 'state' or array is None:
                raise ProtocolError(f'rank {sender} sent {got!r} among optimizer states')
            yield key, array

    def wait_for_acks(self, about):
        for server in self.servers:
            self.expect(server, 'ack', None, about)


def check_updatable(key, dtype):
    """Refuse an integer key under the servers' SGD: each step would be rounded to a whole
    number, so a step below one would be lost, silently."""
    if numpy.dtype(dtype).kind in 'iu':
        raise ValueError(f'key {key!r} holds {numpy.dtype(dtype)}, and the servers\' SGD '
                         'updates floating-point values only (a step would be rounded to a '
                         'whole number, and lost when below one): init the key with a float '
                         "value (value.astype('float32')), or keep integers in a store without "
                         'set_optimizer, which sums them exactly')


def host_copy(value):
    return value.asnumpy() if isinstance(value, NDArray) else numpy.asarray(value)


def writable_buffer(target, shape, dtype):
    """The host buffer of `target`, free to be received into, or None where it has none (a GPU
    array, an output that is not one C-contiguous block)."""
    if not isinstance(target, NDArray) or target.device.kind != 'cpu':
        return None
    target.wait_to_read()                 # raises the failure of what wrote it, if any
    engine.wait_to_write(target.var)
    data = target.data
    fits = data.shape == shape and data.dtype == dtype
    return data if fits and data.flags.c_contiguous and data.flags.writeable else None


def host_view(value):
    """The host values of `value`, without a copy where they already live on the host."""
    if isinstance(value, NDArray) and value.device.kind == 'cpu':
        return numpy.asarray(value.wait_to_read().data)
    return host_copy(value)
