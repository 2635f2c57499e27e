"""Optimizers: the update rule a Trainer or a key-value store applies to a weight.

Where the update runs is the store's business ("Parameter Servers"): on the CPU, on the device
that holds the weight, or on a server process. What the update is lives here, so that every
store applies the same rule. An optimizer keeps one state per key (SGD's momentum); the states
travel as plain NumPy arrays, so a store saves them to `.npz` and never to pickle.
"""
import math

import numpy

from . import np
from .device import label


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
            velocity = self.states[key] = new_state(weight)
        velocity *= self.momentum
        velocity -= self.learning_rate * g
        weight += velocity

    @staticmethod
    def state_of(weight):
        """(shape, dtype) of the state `get_states` gives for `weight`: its momentum's."""
        return tuple(weight.shape), numpy.dtype(weight.dtype)

    def get_states(self):
        """{key: numpy.ndarray}: the momentum of every key, copied to the host."""
        return {key: state.asnumpy() for key, state in self.states.items()}

    def set_states(self, states, device_of):
        """Take `states` ({key: numpy array}) back; `device_of(key)` says where each lives."""
        if self.momentum == 0 and states:
            raise ValueError(f'these optimizer states hold momentum for {len(states)} keys, '
                             'but this SGD has momentum=0: create it with the momentum the '
                             'states were saved with')
        self.states = {key: label(np.array(numpy.asarray(value), device=device_of(key)),
                                   'optimizer state')
                       for key, value in states.items()}


class Adam:
    """Adam (Kingma and Ba, 2015), by MXNet's rule and defaults.

    g = rescale_grad · grad + wd · weight;  mean ← β1 · mean + (1 − β1) · g;
    var ← β2 · var + (1 − β2) · g²;  weight ← weight − lr_t · mean / (√var + ε), where
    lr_t = learning_rate · √(1 − β2^t) / (1 − β1^t) at the key's t-th update (bias correction,
    folded into the rate as MXNet does). Two states the size of the weight, where SGD with
    momentum keeps one: why sharding the optimizer's state over devices pays (ZeRO).
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
                 rescale_grad=1.0):
        for name, value in (('learning_rate', learning_rate), ('beta1', beta1),
                            ('beta2', beta2), ('epsilon', epsilon), ('wd', wd),
                            ('rescale_grad', rescale_grad)):
            check_setting(name, value, 'Adam')
        for name, value in (('beta1', beta1), ('beta2', beta2)):
            if value >= 1:
                raise ValueError(f'Adam needs {name} below 1 (the bias correction divides by '
                                 f'1 - {name}^t), not {value}')
        self.learning_rate, self.beta1, self.beta2 = float(learning_rate), beta1, beta2
        self.epsilon, self.wd, self.rescale_grad = float(epsilon), float(wd), float(rescale_grad)
        self.states = {}             # key -> (mean, var) NDArrays, created on the first update
        self.counts = {}             # key -> updates so far (t)
        self.saved = {}              # key -> (mean, var, device) loaded, not yet given a shape

    def update(self, key, weight, grad):
        """Apply one step to `weight` in place (engine operations on weight's device)."""
        if key in self.saved:
            self._restore(key, weight)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = (new_state(weight), new_state(weight))
        mean, var = state
        t = self.counts[key] = self.counts.get(key, 0) + 1
        rate = self.learning_rate * math.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)
        g = grad * self.rescale_grad if self.rescale_grad != 1 else grad
        if self.wd:
            g = g + self.wd * weight
        mean *= self.beta1
        mean += (1 - self.beta1) * g
        var *= self.beta2
        var += (1 - self.beta2) * (g * g)
        weight -= rate * mean / (np.sqrt(var) + self.epsilon)

    @staticmethod
    def state_of(weight):
        """(shape, dtype) of the state `get_states` gives for `weight`."""
        return (2 * weight.size + 1,), numpy.dtype(numpy.float64)

    def get_states(self):
        """{key: numpy.ndarray}: one flat float64 array a key, [t, mean..., var...], so that a
        store saves it as it saves SGD's momentum (float64 holds every float32 and t exactly)."""
        states = {key: (mean.asnumpy(), var.asnumpy())
                  for key, (mean, var) in self.states.items()}
        states.update({key: (mean, var) for key, (mean, var, _) in self.saved.items()})
        return {key: numpy.concatenate([[self.counts[key]], numpy.ravel(mean),
                                        numpy.ravel(var)]).astype(numpy.float64)
                for key, (mean, var) in states.items()}

    def set_states(self, states, device_of):
        """Take `states` (as `get_states` gives them) back; each key's mean and var get its
        weight's shape and dtype at the key's next update."""
        counts, saved = {}, {}
        for key, flat in states.items():
            flat = numpy.asarray(flat, numpy.float64)
            if flat.ndim != 1 or flat.size % 2 != 1:
                raise ValueError(f'the saved Adam state of key {key!r} is not [t, mean..., '
                                 f'var...] (shape {flat.shape}): it was not saved by Adam')
            half = flat.size // 2
            counts[key] = int(flat[0])
            saved[key] = (flat[1:1 + half], flat[1 + half:], device_of(key))
        self.states, self.counts, self.saved = {}, counts, saved      # all or nothing

    def _restore(self, key, weight):
        mean, var, device = self.saved.pop(key)
        if mean.size != weight.size:
            raise ValueError(f'the saved Adam state of key {key!r} holds {mean.size} values, '
                             f'its weight {weight.size}: states and weights do not match')
        self.states[key] = tuple(label(np.array(v.reshape(weight.shape).astype(weight.dtype),
                                                device=device), 'optimizer state')
                                 for v in (mean, var))


def new_state(weight):
    """Zeros the shape, dtype and device of `weight`, counted as optimizer state."""
    return label(np.zeros(weight.shape, weight.dtype, weight.device), 'optimizer state')


def check_setting(name, value, optimizer='SGD'):
    """Refuse a hyperparameter that is not a finite number >= 0: NaN slips through `< 0` (every
    comparison with NaN is false) and would turn every weight into NaN at the first step."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f'{optimizer} needs a number for {name}, not {value!r}')
    if not math.isfinite(value) or value < 0:
        raise ValueError(f'{optimizer} needs a finite number >= 0 for {name}, not {value!r}')


def create(name, **params):
    """An optimizer by name, as Trainer(params, 'sgd', {...}) names it."""
    optimizers = {'sgd': SGD, 'adam': Adam}
    if name not in optimizers:
        raise ValueError(f'unknown optimizer {name!r}; d2lperf offers {sorted(optimizers)}')
    return optimizers[name](**params)

