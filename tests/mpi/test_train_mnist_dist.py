"""train_mnist as dist_sync and dist_async jobs of two workers and a server."""
import pytest

from tests.dist_helpers import run_program
from tests.test_train_mnist import epochs

pytestmark = pytest.mark.chapter('distributed_training')


def train_job(tmp_path, store):
    """One epoch of train_mnist as a job of 2 workers and 1 server: the job's result, and each
    worker's epoch line."""
    program = ("from d2lperf import train_mnist\n"
               f"train_mnist.main(['--network', 'mlp', '--kv-store', '{store}', "
               "'--batch-size', '32', '--max-examples', '400', '--epochs', '1'])\n")
    result = run_program(tmp_path, program, 3, timeout=300)
    assert result.returncode == 0, result.report()
    return result, [epochs(result.stdout[rank])[0] for rank in (0, 1)]


def test_dist_sync_workers_hold_the_same_weights(tmp_path):
    result, lines = train_job(tmp_path, 'dist_sync')
    assert epochs(result.stdout[2]) == []                       # the server trains nothing
    assert [(line[4], line[6], line[7], line[8]) for line in lines] == [
        ('dist_sync', '200', '0', '2'), ('dist_sync', '200', '1', '2')]
    assert lines[0][1] == lines[1][1] and float(lines[0][1]) > 0.3   # one model, learned


def test_dist_async_workers_train_through_the_trainer(tmp_path):
    _, lines = train_job(tmp_path, 'dist_async')
    assert [(line[4], line[6], line[7], line[8]) for line in lines] == [
        ('dist_async', '200', '0', '2'), ('dist_async', '200', '1', '2')]
    assert min(float(line[1]) for line in lines) > 0.3
