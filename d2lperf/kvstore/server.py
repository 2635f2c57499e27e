"""A parameter server: one process that holds a slice of every key and updates it.

Each server owns the same slice of every value (server s of S holds chunk s of the flattened
array, as ps-lite slices large values), so the traffic of a step spreads evenly over the
servers. The server is one receive loop over messages from any worker; as it handles one
message at a time, every update of a key is atomic without a lock.

Synchronous mode (dist_sync, dist_device_sync): a worker's n-th push of a key belongs to round
n; a round is applied once every worker has pushed into it, and a worker's pull is answered
once every round it pushed into is applied. Pushes into a later round wait in their own sum,
so a fast worker may run ahead without mixing rounds. Asynchronous mode (dist_async): each
push is applied as it arrives and a pull is answered at once.

Applying: without an optimizer the stored value becomes the sum of the round's pushes; with
one, the server runs the optimizer's update (`optimizer.SGD`, built from the numbers the
workers sent) on the stored value.

float16 keys travel as float16 but are summed and kept in float32 here (MXNet keeps them in
float16 unless the optimizer has multi_precision=True; a server is where a weight takes
thousands of updates, and each float16 rounding loses an update smaller than half a unit in
the last place). Measured (`python -m pytest -s tests/mpi/test_kvstore_dist_float16.py` prints
it): 1000 dist_async pushes of values in [0, 0.002) onto a float16 key under
SGD(learning_rate=1) pull back within a relative 4.8e-4 of the float64 sum, which is the one
float16 rounding of the result (at most 2^-11 = 4.9e-4); summed and kept in float16, as MXNet
does by default, the same pushes end up to 1.2e-2 off. Momentum is float32 here too; states
travel in the key's dtype, as the workers save them.

Every message is checked against what it may be before anything changes: a refusal
(`ProtocolError`, naming the sender's rank) ends the job with the reason. So does any other
error (a bug, an update that fails): a server that died silently would leave every worker
waiting for its answer. A failing server prints why, naming itself, the message in hand and
its key (worker 0 sends each key's name with its init; the wire carries ids), sends the same
line to every worker still here ('failed', which a waiting worker raises as ServerError),
and exits non-zero, so that the launcher names it and ends the job.

A worker that leaves (says `bye`) after fewer pushes of a key than another has made leaves a
round that can never be complete: the server refuses the pulls that wait for it ('refused',
naming the departed rank), rather than keep them waiting forever. Waiting for work has no
deadline (workers may compute for long between calls, and their own waits have one); the
rest of a message, and a reply's send, give up after D2LPERF_TIMEOUT. Taught in "Parameter
Servers".
"""
import math
import os
import sys
import time
import traceback

import numpy

from ..device import cpu
from ..np.multiarray import from_host
from ..optimizer import SGD
from .keys import describe, key_of_state
from .protocol import (HEADER_TAG, TEXT, DeadlineError, ProtocolError, as_text, key_id, log,
                       receive, send, text_of, wait_for_sends, wait_until)

FAREWELL_SECONDS = 2.0    # how long a failing server waits for its last words to leave


