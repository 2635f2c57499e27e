"""Optimizers: the update rule a Trainer or a key-value store applies to a weight.

Where the update runs is the store's business ("Parameter Servers"): on the CPU, on the device
that holds the weight, or on a server process. What the update is lives here, so that every
store applies the same rule. An optimizer keeps one state per key (SGD's momentum); the states
travel as plain NumPy arrays, so a store saves them to `.npz` and never to pickle.
"""
import math

import numpy

from . import np


class SGD:
    """Minibatch SGD with momentum and weight decay, by MXNet's rule.

    g = rescale_grad · grad + wd · weight;  momentum m ← momentum · m − learning_rate · g;
    weight ← weight + m. Without momentum: weight ← weight − learning_rate · g.

    Works on float16 weights as on any other: the update runs in the weight's dtype (as
    MXNet's SGD without multi_precision), and the momentum has the weight's dtype.
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, wd=0.0, rescale_grad=1.0):
        for name, value in (('learning_rate', learning_rate), ('momentum', momentum),
                            ('wd', wd), ('rescale_grad', rescale_grad)):
            check_setting(name, value)
        if momentum >= 1:
            raise ValueError(f'SGD momentum must be below 1 (or the steps grow without bound), '
                             f'not {momentum}')
        self.learning_rate, self.momentum = float(learning_rate), float(momentum)
        self.wd, self.rescale_grad = float(wd), float(rescale_grad)
        self.states = {}             # key -> momentum NDArray, created on the first update

    def update(self, key, weight, grad):
        """Apply one step to `weight` in place (engine operations on weight's device)."""
        if not self.momentum and not self.wd:          # the common case: two operations
            weight -= (self.learning_rate * self.rescale_grad) * grad
            return
        g = grad * self.rescale_grad if self.rescale_grad != 1 else grad
        if self.wd:
            g = g + self.wd * weight
        if not self.momentum:
            weight -= self.learning_rate * g
            return
        velocity = self.states.get(key)
        if velocity is None:
            velocity = self.states[key] = np.zeros(weight.shape, weight.dtype, weight.device)
        velocity *= self.momentum
        velocity -= self.learning_rate * g
        weight += velocity

    def get_states(self):
        """{key: numpy.ndarray}: the momentum of every key, copied to the host."""
        return {key: state.asnumpy() for key, state in self.states.items()}

    def set_states(self, states, device_of):
        """Take `states` ({key: numpy array}) back; `device_of(key)` says where each lives."""
        if self.momentum == 0 and states:
            raise ValueError(f'these optimizer states hold momentum for {len(states)} keys, '
                             'but this SGD has momentum=0: create it with the momentum the '
                             'states were saved with')
        self.states = {key: np.array(numpy.asarray(value), device=device_of(key))
                       for key, value in states.items()}


def check_setting(name, value):
    """Refuse a hyperparameter that is not a finite number >= 0: NaN slips through `< 0` (every
    comparison with NaN is false) and would turn every weight into NaN at the first step."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f'SGD needs a number for {name}, not {value!r}')
    if not math.isfinite(value) or value < 0:
        raise ValueError(f'SGD needs a finite number >= 0 for {name}, not {value!r}')


def create(name, **params):
    """An optimizer by name, as Trainer(params, 'sgd', {...}) names it."""
    optimizers = {'sgd': SGD}
    if name not in optimizers:
        raise ValueError(f'unknown optimizer {name!r}; d2lperf offers {sorted(optimizers)}')
    return optimizers[name](**params)

