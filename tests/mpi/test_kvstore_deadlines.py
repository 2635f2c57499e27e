"""A job that is alive but stuck ends with an error naming the rank, the key and the command
within D2LPERF_TIMEOUT (`--timeout`, short here), and leaves no process behind; so does a job
whose server fails, or whose ranks never all reach the store."""
import os
import re
import sys
import time

import pytest

from tests.dist_helpers import MPIEXEC, left_running, run_module
from d2lperf import launch
from d2lperf.kvstore import protocol

pytestmark = [pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python'),
              pytest.mark.chapter('parameter_servers', 'distributed_training')]

HEADER = '''
import sys, time, numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
x = d2l.np.array(numpy.zeros(3, numpy.float32))
'''

UNEVEN = HEADER + '''
kv.init('w', x)
for step in range(2 if kv.rank == 1 else 3):       # rank 1 stops one batch early, exit 0
    kv.push('w', x)
    kv.pull('w', out=x)
'''

STUCK_PULL = HEADER + '''
kv.init('x', x)
if kv.rank == 1:
    time.sleep(120)                                 # alive, but it never pushes
kv.push('x', x)
kv.pull('x', out=x)
'''

STUCK_BARRIER = HEADER + '''
if kv.rank == 1:
    time.sleep(120)
kv.barrier()
'''

CAUGHT_INIT = HEADER + '''
value = numpy.zeros(3, numpy.complex64) if kv.rank == 0 else x   # refused on rank 0 alone
try:
    kv.init('w', value)
except ValueError as error:
    print(f'rank {kv.rank} caught: {error}', file=sys.stderr, flush=True)
kv.init('w', x)                                     # and every worker went on together
kv.barrier()
print(f'went on {kv.rank}', flush=True)
'''


BROKEN_SERVER = '''
import numpy, d2lperf as d2l
from d2lperf.kvstore import server
def broken(self, key, total):
    raise RuntimeError('a bug in the update')
server.Server.apply = broken
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
x = d2l.np.array(numpy.ones(4, numpy.float32))
kv.init('w', x)
kv.push('w', x)
kv.pull('w', out=x)
'''

INTEGER_KEYS = HEADER + '''
def refused(call):
    try:
        call()
    except ValueError as error:
        print(f'REFUSED {kv.rank}: {error}', flush=True)
whole = d2l.np.array(numpy.arange(3, dtype=numpy.int32))
kv.init('count', whole)                               # summed exactly: no optimizer yet
refused(lambda: kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5)))
kv.init('w', x)
kv.push('count', whole)
kv.pull('count', out=whole)
print(f'SUM {kv.rank} {whole.asnumpy().tolist()}', flush=True)
'''

INTEGER_AFTER_SGD = HEADER + '''
kv.set_optimizer(d2l.optimizer.SGD(learning_rate=0.5))
try:
    kv.init('count', d2l.np.array(numpy.arange(3, dtype=numpy.int32)))
except ValueError as error:
    print(f'REFUSED {kv.rank}: {error}', flush=True)
kv.init('w', x)                                       # every worker went on together
kv.barrier()
'''

LATE = '''
import os, time
late, rank = os.environ['LATE'], int(os.environ['PMI_RANK'])
if late == 'before MPI' and rank == 1:
    time.sleep(40)                      # the others start MPI in create: it waits for rank 1
if late != 'before MPI':
    from mpi4py import MPI              # MPI starts here, on every rank
    if rank == 1 and late == 'after MPI':
        time.sleep(40)
    if rank == 1 and late == 'failed':
        raise RuntimeError('rank 1 failed before it made its store')
import d2lperf as d2l
d2l.kvstore.create('dist_sync')
'''

PATIENT = '''
import time, numpy
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 1:
    time.sleep(4)                                   # late to the store's creation
wall, cpu = time.monotonic(), time.process_time()
from d2lperf.kvstore.dist import create_dist
import d2lperf as d2l
kv = create_dist('dist_sync')
x = d2l.np.array(numpy.zeros(3, numpy.float32))
kv.init('x', x)
print(f'CREATE {kv.rank} {(time.process_time() - cpu) / (time.monotonic() - wall):.3f}', flush=True)
if kv.rank == 1:
    time.sleep(3)                                   # late to push: rank 0's pull waits
kv.push('x', x)
wall, cpu = time.monotonic(), time.process_time()
kv.pull('x', out=x)
print(f'PULL {kv.rank} {(time.process_time() - cpu) / (time.monotonic() - wall):.3f}', flush=True)
'''


