"""A unit of sharded training (FSDP's wrapping unit): a child block's parameters as one flat
buffer a device, of which device d owns chunk d, moved by one device's half of a collective
at a time (`comm.device_halves`): a gather onto one device, and one device's sends to the
chunks' owners.

The parameters are views of the flat buffer, so one copy moves a whole unit. Each device's
half is what its own process would run (in a real job the halves of all devices meet in one
collective): here one process runs the devices one after another, and each sends and
receives its own. `zero.py` decides when each runs.
"""
import numpy

from .. import comm, engine, np
from ..comm import chunk_bounds
from ..device import label, release, restore
from ..np.multiarray import NDArray


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
        self.full_grads = None
        self.drop_gradients()

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
        comm.receive_from_owners(self.weight_shards, flat, self.bounds)
        self.bind_views(d)
        self.gathered[d] = True

    # -- gradients -----------------------------------------------------------------------------
    def expect_gradients(self, d=None):
        """Mark device d's views (every device's by default) as wanting a gradient without
        making one: backward makes it."""
        for d in range(len(self.devices)) if d is None else [d]:
            for view, slot in zip(self.views[d], self.slots[d]):
                view.grad = slot

    def made_gradients(self):
        """The views holding a gradient that backward made and nobody has taken yet: the next
        micro-batch's backward adds into them (`autograd.adding`)."""
        return [view for views, slots in zip(self.views, self.slots)
                for view, slot in zip(views, slots) if view.grad is not slot]

    def take_gradients(self, d):
        """Device d's gradients of the unit, one flat array made from the views' (which are
        dropped): their sum over the micro-batches since the last take, as autograd added it."""
        flat = label(np.concatenate([made_or_zero(view, slot).reshape(-1)
                                     for view, slot in zip(self.views[d], self.slots[d])]),
                     'gradients')
        self.expect_gradients(d)
        self.unsent[d] = False
        return flat

    def keep_gradients(self, d):
        """Device d's gradients stay on the views, unsent, for the next micro-batch's backward
        to add to (FSDP's no_sync) or, stage 1, for the update to reduce-scatter."""
        self.unsent[d] = True

    def send_chunks(self, d):
        """Stages 2 and 3: device d's chunk of each owner's part to that owner, which adds it
        to its shard (the first to send since the update sets it): device d's half of a
        reduce-scatter."""
        flat = self.take_gradients(d)
        comm.send_to_owners(flat, self.grad_shards, self.bounds, combine=self.sent > 0)
        self.sent += 1

    def sum_kept_gradients(self, algorithm):
        """Before the update: stage 1 reduce-scatters every device's whole gradients, packed
        flat; stages 2 and 3 send what the micro-batches since the last sync left."""
        if self.stage == 1:
            self.full_grads = [self.take_gradients(d) for d in range(len(self.devices))]
            self.grad_shards = comm.reduce_scatter(self.full_grads, algorithm)
            return
        for d, unsent in enumerate(self.unsent):
            if unsent:
                self.send_chunks(d)

    def sends_done(self, d):
        """A variable written once device d's sends of this unit have all been added in."""
        done = engine.Var()
        engine.push(lambda: None, [shard.var for shard in self.grad_shards], [done],
                    self.devices[d], f'unit {self.index} sent')
        return done

    def drop_gradients(self):
        """Forget the step's gradients, whether made, kept or sent: the next step starts from
        zero (after an update, or after a step that failed or was interrupted midway). The
        views keep their slots, so that every forward's tape records them."""
        self.expect_gradients()
        self.sent, self.unsent = 0, [False] * len(self.devices)
        if self.stage == 1:
            self.full_grads = self.grad_shards = None


def unmade_like(array):
    """An array that backward will replace and nobody reads: it marks a parameter as wanting a
    gradient (`needs_grad`) while no memory is held for one, and so counts nothing."""
    return release(NDArray(array.shape, array.dtype, array.device))


def made_or_zero(view, slot):
    """The gradient backward made for `view`, or zeros where it made none (the loss did not
    reach the parameter): DDP's `find_unused_parameters`, so the sums still fit the shards."""
    if view.grad is slot:
        return np.zeros(view.shape, view.dtype, view.device)
    return view.grad

