"""Data parallelism by hand: what "Training on Multiple GPUs" writes before "Concise
Implementation for Multiple GPUs" hands it to `nn` and the `Trainer`: a copy of the parameters
for each device, each with its gradient buffer. `allreduce_on_first`, in comm, sums the
gradients between the copies, and `optimizer.by_hand.sgd` updates each copy where it lives.
"""


def get_params(params, device):
    """Copies of `params` on `device`, each with a gradient buffer."""
    copies = [p.copyto(device) for p in params]
    for copy in copies:
        copy.attach_grad()
    return copies
