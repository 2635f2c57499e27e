"""Data parallelism past the source ("Data Parallelism at Scale").

    buckets   gradients summed in buckets of a chosen size while backward runs, in the order
              backward finishes them (PyTorch DDP's buckets, Horovod's tensor fusion); one
              parameter a bucket and one bucket for everything are the ladder's two ends.
    zero      ZeRO's stages on reduce_scatter and all_gather: the optimizer state (stage 1),
              the gradients (2) and the weights (3) sharded over the devices.
    predict   memory per device and the time a step spends communicating, predicted from the
              parameter count, the devices, the stage, the optimizer and the fitted α and β.

Both kinds of step take `step(forward, batch_size)`, where `forward()` computes every device's
loss on its part of the batch, so that the chapter and the benchmarks time them alike.
"""
from .buckets import Buckets, plan_buckets
from .zero import Zero
from . import predict

__all__ = ['Buckets', 'plan_buckets', 'Zero', 'predict']
