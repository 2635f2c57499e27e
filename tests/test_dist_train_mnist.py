"""train_mnist end to end: locally over two devices, and as a dist_sync job of two workers."""
import re
import sys

import pytest

from tests.dist_helpers import MPIEXEC, run_module
from d2lperf import train_mnist

LINE = re.compile(r'epoch (\d+): test acc ([\d.]+), (\d+) images/s on (\S+), kvstore (\S+), '
                  r'(.+), (\d+) examples, worker (\d+) of (\d+)')


def epochs(stdout):
    return [found.groups() for found in map(LINE.search, stdout.splitlines()) if found]


def test_local_training_learns_and_says_what_ran(tmp_path):
    result = run_module(tmp_path, ['d2lperf.train_mnist', '--network', 'mlp', '--devices',
                                   'cpu0,cpu1', '--kv-store', 'device', '--batch-size', '32',
                                   '--max-examples', '400', '--epochs', '2',
                                   '--work-load-list', '3,1'], timeout=300)
    assert result.returncode == 0, result.stderr
    lines = epochs(result.stdout)
    assert [line[0] for line in lines] == ['1', '2']
    epoch, accuracy, _, devices, kvstore, _, examples, rank, workers = lines[-1]
    assert (devices, kvstore, examples, rank, workers) == ('cpu(0),cpu(1)', 'device', '400',
                                                           '0', '1')
    assert float(accuracy) > 0.3            # ten classes: chance is 0.1


@pytest.mark.skipif(not MPIEXEC.exists(), reason='no mpiexec next to this Python')
def test_dist_sync_workers_hold_the_same_weights(tmp_path):
    result = run_module(tmp_path, ['d2lperf.launch', '-n', '2', '-s', '1', sys.executable,
                                   '-m', 'd2lperf.train_mnist', '--network', 'mlp',
                                   '--kv-store', 'dist_sync', '--batch-size', '32',
                                   '--max-examples', '400', '--epochs', '1'], timeout=300)
    assert result.returncode == 0, result.stderr
    lines = sorted(epochs(result.stdout), key=lambda line: line[7])
    assert [(line[4], line[6], line[7], line[8]) for line in lines] == [
        ('dist_sync', '200', '0', '2'), ('dist_sync', '200', '1', '2')]
    assert lines[0][1] == lines[1][1] and float(lines[0][1]) > 0.3   # one model, learned


@pytest.mark.parametrize('argv, message', [
    (['--devices', 'gpu0'], 'cpu0,cpu1'),
    (['--devices', 'cpu0,cpu1', '--work-load-list', '1'], '1 shares for 2 devices'),
    (['--batch-size', '0'], '--batch-size must be 1 or more'),
    (['--kv-store', 'nccl'], 'invalid choice'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_mnist.parse(argv)
    assert message in capsys.readouterr().err
