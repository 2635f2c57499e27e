"""Data parallelism across MPI processes over tensor × pipeline grids inside each: every worker
is one replica of a 1 × 2 × 2 layout on its own virtual devices, and the distributed store
sums the replicas' gradients, as in Megatron-LM's grid with d across machines."""
import json

import numpy
import pytest

from tests.dist_helpers import run_program

pytestmark = pytest.mark.chapter('parallel_layouts')

STEPS, BATCH = 3, 8

WORKER = f'''
import json, numpy, d2lperf as d2l
from d2lperf import autograd, kvstore, nn, np
from d2lperf.model_parallel import parallel_gpt
VOCAB, LAYERS, HIDDEN, HEADS, SEQ = 20, 4, 16, 4, 8
LOSS = d2l.SoftmaxCrossEntropyLoss()
rng = numpy.random.default_rng(0)
TOKENS = [rng.integers(0, VOCAB, ({BATCH}, SEQ))] * {STEPS}      # one batch, learned
LABELS = [rng.integers(0, VOCAB, ({BATCH}, SEQ))] * {STEPS}


def gpt():
    np.random.seed(0)
    net = nn.GPT(VOCAB, LAYERS, HIDDEN, HEADS, SEQ)
    net.initialize(device=d2l.cpu(0))
    return net


def one_device_losses():
    """The same steps on one device, on the whole batch: what the job must reproduce."""
    net = gpt()
    trainer = d2l.Trainer(net.collect_params(), 'adam', {{'learning_rate': 0.01}},
                          kvstore=None)
    losses = []
    for tokens, labels in zip(TOKENS, LABELS):
        with autograd.record():
            loss = LOSS(net(np.array(tokens)), np.array(labels)).sum()
        loss.backward()
        trainer.step({BATCH})
        losses.append(loss.item())
    return losses


store = kvstore.create('dist_sync')
split = parallel_gpt(gpt(), [d2l.cpu(i + 1) for i in range(4)], 1, 2, 2, '1f1b')
trainer = d2l.Trainer(split.collect_params(), 'adam', {{'learning_rate': 0.01}}, kvstore=store,
                      update_on_kvstore=False)     # the store sums; each worker runs Adam
each = {BATCH} // store.num_workers
mine = slice(each * store.rank, each * (store.rank + 1))
losses = []
for tokens, labels in zip(TOKENS, LABELS):
    parts = split.forward_backward(np.array(tokens[mine]), np.array(labels[mine]), LOSS, 2)
    trainer.step({BATCH})                      # the examples the store sums
    losses.append(sum(part.item() for part in parts))
print('LOSSES', store.rank, json.dumps(losses))
if store.rank == 0:
    print('ONE', json.dumps(one_device_losses()))
'''


def test_two_processes_of_tensor_and_pipeline_parallelism_train_as_one_device(tmp_path):
    result = run_program(tmp_path, WORKER, 3, timeout=300, D2LPERF_NUM_SERVERS=1)
    assert result.returncode == 0, result.report()
    lines = [line.split(maxsplit=2) for line in result.lines('LOSSES')]
    assert [rank for _, rank, _ in lines] == ['0', '1']
    summed = numpy.sum([json.loads(losses) for *_, losses in lines], axis=0)
    one = json.loads(result.lines('ONE')[0].split(maxsplit=1)[1])
    assert one[-1] < one[0]
    numpy.testing.assert_allclose(summed, one, rtol=1e-5)
