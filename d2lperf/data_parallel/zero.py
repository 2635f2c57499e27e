"""ZeRO (Rajbhandari et al., 2020) and FSDP (Zhao et al., 2023): shard what plain data
parallelism keeps n copies of, and hold whole only what the step is using.

Plain data parallelism keeps, on each of n devices, every weight, every gradient and the whole
optimizer state, though each device's update repeats all the others'. Here the net's children
are the units (FSDP's wrapping unit): each unit's parameters live as one flat buffer a device,
the parameters being views of it (FSDP's flat parameter), and device d owns chunk d of every
unit (its shard), which only it updates. One gather or one reduction moves a whole unit: one
collective a unit, never one a parameter.

* stage 1: the optimizer state of its chunks alone. After backward each unit's gradients are
  reduce-scattered (device d gets the sum of chunk d), each device updates its chunks, and the
  units' weights are all-gathered: the bytes of one allreduce, which is these two halves.
* stage 2: the gradients too. Nothing holds a gradient before backward makes it; as soon as
  a device's backward has made a unit's gradients, it sends each chunk to the chunk's owner,
  which adds it into its shard, and drops them. (One process runs the devices' backward passes
  one after another, so each device sends its own, as its own process would, rather than
  waiting for the others' passes with every gradient held.)
* stage 3: the weights too. Between steps a device holds only its chunks. A unit is gathered
  onto a device just before its forward there and freed right after, gathered again just
  before its backward (`autograd.on_backward`) and freed once its gradients are sent. The
  next `prefetch` units are gathered along with it, so their copies can overlap compute: a
  device holds its shards plus at most prefetch + 1 units whole. Three halves of traffic a
  step: two gathers and one reduction. `Zero(net, 3)` runs the net imperatively
  (`net.hybridize(False)`): one graph compiled from the whole net would run past the gathers.

A unit the loss does not reach gets zero gradients (DDP's `find_unused_parameters`), and a
step that fails or is interrupted midway is dropped whole, so the next starts from zero.

Taught in "Data Parallelism at Scale"; `predict` says what each stage should hold and move.
"""
from __future__ import annotations

import collections
import weakref
from typing import Callable, Sequence

import numpy

from .. import autograd, comm, engine
from ..hybrid import Symbol, TraceError
from ..nn.block import Block
from ..np.multiarray import NDArray
from .overlap import one_loss_a_device, reached_twice
from .units import units_of
from .updates import apply_updates, check_devices, create_optimizer, trained

STAGES = (1, 2, 3)
HYBRIDIZED = ('ZeRO stage 3 gathers each unit just before its forward and its backward, which '
              'a net compiled whole would run past: Zero(net, 3) runs the net imperatively, '
              'and the net was hybridized after it; call net.hybridize(False)')