def run_job(tmp_path, program, timeout_seconds=2, workers=2, launcher=(), **env):
    """Run `program` on `workers` workers and one server with --timeout; (the finished
    launcher, seconds it took, processes of the program left running)."""
    script = tmp_path / 'program.py'
    script.write_text(program)
    started = time.monotonic()
    result = run_module(tmp_path, ['d2lperf.launch', '-n', str(workers), '-s', '1',
                                   '--timeout', str(timeout_seconds), *launcher,
                                   sys.executable, str(script)], timeout=90, **env)
    return result, time.monotonic() - started, left_running(str(script))


def test_uneven_pushes_refuse_the_round_naming_the_rank_that_left(tmp_path):
    result, seconds, left = run_job(tmp_path, UNEVEN, timeout_seconds=60)
    assert result.returncode != 0 and seconds < 30, result.stderr      # not the timeout
    assert ("IncompleteRoundError: rank 2 refused the pull of key 'w' by rank 0: worker rank 1 "
            'left after 2 pushes of it, and this worker pushed 3') in result.stderr
    assert 'the job failed: d2lperf.launch: rank 0' in result.stderr
    assert left == []


def test_a_pull_held_by_a_stuck_worker_ends_at_the_deadline(tmp_path):
    result, seconds, left = run_job(tmp_path, STUCK_PULL)
    assert result.returncode != 0 and seconds < 30, result.stderr
    assert ("DeadlineError: rank 0 waited for server rank 2 to answer its pull of key 'x', "
            "which waits for every worker's push, in vain for 2 s") in result.stderr
    assert 'in vain for 2 s' in result.stderr and 'D2LPERF_TIMEOUT' in result.stderr
    assert left == []


def test_a_barrier_a_worker_never_reaches_ends_at_the_deadline(tmp_path):
    result, seconds, left = run_job(tmp_path, STUCK_BARRIER)
    assert result.returncode != 0 and seconds < 30, result.stderr
    assert ('DeadlineError: rank 0 waited for worker rank 1 to reach barrier, in vain for 2 s'
            in result.stderr)
    assert left == []


def test_an_init_error_caught_on_one_rank_is_raised_on_every_rank(tmp_path):
    """No rank waits for one that gave up: a refusal on rank 0 is raised on every worker (the
    store agrees on failure before anything travels), and the job goes on."""
    result, seconds, left = run_job(tmp_path, CAUGHT_INIT)
    assert result.returncode == 0 and seconds < 30, result.stderr
    assert 'rank 0 caught: the store holds' in result.stderr
    assert 'rank 1 caught: another worker refused this init' in result.stderr
    assert 'went on 0' in result.stdout and 'went on 1' in result.stdout
    assert left == []


def test_a_failing_server_ends_the_job_naming_itself_and_its_error(tmp_path):
    """Not the timeout (60 s): the server prints its traceback and a line naming itself, the
    message and the key, tells the workers, and exits; the launcher names it."""
    result, seconds, left = run_job(tmp_path, BROKEN_SERVER, timeout_seconds=60)
    assert result.returncode != 0 and seconds < 30, result.stderr
    assert ("d2lperf server (rank 2) failed on the push of key 'w' from rank "
            in result.stderr), result.stderr
    assert 'RuntimeError: a bug in the update' in result.stderr
    assert 'the job failed: d2lperf.launch: rank 2 ' in result.stderr
    assert left == []


