"""The launcher at the edges: every line of every rank arrives whole, a failed rank is named
with its error, and the job ends with its launcher however that ends (a signal, SIGKILL, a
reader that goes away, a deadline), leaving no process behind."""
import inspect
import io
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import given, strategies as st

from tests.dist_helpers import (MPIEXEC, end_session, environment, left_running,
                                processes_running, run_module)
from tests.strategies import checks
from d2lperf import launch

pytestmark = pytest.mark.chapter('distributed_training')

needs_mpiexec = pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')


def lengths(number):
    """Up to 3 KB, and every 100th line longer than one write that a pipe keeps whole."""
    return (4096, 40_000) if number % 100 == 0 else (0, 3072)


FLOOD = inspect.getsource(lengths) + '''
import os, random, sys
rank = int(os.environ['PMI_RANK'])
draw = random.Random(rank)
for number in range(3000):
    line = f'{rank}:{number}:' + 'x' * draw.randrange(*lengths(number))
    if number % 2:
        print(line, flush=True)
    else:                        # the text and the newline as two writes, as `python -u` does
        sys.stdout.write(line); sys.stdout.flush(); sys.stdout.write('\\n'); sys.stdout.flush()
print(f'{rank}:partial', end='', flush=True)
'''


def expected_flood(rank):
    draw = random.Random(rank)
    return ([f'[{rank}] {rank}:{number}:' + 'x' * draw.randrange(*lengths(number))
             for number in range(3000)] + [f'[{rank}] {rank}:partial'])


@needs_mpiexec
def test_every_line_of_every_rank_arrives_whole_once_and_in_order(tmp_path):
    (tmp_path / 'flood.py').write_text(FLOOD)
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '4', '-s', '1', sys.executable,
                                   'flood.py'], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split('\n')
    assert lines.pop() == ''                             # the partial line got its newline
    for rank in range(5):
        assert [line for line in lines if line.startswith(f'[{rank}] ')] == expected_flood(rank)
    assert len(lines) == 5 * 3001                        # and nothing else, nothing twice


SERVER_FAILS = '''
import os, sys, time
if os.environ['PMI_RANK'] == '2':                  # the server of -n 2 -s 1
    time.sleep(1)
    for step in range(30):
        print(f'served step {step}', flush=True)
    raise ValueError('in-place subtract cannot store a float64[4] result in a int32[4] array')
while True:                                         # the workers write pieces of lines meanwhile
    sys.stderr.write('waiting'); sys.stderr.flush()
    sys.stderr.write(' for the server\\n'); sys.stderr.flush()
    time.sleep(0.002)
'''


@needs_mpiexec
def test_a_failing_server_is_named_with_its_traceback(tmp_path):
    marker = f'# {tmp_path}'                  # a command of many lines: the report has one
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '2', '-s', '1', sys.executable,
                                   '-c', marker + SERVER_FAILS], timeout=90)
    assert result.returncode != 0
    failed = next(line for line in result.stderr.splitlines() if 'the job failed' in line)
    assert 'd2lperf.launch: rank 2 (' in failed and failed.endswith('exited 1'), failed
    report = result.stderr.split('d2lperf.launch: the last lines of rank 2')[1].splitlines()
    assert '    Traceback (most recent call last):' in report
    assert ('    ValueError: in-place subtract cannot store a float64[4] result in a int32[4] '
            'array') in report
    assert not any('waiting' in line or 'served step' in line for line in report), report
    assert left_running(marker) == []


SLEEPER = '''
import os, time
open(f'up.{os.environ["PMI_RANK"]}', 'w').close()
time.sleep(120)
'''


