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
  step: two gathers and one reduction.

Taught in "Data Parallelism at Scale"; `predict` says what each stage should hold and move.
"""
from __future__ import annotations

import collections
import weakref
from typing import Callable, Sequence

import numpy

from .. import autograd, comm, engine, np
from ..comm import chunk_bounds
from ..comm.allreduce import TransferName
from ..device import label, release, restore, transfer
from ..nn.block import Block
from ..np.multiarray import NDArray
from .updates import apply_updates, check_devices, create_optimizer, trained

STAGES = (1, 2, 3)


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
            for unit in self.units:
                self._hook(unit)

    # -- a step ------------------------------------------------------------------------------
    def step(self, forward: Callable[[], Sequence[NDArray]], batch_size: int) -> None:
        self.accumulate(forward)
        self.update(batch_size)

    def accumulate(self, forward: Callable[[], Sequence[NDArray]], sync: bool = True) -> None:
        """One micro-batch: forward and backward, its gradients added to the step's.

        `sync=False` is DDP's and FSDP's `no_sync`: each device keeps its gradients summed
        whole and sends nothing, so the bytes of one reduction serve many micro-batches, at
        the price of every full gradient held until the next micro-batch that syncs."""
        for unit in self.units:         # before forward, so that the tape records the weights
            unit.expect_gradients()
        with autograd.record():
            losses = list(forward())
        self.backward(losses, sync)

    def backward(self, losses, sync=True):
        """Each device's backward pass; a unit's gradients go on as soon as a device has them."""
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
            loss.backward(on_gradient=reached)
            for unit in self.units:                 # units the loss did not reach
                if missing[id(unit)] > 0:
                    self.gradients_made(unit, device, sync)

    def gradients_made(self, unit, device, sync=True):
        """A device's backward has made a unit's gradients: stage 1 keeps them (whole, as it
        holds them anyway) for one reduce-scatter at the update; stages 2 and 3 send this
        device's chunks to their owners now, and drop them, unless told not to sync."""
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
        for index, unit in enumerate(self.units):
            unit.sum_kept_gradients(self.algorithm)
            apply_updates(self.optimizer, self.scale, batch_size,
                          [((index, device), weight, grad) for device, (weight, grad)
                           in enumerate(zip(unit.weight_shards, unit.grad_shards))])
            if self.stage < 3:
                comm.all_gather_into(unit.flats, self.algorithm)
            else:                       # a copy gathered ahead and not used is stale now
                for device in range(len(self.devices)):
                    unit.free(device)
            unit.drop_gradients()

    # -- stage 3: a unit whole only around its forward and its backward ---------------------
    def _hook(self, unit):
        """Gather around the unit's forward, and before its backward. The hooks hold this Zero
        weakly: the net does not keep it alive, and its hooks do nothing once it is gone."""
        zero = weakref.ref(self)

        def before_forward(block, args):
            if zero() is not None:
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


def units_of(net, params, devices, stage):
    """The net's children that hold trained parameters, in forward order, as Units."""
    trained_ids = {id(p) for p in params}
    units, covered = [], set()
    for child in net.children():
        mine = [p for p in child.collect_params().values() if id(p) in trained_ids]
        if mine:
            units.append(Unit(len(units), child, mine, devices, stage))
            covered.update(id(p) for p in mine)
    if len(covered) < len(trained_ids):
        raise ValueError('ZeRO shards the net by its children (FSDP\'s units): put the '
                         'parameters the net holds itself into a child block')
    return units


