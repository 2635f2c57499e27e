"""Megatron-LM's parallel layers (Shoeybi et al., 2019): a Dense layer split over the t devices
of a group, with the collective that joins the devices inside it.

* `ColumnParallelDense` holds 1/t of the layer's output features (rows of its weight). Its
  input must be whole on every device: f, at its entry, is the identity forward and an
  allreduce of the input's gradients backward, since every device's share contributed to it.
* `RowParallelDense` holds 1/t of its input features (columns of its weight), so each device
  computes a part of the output: g, at its exit, sums the parts (an allreduce) forward and is
  the identity backward. Its bias is added once, by the first device.

A Transformer block is f, column-parallel layers, whatever each device computes alone, a
row-parallel layer, g: one allreduce forward and one backward a block. With sequence
parallelism (Korthikanti et al., 2022) the residual stream between the blocks is split by
tokens, and f and g become the two halves of the allreduce: f an all-gather of the tokens
(a reduce-scatter backward), g a reduce-scatter (an all-gather backward).

Megatron runs each device's share as a process of its own, and a collective is where the
processes meet. Here a `TensorGroup` runs each device's program on a thread of its own, one at
a time (`run`): a device runs until its collective, hands on to the next, and the last to come
runs the collective for all (`meet`). The engine sees the operations pushed in the order one
thread pushing for each device in turn would push them. Backward needs no threads: the
devices' walks already go side by side (`autograd.backward_together`). `DeviceSpec` is what
a GPT's blocks are made of on one device of the group (`nn.layer_spec.LayerSpec`).
Taught in "Tensor and Sequence Parallelism".
"""
from __future__ import annotations

import collections
import threading

from .. import autograd, comm, np
from ..nn.block import Dense
from ..np.multiarray import alias
from ..nn.init import Normal
from ..nn.layer_spec import INIT_SIGMA, LayerSpec
from . import context, expert
from .stage import copied, in_dtypes_of


