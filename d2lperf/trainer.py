"""The Trainer: sum each parameter's gradients over its device copies, then update every copy.

Taught in "Concise Implementation for Multiple GPUs" and "Parameter Servers". The sums go
through a key-value store (one key a parameter), which decides where they happen; the update
rule is an optimizer's, applied to every copy alike, so the copies stay identical.
"""
from . import comm, kvstore as kvstores, optimizer as optimizers
from .nn.parameter import Parameter


class Trainer:
    """Minibatch training over a dict of parameters (`net.collect_params()`).

    A parameter initialized on several devices has a gradient on each, from that device's
    slice of the batch. `step` sums them (`allreduce_grads`, through the store named by
    `kvstore`: 'device', 'local', or None for a plain `comm.allreduce`), then updates every
    copy (`update`), as one device with the whole batch would.
    """

    KVSTORES = ('device', 'local', None)

    def __init__(self, params, optimizer='sgd', optimizer_params=None, kvstore='device'):
        if kvstore not in self.KVSTORES:
            raise ValueError(f'unknown kvstore {kvstore!r}; this Trainer sums gradients in this '
                             f'process and takes one of {self.KVSTORES}')
        params = list(params.values()) if isinstance(params, dict) else list(params)
        if not all(isinstance(p, Parameter) for p in params):
            raise TypeError('Trainer takes net.collect_params() or a list of Parameters')
        try:
            self.optimizer = optimizers.create(optimizer, **(optimizer_params or {}))
        except TypeError as error:
            raise ValueError(f'optimizer {optimizer!r} does not take {optimizer_params}: '
                             f'{error}') from error
        self.params = [p for p in params if p.grad_req == 'write']    # not running statistics
        self.kvstore = kvstore
        self.store = None if kvstore is None else kvstores.create(kvstore)
        self.reduced = set()             # parameters whose gradients are summed for this step

    @property
    def learning_rate(self):
        return self.optimizer.learning_rate

    def step(self, batch_size):
        """Sum the gradients over the devices, then update every copy with 1/batch_size of it."""
        self.allreduce_grads()
        self.update(batch_size)

    def allreduce_grads(self):
        """Sum each parameter's gradients over its devices (those not summed yet this step)."""
        for index, param in enumerate(self.params):
            self._reduce(index, param)

    def update(self, batch_size):
        """Apply the optimizer to every copy of every parameter, from its (summed) gradient."""
        self.optimizer.rescale_grad = 1 / batch_size
        for index, param in enumerate(self.params):
            for copy, weight in enumerate(param.list_data()):
                self.optimizer.update((index, copy), weight, weight.grad)
        self.reduced.clear()

    def backward(self, losses):
        """Backpropagate every device's loss, summing each gradient as soon as it is complete.

        The last device's backward pass reports each parameter's gradient as it pushes it
        (`on_gradient`), and its sum over the devices is pushed right then, while the layers
        below are still being differentiated: Horovod's overlap of communication with
        backpropagation. The engine runs each sum as soon as the gradients it reads exist.
        """
        losses = list(losses)
        for loss in losses[:-1]:
            loss.backward()
        index_of = {id(copy): i for i, p in enumerate(self.params) for copy in p.list_data()}

        def reduce_now(array):
            index = index_of.get(id(array))
            if index is not None:
                self._reduce(index, self.params[index])
        losses[-1].backward(on_gradient=reduce_now)

    def _reduce(self, index, param):
        if index in self.reduced:
            return
        self.reduced.add(index)
        grads = [weight.grad for weight in param.list_data()]
        if len(grads) == 1:
            return
        if self.store is None:
            comm.allreduce(grads)
            return
        if index not in self.store.values:
            self.store.init(index, grads[0])
        self.store.pushpull(index, grads)
