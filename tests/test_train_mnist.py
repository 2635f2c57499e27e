"""train_mnist end to end, locally over two devices, and its arguments. Its dist_sync and
dist_async jobs are MPI tests: tests/mpi/test_train_mnist_dist.py."""
import re
import sys
import urllib.error

import pytest

from tests.dist_helpers import run_module
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


@pytest.mark.parametrize('argv, message', [
    (['--devices', 'gpu0'], 'cpu0,cpu1'),
    (['--devices', 'cpu0,cpu1', '--work-load-list', '1'], '1 shares for 2 devices'),
    (['--batch-size', '0'], '--batch-size must be 1 or more'),
    (['--kv-store', 'nccl'], 'invalid choice'),
    (['--devices', 'cpu0,cpu1', '--slow-down', 'cpu2=3'], 'not among --devices'),
    (['--devices', 'cpu0,cpu1', '--slow-down', 'cpu1=0.5'], 'factor of 1 or more'),
    (['--slow-down', 'cpu0'], 'DEVICE=FACTOR'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        train_mnist.parse(argv)
    assert message in capsys.readouterr().err


def test_slow_down_names_a_device_and_its_factor():
    args = train_mnist.parse(['--devices', 'cpu0,cpu1', '--slow-down', 'cpu1=3'])
    assert args.slow_down == (train_mnist.cpu(1), 3.0)
    assert train_mnist.slowed(args) == ' (cpu(1) slowed 3×)'


def test_offline_without_scikit_learn_exits_with_the_fix_not_a_traceback(tmp_path, monkeypatch):
    """Installed with [mpi] but not [book], and no network: the download failed, and the
    fallback's `import sklearn` ended the run in a bare ModuleNotFoundError."""
    def refuse(url, timeout):
        raise urllib.error.URLError('no network')
    monkeypatch.setattr(train_mnist.data.urllib.request, 'urlopen', refuse)
    monkeypatch.setenv('D2LPERF_DATA', str(tmp_path))         # nothing cached
    for name in ('sklearn', 'sklearn.datasets'):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as exited:
        train_mnist.main(['--network', 'mlp', '--devices', 'cpu0', '--kv-store', 'device'])
    message = str(exited.value.code)
    assert message.startswith('train_mnist: Fashion-MNIST could not be downloaded (URLError')
    assert '`pip install scikit-learn`' in message and "'.[book]'" in message