def start_job(tmp_path, source, *options):
    """A launcher of a 2-rank job running `source`, in a session of its own; and the script,
    whose path marks every process of the job."""
    script = tmp_path / 'job.py'
    script.write_text(source)
    launcher = subprocess.Popen([sys.executable, '-m', 'd2lperf.launch', '-n', '1', '-s', '1',
                                 *options, sys.executable, str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env=environment(), cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 60
    try:
        while not all((tmp_path / f'up.{rank}').exists() for rank in (0, 1)):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, 'the job did not start within 60 s'
            time.sleep(0.05)
    except AssertionError:
        end_everything(launcher, str(script))
        raise
    return launcher, str(script)


def end_everything(launcher, marker):
    """After a test: nothing of its job left, whatever the launcher did."""
    if launcher.poll() is None:
        end_session(launcher)
    for pid in processes_running(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@needs_mpiexec
@pytest.mark.parametrize('name', ['SIGTERM', 'SIGINT', 'SIGHUP', 'SIGKILL'])
def test_a_launcher_that_is_signalled_leaves_no_process_of_its_job(tmp_path, name):
    number = signal.Signals[name]
    launcher, marker = start_job(tmp_path, SLEEPER)
    try:
        signalled_at = time.monotonic()
        os.kill(launcher.pid, number)
        code = launcher.wait(timeout=30)
        left = left_running(marker, seconds=max(0.0, signalled_at + 5 - time.monotonic()))
    finally:
        end_everything(launcher, marker)
    assert code == (-number if number == signal.SIGKILL else 128 + number)
    assert left == []


@needs_mpiexec
def test_a_job_past_its_job_timeout_is_ended_and_says_so(tmp_path):
    started = time.monotonic()
    launcher, marker = start_job(tmp_path, SLEEPER, '--job-timeout', '4')
    try:
        _, stderr = launcher.communicate(timeout=60)
        seconds = time.monotonic() - started
    finally:
        end_everything(launcher, marker)
    assert launcher.returncode == launch.TIMED_OUT and 4 <= seconds < 30
    assert 'the job failed: it ran longer than --job-timeout 4 s' in stderr.decode()
    assert left_running(marker) == []


CHATTY = '''
import itertools, os
open(f'up.{os.environ["PMI_RANK"]}', 'w').close()
for number in itertools.count():
    print(f'line {number}', flush=True)
'''


@needs_mpiexec
def test_a_reader_that_goes_away_ends_the_job_as_sigpipe_would(tmp_path):
    launcher, marker = start_job(tmp_path, CHATTY)
    try:
        first = launcher.stdout.readline()
        launcher.stdout.close()                          # what `| head -1` does
        code = launcher.wait(timeout=30)
    finally:
        end_everything(launcher, marker)
    assert first.startswith((b'[0] line ', b'[1] line '))
    assert code == 128 + signal.SIGPIPE
    assert left_running(marker) == []


@checks(50)
@given(st.lists(st.one_of(st.binary(max_size=9000),
                          st.sampled_from([b'\n', b'[3] a\n', b'[2]+b', b'\r'])), max_size=8))
def test_a_ranks_lines_of_any_length_are_cut_into_pipe_sized_writes_and_joined(chunks):
    with tempfile.TemporaryFile() as file:
        lines = launch.RankLines(file.fileno(), 7)
        for chunk in chunks:
            lines.feed(chunk)
        lines.finish()
        file.seek(0)
        frames = list(io.BytesIO(file.read()))
    assert all(len(frame) <= select.PIPE_BUF and frame.endswith(b'\n') for frame in frames)
    expected = b''.join(chunks).split(b'\n')
    if expected[-1] == b'':
        expected.pop()                                   # no partial line at the end
    assert list(launch.joined_lines(frames)) == [(7, line) for line in expected]


def test_mpiexecs_own_lines_pass_and_a_line_cut_off_is_kept():
    frames = [b'[1]+ab\n', b'[mpiexec@host] note\n', b'[0] z\n', b'[1]+c\n']
    assert list(launch.joined_lines(frames)) == [(None, b'[mpiexec@host] note\n'), (0, b'z'),
                                                 (1, b'abc')]
