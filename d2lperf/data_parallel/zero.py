"""ZeRO (Rajbhandari et al., 2020): shard what plain data parallelism keeps n copies of.

Plain data parallelism keeps, on each of n devices, every weight, every gradient and the whole
optimizer state, though each device's update repeats all the others'. Here device d owns
chunk d of every parameter (`comm.chunk_bounds` of its flattened values) and updates only that:

* stage 1: the optimizer state of its chunks alone. The gradients are reduce-scattered
  (device d gets the sum of chunk d), each device updates its chunks, and the weights are
  all-gathered: the same bytes moved as one allreduce, since that is an allreduce's two halves.
* stage 2: the gradients too: the summed chunk is copied to a buffer of the chunk's size and
  the full gradients are dropped as soon as the sum has read them; fresh ones are attached for
  the next step.
* stage 3: the weights too: between steps a device holds only its chunks; each step gathers
  the whole weights into fresh arrays (all-gather), computes, and drops them after the update.
  ZeRO-3 and FSDP free each layer's weights after its forward and gather them again for its
  backward: three halves of traffic a step, not two. `gathers=2` does that for the whole net
  at once (the tape keeps the arrays, without their data, in between), which moves the third
  half as ZeRO-3 does; only freeing layer by layer, which this does not do, lowers the peak.

Taught in "Data Parallelism at Scale"; `predict` says what each stage should hold and move.
"""
import numpy

from .. import autograd, comm, engine, np
from ..comm import chunk_bounds, fill
from ..device import label, release, restore
from ..np.multiarray import NDArray
from .overlap import backward_reporting
from .updates import apply_updates, check_devices, create_optimizer, trained

STAGES = (1, 2, 3)


class Zero:
    """Data-parallel training with ZeRO stage 1, 2 or 3 over the devices the parameters live on.

    `params`: `net.collect_params()`, initialized on the devices that compute.
    `step(forward, batch_size)`: `forward()` returns one loss a device, computed under
    `autograd.record`; the step sums, updates and (stages 1, 2) gathers the weights.
    """

    def __init__(self, params, stage, optimizer='sgd', optimizer_params=None, algorithm='ring',
                 gathers=1):
        if stage not in STAGES:
            raise ValueError(f'ZeRO has stages 1 (optimizer state sharded), 2 (and gradients) '
                             f'and 3 (and weights), not {stage!r}')
        if gathers not in (1, 2) or (gathers == 2 and stage != 3):
            raise ValueError(f'gathers is 1, or 2 for stage 3 (the weights gathered again for '
                             f'backward), not {gathers!r} at stage {stage}')
        self.gathers = gathers
        self.names, self.params = trained(params)
        self.devices = check_devices(self.params)
        self.stage, self.algorithm = stage, algorithm
        self.optimizer = create_optimizer(optimizer, optimizer_params)
        self.scale = self.optimizer.rescale_grad       # the user's; step(b) scales by scale / b
        self.shapes = [p.list_data()[0].shape for p in self.params]
        self.bounds = [chunk_bounds(p.list_data()[0].size, len(self.devices))
                       for p in self.params]
        self.grad_shards = [self._shards(i, 'gradients') for i in range(len(self.params))] \
            if stage >= 2 else None
        self.weight_shards, self.summed = None, None
        if stage == 3:
            self.weight_shards = [self._shards(i, 'weights') for i in range(len(self.params))]
            for param in self.params:
                param.set_copies(None)

    def _shards(self, index, kind):
        """Device d's chunk d of parameter `index`, as an array of its own: the weight's values
        for 'weights', zeros for 'gradients'."""
        weights = self.params[index].list_data()
        shards = []
        for weight, (start, stop) in zip(weights, self.bounds[index]):
            shard = (weight.reshape(-1)[start:stop].copy() if kind == 'weights'
                     else np.zeros((stop - start,), weight.dtype, weight.device))
            shards.append(label(shard, kind))
        return shards

    def step(self, forward, batch_size):
        if self.stage == 3:
            self.gather_weights()
        if self.stage >= 2:
            for param in self.params:
                for weight in param.list_data():
                    weight.attach_grad()
        with autograd.record():
            losses = list(forward())
        if self.gathers == 2:
            self.release_weights()
            self.gather_weights([p.list_data() for p in self.params])
        self.backward(losses)
        self.update(batch_size)

    def gather_weights(self, into=None):
        """Stage 3: every weight whole on every device again, from the devices' chunks: into
        fresh arrays, or `into` (one list of arrays a parameter) whose data was released."""
        for index, param in enumerate(self.params):
            whole = into[index] if into else [
                label(NDArray(self.shapes[index], shard.dtype, device), 'weights')
                for shard, device in zip(self.weight_shards[index], self.devices)]
            for array, shard, bounds in zip(whole, self.weight_shards[index],
                                            self.bounds[index]):
                fill(restore(array), shard, *bounds)
            param.set_copies(comm.all_gather_into(whole, self.algorithm))

    def release_weights(self):
        """After the forward pass: free every whole weight's data (the tape keeps the arrays)."""
        for param in self.params:
            for weight in param.list_data():
                engine.push(lambda weight=weight: setattr(weight, 'data', None), [],
                            [weight.var], weight.device, 'release')
                release(weight)

    def backward(self, losses):
        """Backpropagate every device's loss; reduce-scatter each gradient once it is pushed."""
        self.summed = [None] * len(self.params)
        backward_reporting(losses, self.params, self.reduce_scatter)

    def reduce_scatter(self, index):
        param = self.params[index]
        shards = comm.reduce_scatter(param.list_grad(), self.algorithm)
        if self.stage >= 2:
            for buffer, shard in zip(self.grad_shards[index], shards):
                buffer[...] = shard
            for weight in param.list_data():
                weight.grad = None                  # freed once the sum has been read
            shards = self.grad_shards[index]
        self.summed[index] = shards

    def update(self, batch_size):
        """Each device updates its chunks; then the weights are gathered (stages 1 and 2) or
        the whole ones dropped (stage 3). One parameter at a time, so that its gather starts
        while the next is updated."""
        for index, param in enumerate(self.params):
            apply_updates(self.optimizer, self.scale, batch_size, self.shard_updates(index))
            if self.stage < 3:
                comm.all_gather_into(param.list_data(), self.algorithm)
            else:
                param.set_copies(None)

    def shard_updates(self, index):
        """(key, weight chunk, summed gradient chunk) of parameter `index` on every device."""
        return [((index, device), self.weight_shard(index, device), grad)
                for device, grad in enumerate(self.summed[index])]

    def weight_shard(self, index, device):
        if self.stage == 3:
            return self.weight_shards[index][device]
        start, stop = self.bounds[index][device]
        return self.params[index].list_data()[device].reshape(-1)[start:stop]

    def weights(self):
        """{name: NumPy array}: every weight whole (from the first device, or the shards)."""
        if self.stage < 3:
            return {name: p.list_data()[0].asnumpy() for name, p in zip(self.names, self.params)}
        return {name: numpy.concatenate([s.asnumpy() for s in shards]).reshape(shape)
                for name, shards, shape in zip(self.names, self.weight_shards, self.shapes)}
