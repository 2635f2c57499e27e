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
the last place). Measured (`python -m pytest -s tests/test_kvstore_dist_float16.py` prints
it): 1000 dist_async pushes of values in [0, 0.002) onto a float16 key under SGD(learning_rate=1) pull
back within a relative 4.8e-4 of the float64 sum, which is the one float16 rounding of the
result (at most 2^-11 = 4.9e-4); summed and kept in float16, as MXNet does by default, the
same pushes end up to 1.2e-2 off. Momentum is float32 here too; states travel in the key's
dtype, as the workers save them.

Every message is checked against what it may be before anything changes: a refusal
(`ProtocolError`, naming the sender's rank) ends the job with the reason.

A worker that leaves (says `bye`) after fewer pushes of a key than another has made leaves a
round that can never be complete: the server refuses the pulls that wait for it ('refused',
naming the departed rank), rather than keep them waiting forever. Waiting for work has no
deadline (workers may compute for long between calls, and their own waits have one); the
rest of a message, and a reply's send, give up after D2LPERF_TIMEOUT. Taught in "Parameter
Servers".
"""
import math
import sys
import time

import numpy

from ..device import cpu
from ..ndarray import from_host
from ..optimizer import SGD
from .keys import describe
from .protocol import (HEADER_TAG, DeadlineError, ProtocolError, log, receive, send,
                       wait_for_sends, wait_until)

LINE_FORWARDING_SECONDS = 0.5     # before a refusing server aborts the job (see run_server)


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

    def serve(self):
        """Handle messages until every worker said goodbye."""
        from mpi4py import MPI
        while len(self.departed) < self.num_workers:
            self.wait_for_work()
            command, key, array, sender = receive(
                self.world, MPI.ANY_SOURCE,
                waiting_for=f'server rank {self.world.rank} waited for the rest of a message')
            started = time.perf_counter()              # the handling, not the waiting
            handler = getattr(self, 'on_' + command, None)
            if handler is None:
                raise ProtocolError(f'rank {sender} sent {command!r}, which a server does '
                                    'not take')
            if sender in self.departed:
                raise ProtocolError(f'rank {sender} sent {command!r} after its bye; a worker '
                                    'says bye once, when it closes its store, and then nothing')
            handler(key, array, sender)
            log(self.world.rank, f'{command} key {key} from rank {sender}',
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
                                 f'take its {command} of key id {key}')

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
            raise ProtocolError(f'rank {sender} used key id {key}, which was never initialized')
        return self.values[key]

    def check_chunk(self, key, array, sender, what):
        """Refuse `array` unless it has the key's dtype and this server's slice size."""
        stored, dtype = self.values[key], self.dtypes[key]
        if array is None or array.shape != stored.shape or array.dtype != dtype:
            raise ProtocolError(f'rank {sender} sent {what} of {describe(array)} for key id '
                                f'{key}, whose slice on this server is shape {stored.shape} '
                                f'{dtype}')

    def on_init(self, key, array, sender):
        self.from_worker(sender, 'init')
        if array is None:
            raise ProtocolError(f'rank {sender} sent init of key id {key} without a value; an '
                                "init carries the key's first value (kv.init(key, value))")
        if key in self.values:
            raise ProtocolError(f'rank {sender} initialized key id {key} a second time')
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
    """Serve until every worker has left, then end the process; on a broken message or a
    deadline passed, the job."""
    try:
        Server(world, synchronous, num_workers).serve()
    except (ProtocolError, DeadlineError) as error:
        print(f'd2lperf server (rank {world.rank}): {type(error).__name__}: {error}',
              file=sys.stderr, flush=True)
        # The line goes through a pipe to MPICH's process manager, which forwards it; Abort
        # tears the job down at once, sometimes before the forwarding. Give it a moment.
        time.sleep(LINE_FORWARDING_SECONDS)
        world.Abort(3)
    sys.exit(0)
