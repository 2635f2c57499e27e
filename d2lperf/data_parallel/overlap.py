"""Summing gradients while backward runs (Horovod's overlap, PyTorch DDP's hooks).

A parameter's gradient is complete on every device as soon as the last device's backward pass
has pushed it; its sum can be pushed right then, and the engine runs it while the layers below
are still being differentiated. The Trainer ("Parameter Servers"), `Buckets` and `Zero` ("Data
Parallelism at Scale") all start their sums from this one loop.
"""
from .. import np
from ..device import label


def backward_reporting(losses, params, ready):
    """Backpropagate every device's loss, and call `ready(i)` as soon as the last device's
    gradient of `params[i]` has been pushed (`on_gradient`), so that a sum pushed then runs
    while the layers below are still being differentiated; after backward, `ready(i)` for each
    parameter the losses did not reach. The other devices' passes are pushed first, so by then
    their gradients of that parameter are pushed too, and a copy they did not reach is given
    zeros (`zero_unreached`)."""
    made = set()
    for loss in losses[:-1]:
        loss.backward(on_gradient=lambda copy: made.add(id(copy)))
    index_of = {id(copy): i for i, p in enumerate(params) for copy in p.list_data()}
    reached = set()

    def reached_one(copy):
        made.add(id(copy))
        index = index_of.get(id(copy))
        if index is not None:
            if index in reached:
                raise reached_twice(f"parameter '{params[index].name}'")
            reached.add(index)
            zero_unreached(params[index], made)
            ready(index)
    losses[-1].backward(on_gradient=reached_one)
    for index in range(len(params)):
        if index not in reached:
            zero_unreached(params[index], made)
            ready(index)


def backward_all(losses, params):
    """Backpropagate every device's loss; then give zeros to each copy not reached."""
    made = set()
    for loss in losses:
        loss.backward(on_gradient=lambda copy: made.add(id(copy)))
    for param in params:
        zero_unreached(param, made)


def zero_unreached(param, made):
    """Zeros for each copy of `param` that this backward pass gave no gradient (`made`: the ids
    of those it did), DDP's `find_unused_parameters`: it would otherwise keep the last step's
    gradient, to be summed and applied once more."""
    for copy in param.list_data():
        if id(copy) not in made:
            copy.grad = label(np.zeros(copy.shape, copy.dtype, copy.device), 'gradients')


def reached_twice(what):
    """The error for a second gradient of one parameter in one backward pass, its sum over the
    devices already started from the first: the parameter is used in several checkpointed
    segments, which `autograd.checkpoint` walks one at a time. PyTorch's DDP refuses it too."""
    return RuntimeError(
        f'{what} got a second gradient in one backward pass, after its sum over the devices '
        'had started: it is used in several segments of autograd.checkpoint. Use it in one '
        'segment or outside checkpoint, or sum after backward (Buckets(..., overlap=False))')


def one_loss_a_device(losses, devices):
    """Refuse a step whose forward returned other than one loss a device: with fewer, part of
    the batch would silently go untrained; with more, some device would hold two."""
    if len(losses) != len(devices):
        raise ValueError(f'forward() returned {len(losses)} losses for {len(devices)} devices: '
                         'return one loss a device, each computed from its part of the batch '
                         '(d2l.split_batch), in the order of the devices')