class Unit:
    """One child block's parameters as one flat buffer a device; the parameters are views of
    it, and device d owns chunk d (`weight_shards[d]`, `grad_shards[d]`)."""

    def __init__(self, index, block, params, devices, stage):
        self.index, self.block, self.params, self.devices = index, block, params, devices
        self.stage = stage
        self.shapes = [p.list_data()[0].shape for p in params]
        stops = numpy.cumsum([p.list_data()[0].size for p in params]).tolist()
        self.layout = list(zip([0] + stops[:-1], stops))
        dtype = params[0].list_data()[0].dtype
        self.bounds = chunk_bounds(stops[-1], len(devices))
        self.flats = [label(np.concatenate([p.list_data()[d].reshape(-1) for p in params]),
                            'weights') for d in range(len(devices))]
        self.views = [[NDArray(shape, dtype, device, flat.var) for shape in self.shapes]
                      for device, flat in zip(devices, self.flats)]
        for d in range(len(devices)):
            self.bind_views(d)
        for i, param in enumerate(params):
            param.set_copies([views[i] for views in self.views])
        self.gathered = [True] * len(devices)
        if stage == 3:
            self.weight_shards = [label(flat[start:stop].copy(), 'weights')
                                  for flat, (start, stop) in zip(self.flats, self.bounds)]
            for d in range(len(devices)):
                self.free(d)
        else:
            self.weight_shards = [flat[start:stop]
                                  for flat, (start, stop) in zip(self.flats, self.bounds)]
        self.grad_shards = None if stage == 1 else [
            label(np.zeros((stop - start,), dtype, device), 'gradients')
            for device, (start, stop) in zip(devices, self.bounds)]
        self.slots = [[unmade_like(view) for view in views] for views in self.views]
        self.kept = [None] * len(devices)       # gradients summed here, not sent yet
        self.full_grads, self.sent = None, 0

    # -- weights ------------------------------------------------------------------------------
    def bind_views(self, d):
        """One engine operation: each parameter's view as its piece of the flat buffer."""
        flat, views = self.flats[d], self.views[d]

        def run():
            for view, (start, stop) in zip(views, self.layout):
                view.data = flat.data[start:stop].reshape(view.shape)
        engine.push(run, [], [flat.var], flat.device, f'unit {self.index} views')

    def free(self, d):
        """Stage 3: drop the unit's whole weights on device d (its shard stays)."""
        if self.stage < 3 or not self.gathered[d]:
            return
        flat, views = self.flats[d], self.views[d]

        def run():
            flat.data = None
            for view in views:
                view.data = None
        engine.push(run, [], [flat.var], flat.device, f'unit {self.index} free')
        release(flat)
        self.gathered[d] = False

    def gather(self, d):
        """Stage 3: the unit whole on device d again, each owner's shard copied into its
        chunk: device d's half of an all-gather, as its own process runs it."""
        if self.gathered[d]:
            return
        flat = restore(self.flats[d])

        def allocate():
            flat.data = flat.device.xp.empty(flat.shape, flat.dtype)
        engine.push(allocate, [], [flat.var], flat.device, f'unit {self.index} memory')
        for owner, (shard, (start, stop)) in enumerate(zip(self.weight_shards, self.bounds)):
            send(shard, flat, start, stop, 'all-gather', owner, combine=False)
        self.bind_views(d)
        self.gathered[d] = True

    # -- gradients -----------------------------------------------------------------------------
    def expect_gradients(self):
        """Mark every view as wanting a gradient without making one: backward makes it."""
        for views, slots in zip(self.views, self.slots):
            for view, slot in zip(views, slots):
                view.grad = slot

    def take_gradients(self, d, kept_only=False):
        """Device d's gradients of the unit, one flat array (made from backward's, which are
        dropped), with what earlier micro-batches kept here added in."""
        if kept_only:
            kept, self.kept[d] = self.kept[d], None
            return kept
        grads = [view.grad for view in self.views[d]]
        flat = np.concatenate([g.reshape(-1) for g in grads])
        for view, slot in zip(self.views[d], self.slots[d]):
            view.grad = slot
        kept, self.kept[d] = self.kept[d], None
        return label(flat if kept is None else kept + flat, 'gradients')

    def keep_gradients(self, d):
        self.kept[d] = self.take_gradients(d)

    def send_chunks(self, d, kept_only=False):
        """Stages 2 and 3: device d's chunk of each owner's part to that owner, which adds it
        to its shard (the first to send since the update sets it): device d's half of a
        reduce-scatter."""
        flat = self.take_gradients(d, kept_only)
        for owner, (shard, (start, stop)) in enumerate(zip(self.grad_shards, self.bounds)):
            send(flat, shard, start, stop, 'reduce-scatter', owner, combine=self.sent > 0,
                 reverse=True)
        self.sent += 1

    def sum_kept_gradients(self, algorithm):
        """Before the update: stage 1 reduce-scatters the whole gradients every device kept;
        stages 2 and 3 send what a last micro-batch without sync left."""
        if self.stage == 1:
            self.full_grads, self.kept = self.kept, [None] * len(self.devices)
            self.grad_shards = comm.reduce_scatter(self.full_grads, algorithm)
            return
        for d, kept in enumerate(self.kept):
            if kept is not None:
                self.send_chunks(d, kept_only=True)

    def sends_done(self, d):
        """A variable written once device d's sends of this unit have all been added in."""
        done = engine.Var()
        engine.push(lambda: None, [shard.var for shard in self.grad_shards], [done],
                    self.devices[d], f'unit {self.index} sent')
        return done

    def drop_gradients(self):
        self.sent = 0
        if self.stage == 1:
            self.full_grads = self.grad_shards = None


def unmade_like(array):
    """An array that backward will replace and nobody reads: it marks a parameter as wanting a
    gradient (`needs_grad`) while no memory is held for one, and so counts nothing."""
    return release(NDArray(array.shape, array.dtype, array.device))


def send(source, target, start, stop, phase, owner, combine, reverse=False):
    """Copy chunk [start, stop) between a flat array and a shard on another device (or the
    same one), and set or add it there: from the owner's shard into `target`'s chunk (a
    gather), or, `reverse`, from `source`'s chunk into the owner's shard (a reduction).
    Named as comm names a transfer, so `comm.bytes_sent` counts it."""
    if stop == start:
        return
    source_device, target_device = source.device, target.device
    nbytes = (stop - start) * source.dtype.itemsize
    read = (lambda: source.data[start:stop]) if reverse else (lambda: source.data)

    def write(data):
        if reverse:
            if combine:
                target.data += data
            else:
                target.data[...] = data
        else:
            target.data[start:stop] = data
    action = 'add' if combine else 'set'
    if source_device == target_device:
        engine.push(lambda: write(read()), [source.var], [target.var], target_device,
                    TransferName('direct', phase, 1, owner, source_device, target_device,
                                 action))
        return
    received, move = {}, transfer(source_device, target_device)
    copy_device, lane = engine.copy_lane(source_device, target_device)
    buffer = engine.Var()

    def sent():
        received['data'] = move(read())
    engine.push(sent, [source.var], [buffer], copy_device,
                TransferName('direct', phase, 1, owner, source_device, target_device, 'send',
                             nbytes), lane)
    engine.push(lambda: write(received.pop('data')), [buffer], [target.var], target_device,
                TransferName('direct', phase, 1, owner, source_device, target_device, action))
