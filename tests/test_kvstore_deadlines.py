"""A job that is alive but stuck ends with an error naming the rank, the key and the command
within D2LPERF_TIMEOUT (`--timeout`, short here), and leaves no process behind."""
import os
import sys
import time

import pytest

from tests.dist_helpers import MPIEXEC, left_running, run_module
from d2lperf import launch
from d2lperf.kvstore import protocol

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')

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


def run_job(tmp_path, program, timeout_seconds=2, workers=2, launcher=()):
    """Run `program` on `workers` workers and one server with --timeout; (the finished
    launcher, seconds it took, processes of the program left running)."""
    script = tmp_path / 'program.py'
    script.write_text(program)
    started = time.monotonic()
    result = run_module(tmp_path, ['d2lperf.launch', '-n', str(workers), '-s', '1',
                                   '--timeout', str(timeout_seconds), *launcher,
                                   sys.executable, str(script)], timeout=90)
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
