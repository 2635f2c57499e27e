"""Messages between parameter-server processes: a fixed header, then the array's raw bytes.

What travels is numbers only. A message is an int64 header (command, key id, dtype code,
ndim, up to 8 dims, payload bytes) sent with MPI's buffer interface (mpi4py's upper-case
`Isend`/`Recv` on NumPy arrays), then the payload as its own message; nothing is pickled, so
a peer can send wrong numbers but never code. The receiver checks the header against what it
can be before it takes the payload, and refuses (`ProtocolError`, naming the sender's rank)
anything it cannot account for: an unknown command, a dtype outside `DTYPES`, a shape that
cannot be, a payload whose size is not the header's, a truncated header. Every header comes
with exactly one payload message (empty when there is nothing to carry), so even a refused
message leaves the channel in step.

Keys: `key_id` maps an int or str key to a 56-bit number by a stable hash (BLAKE2b of the
key's type and text), the same in every process and in any order of `init`, so no process
has to tell the others its keys. A store refuses two keys with the same id.

Text travels as UTF-8 bytes (dtype uint8, `TEXT`), read back as text and never run: a key's
name, so that a server's errors say 'w' rather than an id, and a failed server's error, which
it sends to every worker (`failed`) before it exits, so that none waits out its deadline.

Deadlines: MPI's blocking calls (Init, Probe, Recv, Barrier, Comm_split, Wait) wait forever,
so a peer that is alive but stuck, or late, would hang the job. Every wait here polls MPI's
nonblocking form through `wait_until`, which gives up after D2LPERF_TIMEOUT seconds
(`timeout_seconds`) with a `DeadlineError` that names the rank waited for, the key and the
command. Two waits have no nonblocking form: `start_mpi` bounds MPI_Init with a watchdog,
and `roll_call` makes sure every rank has come before a blocking collective that follows it.

`log` is the D2LPERF_VERBOSE=1 line the stores write for every push and pull.
Taught in "Parameter Servers".
"""
import hashlib
import math
import os
import subprocess
import sys
import time

import numpy

COMMANDS = ('init', 'push', 'pull', 'value', 'ack', 'optimizer', 'get_states', 'state',
            'set_state', 'end', 'bye', 'refused', 'name', 'failed')
CODE = {name: i for i, name in enumerate(COMMANDS)}
# A dtype's code is its place here: a new dtype goes at the end, so old codes keep their meaning.
VALUE_DTYPES = (numpy.dtype('float32'), numpy.dtype('float64'), numpy.dtype('int32'),
                numpy.dtype('int64'), numpy.dtype('float16'))      # what a store holds
TEXT = numpy.dtype('uint8')                                         # UTF-8: names, errors
DTYPES = VALUE_DTYPES + (TEXT,)                                     # what travels
MAX_DIMS = 8
HEADER_WORDS = 5 + MAX_DIMS          # command, key, dtype, ndim, dims..., nbytes
HEADER_TAG, PAYLOAD_TAG, ROLL_CALL_TAG = 1, 2, 3
DEFAULT_TIMEOUT = 300.0        # seconds: generous, as a slow step is not a stuck one
SPIN_SECONDS = 0.005           # poll, yielding the core, this long: most waits end within it
LONGEST_PAUSE = 0.001          # then sleep, doubling up to this, between polls
abandoned = []                 # (request, buffer) given up on at a deadline: MPI may write it


class ProtocolError(RuntimeError):
    """A message that breaks the protocol; nothing it asked for was done."""


class DeadlineError(TimeoutError):
    """A distributed wait that passed D2LPERF_TIMEOUT: the rank it waited for is stuck."""


class IncompleteRoundError(RuntimeError):
    """A dist_sync round that can never complete: a worker left before pushing into it."""


class ServerError(RuntimeError):
    """A server failed, so it will never answer: its error, as it sent it before exiting."""


def timeout_seconds():
    """D2LPERF_TIMEOUT: how many seconds any distributed wait may block (default 300)."""
    text = os.environ.get('D2LPERF_TIMEOUT', '')
    try:
        seconds = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < math.inf:
        raise ValueError(f'D2LPERF_TIMEOUT={text!r}: give the seconds a distributed wait may '
                         'block, a positive number (python -m d2lperf.launch --timeout SECONDS)')
    return seconds


