"""Expert parallelism (GShard, Lepikhin et al., 2020): a mixture's experts spread over n
devices, E/n each, and each token sent to its experts' device and back by all-to-all.

Each device holds a data-parallel share of the tokens and a copy of the router. It routes
its own tokens and fills its expert buffer, E · capacity rows in the order of the experts
(`nn.MoE.dispatch`); since device j holds experts j · E/n onwards, chunk j of the buffer is
device j's, and one all-to-all brings every device the rows of its experts from every
sender. Each local expert runs on its rows from all senders at once; a second all-to-all,
the same call on the outputs, sends each row home, where the device combines its tokens'
outputs as one device would. As in Megatron-LM, the expert-parallel ranks are the data-
parallel ones (expert parallelism does not add devices): the router's gradients are summed
over them as a data-parallel replica's are (`finish_gradients`); each expert's stay where it
lives. Backward runs the two all-to-alls again, in reverse: an all-to-all's gradient is an
all-to-all of the gradients (`autograd.collective`; `backward` walks every device's graph
side by side). Taught in "Long Sequences and Many Experts".
"""
from __future__ import annotations

from typing import Sequence

from .. import autograd, comm, np
from ..device import Device
from ..nn.moe import Mixture, MoE
from ..nn.transformer import MLP
from ..np.multiarray import NDArray
from .stage import copied


def expert_parallel(moe: MoE, devices: Sequence[Device]) -> ExpertParallelMoE:
    """`moe`'s experts split over `devices` (E/n each, in order), its router copied to each;
    `moe` itself is left as it is. Call it on a list of inputs, one a device.

    >>> moe = d2l.nn.MoE(8, num_experts=4, capacity_factor=4.0).initialize()
    >>> ep = d2l.model_parallel.expert_parallel(moe, [d2l.cpu(1), d2l.cpu(2)])
    >>> [len(rank.experts) for rank in ep.ranks], [rank.device for rank in ep.ranks]
    ([2, 2], [cpu(1), cpu(2)])
    >>> x = d2l.np.random.normal(size=(6, 8))
    >>> outs = ep([x.copyto(d2l.cpu(1)), x.copyto(d2l.cpu(2))])
    >>> bool(abs(outs[1].asnumpy() - moe(x).asnumpy()).max() < 1e-6), ep.dropped
    (True, 0)
    """
    return ExpertParallelMoE(moe, devices)


class ExpertRank(Mixture):
    """One device's part: the router, whole, and experts `first` onwards (`local` of them),
    with `moe`'s values. Routing, dispatch and combine are the mixture's, over all E experts;
    it has no forward of its own: `ExpertParallelMoE` calls its parts."""

    def __init__(self, moe, first, local, device):
        super().__init__(moe.num_hiddens, moe.num_experts, moe.top_k, moe.capacity_factor)
        copied(self.router, moe.router)
        self.device, self.experts = device, []
        for e in range(first, first + local):
            expert = copied(MLP(moe.num_hiddens), moe.experts[e])
            setattr(self, f'expert{e}', expert)
            self.experts.append(expert)
        self.reset_device(device)

    def run_experts(self, arrived, senders, rows):
        return run_experts(self.experts, arrived, senders, rows)


def run_experts(experts, arrived, senders, rows):
    """The outputs of a device's `experts` for the rows that `senders` devices sent, in the
    order they arrived: sender by sender, expert by expert, `rows` a sender and expert. Each
    expert runs once, on its rows from every sender."""
    local = len(experts)

    def block(sender, expert):
        start = (sender * local + expert) * rows
        return start, start + rows
    outputs = []
    for e, expert in enumerate(experts):
        mine = [arrived[slice(*block(i, e))] for i in range(senders)]
        outputs.append(expert(mine[0] if senders == 1 else np.concatenate(mine)))
    return np.concatenate([outputs[e][i * rows:(i + 1) * rows]
                           for i in range(senders) for e in range(local)])


