"""What every data-parallel step shares: which parameters train, and the one way to update them.

The Trainer ("Concise Implementation for Multiple GPUs"), `Buckets` and `Zero` ("Data
Parallelism at Scale") differ in how they sum gradients, not in which parameters they train or
in how an optimizer applies a summed gradient; both live here once, so that a rule one of them
honours (`rescale_grad`, running statistics left alone), all of them do.
"""
from .. import engine, optimizer as optimizers
from ..nn.parameter import Parameter


def trained(params):
    """(names, parameters) of those that take gradients, from `net.collect_params()` or a list;
    batch norm's running statistics (grad_req 'null') are not trained."""
    named = list(params.items()) if isinstance(params, dict) else [(None, p) for p in params]
    if not all(isinstance(p, Parameter) for _, p in named):
        raise TypeError('training takes net.collect_params() or a list of Parameters')
    named = [(name or p.name, p) for name, p in named]
    named = [(name, p) for name, p in named if p.grad_req == 'write']
    return [name for name, _ in named], [p for _, p in named]


def check_devices(params):
    """The devices every parameter has one copy on, in order; a clear error otherwise."""
    if not params:
        raise ValueError('no parameters to train: initialize the net first')
    devices = params[0].list_device()
    for param in params[1:]:
        if param.list_device() != devices:
            raise ValueError(f'parameter {param.name!r} lives on {param.list_device()}, '
                             f'{params[0].name!r} on {devices}: initialize the whole net on '
                             'one list of devices')
    return devices


def create_optimizer(optimizer, optimizer_params):
    """`optimizer.create(optimizer, **optimizer_params)`, and an error that names the parameter
    it does not take (the optimizer's own TypeError names only the Python call)."""
    try:
        return optimizers.create(optimizer, **(optimizer_params or {}))
    except TypeError as error:
        raise ValueError(f'optimizer {optimizer!r} does not take {optimizer_params}: '
                         f'{error}') from error


def apply_updates(optimizer, scale, batch_size, updates):
    """Apply `optimizer` to every (key, weight, gradient) of `updates`, each gradient scaled by
    `scale / batch_size`: the user's rescale_grad (`scale`: the optimizer's own, or it over a
    loss scale) times the mean over the batch, MXNet's Trainer.step rule, passed to each
    update as this step's scale (the optimizer's own setting is left as it is). A gradient
    whose operation has failed by now raises here, before any update; one that fails later
    skips its update (`engine.push_update`): either way the weights and the optimizer's state
    stay as they were."""
    updates = list(updates)
    engine.raise_known_failure([grad.var for _, _, grad in updates])
    rescale_grad = scale / batch_size
    for key, weight, grad in updates:
        optimizer.update(key, weight, grad, rescale_grad)


def copies_of(params):
    """(key, weight, gradient) for every device's copy of every parameter; the key
    (parameter index, copy index) keeps each copy's optimizer state apart."""
    return [((index, copy), weight, weight.grad) for index, param in enumerate(params)
            for copy, weight in enumerate(param.list_data())]