def wait_until(test, deadline, what):
    """Call `test()` until it returns something true, and return that; past `deadline` (a
    `time.monotonic()` time) raise `DeadlineError` saying `what` was waited for.

    Why poll: MPI's blocking calls have no timeout, so a peer that is alive but never answers
    (stuck, or waiting for yet another rank) would hold this process forever, and its job with
    it. Each `test` is one nonblocking MPI call (Iprobe, Request.Test), which also drives MPI's
    progress. For the first SPIN_SECONDS it polls again at once, as MPI's own blocking calls do
    (most answers come within microseconds, and a large message may move only while its ranks
    poll), but yields the core between polls: on a machine with more ranks than cores, the rank
    we wait for may need this very core to compute the answer. Past that the process sleeps
    between polls, from 10 microseconds doubling up to LONGEST_PAUSE, so a long wait costs
    1 to 2% of a core (measured: tests/mpi/test_kvstore_deadlines.py) and still answers within
    a millisecond. The yield matters where ranks outnumber cores: with 4 workers and a server
    on 2 cores, polling without it kept LeNet's images/s in all below one worker's."""
    done = test()
    if done:
        return done
    spin_until = time.monotonic() + SPIN_SECONDS
    pause = 1e-5
    while True:
        done = test()
        if done:
            return done
        now = time.monotonic()
        if now > deadline:
            raise DeadlineError(in_vain(what))
        if now < spin_until:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_PAUSE)


def in_vain(what):
    """What a DeadlineError says: `what` was waited for, how long, and what to do."""
    return (f'{what}, in vain for {timeout_seconds():g} s. Look at the output of the ranks it '
            'waited for to see why they are stuck; if they are only slow, raise '
            'D2LPERF_TIMEOUT (python -m d2lperf.launch --timeout SECONDS)')


def deadline():
    """The time (`time.monotonic()`) at which a wait that starts now gives up."""
    return time.monotonic() + timeout_seconds()


def start_mpi():
    """mpi4py's MPI module, with MPI started (MPI_Init) within D2LPERF_TIMEOUT.

    MPI_Init returns only once every rank of the job has called it, and it has no timeout: a
    rank that never comes (it failed, or computes something first) would hold the others
    forever, each spinning on a core (MPICH polls there: 0.7 of a core each, measured). No
    thread of ours can run meanwhile (MPI_Init holds Python's GIL), so the watchdog is a small
    process of its own: past the deadline it says why on our stderr and kills us; the launcher
    then names this rank and ends the job. Closing its stdin, as we do once MPI runs (or as
    our death does), sends it away."""
    started = sys.modules.get('mpi4py.MPI')     # the program imported it: MPI runs already
    if started is not None:
        return started
    rank = os.environ.get('PMI_RANK', '?')        # MPI is not running: its launcher's word
    what = (f'rank {rank} waited for every rank of the job to start MPI, which each process '
            'does in its first d2l.kvstore.create')
    watchdog = subprocess.Popen([sys.executable, '-I', '-S', '-c', WATCHDOG,
                                 str(timeout_seconds()), f'DeadlineError: {in_vain(what)}'],
                                stdin=subprocess.PIPE)
    try:
        from mpi4py import MPI
    finally:
        watchdog.stdin.close()
        watchdog.wait()
    return MPI


WATCHDOG = """
import os, select, signal, sys
seconds, message = float(sys.argv[1]), sys.argv[2]
if not select.select([sys.stdin], [], [], seconds)[0]:    # neither closed nor gone in time
    sys.stderr.write(message + '\\n')
    sys.stderr.flush()
    os.kill(os.getppid(), signal.SIGKILL)       # SIGKILL: inside MPI_Init, no handler runs
"""


def roll_call(comm, waiting_for):
    """Return once every rank of `comm` has called this too, within D2LPERF_TIMEOUT; past it,
    raise DeadlineError saying `waiting_for(ranks that never came)`.

    Each rank sends a word to every other and waits for theirs: unlike a barrier, this knows
    who is missing. Put before a blocking collective (Comm_split), it bounds that one's wait."""
    others = [rank for rank in range(comm.Get_size()) if rank != comm.Get_rank()]
    here = numpy.zeros(1, numpy.int64)
    words = {rank: numpy.empty(1, numpy.int64) for rank in others}
    sends = [comm.Isend(here, dest=rank, tag=ROLL_CALL_TAG) for rank in others]
    missing = {rank: comm.Irecv(words[rank], source=rank, tag=ROLL_CALL_TAG) for rank in others}

    def everyone_came():
        for rank in [rank for rank, request in missing.items() if request.Test()]:
            del missing[rank]
        return not missing
    try:
        wait_until(everyone_came, deadline(), 'the roll call')
    except DeadlineError:
        abandoned.extend((request, words[rank]) for rank, request in missing.items())
        abandoned.extend((request, here) for request in sends)
        raise DeadlineError(in_vain(waiting_for(sorted(missing)))) from None
    wait_for_sends(sends, f'rank {comm.Get_rank()} waited for its roll-call word to leave')


