"""SGD by hand: the update "Training on Multiple GPUs" writes on a plain list of arrays, before
it hands the parameters to `nn` and the Trainer. `rules.SGD` is the same step, with momentum,
weight decay and a state per key, for a Trainer or a key-value store to apply.
"""


def sgd(params, lr, batch_size):
    """Minibatch SGD in place: p -= lr / batch_size * p.grad (the gradient of a summed loss)."""
    scale = lr / batch_size
    for param in params:
        if param.grad is None:
            raise ValueError(f'a parameter of shape {param.shape} has no gradient: call '
                             'attach_grad() on it (get_params does) before training')
        param -= scale * param.grad