def test_an_integer_key_is_refused_under_the_servers_sgd(tmp_path):
    """Refused where the call is made, naming the key, its dtype and the remedy; without an
    optimizer the servers sum integers exactly."""
    result, seconds, left = run_job(tmp_path, INTEGER_KEYS, timeout_seconds=30)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert (f"REFUSED {rank}: key 'count' holds int32, and the servers' SGD updates "
                'floating-point values only' in result.stdout)
        assert f'SUM {rank} [0, 2, 4]' in result.stdout
    assert "init the key with a float value (value.astype('float32'))" in result.stdout
    result, seconds, left = run_job(tmp_path, INTEGER_AFTER_SGD, timeout_seconds=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("key 'count' holds int32, and the servers' SGD") == 2
    assert left == []


@pytest.mark.parametrize('late, waited_for', [
    ('after MPI', "waited for worker rank 1 to reach d2l.kvstore.create('dist_sync'), in vain "
                  'for 2 s'),
    ('before MPI', 'waited for every rank of the job to start MPI, which each process does in '
                   'its first d2l.kvstore.create, in vain for 2 s'),
    ('failed', "waited for worker rank 1 to reach d2l.kvstore.create('dist_sync'), in vain for "
               '2 s'),
])
def test_a_rank_that_never_reaches_the_store_ends_the_job_at_the_deadline(tmp_path, late,
                                                                          waited_for):
    """Rank 1 comes 40 s late (before or after starting MPI), or fails first: the others give
    up after --timeout 2, naming it where MPI can tell (MPI_Init cannot), and the job ends
    within the launcher's grace period, long before rank 1 would have come."""
    result, seconds, left = run_job(tmp_path, LATE, LATE=late)
    assert result.returncode != 0 and seconds < 2 + launch.GRACE_SECONDS + 8, result.stderr
    # Ranks 0 and 2 both wait for rank 1; MPICH ends the job when the first of them exits.
    assert re.search(f'DeadlineError: rank [02] {re.escape(waited_for)}', result.stderr), \
        result.stderr
    if late == 'failed':
        assert 'RuntimeError: rank 1 failed before it made its store' in result.stderr
    assert left == []


@pytest.mark.serial                       # each rank's CPU time over the wall time
def test_a_waiting_rank_leaves_the_cpu_to_the_others(tmp_path):
    """Rank 0 waits 4 s for rank 1 to create its store, then 3 s for its push. Waiting costs
    it a few percent of a core (it waited in a blocking Comm_split at 0.72 of one)."""
    result, seconds, left = run_job(tmp_path, PATIENT, timeout_seconds=60)
    assert result.returncode == 0, result.stderr
    create = float(re.search(r'CREATE 0 ([\d.]+)', result.stdout)[1])
    pull = float(re.search(r'PULL 0 ([\d.]+)', result.stdout)[1])
    print(f'\nCPU of a waiting rank, in cores: {create:.3f} in create, {pull:.3f} in a pull')
    assert create < 0.25 and pull < 0.25, result.stdout


FAILING_SSH = '''#!/bin/sh
host="$1"; shift
if [ "$host" = 127.0.0.1 ]; then
    echo "ssh: connect to host $host port 22: Connection refused" >&2
    exit 255
fi
exec /bin/sh -c "$*"
'''


def test_an_ssh_proxy_that_fails_to_start_ends_the_job_naming_its_host(tmp_path):
    (tmp_path / 'bin').mkdir()
    (tmp_path / 'bin' / 'ssh').write_text(FAILING_SSH)
    (tmp_path / 'bin' / 'ssh').chmod(0o755)
    (tmp_path / 'hosts').write_text('localhost:2\n127.0.0.1:1\n')
    script = tmp_path / 'program.py'
    script.write_text(HEADER)
    started = time.monotonic()
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '2', '-s', '1', '--launcher', 'ssh',
                                   '-H', 'hosts', '--timeout', '2', sys.executable,
                                   str(script)], timeout=90,
                        PATH=f'{tmp_path / "bin"}:{os.environ["PATH"]}')
    assert result.returncode != 0 and time.monotonic() - started < 30, result.stderr
    assert ('d2lperf.launch: the job failed: the MPI proxy for host 127.0.0.1 exited 255 (ssh '
            '127.0.0.1 ') in result.stderr
    assert 'check that `ssh 127.0.0.1` works' in result.stderr
    assert left_running(str(script)) == [] and left_running(str(tmp_path / 'bin')) == []


def test_the_launchers_timeout_reaches_every_rank(monkeypatch):
    monkeypatch.setenv('D2LPERF_TIMEOUT', '7')
    inherited = launch.job_environment(launch.parse(['-n', '2', 'python']))
    assert inherited['D2LPERF_TIMEOUT'] == '7'            # carried over ssh too
    args = launch.parse(['-n', '2', '--timeout', '2.5', 'python'])
    words = launch.mpiexec_command(args, launch.job_environment(args))
    assert ['-genv', 'D2LPERF_TIMEOUT', '2.5'] == words[words.index('D2LPERF_TIMEOUT') - 1:][:3]


@pytest.mark.parametrize('seconds', ['0', '-1', 'inf', 'nan'])
def test_a_timeout_is_a_positive_number(seconds, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        launch.parse(['-n', '2', '--timeout', seconds, 'python'])
    assert '--timeout takes a positive number' in capsys.readouterr().err
    monkeypatch.setenv('D2LPERF_TIMEOUT', seconds)
    with pytest.raises(ValueError, match='D2LPERF_TIMEOUT'):
        protocol.timeout_seconds()


def test_wait_until_returns_what_the_test_found_or_raises_saying_what(monkeypatch):
    monkeypatch.setenv('D2LPERF_TIMEOUT', '0.2')
    calls = iter([0, None, 'done'])
    assert protocol.wait_until(lambda: next(calls), protocol.deadline(), 'never') == 'done'
    started = time.monotonic()
    with pytest.raises(protocol.DeadlineError, match='rank 3 waited for rank 5 to answer its '
                                                      "pull of key 'x', in vain for 0.2 s"):
        protocol.wait_until(lambda: False, protocol.deadline(),
                             "rank 3 waited for rank 5 to answer its pull of key 'x'")
    assert 0.2 <= time.monotonic() - started < 5
