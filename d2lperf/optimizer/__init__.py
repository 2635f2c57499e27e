"""The update and what mixed precision adds to it (the optimizer's and AMP's names, as MXNet).

    rules   the update rules (SGD with momentum and weight decay, Adam) that a trainer or a
            key-value store applies, with their states as plain arrays; `multi_precision`
            keeps float32 master weights for float16 and bfloat16 ones ("Parameter Servers",
            "Memory").
    kernels  the same rules as one CUDA kernel a parameter, on a GPU (MXNet's fused
            `sgd_mom_update` and `adam_update`).
    by_hand  minibatch SGD on a plain list of arrays, as "Training on Multiple GPUs" writes it
            (`d2l.sgd`), before the Trainer applies `rules.SGD`.
    amp     the dynamic loss scaler that float16 gradients need, and MXNet AMP's names for it
            (`d2l.amp.init_trainer`, `d2l.amp.scale_loss`) ("Memory").
"""
from .rules import SGD, Adam, Optimizer, create
from . import amp, by_hand

__all__ = ['SGD', 'Adam', 'Optimizer', 'create', 'amp', 'by_hand']
