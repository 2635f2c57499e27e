"""A pipeline stage as a declared interface: what a Pipeline calls on each part of a model,
and all it calls.

A stage holds consecutive units of a model on its devices: one device (`pipeline.Part`), or
a group of devices that split each layer, its sequence and its batch (tensor, context and
data parallelism: `tensor.TensorParallelGPT`).
Values cross a stage's border as lists, one array a device of the stage, so that a pipeline
moves a group's activations device to device without knowing how the group splits them.
A stage names its parameters as the whole net's `collect_params()` does, after the place
that holds them (`rank1.3.mlp.dense1.weight`: the tensor-parallel rank, then the net's name);
data parallelism's replicas of a stage run the same ranks on other devices: one Parameter,
with a copy a replica, as a data-parallel net's parameters are.
Taught in "Model Parallelism".
"""
from __future__ import annotations

import abc
from typing import Sequence

from ..device import Device
from ..nn.block import Block
from ..nn.parameter import Parameter, ParameterDict
from ..np.multiarray import NDArray


class Stage(abc.ABC):
    """One part of a model on `devices`, as a pipeline runs it (PyTorch's PipelineStage, a
    virtual stage in Megatron's interleaved layout): a micro-batch's forward and backward,
    the step's last pass over the gradients, the parameters it trains."""

    devices: list[Device]

    @abc.abstractmethod
    def forward(self, xs: list[NDArray], shape: Sequence[int]) -> list[NDArray]:
        """The part's outputs (one array a device) from its inputs `xs` (one a device),
        recorded for backward when under `autograd.record()`. `shape` is the micro-batch's
        input shape, (batch, sequence) of tokens: a group that splits the residual stream by
        tokens puts its parts back together with it."""

    @abc.abstractmethod
    def backward(self, outs: list[NDArray], heads: list[NDArray] | None = None) -> None:
        """A micro-batch's backward from the part's outputs `outs` (losses, where `heads` is
        None; else `heads` are the gradients of `outs`, one a device). Each parameter's
        gradient is written, or added where its grad_req (or `autograd.adding`) says so."""

    def finish_gradients(self) -> None:
        """What the gradients need once every micro-batch's backward has run: nothing, unless
        a stage's devices each saw a part of the data of a parameter they all hold."""

    @abc.abstractmethod
    def collect_params(self) -> ParameterDict:
        """Every parameter the part trains, by the net's name after its place on the stage."""

    def params(self) -> list[Parameter]:
        """Every parameter the part trains, in order."""
        return list(self.collect_params().values())

    def summed_over_replicas(self) -> list[Parameter]:
        """The parameters whose gradients data parallelism sums over the replicas' copies:
        all of them, unless the stage sums some itself (experts, over those that hold them)."""
        return self.params()

    def inputs_of(self, tokens: NDArray) -> list[NDArray]:
        """What each device of the part reads of a micro-batch's tokens (or labels), at the
        pipeline's start (and its loss): all of them, unless its devices are replicas that
        share the micro-batch."""
        return [tokens] * len(self.devices)

    def one_a_replica(self, losses: list[NDArray]) -> list[NDArray]:
        """Of the losses at the part's devices, one a replica (its devices' are alike)."""
        return losses[:1]


def named(net: Block, units: Sequence[Block], prefix: str = '') -> ParameterDict:
    """The parameters of `units` (children of `net`) by the names `net.collect_params()` gives
    them, after `prefix`: a part of a net names a weight as the whole net does."""
    mine = {id(param) for unit in units for param in unit.collect_params().values()}
    return ParameterDict((prefix + name, param) for name, param in net.collect_params().items()
                         if id(param) in mine)


def copy_onto(params: Sequence[Parameter], device: Device) -> None:
    """Each parameter given one more copy, on `device`, of its first: a replica's."""
    for param in params:
        param.reset_device(param.list_device() + [device])


def copied(block, source):
    """`block` (built alike) with `source`'s values."""
    in_dtypes_of(block, source)
    for mine, theirs in zip(block.collect_params().values(), source.collect_params().values()):
        mine.set_data(theirs.data().copy())
    return block


def in_dtypes_of(block, source):
    """`block` initialized with each parameter in the dtype of `source`'s (built alike): a
    float16 net splits into float16 parts, its float32 norms stay float32."""
    for mine, theirs in zip(block.collect_params().values(), source.collect_params().values()):
        mine.cast(theirs.data().dtype)
    block.initialize()
