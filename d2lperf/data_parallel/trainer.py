"""The Trainer: sum each parameter's gradients over its devices and workers, then update it.

Taught in "Concise Implementation for Multiple GPUs", "Parameter Servers" and "Distributed
Training". The sums go through a key-value store of any type, by name or as an object (one key
a parameter: its index), which decides where they happen. Where the update runs follows
Gluon's rule, `update_on_kvstore`:

* on the devices (the in-process stores, and no store): the store sums the gradients, then the
  Trainer applies the optimizer to every copy alike, so the copies stay identical;
* in the store (a distributed store, unless told otherwise; dist_async always): the workers
  push gradients, the servers run the optimizer, the workers pull the weights.

`step(batch_size)` scales the summed gradient by the optimizer's rescale_grad / batch_size, as
MXNet's Trainer does: on the devices the step passes that scale to each update; a store that
updates gets a copy of the optimizer whose rescale_grad is that scale (and keeps the copy's
states). The Trainer's optimizer keeps the rescale_grad the user set. Under a synchronous
distributed store the servers sum the gradients of every worker, so for the step of one
process on the combined batch each worker calls `step(batch_size · num_workers)`, the examples
that went into the sum (train_mnist does); `step(batch_size)` takes a step num_workers times
larger, MXNet's behaviour. dist_async applies each push as it arrives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping

from .. import kvstore as kvstores
from .overlap import backward_reporting
from .updates import apply_updates, copies_of, create_optimizer, trained

if TYPE_CHECKING:
    from ..nn.parameter import Parameter
    from ..np.multiarray import NDArray
    from ..optimizer import SGD, Adam


class Trainer:
    """Minibatch training over a dict of parameters (`net.collect_params()`).

    `kvstore`: a store's name (`kvstore.create`'s), a store, or None for none (parameters on
    one device, in one process: nothing to sum). `update_on_kvstore`: None for Gluon's choice
    (True for a distributed store), or True or False. Afterwards `store` is the store the
    gradients go through (None where nothing needs summing) and `kvstore` its type.
    """

    def __init__(self, params: Mapping[str, Parameter] | Iterable[Parameter],
                 optimizer: str | SGD | Adam = 'sgd', optimizer_params: dict | None = None,
                 kvstore: str | kvstores.KVStoreBase | None = 'device',
                 update_on_kvstore: bool | None = None):
        self.optimizer = create_optimizer(optimizer, optimizer_params)
        _, self.params = trained(params)
        self.store = store_from(kvstore)
        self.distributed = self.kvstore in kvstores.DIST_TYPES
        self.update_on_kvstore = self._where_to_update(update_on_kvstore)
        self.initialized = False         # whether the store holds the parameters
        self.store_updates = False       # whether the store holds the optimizer
        self.reduced = set()             # parameters whose gradients are summed for this step
        self.loss_scaler = None          # amp's LossScaler: skips steps that overflowed

    def _where_to_update(self, choice):
        if self.store is None:
            if choice:
                raise ValueError('update_on_kvstore=True needs a kvstore to update in')
            return False
        if self.kvstore == 'dist_async':
            if choice is False:
                raise ValueError('dist_async updates on the store: each push is applied as it '
                                 'arrives, so it takes update_on_kvstore=True (or None)')
            return True
        return self.distributed if choice is None else bool(choice)

    def set_loss_scaler(self, scaler) -> None:
        """Check every step's gradients with `scaler` (amp.init_trainer gives one)."""
        if self.update_on_kvstore:
            raise ValueError('a loss scaler needs the update on the devices, where a step can '
                             'be skipped: create the Trainer with update_on_kvstore=False')
        self.loss_scaler = scaler

    @property
    def kvstore(self) -> str | None:
        """The type of the store the gradients go through; None once none is needed."""
        return None if self.store is None else self.store.type

    @property
    def learning_rate(self) -> float:
        return self.optimizer.learning_rate

    def step(self, batch_size: int) -> None:
        """Sum the gradients over devices and workers, then update with 1/batch_size of it:
        on the devices, Gluon's allreduce_grads() then update(); in the store, a push of the
        gradients and a pull of the weights the servers updated."""
        if not self.update_on_kvstore:
            self.allreduce_grads()
            self.update(batch_size)
            return
        self._init_store()
        self._give_store_the_optimizer(batch_size)
        try:
            self._reduce_all()
            self.store.pull(list(range(len(self.params))), [p.list_data() for p in self.params])
        finally:
            self.reduced.clear()

    def allreduce_grads(self) -> None:
        """Sum each parameter's gradients over its devices (those not summed yet this step)."""
        self._refuse_on_kvstore('allreduce_grads')
        self._init_store()
        self._reduce_all()

    def update(self, batch_size: int) -> None:
        """Apply the optimizer to every copy of every parameter, from its (summed) gradient."""
        self._refuse_on_kvstore('update')
        try:
            scale = self.optimizer.rescale_grad
            if self.loss_scaler is not None:
                # every copy holds the sum now: the first copies tell whether it overflowed
                loss_scale = self.loss_scaler.check([p.list_grad()[0] for p in self.params])
                if loss_scale is None:
                    return
                scale /= loss_scale      # folded into the step's scale: no pass over the grads
            apply_updates(self.optimizer, scale, batch_size, copies_of(self.params))
        finally:                         # a step that raised (a failed gradient) is over too
            self.reduced.clear()

    def backward(self, losses: Iterable[NDArray]) -> None:
        """Backpropagate every device's loss, summing each gradient as soon as it is complete.

        The last device's backward pass reports each parameter's gradient as it pushes it
        (`on_gradient`), and its sum over the devices is pushed right then, while the layers
        below are still being differentiated: Horovod's overlap of communication with
        backpropagation. The engine runs each sum as soon as the gradients it reads exist.
        """
        losses = list(losses)
        self._init_store()
        if self.update_on_kvstore and not self.store_updates:   # no optimizer there yet
            for loss in losses:
                loss.backward()
            return
        backward_reporting(losses, self.params, lambda i: self._reduce(i, self.params[i]))

    def _give_store_the_optimizer(self, batch_size):
        """A store that updates applies its optimizer to each push as it comes, told nothing of
        the step: at the first step it gets a copy of the Trainer's whose rescale_grad is the
        step's (the user's / batch_size), and the Trainer's stays the user's. A distributed
        store's servers keep the numbers they were sent, so a later step may not change the
        batch size; an in-process store's copy takes the new scale."""
        scale = self.optimizer.rescale_grad / batch_size
        if not self.store_updates:
            self.store.set_optimizer(self.optimizer.rescaled(scale))
            self.store_updates = True
        elif scale != self.store.optimizer.rescale_grad:
            if self.distributed:
                raise ValueError(f'step({batch_size}) after steps of another batch size: the '
                                 'servers scale gradients by the 1/batch_size of the first '
                                 'step; keep the batch size, or scale the loss and call step(1)')
            self.store.optimizer.rescale_grad = scale

    def _init_store(self):
        """Once, at the first backward or step (as Gluon does, so that creating a Trainer costs
        nothing): every parameter into the store, under its index, and worker 0's weights into
        every copy; no store where none is needed. Start every worker from the same weights
        (one seed): the first gradients are computed before the copies agree."""
        if self.initialized:
            return
        devices = max(len(p.list_data()) for p in self.params) if self.params else 1
        if self.store is None and devices > 1:
            raise ValueError(f'kvstore=None sums nothing, and the parameters live on {devices} '
                             "devices, whose copies would drift apart: use kvstore='device' "
                             "(the default) or 'local'; or, where the gradients are summed "
                             'already (a ParallelGPT step sums its replicas\'), call update(), '
                             'not step()')
        if self.store is not None and not self.distributed and not self.update_on_kvstore \
                and devices == 1:
            self.store = None           # one device, one process: nothing to sum
        if self.store is not None:
            keys = list(range(len(self.params)))
            self.store.init(keys, [p.list_data()[0] for p in self.params])
            if self.distributed:
                self.store.pull(keys, [p.list_data() for p in self.params])
        self.initialized = True

    def _reduce_all(self):
        for index, param in enumerate(self.params):
            self._reduce(index, param)

    def _reduce(self, index, param):
        if index in self.reduced:
            return
        self.reduced.add(index)
        grads = param.list_grad()
        if self.update_on_kvstore:
            self.store.push(index, grads)
        elif self.store is not None and (len(grads) > 1 or self.distributed):
            self.store.pushpull(index, grads)

    def _refuse_on_kvstore(self, name):
        if self.update_on_kvstore:
            raise ValueError(f'{name}() runs on the devices, but this Trainer updates in the '
                             f'{self.kvstore!r} store: call step(), or create the Trainer with '
                             'update_on_kvstore=False')


def store_from(kvstore):
    """The store a Trainer was given: None, a name for `kvstore.create`, or a store itself."""
    if isinstance(kvstore, str):
        return kvstores.create(kvstore)
    if kvstore is None or isinstance(kvstore, kvstores.KVStoreBase):
        return kvstore
    raise TypeError(f"kvstore is a store's name, a store or None, not {kvstore!r}")