def as_text(text):
    """`text` as the array that carries it: its UTF-8 bytes."""
    return numpy.frombuffer(text.encode(), TEXT).copy()


def text_of(array):
    """The text an array of UTF-8 bytes carries (never run, only shown)."""
    return bytes(array).decode(errors='replace') if array is not None else ''


def key_id(key):
    """The number every process gives `key` (an int or a str)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f'a key-value store key is an int or a str, not {type(key).__name__} '
                        f'{key!r}')
    digest = hashlib.blake2b(f'{type(key).__name__}:{key}'.encode(), digest_size=7).digest()
    return int.from_bytes(digest, 'little')


def verbose():
    return os.environ.get('D2LPERF_VERBOSE') == '1'


def header_for(command, key, array):
    """The int64 header that announces `array` (a contiguous NumPy array or None)."""
    header = numpy.zeros(HEADER_WORDS, numpy.int64)
    header[0], header[1] = CODE[command], key
    if array is not None:
        if array.dtype not in DTYPES or array.ndim > MAX_DIMS:
            raise ValueError(f'cannot send a {array.dtype} array of {array.ndim} dims: the '
                             f'store carries {[d.name for d in DTYPES]} with at most '
                             f'{MAX_DIMS} dims')
        header[2], header[3] = DTYPES.index(array.dtype), array.ndim
        header[4:4 + array.ndim] = array.shape
        header[-1] = array.nbytes
    return header


def send(comm, dest, command, key=0, array=None):
    """Start sending one message; returns the MPI requests (wait on them, or keep them)."""
    payload = numpy.empty(0, numpy.uint8) if array is None else numpy.ascontiguousarray(array)
    header = header_for(command, key, None if array is None else payload)
    requests = [comm.Isend(header, dest=dest, tag=HEADER_TAG),
                comm.Isend(payload, dest=dest, tag=PAYLOAD_TAG)]
    return requests, (header, payload)       # the buffers must live until the sends finish


def receive(comm, source, into=None, for_message=None, *, waiting_for=None):
    """(command, key, array or None, sender) of the next message from `source` (or ANY_SOURCE).

    The payload lands in `into` (a pull into its output, with no copy after) only when the
    header is `for_message`, a (command, key), with `into`'s shape and dtype; anything else
    lands in a new array, so a message the caller will refuse never overwrites its buffer.
    Each wait gives up after D2LPERF_TIMEOUT with a DeadlineError that says `waiting_for`
    (which rank waited for which, and for what; by default, only the ranks)."""
    from mpi4py import MPI
    anyone = source == MPI.ANY_SOURCE
    waiting_for = waiting_for or (f'rank {comm.Get_rank()} waited for a message'
                                  + ('' if anyone else f' from rank {source}'))
    status = MPI.Status()
    wait_until(lambda: comm.Iprobe(source=source, tag=HEADER_TAG, status=status), deadline(),
               waiting_for)
    sender, size = status.Get_source(), status.Get_count(MPI.BYTE)
    if anyone:                      # the rest comes from the header's sender: name it
        waiting_for += f' from rank {sender}'
    raw = numpy.empty(max(size, 1), numpy.uint8)
    receive_exactly(comm, raw[:size], sender, HEADER_TAG, waiting_for)
    try:
        command, key, dtype, shape, expected = parse_header(raw[:size], sender)
    except ProtocolError:
        drain_payload(comm, sender, waiting_for)
        raise
    nbytes = probe_payload(comm, sender, waiting_for)
    if nbytes != expected:
        drain_payload(comm, sender, waiting_for)
        raise ProtocolError(f'rank {sender} sent {nbytes} payload bytes for a {command} of '
                            f'shape {shape} {dtype}, which takes {expected}')
    array = None
    if dtype is not None:
        fits = (into is not None and (command, key) == for_message
                and into.shape == tuple(shape) and into.dtype == dtype)
        array = into if fits else numpy.empty(shape, dtype)
        receive_exactly(comm, array, sender, PAYLOAD_TAG, waiting_for)
    else:
        receive_exactly(comm, numpy.empty(0, numpy.uint8), sender, PAYLOAD_TAG, waiting_for)
    return command, key, array, sender


def probe_payload(comm, sender, waiting_for):
    """The size in bytes of the payload `sender` sends next, once it has come."""
    from mpi4py import MPI
    status = MPI.Status()
    wait_until(lambda: comm.Iprobe(source=sender, tag=PAYLOAD_TAG, status=status), deadline(),
               f'{waiting_for} (a payload)')
    return status.Get_count(MPI.BYTE)


def receive_exactly(comm, buffer, sender, tag, waiting_for):
    """Receive `sender`'s next message of `tag` into `buffer`, within the deadline."""
    wait_for_request(comm.Irecv(buffer, source=sender, tag=tag), waiting_for, buffer)


