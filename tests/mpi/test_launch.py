"""The launcher: a failed or killed rank ends the job, named, with nothing left running."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, strategies as st

from tests.dist_helpers import MPIEXEC, end_session, environment, left_running, run_module
from tests.strategies import checks
from d2lperf import launch

pytestmark = pytest.mark.chapter('distributed_training')

TRAINING = '''
import os, sys, time, numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
open(f'pid.{kv.rank}', 'w').write(str(os.getpid()))     # files: read while it runs
kv.init(1, d2l.np.array(numpy.zeros(3, numpy.float32)))
out = d2l.np.array(numpy.zeros(3, numpy.float32))
for step in range(10 ** 9):
    if step == 20:
        open(f'step20.{kv.rank}', 'w').close()
    kv.push(1, out)
    kv.pull(1, out=out)
    time.sleep(0.001)
'''


@pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')
def test_a_killed_worker_ends_the_job_naming_its_rank(tmp_path):
    script = tmp_path / 'training.py'
    script.write_text(TRAINING)
    job = subprocess.Popen([sys.executable, '-m', 'd2lperf.launch', '-n', '2', '-s', '1',
                            sys.executable, str(script)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=environment(), cwd=tmp_path,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / 'step20.1').exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {rank: int((tmp_path / f'pid.{rank}').read_text()) for rank in (0, 1)}
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        job.wait(timeout=30)
        seconds = time.monotonic() - killed_at
        stderr = job.communicate()[1]
    finally:
        if job.poll() is None:
            end_session(job)
    assert job.returncode != 0 and seconds < 30
    assert 'd2lperf.launch: the job failed: d2lperf.launch: rank 1' in stderr
    assert 'was killed by SIGKILL' in stderr and 'the last lines of rank 1' in stderr
    assert left_running(str(script)) == []


@pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')
def test_a_failing_rank_is_named_with_its_last_lines(tmp_path):
    script = tmp_path / 'fails.py'
    script.write_text('import os, sys\n'
                      'if os.environ["PMI_RANK"] == "2":\n'
                      '    print("about to fail", file=sys.stderr, flush=True)\n'
                      '    sys.exit(5)\n'
                      'import time; time.sleep(60)\n')
    started = time.monotonic()
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '2', sys.executable, str(script)],
                        timeout=60)
    assert result.returncode != 0 and time.monotonic() - started < 30
    assert 'rank 2' in result.stderr and 'exited 5' in result.stderr
    assert '    about to fail' in result.stderr
    assert left_running(str(script)) == []


FAKE_SSH = '''#!/bin/sh
host="$1"; shift
echo "$host" >> "$FAKE_SSH_LOG"
exec /bin/sh -c "$*"
'''

HELLO = '''
import os, sys, numpy, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
kv.init('x', d2l.np.array(numpy.zeros(2)))
kv.push('x', d2l.np.array(numpy.ones(2) * (kv.rank + 1)))
out = d2l.np.array(numpy.zeros(2))
kv.pull('x', out=out)
with open(f'sum.{kv.rank}', 'w') as file:    # a file a rank, read after the job
    file.write(f"{out.asnumpy().tolist()} {os.environ['GREETING']}")
'''


@pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')
def test_ssh_launcher_starts_one_proxy_a_host(tmp_path):
    bin_folder = tmp_path / 'bin'
    bin_folder.mkdir()
    (bin_folder / 'ssh').write_text(FAKE_SSH)
    (bin_folder / 'ssh').chmod(0o755)
    (tmp_path / 'hosts').write_text('# two hosts\nlocalhost:2\n127.0.0.1:1\n')
    (tmp_path / 'hello.py').write_text(HELLO)
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '2', '-s', '1', '--launcher', 'ssh',
                                   '-H', 'hosts', '--env', 'GREETING=hi there; rm -rf /',
                                   sys.executable, 'hello.py'], timeout=90,
                        PATH=f'{bin_folder}:{os.environ["PATH"]}',
                        FAKE_SSH_LOG=tmp_path / 'ssh.log')
    assert result.returncode == 0, result.stderr
    assert sorted((tmp_path / 'ssh.log').read_text().split()) == ['127.0.0.1', 'localhost']
    for rank in (0, 1):
        assert (tmp_path / f'sum.{rank}').read_text() == '[3.0, 3.0] hi there; rm -rf /'


FAKE_RSYNC = '''#!{python}
"""A stand-in rsync: copies SOURCE/ to HOST:DESTINATION/ on this machine, and logs its words."""
import json, os, shutil, sys
source, target = sys.argv[-2], sys.argv[-1]
host, _, destination = target.partition(':')
with open(os.environ['FAKE_RSYNC_LOG'], 'a') as log:
    log.write(json.dumps(sys.argv[1:]) + '\\n')
shutil.copytree(source, destination, dirs_exist_ok=True, ignore=shutil.ignore_patterns('bin'))
'''

WHERE = '''
import os, d2lperf as d2l
from d2lperf.kvstore.dist import create_dist
kv = create_dist('dist_sync')
kv.barrier()
with open(f'where.{kv.rank}', 'w') as file:
    file.write(os.getcwd())
'''


@pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')
def test_sync_dst_dir_copies_the_folder_to_every_host_and_runs_the_job_there(tmp_path,
                                                                             tmp_path_factory):
    bin_folder = tmp_path / 'bin'
    bin_folder.mkdir()
    for name, text in (('ssh', FAKE_SSH), ('rsync', FAKE_RSYNC.format(python=sys.executable))):
        (bin_folder / name).write_text(text)
        (bin_folder / name).chmod(0o755)
    (tmp_path / 'hosts').write_text('localhost:2\n127.0.0.1:1\n')
    (tmp_path / 'where.py').write_text(WHERE)
    remote = tmp_path_factory.mktemp('remote') / 'course dir'
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '2', '-s', '1', '--launcher', 'ssh',
                                   '-H', 'hosts', '--sync-dst-dir', str(remote),
                                   sys.executable, 'where.py'], timeout=90,
                        PATH=f'{bin_folder}:{os.environ["PATH"]}', D2LPERF_VERBOSE='1',
                        FAKE_SSH_LOG=tmp_path / 'ssh.log', FAKE_RSYNC_LOG=tmp_path / 'rsync.log')
    assert result.returncode == 0, result.stderr
    copies = [json.loads(line) for line in (tmp_path / 'rsync.log').read_text().splitlines()]
    assert [words[-1] for words in copies] == [f'localhost:{remote}/', f'127.0.0.1:{remote}/']
    assert all(words[:2] == ['-a', '--protect-args'] for words in copies)
    assert f"-wdir '{remote}'" in result.stderr             # the command the launcher printed
    for rank in (0, 1):                                    # the job ran in the copy
        assert (remote / f'where.{rank}').read_text() == str(remote)
    assert (remote / 'where.py').exists() and not (tmp_path / 'where.0').exists()


def test_the_interface_reaches_mpiexec(monkeypatch):
    monkeypatch.setattr(launch, 'find_mpiexec', lambda: MPIEXEC)     # a command, not a run
    args = launch.parse(['-n', '1', 'python', 'train.py'])
    monkeypatch.delenv('D2LPERF_INTERFACE', raising=False)
    assert '-iface' not in launch.mpiexec_command(args, {})
    monkeypatch.setenv('D2LPERF_INTERFACE', 'lo')
    words = launch.mpiexec_command(args, {})
    assert words[words.index('-iface') + 1] == 'lo'


@checks(50)
@given(st.lists(st.text(st.characters(blacklist_categories=['Cs'], blacklist_characters='\0'),
                        max_size=12), min_size=1, max_size=5))
def test_ssh_commands_quote_every_word(words):
    import shlex
    ssh, host, remote = launch.ssh_command('node1', words, {'A': 'x y', 'B': "it's"})
    assert (ssh, host) == ('ssh', 'node1')
    assert shlex.split(remote) == ['env', 'A=x y', "B=it's", *words]


@pytest.mark.parametrize('argv, message', [
    (['-n', '0', 'python'], 'one worker'),
    (['-n', '2'], 'COMMAND'),
    (['-n', '2', '--launcher', 'ssh', 'python'], 'hostfile'),
    (['-n', '2', '--env', '1A=2', 'python'], 'NAME=VALUE'),
    (['-n', '2', '-H', 'hosts', 'python'], 'need --launcher mpi or ssh'),
    (['-n', '2', '--job-timeout', '0', 'python'], '--job-timeout takes a positive number'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        launch.parse(argv)
    assert message in capsys.readouterr().err


def test_every_rank_gets_the_server_count_and_the_users_variables(monkeypatch):
    monkeypatch.setattr(launch, 'find_mpiexec', lambda: MPIEXEC)     # a command, not a run
    args = launch.parse(['-n', '3', '-s', '2', '--env', 'X=1=2', 'python', 'train.py'])
    environment = launch.job_environment(args)
    assert environment['D2LPERF_NUM_SERVERS'] == '2' and environment['X'] == '1=2'
    words = launch.mpiexec_command(args, environment)
    assert words[1:3] == ['-n', '5'] and words[-2:] == ['python', 'train.py']
    assert ['-genv', 'D2LPERF_NUM_SERVERS', '2'] == words[words.index('-genv'):][:3]


def test_mpiexec_is_found_in_the_scripts_folder_where_pip_put_it(tmp_path, monkeypatch):
    """On Colab pip installs scripts in /usr/local/bin while Python is /usr/bin/python3."""
    python_folder, scripts = tmp_path / 'bin', tmp_path / 'local-bin'
    python_folder.mkdir(), scripts.mkdir()
    monkeypatch.setattr(sys, 'executable', str(python_folder / 'python3'))
    monkeypatch.setattr(launch.sysconfig, 'get_path', lambda name: str(scripts))
    with pytest.raises(SystemExit, match='no mpiexec in .*bin or .*local-bin'):
        launch.find_mpiexec()
    (scripts / 'mpiexec').touch()
    assert launch.find_mpiexec() == scripts / 'mpiexec'
    (python_folder / 'mpiexec').touch()                # the venv's own comes first
    assert launch.find_mpiexec() == python_folder / 'mpiexec'