class Server:
    """The state and the receive loop of one server process."""

    def __init__(self, world, synchronous, num_workers):
        self.world, self.synchronous, self.num_workers = world, synchronous, num_workers
        self.values = {}          # key id -> NDArray, this server's chunk (float32 for float16)
        self.dtypes = {}          # key id -> the dtype the key travels in
        self.rounds = {}          # key id -> rounds applied
        self.pushes = {}          # key id -> pushes received, one count per worker
        self.sums = {}            # (key id, round) -> [sum of pushes, pushes in it]
        self.waiting = {}         # key id -> workers whose pull waits for a round
        self.optimizer = None
        self.staged_states = {}   # key id -> momentum chunk, until 'end' commits them
        self.sending = []         # (key id, worker, command, requests, buffers) of replies
        self.departed = set()     # workers that said goodbye
        self.names = {}           # key id -> the key, for messages
        self.handling = None      # (command, key id, sender) of the message in hand

    def serve(self):
        """Handle messages until every worker said goodbye."""
        from mpi4py import MPI
        while len(self.departed) < self.num_workers:
            self.handling = None
            self.wait_for_work()
            command, key, array, sender = receive(
                self.world, MPI.ANY_SOURCE,
                waiting_for=f'server rank {self.world.rank} waited for the rest of a message')
            self.handling = command, key, sender
            started = time.perf_counter()              # the handling, not the waiting
            handler = getattr(self, 'on_' + command, None)
            if handler is None:
                raise ProtocolError(f'rank {sender} sent {command!r}, which a server does '
                                    'not take')
            if sender in self.departed:
                raise ProtocolError(f'rank {sender} sent {command!r} after its bye; a worker '
                                    'says bye once, when it closes its store, and then nothing')
            handler(key, array, sender)
            log(self.world.rank, f'{command} {self.key_name(key)} from rank {sender}',
                0 if array is None else array.nbytes, started)
        for sent, worker, command, requests, _ in self.sending:
            self.wait_for_reply(sent, worker, command, requests)

    def wait_for_work(self):
        """Wait, with no deadline, until a message comes; the replies in flight move meanwhile
        (each test drives MPI's progress) and are let go once sent."""
        from mpi4py import MPI

        def arrived():
            self.sending = [item for item in self.sending if not MPI.Request.Testall(item[3])]
            return self.world.Iprobe(source=MPI.ANY_SOURCE, tag=HEADER_TAG)
        wait_until(arrived, math.inf, 'work')

    def reply(self, worker, command, key=0, array=None):
        self.sending.append((key, worker, command, *send(self.world, worker, command, key,
                                                         array)))

    def wait_for_reply(self, key, worker, command, requests):
        wait_for_sends(requests, f'server rank {self.world.rank} waited for rank {worker} to '
                                 f'take its {command} of {self.key_name(key)}')

    def key_name(self, key):
        """How a message names key id `key`: by the key, once a worker has said its name."""
        return f'key {self.names[key]!r}' if key in self.names else f'key id {key}'

    def finish_replies(self, key):
        """Wait until the values of `key` in flight have left: an update may then overwrite them."""
        for sent, worker, command, requests, _ in self.sending:
            if sent == key:
                self.wait_for_reply(sent, worker, command, requests)

    def from_worker(self, sender, command):
        """Refuse a message from a rank that is not a worker (workers are ranks 0 to W-1)."""
        if not 0 <= sender < self.num_workers:
            raise ProtocolError(
                f"rank {sender} sent {command!r}, but it is not a worker: this server's "
                f'workers are ranks 0 to {self.num_workers - 1}. Every rank must see the same '
                'D2LPERF_NUM_SERVERS: start the job with python -m d2lperf.launch -s SERVERS')

    def known(self, key, sender, command):
        """The key's chunk, after checking that a worker sent `command` for a known key."""
        self.from_worker(sender, command)
        if key not in self.values:
            raise ProtocolError(f'rank {sender} used {self.key_name(key)}, which was never '
                                'initialized')
        return self.values[key]

    def check_chunk(self, key, array, sender, what):
        """Refuse `array` unless it has the key's dtype and this server's slice size."""
        stored, dtype = self.values[key], self.dtypes[key]
        if array is None or array.shape != stored.shape or array.dtype != dtype:
            raise ProtocolError(f'rank {sender} sent {what} of {describe(array)} for '
                                f'{self.key_name(key)}, whose slice on this server is shape '
                                f'{stored.shape} {dtype}')

    def on_name(self, key, array, sender):
        """Learn the key of id `key` (its `keys.state_name`), to name it in messages."""
        self.from_worker(sender, 'name')
        name = text_of(array) if array is not None and array.dtype == TEXT else None
        try:
            named = key_of_state(name or '')
        except ValueError:
            named = None
        if named is None or key_id(named) != key:
            raise ProtocolError(f'rank {sender} named key id {key} {name!r}, which is not the '
                                "name of a key of that id ('int:3' for key 3, 'str:w' for 'w')")
        self.names[key] = named

    def on_init(self, key, array, sender):
        self.from_worker(sender, 'init')
        if array is None:
            raise ProtocolError(f'rank {sender} sent init of {self.key_name(key)} without a '
                                "value; an init carries the key's first value (kv.init(key, "
                                'value))')
        if key in self.values:
            raise ProtocolError(f'rank {sender} initialized {self.key_name(key)} a second time')
        self.dtypes[key] = array.dtype
        self.values[key] = from_host(summable(array), cpu(0))
        self.rounds[key], self.pushes[key], self.waiting[key] = 0, [0] * self.num_workers, []
        self.reply(sender, 'ack', key)

    def on_push(self, key, array, sender):
        self.known(key, sender, 'push')
        self.check_chunk(key, array, sender, 'a push')
        if not self.synchronous:
            self.apply(key, summable(array))
            return
        round_ = self.pushes[key][sender]
        self.pushes[key][sender] += 1
        total = self.sums.get((key, round_))
        if total is None:           # the received buffer is ours: it starts the sum
            self.sums[key, round_] = [summable(array), 1]
        else:
            total[0] += array       # float16 into a float32 sum: widened, never rounded
            total[1] += 1
        while self.sums.get((key, self.rounds[key]), [None, 0])[1] == self.num_workers:
            self.apply(key, self.sums.pop((key, self.rounds[key]))[0])
            self.rounds[key] += 1
        self.answer_waiting_pulls(key)

    def apply(self, key, total):
        """Update `key` with `total`, a buffer this server owns (wrapped, never copied)."""
        self.finish_replies(key)
        if self.optimizer is None:
            self.values[key] = from_host(total, cpu(0))
        else:
            self.optimizer.update(key, self.values[key], from_host(total, cpu(0)))

    def on_pull(self, key, array, sender):
        self.known(key, sender, 'pull')
        self.waiting[key].append(sender)
        self.answer_waiting_pulls(key)

    def answer_waiting_pulls(self, key):
        still_waiting = []
        for worker in self.waiting[key]:
            departed = self.left_behind(key, worker)
            if departed is not None:
                numbers = [departed, self.pushes[key][departed], self.pushes[key][worker]]
                self.reply(worker, 'refused', key, numpy.array(numbers, numpy.int64))
            elif self.synchronous and self.pushes[key][worker] > self.rounds[key]:
                still_waiting.append(worker)
            else:
                self.reply(worker, 'value', key,
                           self.wire_value(key, self.values[key].wait_to_read().data))
        self.waiting[key] = still_waiting

    def wire_value(self, key, data):
        """`data` (host values of `key`) in the dtype the key travels in."""
        return data if data.dtype == self.dtypes[key] else data.astype(self.dtypes[key])

    def on_optimizer(self, key, array, sender):
        self.from_worker(sender, 'optimizer')
        if array is None or array.shape != (4,) or array.dtype != numpy.float64:
            raise ProtocolError(f'rank {sender} sent optimizer numbers {describe(array)}; '
                                'they are 4 float64: learning_rate, momentum, wd, rescale_grad')
        learning_rate, momentum, wd, rescale_grad = (float(v) for v in array)
        try:
            self.optimizer = SGD(learning_rate, momentum, wd, rescale_grad)
        except ValueError as error:
            raise ProtocolError(f'rank {sender} sent optimizer numbers SGD refuses: {error}')
        self.reply(sender, 'ack')

    def on_get_states(self, key, array, sender):
        self.from_worker(sender, 'get_states')
        states = self.optimizer.get_states() if self.optimizer else {}
        for state_key, state in sorted(states.items()):
            self.reply(sender, 'state', state_key, self.wire_value(state_key, state))
        self.reply(sender, 'end')

    def on_set_state(self, key, array, sender):
        self.known(key, sender, 'set_state')
        self.check_chunk(key, array, sender, 'an optimizer state')
        self.staged_states[key] = summable(array)

    def on_end(self, key, array, sender):
        """Commit the states sent since the last 'end' (a load is all or nothing)."""
        self.from_worker(sender, 'end')
        if self.optimizer is None:
            raise ProtocolError(f'rank {sender} sent optimizer states before an optimizer')
        try:
            self.optimizer.set_states(self.staged_states, device_of=lambda _: cpu(0))
        except ValueError as error:
            raise ProtocolError(f'rank {sender} sent states the optimizer refuses: {error}')
        self.staged_states = {}
        self.reply(sender, 'ack')

    def left_behind(self, key, worker):
        """A departed worker that never pushed into the round `worker` waits for, or None."""
        if not self.synchronous or self.pushes[key][worker] <= self.rounds[key]:
            return None
        return next((departed for departed in sorted(self.departed)
                     if self.pushes[key][departed] < self.pushes[key][worker]), None)

    def on_bye(self, key, array, sender):
        self.from_worker(sender, 'bye')
        self.departed.add(sender)
        for key in self.waiting:
            self.answer_waiting_pulls(key)