def wait_for_request(request, waiting_for, buffer=None):
    """Wait until `request` (a nonblocking receive or collective) is done, within the
    deadline; one given up on keeps its `buffer` for good, as MPI may still write it."""
    try:
        wait_until(request.Test, deadline(), waiting_for)
    except DeadlineError:
        abandoned.append((request, buffer))
        raise


def wait_for_sends(requests, waiting_for):
    """Wait until the sends of `requests` (from `send`) are done, within the deadline."""
    from mpi4py import MPI
    wait_until(lambda: MPI.Request.Testall(requests), deadline(), waiting_for)


def parse_header(raw, sender):
    """(command, key, dtype or None, shape, nbytes) of a header, or ProtocolError naming
    `sender`."""
    if raw.size != HEADER_WORDS * 8:
        raise ProtocolError(f'rank {sender} sent a header of {raw.size} bytes; a header has '
                            f'{HEADER_WORDS * 8}')
    header = raw.view(numpy.int64)
    code, key, dtype_code, ndim = (int(v) for v in header[:4])
    if not 0 <= code < len(COMMANDS):
        raise ProtocolError(f'rank {sender} sent unknown command {code}')
    nbytes = int(header[-1])
    if nbytes == 0 and dtype_code == 0 and ndim == 0 and not header[4:-1].any():
        return COMMANDS[code], key, None, (), 0         # a message that carries no array
    if not 0 <= dtype_code < len(DTYPES):
        raise ProtocolError(f'rank {sender} sent dtype code {dtype_code}; the store carries '
                            f'only {[d.name for d in DTYPES]}')
    if not 0 <= ndim <= MAX_DIMS:
        raise ProtocolError(f'rank {sender} sent an array of {ndim} dims; at most {MAX_DIMS}')
    shape = tuple(int(d) for d in header[4:4 + ndim])
    if any(d < 0 for d in shape) or header[4 + ndim:-1].any():
        raise ProtocolError(f'rank {sender} sent impossible shape {list(header[4:-1])} '
                            f'for {ndim} dims')
    dtype = DTYPES[dtype_code]
    if nbytes != math.prod(shape) * dtype.itemsize:      # Python ints: no overflow
        raise ProtocolError(f'rank {sender} sent a header of {nbytes} bytes for shape '
                            f'{shape} {dtype}')
    return COMMANDS[code], key, dtype, shape, nbytes


def drain_payload(comm, sender, waiting_for):
    """Take the payload that follows a refused header, so the next message starts clean."""
    buffer = numpy.empty(probe_payload(comm, sender, waiting_for), numpy.uint8)
    receive_exactly(comm, buffer, sender, PAYLOAD_TAG, waiting_for)


def log(rank, what, nbytes, started):
    """One line on stderr, when D2LPERF_VERBOSE=1: who did what, how many bytes, how long."""
    if not verbose():
        return
    milliseconds = (time.perf_counter() - started) * 1e3
    # One write, newline included: mpiexec forwards what it reads, and a newline written on
    # its own can arrive after another rank's line.
    sys.stderr.write(f'[d2lperf rank {rank}] {what}: {nbytes} bytes, {milliseconds:.3f} ms\n')
    sys.stderr.flush()
