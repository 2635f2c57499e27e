"""Data parallelism by hand: what "Training on Multiple GPUs" writes before "Concise
Implementation for Multiple GPUs" hands it to `nn` and the `Trainer`: a copy of the parameters
for each device, and an update that runs where the parameters live (`allreduce_on_first`, in
comm, sums the gradients between the two).
"""


def get_params(params, device):
    """Copies of `params` on `device`, each with a gradient buffer."""
    copies = [p.copyto(device) for p in params]
    for copy in copies:
        copy.attach_grad()
    return copies


def sgd(params, lr, batch_size):
    """Minibatch SGD in place: p -= lr / batch_size * p.grad (the gradient of a summed loss)."""
    scale = lr / batch_size
    for param in params:
        if param.grad is None:
            raise ValueError(f'a parameter of shape {param.shape} has no gradient: call '
                             'attach_grad() on it (get_params does) before training')
        param -= scale * param.grad
