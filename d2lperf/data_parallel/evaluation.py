"""Test accuracy: counted on one device, or on every device the net lives on, each with its
share of the batch ("Training on Multiple GPUs" and the chapters after it).
"""
from ..comm import split_batch
from ..device import Device
from ..utils import Accumulator


def accuracy(y_hat, y):
    """How many predictions are right, as a float: `y_hat` holds scores or predicted classes."""
    if y_hat.ndim > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(axis=1)
    if y_hat.shape != y.shape:
        raise ValueError(f'{y_hat.shape[0] if y_hat.ndim else 1} predictions for labels of '
                         f'shape {y.shape}; pass the scores of the same batch')
    return float((y_hat.astype(y.dtype) == y).astype('float32').sum())


def evaluate_accuracy_gpu(net, data_iter, device=None):
    """The accuracy of `net` on `data_iter`, computed on one device.

    `device` defaults to the first device of the net's first parameter; a plain function
    (`lambda X: lenet(X, params)`) must name it.
    """
    if device is None:
        device = _devices_of(net, 'pass device=...')[0]
    if not isinstance(device, Device):
        raise TypeError(f'device must be a Device such as d2l.cpu(0), not {device!r}')
    metric = Accumulator(2)                     # correct predictions, examples
    for X, y in data_iter:
        X, y = _on(X, device), _on(y, device)
        metric.add(accuracy(net(X), y), y.size)
    return _fraction_right(metric)


def evaluate_accuracy_gpus(net, data_iter, split_f=split_batch):
    """The accuracy of `net` on `data_iter`, each batch split among the net's devices."""
    devices = _devices_of(net, 'use a Block (net.initialize(device=[...]))')
    metric = Accumulator(2)                     # correct predictions, examples
    for features, labels in data_iter:
        X_shards, y_shards = split_f(features, labels, devices)
        predictions = [net(X_shard) for X_shard in X_shards]      # all devices at once
        metric.add(sum(accuracy(y_hat, y_shard)
                       for y_hat, y_shard in zip(predictions, y_shards)), labels.size)
    return _fraction_right(metric)


def _devices_of(net, fix):
    """The devices of the net's first parameter: where the net was initialized."""
    params = list(net.collect_params().values()) if hasattr(net, 'collect_params') else []
    if not params:
        raise TypeError(f'{net!r} has no parameters to say which devices it runs on; {fix}')
    return params[0].list_device()


def _fraction_right(metric):
    if metric[1] == 0:
        raise ValueError('data_iter gave no examples to evaluate on')
    return metric[0] / metric[1]


def _on(array, device):
    return array if array.device is device else array.copyto(device)
