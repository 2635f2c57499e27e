"""The launcher's hostfile: every host checked before it reaches an ssh, rsync or mpiexec
command line, where a word starting with '-' would be taken for an option."""
import pytest

from d2lperf import launch


def test_hosts_and_slots_are_read_in_order(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# the lab\nnode-1.lab:4\n\n  10.0.0.7  \nnode_2:1\nnode-1.lab\n')
    assert launch.read_hosts(hostfile) == ['node-1.lab', '10.0.0.7', 'node_2', 'node-1.lab']


@pytest.mark.parametrize('line', ['-oProxyCommand=touch /tmp/owned', 'node1:-2', '.hidden',
                                  'node1:4 extra', 'user@node1', 'node;rm -rf /', 'node1:'])
def test_a_line_that_is_not_a_host_is_refused_naming_it(tmp_path, line):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text(f'node0\n# a comment\n{line}\n')
    with pytest.raises(SystemExit) as refused:
        launch.read_hosts(hostfile)
    message = str(refused.value)
    assert f'{hostfile} line 3: {line!r}' in message and 'host name' in message


def test_a_bad_hostfile_stops_the_launch_before_anything_runs(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(launch.subprocess, 'run', lambda *args, **kw: ran.append(args))
    monkeypatch.setattr(launch.subprocess, 'Popen', lambda *args, **kw: ran.append(args))
    (tmp_path / 'hosts').write_text('-oProxyCommand=sh\n')
    with pytest.raises(SystemExit, match='line 1'):
        launch.main(['-n', '1', '--launcher', 'ssh', '-H', str(tmp_path / 'hosts'),
                     '--sync-dst-dir', 'job', 'python', 'train.py'])
    assert ran == []


def test_rsync_protects_its_arguments_from_the_remote_shell(monkeypatch):
    commands = []

    class Done:
        returncode = 0
    monkeypatch.setattr(launch.subprocess, 'run', lambda command: commands.append(command) or Done)
    launch.sync_to_hosts(['node1', 'node2', 'node1'], 'runs/my job')
    assert [command[-1] for command in commands] == ['node1:runs/my job/', 'node2:runs/my job/']
    assert all(command[:3] == ['rsync', '-a', '--protect-args'] for command in commands)


def test_the_launcher_leaves_the_allocator_to_the_engine():
    args = launch.parse(['-n', '2', 'python', 'train.py'])
    assert not any(name.startswith('MALLOC_') for name in launch.job_environment(args))