class ExpertParallelMoE:
    """A mixture over devices: `ranks[r]` holds the router and experts r · E/n onwards on
    `devices[r]`. After a call, `aux_loss` is each device's loss over its own tokens (a
    list) and `dropped` the choices dropped over all devices."""

    def __init__(self, moe, devices):
        self.devices, n = list(devices), len(devices)
        if n == 0 or moe.num_experts % n:
            raise ValueError(f'{moe.num_experts} experts do not split among {n} devices: use '
                             f'a number of devices that divides {moe.num_experts}')
        if len(set(self.devices)) < n:
            raise ValueError(f'expert parallelism needs distinct devices, got {self.devices}')
        local = moe.num_experts // n
        self.ranks = [ExpertRank(moe, r * local, local, device)
                      for r, device in enumerate(self.devices)]
        self.aux_loss, self.dropped = None, None

    def __call__(self, xs: Sequence[NDArray]) -> list[NDArray]:
        """Outputs for `xs`, one array a device, each (..., hiddens) with the same number of
        tokens (so that every device's buffer has one shape)."""
        xs = list(xs)
        self.check(xs)
        tokens = [x.reshape(-1, x.shape[-1]) for x in xs]
        routings = [rank.route(t) for rank, t in zip(self.ranks, tokens)]
        buffers = [rank.dispatch(t, r) for rank, t, r in zip(self.ranks, tokens, routings)]
        arrived = exchange(buffers)
        rows = routings[0].capacity
        done = [rank.run_experts(a, len(self.ranks), rows)
                for rank, a in zip(self.ranks, arrived)]
        home = exchange(done)
        self.aux_loss = [rank.aux_loss for rank in self.ranks]
        self.dropped = sum(rank.dropped for rank in self.ranks)
        return [rank.combine(h, r).reshape(x.shape)
                for rank, h, r, x in zip(self.ranks, home, routings, xs)]

    def backward(self, heads: Sequence[NDArray]) -> None:
        """Every device's backward pass from its head, side by side: they meet at the two
        all-to-alls."""
        autograd.backward_together(list(heads))

    def finish_gradients(self) -> None:
        """The routers' gradients summed over the devices, as data parallelism sums a
        replica's (each expert's gradient is whole where it lives)."""
        for params in zip(*(rank.router.collect_params().values() for rank in self.ranks)):
            comm.allreduce([p.grad(rank.device) for p, rank in zip(params, self.ranks)])

    def check(self, xs):
        if [x.device for x in xs] != self.devices:
            raise ValueError(f'expert parallelism takes one input a device, on {self.devices} '
                             f'in that order; got inputs on {[x.device for x in xs]}')
        counts = {x.size // x.shape[-1] for x in xs}
        if len(counts) > 1:
            raise ValueError(f'every device must hold the same number of tokens, so that the '
                             f'expert buffers have one shape; got {sorted(counts)}')


class GridMixture(Mixture):
    """A GPT layer's mixture inside a stage group (`layers.TensorGroup` with `expert` = e):
    the router whole, and the experts `held` by the programs that run this share of the GPT
    (in a 3D grid one share serves a program in every replica, whose expert ranks differ).
    A program routes its tokens, sends each expert's rows to its expert rank and runs its
    own E/e experts on what arrives from its e - 1 peers (`TensorGroup.expert_peers`), as
    `ExpertParallelMoE` does for devices side by side. Each expert's Parameter has a copy on
    the devices of the programs whose expert rank holds it, and its gradient is summed over
    them (`TensorParallelGPT.finish_gradients`)."""

    def __init__(self, num_hiddens, num_experts, top_k, group, held):
        super().__init__(num_hiddens, num_experts, top_k)
        self.group, self.held = group, sorted(held)
        for e in self.held:
            setattr(self, f'expert{e}', MLP(num_hiddens))

    def expert(self, e):
        return getattr(self, f'expert{e}')

    def forward(self, x):
        program = self.group.program()
        peers, rank = self.group.expert_peers(program), self.group.expert_rank(program)
        local = self.num_experts // len(peers)
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens)
        arrived = self.group.meet(self.dispatch(tokens, routing), exchange, peers)
        mine = [self.expert(e) for e in range(rank * local, (rank + 1) * local)]
        done = run_experts(mine, arrived, len(peers), routing.capacity)
        return self.combine(self.group.meet(done, exchange, peers), routing).reshape(x.shape)

    def take(self, whole):
        """The router and the held experts of the whole mixture `whole`, and its capacity."""
        copied(self.router, whole.router)
        for e in self.held:
            copied(self.expert(e), whole.experts[e])
        self.capacity_factor = whole.capacity_factor

    def expert_params(self):
        return {e: list(self.expert(e).collect_params().values()) for e in self.held}


def exchange(arrays):
    """An all-to-all of the arrays, recorded: its backward is the all-to-all of the
    gradients, since sending chunk j of device i to device j and back is the identity."""
    with autograd.pause():
        outs = comm.all_to_all(arrays)
    return autograd.collective(outs, arrays, comm.all_to_all)