class TensorGroup:
    """The `size` ranks that split each layer (t, a device each), the collectives that join
    them (`algorithm`), and whether the residual stream is split by tokens (`sequence`). A
    collective joins the arrays the ranks bring, on whatever devices they are.

    With context parallelism (`context` = c > 1) and data parallelism (`data` = d > 1) the
    group is d·c·t programs, t fastest, then c, then d (Megatron's order, tp-cp-dp): program
    r is tensor rank r mod t of context rank (r // t) mod c of replica r // (c·t). The tensor
    collectives join the t programs of a context rank; the attention joins the c programs of
    a tensor rank (`context_attention`, by `context_algorithm`). The replicas run in
    lockstep, so that a collective may join them too: with `expert` = e > 1 a mixture's
    experts are spread over e programs carved out of the d·c that share a tensor rank
    (Megatron's expert parallelism: it adds no devices), which meet at its all-to-alls."""

    def __init__(self, size, algorithm='ring', sequence=False, context=1,
                 context_algorithm='ring', data=1, expert=1):
        self.size, self.algorithm, self.sequence = size, algorithm, sequence
        self.context, self.context_algorithm, self.data = context, context_algorithm, data
        self.expert, self.programs = expert, size * context * data
        self.running = threading.local()            # the program this thread runs

    def program(self):
        """The program that runs on this thread: the replicas share their layers, so a layer
        asks the group which program calls it."""
        return self.running.rank

    def tensor_rank(self, rank):
        return rank % self.size

    def context_rank(self, rank):
        return rank // self.size % self.context

    def data_rank(self, rank):
        return rank // (self.size * self.context)

    def tensor_peers(self, rank):
        """The programs that split a layer with `rank`: its context rank's t."""
        first = rank - self.tensor_rank(rank)
        return tuple(range(first, first + self.size))

    def context_peers(self, rank):
        """The programs of `rank`'s replica that hold the other chunks of the sequence for
        its heads."""
        first = self.data_rank(rank) * self.size * self.context + self.tensor_rank(rank)
        return tuple(range(first, first + self.size * self.context, self.size))

    def expert_rank(self, rank):
        """Of the d·c programs of `rank`'s tensor rank, numbered replica by replica and
        context rank by context rank, each consecutive e are an expert group."""
        return rank // self.size % self.expert

    def expert_peers(self, rank):
        """The programs of `rank`'s expert group: its e consecutive programs of the d·c that
        share its tensor rank."""
        first = rank - self.expert_rank(rank) * self.size
        return tuple(range(first, first + self.expert * self.size, self.size))

    def experts_held(self, share, num_experts):
        """The experts that the programs running `share` (program share, and its copies in
        the other replicas) hold: E/e a program, by its expert rank."""
        shares, local = self.size * self.context, num_experts // self.expert
        ranks = {self.expert_rank(share + r * shares) for r in range(self.data)}
        return [e for e in range(num_experts) if e // local in ranks]

    def run(self, program, inputs, tokens_shape):
        """[program(rank, inputs[rank]) for each rank], each on a thread of its own (rank
        0's the caller's), one at a time: rank 0 first, each until it meets others (`meet`)
        or ends, then the next in the cycle. `tokens_shape` is the (batch, sequence) of the
        tokens the inputs come from."""
        n = self.programs
        batch, seq = tokens_shape
        self.tokens_shape, self.failure = (batch // self.data, seq // self.context), None
        self.turns = [threading.Semaphore(0) for _ in range(n)]
        self.meetings, self.results, self.ended = {}, {}, set()
        self.joined, self.entered = [None] * n, [None] * n
        self.joining = collections.Counter()        # a tensor group's devices come so far
        self.idle = 0                               # turns handed on with no meeting done
        outputs = [None] * n

        def device_program(rank):
            try:
                self.running.rank = rank
                self.wait_turn(rank)
                outputs[rank] = program(rank, inputs[rank])
                self.ended.add(rank)
                self.hand_on(rank)
            except BaseException as error:        # noqa: BLE001 - raised by run, below
                self.fail(error)
        threads = [threading.Thread(target=device_program, args=(rank,), daemon=True,
                                    name=f'tensor rank {rank}') for rank in range(1, n)]
        try:
            for thread in threads:
                thread.start()
            self.turns[0].release()
            device_program(0)                      # device 0's program is this thread's
            for thread in threads:
                thread.join()
        except BaseException as error:             # a Ctrl-C: let no thread wait forever
            self.fail(error)
            raise
        finally:
            self.meetings = self.results = self.joined = self.entered = None  # no arrays held
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        return outputs

    def meet(self, array, collective, among=None):
        """`collective` over the `array` of each program in `among` (by default the t that
        split a layer with this one), run by the last of them to come, which goes on at once
        (one hand-off fewer); each gets its own result back. A program whose meeting is not
        complete hands its turn on until it is."""
        rank = self.program()
        among = self.tensor_peers(rank) if among is None else among
        arrived = self.meetings.setdefault(among, {})
        arrived[rank], self.idle = array, 0
        if len(arrived) == len(among):
            del self.meetings[among]
            self.results.update(zip(among, collective([arrived[r] for r in among])))
        while rank not in self.results:
            self.hand_on(rank)
            self.wait_turn(rank)
            self.idle += rank not in self.results
            if self.idle > self.programs:
                raise RuntimeError(f'the programs wait for each other in a cycle: meetings '
                                   f'{sorted(self.meetings)} never complete; every program must '
                                   'meet its peers in the same order')
        self.idle = 0
        return self.results.pop(rank)

    def hand_on(self, rank):
        """The turn to the next program in the cycle that has not ended (the order of the
        programs only changes which runs first: each program's operations keep their own
        order)."""
        for ahead in range(1, self.programs + 1):
            after = (rank + ahead) % self.programs
            if after not in self.ended:
                self.turns[after].release()
                return

    def wait_turn(self, rank):
        self.turns[rank].acquire()
        if self.failure is not None:
            raise Abandoned()

    def fail(self, error):
        if self.failure is None and not isinstance(error, Abandoned):
            self.failure = error
        for turn in self.turns:            # wake every device: each sees the failure
            turn.release()

    # -- f and g ------------------------------------------------------------------------------
    def enter(self, x):
        """f: the block's input `x` whole on every device, its gradients summed over the
        devices backward. The query, key and value read one input: f joins the devices once
        for the three (Megatron fuses them into one column-parallel layer for this)."""
        rank = self.program()
        if self.entered[rank] is not None and self.entered[rank][0] is x:
            return self.entered[rank][1]
        if self.sequence:
            out = self.meet(x, self.gather_tokens)
        else:
            out = self.copy_in(x)
        self.entered[rank] = (x, out)
        return out

    def leave(self, part):
        """g: the devices' parts of the block's output summed (each device's tokens' sums,
        with sequence parallelism)."""
        return self.meet(part, self.scatter_tokens if self.sequence else self.sum_parts)

    def copy_in(self, x):
        """f, the tokens whole: the identity forward, so a device goes on at once with an
        alias of its `x`; once the last device's has come, their gradients are tied together
        (`autograd.collective`), to be summed by an allreduce in backward."""
        if not autograd.is_recording():
            return x
        rank = self.program()
        self.joined[rank] = x, alias(x, x.shape, x.dtype, lambda data: data, 'collective')
        first = self.tensor_peers(rank)[0]
        self.joining[first] += 1
        if self.joining[first] == self.size:
            self.joining[first] = 0
            xs, outs = zip(*(self.joined[peer] for peer in self.tensor_peers(rank)))
            autograd.collective(list(outs), list(xs), self.allreduce)
        return self.joined[rank][1]

    def sum_parts(self, parts):
        """g, the tokens whole: the parts summed on every device, the identity in backward (a
        recorded copy, whose gradient is its output's, then summed in place outside the
        tape)."""
        return self.allreduce([part.copy() for part in parts])

    def allreduce(self, arrays):
        return comm.allreduce(arrays, self.algorithm)

    def whole_shape(self, shard):
        return self.tokens_shape + (shard.shape[-1],)

    def gather_tokens(self, shards, summed=True):
        """Every device's tokens on every device (an all-gather). In backward, each device's
        tokens' gradients summed over the devices (a reduce-scatter), where each device's part
        of the block gave a part of them; where whole copies gave each device the whole
        gradient (`summed=False`, the head), each device keeps its tokens' own."""
        shape = self.whole_shape(shards[0])
        with autograd.pause():
            flat = [shard.reshape(-1) for shard in shards]
        wholes = [whole.reshape(shape) for whole in comm.all_gather(flat, self.algorithm)]
        each = shards[0].shape

        def backward(grads):
            if summed:
                return [g.reshape(each) for g in comm.reduce_scatter(grads, self.algorithm)]
            return [g.reshape(-1, each[1])[r * each[0]:(r + 1) * each[0]]
                    for r, g in enumerate(grads)]
        return autograd.collective(wholes, shards, backward)

    def scatter_tokens(self, parts):
        """The parts summed, each device keeping its tokens' sums (a reduce-scatter, in
        place: nothing reads the parts again); in backward, an all-gather."""
        shape, hidden = parts[0].shape, parts[0].shape[-1]
        with autograd.pause():
            mine = [s.reshape(-1, hidden).copy()
                    for s in comm.reduce_scatter(parts, self.algorithm)]

        def backward(grads):
            flat = [g.reshape(-1) for g in grads]
            return [w.reshape(shape) for w in comm.all_gather(flat, self.algorithm)]
        return autograd.collective(mine, parts, backward)


class Abandoned(Exception):
    """A device's program given up because another one failed."""


class ParallelDense(Dense):
    """One device's share of a Dense layer of the whole model, on the last axis, for program
    `rank` of `group` (its share is its tensor rank's, `part`). `take` fills it from the whole
    layer."""

    def __init__(self, units, in_units, group, rank):
        super().__init__(units, in_units=in_units, flatten=False)
        self.weight.init = Normal(INIT_SIGMA)       # drawn as the whole layer's, then set
        self.group, self.rank, self.part = group, rank, group.tensor_rank(rank)

    def take(self, whole):
        """This device's share of the whole layer's values, in its dtypes."""
        raise NotImplementedError


class ColumnParallelDense(ParallelDense):
    """Device `rank`'s 1/t of the output features: f, then its rows of the product."""

    def __init__(self, units, in_units, group, rank):
        super().__init__(units // group.size, in_units, group, rank)

    def forward(self, x):
        return super().forward(self.group.enter(x))

    def take(self, whole):
        """Rows of the weight and the bias: this device's output features."""
        mine = slice(self.part * self.units, (self.part + 1) * self.units)
        in_dtypes_of(self, whole)
        self.weight.set_data(whole.weight.data()[mine].copy())
        self.bias.set_data(whole.bias.data()[mine].copy())


class RowParallelDense(ParallelDense):
    """Device `rank`'s 1/t of the input features: its part of the product, then g. The bias
    is the first device's alone (the others' stay zero, untrained): g adds it once."""

    def __init__(self, units, in_units, group, rank):
        super().__init__(units, in_units // group.size, group, rank)
        if self.part > 0:
            self.bias.grad_req = 'null'

    def forward(self, x):
        return self.group.leave(super().forward(x))

    def take(self, whole):
        """Columns of the weight: this device's input features; the bias on the first."""
        inputs = self.weight.shape[1]
        in_dtypes_of(self, whole)
        self.weight.set_data(
            whole.weight.data()[:, self.part * inputs:(self.part + 1) * inputs].copy())
        if self.part == 0:
            self.bias.set_data(whole.bias.data().copy())


class ReplicatedDense(ParallelDense):
    """A layer whole on every device (the head's). With sequence parallelism, where each
    device holds some of the tokens, it reads every token: an all-gather, then the product;
    backward, each device keeps its own tokens' gradients (its weights' are whole already).
    With context parallelism each device's product covers its chunks of the sequence, and
    the outputs are gathered whole (`context.whole_sequence`)."""

    def forward(self, x):
        if self.group.sequence:
            x = self.group.meet(x, self.every_token)
        out = super().forward(x)
        if self.group.context > 1:
            out = self.group.meet(out, context.whole_sequence,
                                  self.group.context_peers(self.group.program()))
        return out

    def every_token(self, shards):
        return self.group.gather_tokens(shards, summed=False)

    def take(self, whole):
        copied(self, whole)


class DeviceSpec(LayerSpec):
    """The layers of program `rank` of `group` (nn.layer_spec.LayerSpec): column- and
    row-parallel shares; the head's layer whole, gathering the tokens where the residual
    stream is split by them; of the embeddings' output, this device's tokens; and the
    attention over the sequence's chunks the context ranks hold."""

    def __init__(self, group, rank):
        self.group, self.rank, self.parts = group, rank, group.size

    def column(self, units, in_units):
        return ColumnParallelDense(units, in_units, self.group, self.rank)

    def row(self, units, in_units):
        return RowParallelDense(units, in_units, self.group, self.rank)

    def replicated(self, units, in_units):
        return ReplicatedDense(units, in_units, self.group, self.rank)

    def local_tokens(self, x):
        """Of the whole (batch, sequence, hidden), the device's tokens: with context
        parallelism its zig-zag chunks of the sequence; of those, with sequence parallelism,
        its 1/t as (tokens / t, hidden)."""
        if self.group.context > 1:
            x = context.own_chunks(x, self.group.context_rank(self.rank), self.group.context)
        if not self.group.sequence:
            return x
        hidden = x.shape[-1]
        count = x.size // hidden
        if count % self.parts:
            raise ValueError(f'{count} tokens (batch × sequence) do not split among '
                             f'{self.parts} devices: use a batch or sequence length that '
                             f'{self.parts} divides')
        each, part = count // self.parts, self.group.tensor_rank(self.rank)
        return x.reshape(count, hidden)[part * each:(part + 1) * each]

    def mixture(self, num_hiddens, num_experts, top_k):
        """Whole on every device, or with expert parallelism this share's experts."""
        if self.group.expert == 1:
            return super().mixture(num_hiddens, num_experts, top_k)
        held = self.group.experts_held(self.rank, num_experts)
        return expert.GridMixture(num_hiddens, num_experts, top_k, self.group, held)

    def attention(self, q, k, v):
        """Over the whole sequence: with context parallelism the c programs of this tensor
        rank meet, each with its chunks' q, k and v packed side by side."""
        if self.group.context == 1:
            return super().attention(q, k, v)
        return self.group.meet(np.concatenate((q, k, v), axis=-1), self.context_attention,
                               self.group.context_peers(self.group.program()))

    def context_attention(self, packed):
        return context.attention_of_chunks(packed, self.group.context_algorithm)