class Zero:
    """Data-parallel training with ZeRO stage 1, 2 or 3 of `net` over the devices it lives on.

    `net`: a Block initialized on the devices that compute; its children that train are the
    units. `step(forward, batch_size)`: `forward()` returns one loss a device, computed from the
    net under `autograd.record`, device after device; the step backpropagates, sums, updates
    and (stages 1, 2) gathers the weights.
    """

    def __init__(self, net: Block, stage: int, optimizer: str = 'sgd',
                 optimizer_params: dict | None = None, algorithm: str = 'ring',
                 prefetch: int = 1):
        if stage not in STAGES:
            raise ValueError(f'ZeRO has stages 1 (optimizer state sharded), 2 (and gradients) '
                             f'and 3 (and weights), not {stage!r}')
        if not (isinstance(prefetch, int) and prefetch >= 0):
            raise ValueError(f'prefetch is how many units to gather ahead, 0 or more, not '
                             f'{prefetch!r}')
        if not isinstance(net, Block):
            raise TypeError(f'Zero takes the net (a Block), whose children it shards one by '
                            f'one, not {type(net).__name__}')
        self.names, self.params = trained(net.collect_params())
        self.devices = check_devices(self.params)
        self.stage, self.algorithm, self.prefetch = stage, algorithm, prefetch
        self.optimizer = create_optimizer(optimizer, optimizer_params)
        self.scale = self.optimizer.rescale_grad       # the user's; step(b) scales by scale / b
        self.units = units_of(net, self.params, self.devices, stage)
        if stage == 3:
            # Each unit is gathered just before its forward and its backward: one graph
            # compiled from the whole net would run past both (and keep the weights it read).
            net.hybridize(False)
            for unit in self.units:
                self._hook(unit)

    # -- a step ------------------------------------------------------------------------------
    def step(self, forward: Callable[[], Sequence[NDArray]], batch_size: int) -> None:
        self.accumulate(forward)
        self.update(batch_size)

    def accumulate(self, forward: Callable[[], Sequence[NDArray]], sync: bool = True) -> None:
        """One micro-batch: forward and backward, its gradients added to the step's.

        `sync=False` is DDP's and FSDP's `no_sync`: each device keeps its gradients whole on
        the parameters, where autograd adds the next micro-batch's (`autograd.adding`, as a
        pipeline's micro-batches add up), and sends nothing, so the bytes of one reduction
        serve many micro-batches, at the price of every full gradient held until the next
        micro-batch that syncs."""
        try:
            # gradients earlier micro-batches left unsent: backward adds into them
            with autograd.adding([view for unit in self.units for view in unit.made_gradients()]):
                with autograd.record():
                    losses = list(forward())
                self.backward(losses, sync)
        except BaseException:
            # A micro-batch that fails or is interrupted (Ctrl-C) midway has sent and kept
            # part of its gradients: the whole step is dropped, so the next starts from zero.
            self.drop(self.units)
            raise

    def backward(self, losses, sync=True):
        """Each device's backward pass; a unit's gradients go on as soon as a device has them."""
        one_loss_a_device(losses, self.devices)
        self.sends_pending = [collections.deque() for _ in self.devices]
        for device, loss in enumerate(losses):
            missing = {id(unit): len(unit.params) for unit in self.units}
            unit_of = {id(view): unit for unit in self.units for view in unit.views[device]}

            def reached(view, device=device, missing=missing, unit_of=unit_of):
                unit = unit_of.get(id(view))
                if unit is not None:
                    missing[id(unit)] -= 1
                    if missing[id(unit)] == 0:
                        self.gradients_made(unit, device, sync)
                    elif missing[id(unit)] < 0:
                        raise reached_twice(f'unit {unit.index} ({type(unit.block).__name__})')
            loss.backward(on_gradient=reached)
            for unit in self.units:     # units the loss did not reach get zero gradients
                if missing[id(unit)] > 0:
                    self.gradients_made(unit, device, sync)

    def gradients_made(self, unit, device, sync=True):
        """A device's backward has made a unit's gradients: stage 1 leaves them on the
        parameters (whole, as it holds them anyway) for one reduce-scatter at the update;
        stages 2 and 3 send this device's chunks to their owners now (`comm.send_to_owners`),
        and drop them, unless told not to sync."""
        if self.stage == 1 or not sync:
            unit.keep_gradients(device)
        else:
            unit.send_chunks(device)
            self.limit_sends_in_flight(unit, device)
        if self.stage == 3:
            unit.free(device)

    def limit_sends_in_flight(self, unit, device):
        """Let backward run at most one unit ahead of the sends: the engine frees a gradient
        only once the operations that read it are done, so a backward pass pushed far ahead of
        them would hold every gradient at once. (FSDP limits its gathers in flight alike.)"""
        pending = self.sends_pending[device]
        pending.append(unit.sends_done(device))
        while len(pending) > 1:
            engine.wait_for(pending.popleft())

    def update(self, batch_size):
        """Each device updates its chunks; then stages 1 and 2 gather the weights. One unit at
        a time, so that its gather starts while the next is updated."""
        try:
            for index, unit in enumerate(self.units):
                unit.sum_kept_gradients(self.algorithm)
                apply_updates(self.optimizer, self.scale, batch_size,
                              [((index, device), weight, grad) for device, (weight, grad)
                               in enumerate(zip(unit.weight_shards, unit.grad_shards))])
                if self.stage < 3:
                    comm.all_gather_into(unit.flats, self.algorithm)
                self.drop([unit])
        finally:
            self.drop(self.units)

    def drop(self, units):
        """The units' gradients dropped and (stage 3) their whole copies freed, once updated or
        when a step fails midway: the next step starts from zero gradients, and from the
        shards (a copy gathered ahead and not used is stale once they are updated)."""
        for unit in units:
            unit.drop_gradients()
            for device in range(len(self.devices)):
                unit.free(device)

    # -- stage 3: a unit whole only around its forward and its backward ---------------------
    def _hook(self, unit):
        """Gather around the unit's forward, and before its backward. The hooks hold this Zero
        weakly: the net does not keep it alive, and its hooks do nothing once it is gone."""
        zero = weakref.ref(self)

        def before_forward(block, args):
            if zero() is not None:
                if isinstance(args[0], Symbol):
                    raise TraceError(HYBRIDIZED)
                zero().gather_with_prefetch(unit.index, args[0].device, +1)

        def after_forward(block, args, out):
            if zero() is None:
                return None
            unit.free(zero().devices.index(out.device))
            return autograd.on_backward(out, lambda: zero().gather_with_prefetch(
                unit.index, out.device, -1))
        unit.block.register_forward_pre_hook(before_forward)
        unit.block.register_forward_hook(after_forward)

    def gather_with_prefetch(self, index, device, direction):
        """Unit `index` whole on `device`, and the next `prefetch` units the pass will reach
        (forward: the following ones; backward: the ones before)."""
        d = self.devices.index(device)
        for ahead in range(self.prefetch + 1):
            j = index + direction * ahead
            if 0 <= j < len(self.units):
                self.units[j].gather(d)

    def weights(self) -> dict[str, numpy.ndarray]:
        """{name: NumPy array}: every weight whole, from the owners' shards."""
        found = {}
        for unit in self.units:
            flat = numpy.concatenate([s.asnumpy() for s in unit.weight_shards])
            for param, shape, (start, stop) in zip(unit.params, unit.shapes, unit.layout):
                found[id(param)] = flat[start:stop].reshape(shape)
        return {name: found[id(param)] for name, param in zip(self.names, self.params)}
