"""Dividing a minibatch among devices: one slice of the batch (and of its labels) a device;
and, for data parallelism by hand, a copy of the parameters a device (`get_params`).

`split_and_load` is the first collective step of data parallelism ("Training on Multiple
GPUs"); its copies are ordinary engine operations, so they run asynchronously and in
dependency order with the forward and backward passes that follow. That chapter writes the
rest by hand too: `get_params` puts the parameters on each device, `allreduce_on_first`
sums their gradients, and `optimizer.by_hand.sgd` updates each copy where it lives.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy

from .. import np
from ..device import Device
from ..np.multiarray import NDArray

Devices = Union[Device, Sequence[Device]]


def split_and_load(data: NDArray | numpy.ndarray, devices: Devices, even_split: bool = True,
                   work_load_list: Sequence[float] | None = None) -> list[NDArray]:
    """One slice of `data` (along axis 0) copied to each of `devices`, in order.

    Without `work_load_list`, the slices are equal; with `even_split=False`, a batch that does
    not divide gives its first slices one example more. `work_load_list` (one positive weight a
    device) divides the batch in proportion to the weights, by MXNet's rule: see `slice_sizes`.
    """
    devices = _check_devices(devices)
    if isinstance(data, numpy.ndarray):
        data = np.array(data)
    if not isinstance(data, NDArray) or data.ndim == 0:
        raise ValueError(f'split_and_load needs an array with a batch axis, not {data!r}')
    slices, begin = [], 0
    for device, size in zip(devices, slice_sizes(len(data), len(devices), even_split,
                                                 work_load_list)):
        slices.append(data[begin:begin + size].copyto(device))
        begin += size
    return slices


def slice_sizes(num_examples: int, num_devices: int, even_split: bool = True,
                work_load_list: Sequence[float] | None = None) -> list[int]:
    """How many examples each device gets.

    Equal split: `num_examples / num_devices` each; with `even_split=False` and a remainder r,
    the first r devices take one more. Weighted split (MXNet's rule): device i gets
    `round(num_examples * w_i / sum(w))` examples (Python's `round`, halves to even); a
    shortfall goes to the last device, an excess is taken from the last devices. With
    `even_split=True`, every weighted share must come out whole, so that nothing is rounded.
    """
    if num_examples < num_devices:
        raise ValueError(f'cannot split a batch of {num_examples} examples among {num_devices} '
                         'devices: every device needs at least one; use a larger batch or '
                         'fewer devices')
    if work_load_list is None:
        return _equal_sizes(num_examples, num_devices, even_split)
    return _weighted_sizes(num_examples, num_devices, even_split, work_load_list)


def _equal_sizes(num_examples, num_devices, even_split):
    each, remainder = divmod(num_examples, num_devices)
    if even_split and remainder:
        raise ValueError(f'a batch of {num_examples} examples does not divide evenly among '
                         f'{num_devices} devices ({each} each leaves {remainder}); use a batch '
                         f'size that is a multiple of {num_devices}, or even_split=False')
    return [each + 1] * remainder + [each] * (num_devices - remainder)


def _weighted_sizes(num_examples, num_devices, even_split, work_load_list):
    weights = list(work_load_list)
    if len(weights) != num_devices:
        raise ValueError(f'work_load_list has {len(weights)} weights for {num_devices} '
                         'devices; give one weight a device')
    if not all(w > 0 for w in weights):
        raise ValueError(f'work_load_list {weights} must hold positive weights')
    total = sum(weights)
    exact = [num_examples * w / total for w in weights]
    if even_split and not all(float(share).is_integer() for share in exact):
        raise ValueError(f'a batch of {num_examples} examples does not divide in the '
                         f'proportions {weights} (shares {exact}); use a batch size that '
                         'does, or even_split=False to round the shares')
    sizes = [round(share) for share in exact]
    sizes[-1] += max(num_examples - sum(sizes), 0)
    ends = numpy.minimum(numpy.cumsum(sizes), num_examples)
    sizes = numpy.diff(ends, prepend=0).tolist()
    if 0 in sizes:
        raise ValueError(f'the proportions {weights} leave a device without examples in a '
                         f'batch of {num_examples} (sizes {sizes}); use a larger batch')
    return sizes


def split_batch(X: NDArray, y: NDArray,
                devices: Devices) -> tuple[list[NDArray], list[NDArray]]:
    """Features and labels, split alike among `devices`: (X slices, y slices).

    The split is as even as the batch allows (`even_split=False`), so a last, smaller batch
    of an epoch splits too; the gradient summed over the slices is the same either way.
    """
    if len(X) != len(y):
        raise ValueError(f'X has {len(X)} examples but y has {len(y)} labels; they must '
                         'come from the same batch')
    return (split_and_load(X, devices, even_split=False),
            split_and_load(y, devices, even_split=False))


def _check_devices(devices):
    devices = [devices] if isinstance(devices, Device) else list(devices)
    if not devices or not all(isinstance(d, Device) for d in devices):
        raise ValueError(f'devices must be a non-empty list of Devices such as '
                         f'[d2l.cpu(0), d2l.cpu(1)], not {devices!r}')
    return devices


def get_params(params: Sequence[NDArray], device: Device) -> list[NDArray]:
    """Copies of `params` on `device`, each with a gradient buffer."""
    copies = [p.copyto(device) for p in params]
    for copy in copies:
        copy.attach_grad()
    return copies
