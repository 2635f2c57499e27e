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
workers sent) on the stored value. Taught in "Parameter Servers".
"""
import sys
import time

import numpy

from .device import cpu
from .ndarray import from_host
from .optimizer import SGD
from .transport import ProtocolError, log, receive, send


class Server:
    """The state and the receive loop of one server process."""

    def __init__(self, world, synchronous, num_workers):
        self.world, self.synchronous, self.num_workers = world, synchronous, num_workers
        self.values = {}          # key id -> NDArray, this server's chunk
        self.rounds = {}          # key id -> rounds applied
        self.pushes = {}          # key id -> pushes received, one count per worker
        self.sums = {}            # (key id, round) -> [sum of pushes, pushes in it]
        self.waiting = {}         # key id -> workers whose pull waits for a round
        self.optimizer = None
        self.staged_states = {}   # key id -> momentum chunk, until 'end' commits them
        self.sending = []         # (key id, requests, buffers) of replies still in flight
        self.goodbyes = 0

    def serve(self):
        """Handle messages until every worker said goodbye."""
        from mpi4py import MPI
        while self.goodbyes < self.num_workers:
            command, key, array, sender = receive(self.world, MPI.ANY_SOURCE)
            started = time.perf_counter()              # the handling, not the waiting
            handler = getattr(self, 'on_' + command, None)
            if handler is None:
                raise ProtocolError(f'rank {sender} sent {command!r}, which a server does '
                                    'not take')
            handler(key, array, sender)
            log(self.world.rank, f'{command} key {key} from rank {sender}',
                0 if array is None else array.nbytes, started)
            self.sending = [item for item in self.sending if not MPI.Request.Testall(item[1])]
        for _, requests, _ in self.sending:
            MPI.Request.Waitall(requests)

    def reply(self, worker, command, key=0, array=None):
        self.sending.append((key, *send(self.world, worker, command, key, array)))

    def finish_replies(self, key):
        """Wait until the values of `key` in flight have left: an update may then overwrite them."""
        from mpi4py import MPI
        for requests in [requests for sent, requests, _ in self.sending if sent == key]:
            MPI.Request.Waitall(requests)

    def known(self, key, sender):
        if key not in self.values:
            raise ProtocolError(f'rank {sender} used key id {key}, which was never initialized')
        return self.values[key]

    def on_init(self, key, array, sender):
        if key in self.values:
            raise ProtocolError(f'rank {sender} initialized key id {key} a second time')
        self.values[key] = from_host(array, cpu(0))
        self.rounds[key], self.pushes[key], self.waiting[key] = 0, [0] * self.num_workers, []
        self.reply(sender, 'ack', key)

    def on_push(self, key, array, sender):
        stored = self.known(key, sender)
        if array is None or array.shape != stored.shape or array.dtype != stored.dtype:
            raise ProtocolError(f'rank {sender} pushed {describe(array)} to key id {key}, '
                                f'which holds {describe(stored)}')
        if not self.synchronous:
            self.apply(key, array)
            return
        round_ = self.pushes[key][sender]
        self.pushes[key][sender] += 1
        total = self.sums.get((key, round_))
        if total is None:           # the received buffer is ours: it starts the sum
            self.sums[key, round_] = [array, 1]
        else:
            total[0] += array
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
        self.known(key, sender)
        self.waiting[key].append(sender)
        self.answer_waiting_pulls(key)

    def answer_waiting_pulls(self, key):
        still_waiting = []
        for worker in self.waiting[key]:
            if self.synchronous and self.pushes[key][worker] > self.rounds[key]:
                still_waiting.append(worker)
            else:
                self.reply(worker, 'value', key, self.values[key].wait_to_read().data)
        self.waiting[key] = still_waiting

    def on_optimizer(self, key, array, sender):
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
        states = self.optimizer.get_states() if self.optimizer else {}
        for state_key, state in sorted(states.items()):
            self.reply(sender, 'state', state_key, state)
        self.reply(sender, 'end')

    def on_set_state(self, key, array, sender):
        stored = self.known(key, sender)
        if array is None or array.shape != stored.shape or array.dtype != stored.dtype:
            raise ProtocolError(f'rank {sender} sent a state {describe(array)} for key id '
                                f'{key}, which holds {describe(stored)}')
        self.staged_states[key] = array

    def on_end(self, key, array, sender):
        """Commit the states sent since the last 'end' (a load is all or nothing)."""
        if self.optimizer is None:
            raise ProtocolError(f'rank {sender} sent optimizer states before an optimizer')
        try:
            self.optimizer.set_states(self.staged_states, device_of=lambda _: cpu(0))
        except ValueError as error:
            raise ProtocolError(f'rank {sender} sent states the optimizer refuses: {error}')
        self.staged_states = {}
        self.reply(sender, 'ack')

    def on_bye(self, key, array, sender):
        self.goodbyes += 1


def describe(array):
    return 'nothing' if array is None else f'shape {tuple(array.shape)} {array.dtype}'


def run_server(world, synchronous, num_workers):
    """Serve until every worker has left, then end the process; on a broken message, the job."""
    try:
        Server(world, synchronous, num_workers).serve()
    except ProtocolError as error:
        print(f'd2lperf server (rank {world.rank}): ProtocolError: {error}', file=sys.stderr,
              flush=True)
        world.Abort(3)
    sys.exit(0)
