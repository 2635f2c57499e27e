"""Every way the book sums gradients over devices, in the order the chapters teach them, after
the first, by hand ("Training on Multiple GPUs": comm's `get_params` and `allreduce_on_first`,
`optimizer.by_hand.sgd`).

    updates   what every way below shares: which parameters train, their devices, and the
              one update path (the user's rescale_grad times 1/batch_size, every copy alike).
    trainer   the Trainer ("Concise Implementation for Multiple GPUs", "Parameter Servers",
              "Distributed Training"): gradients summed through a key-value store of any type,
              and the update on the devices or in the store.
    overlap   each parameter's sum pushed as soon as backward has pushed its last gradient
              (Horovod's overlap), the one loop the Trainer, buckets and zero start from.
    buckets   gradients summed in buckets of a chosen size while backward runs, in the order
              backward finishes them (PyTorch DDP's buckets, Horovod's tensor fusion); one
              parameter a bucket and one bucket for everything are the ladder's two ends.
    zero      ZeRO's stages and FSDP's units: the optimizer state (stage 1), the gradients (2)
              and the weights (3) sharded over the devices, a child block at a time, each
              gradient dropped once sent and each unit whole only around its forward and its
              backward.
    units     what zero shards and moves: a child block's parameters as one flat buffer a
              device, and each device's half of a gather and of a reduction.
    predict   memory per device and the time a step spends communicating, predicted from the
              parameter count, the devices, the stage, the optimizer and the fitted α and β.

Buckets and Zero take `step(forward, batch_size)`, where `forward()` computes every device's
loss on its part of the batch, so that the chapter and the benchmarks time them alike.
"""
from .trainer import Trainer
from .buckets import Buckets, plan_buckets
from .zero import Zero
from . import predict

__all__ = ['Trainer', 'Buckets', 'plan_buckets', 'Zero', 'predict']