def summable(array):
    """`array` in the dtype this server sums and keeps it in: float32 for float16 (a new
    array), any other dtype as it is (the received buffer, not copied)."""
    return array.astype(numpy.float32) if array.dtype == numpy.float16 else array


def run_server(world, synchronous, num_workers):
    """Serve until every worker has left, then end the process; on any error, fail (below)."""
    server = Server(world, synchronous, num_workers)
    try:
        server.serve()
    except Exception as error:      # noqa: BLE001 - whatever it is, the workers must learn it
        fail(server, error)
    sys.exit(0)


def fail(server, error):
    """Say why on stderr, send the same line to every worker still here, and exit non-zero.

    Not MPI_Abort, which kills every rank at once, often before their lines (and this one)
    are forwarded: a worker that reads why it will get no answer can say so itself. Nor
    MPI_Finalize, which would wait for the other ranks: the launcher, seeing this rank end,
    ends the job."""
    line = failure_line(server, error)
    if not isinstance(error, (ProtocolError, DeadlineError)):   # not a refusal: show where
        traceback.print_exception(error)
        line += f' (its traceback is in the output of rank {server.world.rank})'
    print(line, file=sys.stderr, flush=True)
    tell_workers(server, line)
    sys.stdout.flush()
    os._exit(1)


def failure_line(server, error):
    """'d2lperf server (rank 2) failed on the push of key 'w' from rank 0: ValueError: ...'"""
    where = 'while it waited for a message'
    if server.handling is not None:
        command, key, sender = server.handling
        keyed = command in ('init', 'name', 'push', 'pull', 'set_state')
        where = (f'on the {command}' + (f' of {server.key_name(key)}' if keyed else '')
                 + f' from rank {sender}')
    return (f'd2lperf server (rank {server.world.rank}) failed {where}: '
            f'{type(error).__name__}: {error}')


def tell_workers(server, line):
    """Send `line` to every worker that has not left, within FAREWELL_SECONDS."""
    from mpi4py import MPI
    key = server.handling[1] if server.handling else 0
    sent = [send(server.world, worker, 'failed', key, as_text(line))
            for worker in range(server.num_workers) if worker not in server.departed]
    requests = [request for requests, _buffers in sent for request in requests]
    try:
        wait_until(lambda: MPI.Request.Testall(requests), time.monotonic() + FAREWELL_SECONDS,
                   'the last words')
    except DeadlineError:
        pass                        # a worker that takes nothing: the launcher ends it
