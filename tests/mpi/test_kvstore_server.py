"""What a server and a pulling worker refuse: forged messages sent with `protocol.send`
in real MPI jobs. A server's refusal ends the job with one line naming the sender; a worker's
leaves the pull's output as it was. A server that fails tells the workers why."""
import pytest

from tests.dist_helpers import run_program

pytestmark = pytest.mark.chapter('parameter_servers', 'distributed_training')

FORGER = '''
import os, numpy
from mpi4py import MPI
from d2lperf.kvstore import protocol
from d2lperf.kvstore.server import run_server

world = MPI.COMM_WORLD
case, key = os.environ['CASE'], protocol.key_id('w')

def send(command, key=key, array=None):
    requests, buffers = protocol.send(world, 2, command, key, array)
    MPI.Request.Waitall(requests)

def name(text, key=key):
    send('name', key, protocol.as_text(text))

def answer():
    command, _, array, _ = protocol.receive(world, 2)
    print('ANSWER', command, None if array is None else array.tolist(), flush=True)

if world.rank == 2:     # a server of one worker: rank 0. Rank 1 is not one, unless told
    run_server(world, True, 2 if case == 'second bye' else 1)
elif world.rank == 0:
    send('init', key, numpy.arange(4, dtype=numpy.float32))
    answer()
    world.Send(numpy.zeros(1), dest=1, tag=9)             # the key exists: rank 1 may go
    if case == 'init without a value':
        send('init', protocol.key_id('v'))
    elif case == 'a wrong name':
        name('str:v')
    elif case == 'named state of a wrong size':
        name('str:w')
        send('optimizer', 0, numpy.array([0.1, 0.9, 0, 1]))
        answer()
        send('set_state', key, numpy.zeros(3, numpy.float32))
    elif case == 'a header without its payload':
        header = protocol.header_for('push', key, numpy.ones(4, numpy.float32))
        world.Send(header, dest=2, tag=protocol.HEADER_TAG)
    elif case == 'state of a wrong size':
        send('optimizer', 0, numpy.array([0.1, 0.9, 0, 1]))
        answer()
        send('set_state', key, numpy.zeros(3, numpy.float32))
    elif case == 'nan learning rate':
        send('optimizer', 0, numpy.array([float('nan'), 0, 0, 1]))
    elif case == 'inf momentum':
        send('optimizer', 0, numpy.array([0.1, float('inf'), 0, 1]))
    elif case == 'second bye':
        send('bye')
        send('bye')
    elif case == 'none':
        send('push', key, numpy.ones(4, numpy.float32))
        send('pull')
        answer()
        send('bye')
else:
    world.Recv(numpy.zeros(1), source=0, tag=9)
    if case in ('push', 'pull'):
        send(case, key, numpy.ones(4, numpy.float32) if case == 'push' else None)
'''


def run_forger(tmp_path, case):
    return run_program(tmp_path, FORGER, 3, timeout=120, CASE=case)


def test_the_forger_speaks_the_protocol(tmp_path):
    result = run_forger(tmp_path, 'none')
    assert result.returncode == 0, result.report()
    assert result.stdout[0].splitlines() == ['ANSWER ack None',
                                             'ANSWER value [1.0, 1.0, 1.0, 1.0]']


@pytest.mark.parametrize('case, refusal', [
    ('push', "rank 1 sent 'push', but it is not a worker: this server's workers are ranks "
             '0 to 0. Every rank must see the same D2LPERF_NUM_SERVERS'),
    ('pull', "rank 1 sent 'pull', but it is not a worker"),
    ('init without a value', 'rank 0 sent init of key id {v} without a value'),
    ('state of a wrong size', 'rank 0 sent an optimizer state of shape (3,) float32 for key '
                              'id {w}, whose slice on this server is shape (4,) float32'),
    ('nan learning rate', 'rank 0 sent optimizer numbers SGD refuses: SGD needs a finite '
                          'number >= 0 for learning_rate, not nan'),
    ('inf momentum', 'rank 0 sent optimizer numbers SGD refuses: SGD needs a finite number '
                     '>= 0 for momentum, not inf'),
    ('second bye', "rank 0 sent 'bye' after its bye"),     # counted, it would end the server
    ('a wrong name', "rank 0 named key id {w} 'str:v', which is not the name of a key of that "
                     "id ('int:3' for key 3, 'str:w' for 'w')"),
    ('named state of a wrong size', "rank 0 sent an optimizer state of shape (3,) float32 for "
                                    "key 'w', whose slice on this server is shape (4,) float32"),
])
def test_the_server_refuses_naming_the_sender(tmp_path, case, refusal):
    from d2lperf.kvstore.protocol import key_id
    result = run_forger(tmp_path, case)
    assert result.returncode != 0, result.report()
    server = result.stderr[2]
    expected = refusal.format(v=key_id('v'), w=key_id('w'))
    assert f'd2lperf server (rank 2) failed on the ' in server, result.report()
    assert f': ProtocolError: {expected}' in server, result.report()
    assert 'Traceback' not in server


