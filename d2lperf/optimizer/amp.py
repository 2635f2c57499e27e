"""Mixed precision: float16 (or bfloat16) weights and a dynamic loss scaler, MXNet AMP's names.

Taught in "Memory". `net.cast('float16')` halves the bytes of weights, gradients and
activations; `multi_precision=True` keeps float32 master weights in the optimizer
(`rules.py`), so that small updates are not rounded away. What is left is the gradients:
float16 has nothing below 6e-8, and many gradients are smaller. Scaling the loss by S scales
every gradient by S, out of the underflow; the update divides by S again. Too large an S
overflows to inf: that step is skipped and S halved; after `scale_window` clean steps S is
doubled, to find again the largest scale that fits (Micikevicius et al., 2018).

    d2l.amp.init_trainer(trainer)
    with autograd.record():
        loss = loss_fn(net(X).astype('float32'), y)
    with d2l.amp.scale_loss(loss, trainer) as scaled:
        scaled.backward()
    trainer.step(batch_size)     # skips a step whose gradients overflowed

bfloat16 (`ml_dtypes`' dtype) has float32's range, so it needs no scaler. NumPy computes it
through ml_dtypes; CuPy from version 14 (arithmetic, products and reductions ran on an H200
with CuPy 14.2), CuPy 13 not at all: there mixed precision is float16.
"""
import contextlib

import numpy

from .. import autograd, np


class LossScaler:
    """MXNet's dynamic loss scaler: the scale, and the rules that move it.

    `loss_scale` is what the next loss is multiplied by; `skipped` counts the steps skipped
    for an overflow, `steps` those taken.
    """

    def __init__(self, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=2000):
        if not init_scale > 0 or not scale_factor > 1 or scale_window < 1:
            raise ValueError('a loss scaler needs init_scale > 0, scale_factor > 1 and '
                             f'scale_window >= 1, not {init_scale}, {scale_factor}, '
                             f'{scale_window}')
        self.loss_scale, self.scale_factor = float(init_scale), float(scale_factor)
        self.scale_window = int(scale_window)
        self.skipped, self.steps = 0, 0
        self.clean = 0               # steps since the last overflow or increase

    def check(self, grads):
        """The scale `grads` were computed with, to divide them by; None where one of them
        holds an inf or a NaN, and the step is to be skipped. Moves the scale by the rules."""
        scale = self.loss_scale
        overflowed = has_overflow(grads)
        self.update(overflowed)
        return None if overflowed else scale

    def update(self, overflowed):
        """Move the scale after a step: down at once on an overflow, up after a clean window."""
        if overflowed:
            self.skipped += 1
            self.loss_scale /= self.scale_factor
            self.clean = 0
            return
        self.steps += 1
        self.clean += 1
        if self.clean == self.scale_window:
            self.loss_scale *= self.scale_factor
            self.clean = 0

    def __repr__(self):
        return (f'LossScaler(loss_scale={self.loss_scale:g}, steps={self.steps}, '
                f'skipped={self.skipped})')


def has_overflow(grads):
    """Whether any of `grads` holds an inf or a NaN: one reduction a gradient, one wait a
    device. The mean propagates inf and NaN and, unlike the sum, cannot overflow itself: the
    mean of finite float16 values is finite (NumPy accumulates it in float32; where an
    accumulator overflowed, a step would be skipped that need not be, never the reverse)."""
    by_device = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad.mean().reshape(1))
    return not all(numpy.isfinite(np.concatenate(means).asnumpy()).all()
                   for means in by_device.values())


def init_trainer(trainer, init_scale=2.0 ** 16, scale_window=2000):
    """Give `trainer` a dynamic loss scaler (MXNet's amp.init_trainer); returns the scaler."""
    scaler = LossScaler(init_scale=init_scale, scale_window=scale_window)
    trainer.set_loss_scaler(scaler)
    return scaler


@contextlib.contextmanager
def scale_loss(loss, trainer):
    """The loss (or a list of losses) times the trainer's loss scale, recorded for backward;
    the trainer's step divides the gradients by the same scale."""
    if trainer.loss_scaler is None:
        raise ValueError('this trainer has no loss scaler: call d2l.amp.init_trainer(trainer)')
    scale = trainer.loss_scaler.loss_scale
    with autograd.record(train_mode=autograd.is_training()):
        scaled = [each * scale for each in loss] if isinstance(loss, (list, tuple)) \
            else loss * scale
    yield scaled