def test_a_message_cut_short_names_its_sender(tmp_path):
    result = run_program(tmp_path, FORGER, 3, timeout=120, CASE='a header without its payload',
                         D2LPERF_TIMEOUT=2)
    assert result.returncode != 0, result.report()
    assert ('d2lperf server (rank 2) failed while it waited for a message: DeadlineError: '
            'server rank 2 waited for the rest of a message from rank 0 (a payload), in vain '
            'for 2 s' in result.stderr[2]), result.report()


FAILING = '''
import os, sys, time, types, numpy, d2lperf as d2l
from mpi4py import MPI
from d2lperf.kvstore import protocol, server
from d2lperf.kvstore.dist import DistKVStore

world = MPI.COMM_WORLD
if world.rank == 1:
    def broken(self, key, total):
        raise RuntimeError('a bug in the update')
    server.Server.apply = broken
    # Here the server outlives its last words, as it would under a process manager that
    # does not end a job when one rank fails (MPICH's does, at once).
    server.os = types.SimpleNamespace(_exit=lambda code: (time.sleep(5), os._exit(code)))
    server.run_server(world, True, 1)
else:
    kv = DistKVStore('dist_sync', world, MPI.COMM_SELF, 1)
    x = d2l.np.array(numpy.ones(3, numpy.float32))
    kv.init('w', x)
    kv.push('w', x)
    started = time.monotonic()
    try:
        kv.pull('w', out=x)
    except protocol.ServerError as error:
        print(f'RAISED after {time.monotonic() - started:.1f} s: {error}', flush=True)
    os._exit(0)
'''


def test_a_failing_server_tells_the_waiting_worker_why(tmp_path):
    """The worker does not wait out D2LPERF_TIMEOUT (60 s here): it raises ServerError with
    the server's own line, which names the server, the message, its key and the error."""
    result = run_program(tmp_path, FAILING, 2, timeout=120, D2LPERF_TIMEOUT=60)
    said = result.stdout[0]
    assert said.startswith('RAISED after '), result.report()
    assert float(said.split()[2]) < 10, said
    assert ("rank 0's pull of key 'w', which waits for every worker's push will never be "
            "answered: d2lperf server (rank 1) failed on the push of key 'w' from rank 0: "
            'RuntimeError: a bug in the update (its traceback is in the output of rank 1)'
            in said)
    assert 'Traceback' in result.stderr[1] and "a bug in the update" in result.stderr[1]


PULLER = '''
import numpy, d2lperf as d2l
from mpi4py import MPI
from d2lperf.kvstore import protocol
from d2lperf.kvstore.dist import DistKVStore

world = MPI.COMM_WORLD
W, V = protocol.key_id('w'), protocol.key_id('v')

def serve(byes, *answers):
    """Ack every init; answer the pulls with `answers`, in turn; leave after `byes` byes."""
    answers = list(answers)
    while byes:
        command, key, _, _ = protocol.receive(world, 0)
        byes -= command == 'bye'
        if command in ('init', 'pull'):
            reply = ('ack', key, None) if command == 'init' else answers.pop(0)
            requests, buffers = protocol.send(world, 0, *reply)
            MPI.Request.Waitall(requests)

def pull(store, key, out):
    try:
        store.pull(key, out=out)
    except protocol.ProtocolError as error:
        print('REFUSED', error)
    return out.asnumpy().tolist()

if world.rank == 0:
    two = DistKVStore('dist_sync', world, MPI.COMM_SELF, 2)        # servers: ranks 1 and 2
    two.init('w', d2l.np.array(numpy.arange(6, dtype=numpy.float32)))
    out = d2l.np.array(numpy.full(6, 7, numpy.float32))
    print('TWO SERVERS', pull(two, 'w', out))
    one = DistKVStore('dist_sync', world, MPI.COMM_SELF, 1)        # server: rank 2
    one.init('v', d2l.np.array(numpy.arange(6, dtype=numpy.float32)))
    buffer = out.data
    print('ONE SERVER', pull(one, 'v', out))
    print('IN STEP', pull(one, 'v', out), out.data is buffer)     # straight into out's buffer
    two.close()
    one.close()
elif world.rank == 1:
    serve(1, ('value', W, numpy.array([0, 1, 2], numpy.float32)))  # its slice, right
else:
    serve(2, ('value', W, numpy.zeros(4, numpy.float32)),          # a slice of a wrong size
          ('value', W, numpy.full(6, -1, numpy.float32)),          # another key's value
          ('value', V, numpy.arange(6, dtype=numpy.float32) * 10))
'''


def test_a_refused_pull_leaves_its_output_whole(tmp_path):
    from d2lperf.kvstore.protocol import key_id
    result = run_program(tmp_path, PULLER, 3, timeout=120)
    assert result.returncode == 0, result.report()
    assert result.stdout[0].splitlines() == [
        'REFUSED rank 2 sent shape (4,) float32 for a slice of shape (3,) float32',
        f'TWO SERVERS {[7.0] * 6}',
        f"REFUSED rank 2 answered 'value' for key id {key_id('w')} (not one of this store's "
        "keys); this worker waited for a value of key 'v'",
        f'ONE SERVER {[7.0] * 6}',
        'IN STEP [0.0, 10.0, 20.0, 30.0, 40.0, 50.0] True']
