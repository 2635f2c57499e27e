"""Optimizers: the update rule a Trainer or a key-value store applies to a weight.

Where the update runs is the store's business ("Parameter Servers"): on the CPU, on the device
that holds the weight, or on a server process. What the update is lives here, so that every
store applies the same rule. An optimizer keeps one state per key (SGD's momentum); the states
travel as plain NumPy arrays, so a store saves them to `.npz` and never to pickle.

`multi_precision=True` is MXNet's mixed-precision rule ("Memory"): a float16 (or bfloat16)
weight gets a float32 master copy inside the optimizer, the update runs on the master in
float32, and the weight is the master rounded down. An update smaller than half a float16 step
(1e-4 on a weight of 1) would vanish in float16; the master keeps it.
"""
import functools
import math
import warnings

import ml_dtypes
import numpy

from .. import engine, np
from ..device import label
from . import kernels

LOW_PRECISION = (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
FLOAT32 = numpy.dtype(numpy.float32)


class Optimizer:
    """What SGD and Adam share: checked settings, a state per key, and float32 master weights.

    Subclasses give `step(key, weight, grad, rescale_grad)`, the rule itself, which `update`
    runs on the weight or, under multi_precision, on its master copy. `rescale_grad` is the
    user's setting, never changed by training: a step that scales its gradients otherwise (a
    Trainer's, by 1/batch_size) says so as it updates.
    """

    def __init__(self, rescale_grad=1.0, multi_precision=False, **settings):
        for name, value in dict(settings, rescale_grad=rescale_grad).items():
            check_setting(name, value, type(self).__name__)
        self.rescale_grad, self.multi_precision = float(rescale_grad), bool(multi_precision)
        self.setting_names = tuple(settings)     # the rule's own: learning_rate, ...
        self.states = {}             # key -> the rule's state, created on the first update
        self.masters = {}            # key -> float32 master copy (multi_precision only)
        self.saved = {}              # key -> (host array, device) loaded, not yet given a weight
        self.warned = False          # of a low-precision weight updated without a master

    def update(self, key, weight, grad, rescale_grad=None):
        """Apply one step to `weight` in place (engine operations on weight's device), the
        gradient scaled by `rescale_grad`: this step's scale (a Trainer's step(batch_size)
        passes the user's rescale_grad / batch_size), or, None, the optimizer's own (a store
        applies it so to every push)."""
        if rescale_grad is None:
            rescale_grad = self.rescale_grad
        if key in self.saved:
            self.restore(key, weight, *self.saved.pop(key))
        if not self.keeps_master(weight):
            self.warn_without_master(weight)
            self.step(key, weight, grad, rescale_grad)
            return
        master = self.masters.get(key)
        if master is None:
            master = self.masters[key] = label_master(weight.astype(FLOAT32))
        self.step(key, master, grad.astype(FLOAT32), rescale_grad)
        weight[:] = master           # one operation: the assignment rounds to weight's dtype

    def rescaled(self, rescale_grad):
        """A fresh optimizer of this kind and these settings (as they are now) whose own
        rescale_grad is `rescale_grad`: what a Trainer hands a store that updates, which
        applies it to each push as it comes, told nothing of the step (a distributed store
        sends its numbers to the servers once)."""
        settings = {name: getattr(self, name) for name in self.setting_names}
        return type(self)(**settings, rescale_grad=rescale_grad,
                          multi_precision=self.multi_precision)

    def warn_without_master(self, weight):
        """Warn, once, of a float16 or bfloat16 weight updated in its own precision, as MXNet
        does: small updates round away, and Adam's ε rounds to 0 in float16, so a weight
        whose gradient is 0 steps by 0 / 0."""
        dtype = numpy.dtype(weight.dtype)
        if self.warned or dtype not in LOW_PRECISION:
            return
        self.warned = True
        name = type(self).__name__
        warnings.warn(f'{name} updates {dtype} weights in {dtype}, which can lose small '
                      f'updates{self.low_precision_hazard(dtype)}: create it with '
                      f"multi_precision=True (Trainer(params, '{name.lower()}', "
                      "{..., 'multi_precision': True})) to update float32 master copies",
                      UserWarning, stacklevel=3)

    def low_precision_hazard(self, dtype):
        """What else goes wrong with this rule in `dtype` (for the warning)."""
        return ''

    def keeps_master(self, weight):
        """Whether `weight` is updated through a float32 master copy."""
        return self.multi_precision and numpy.dtype(weight.dtype) in LOW_PRECISION

    def step(self, key, weight, grad, rescale_grad):
        """The rule: one step on `weight` (under multi_precision, the master), in place, with
        `grad` scaled by `rescale_grad`."""
        raise NotImplementedError

    def restore(self, key, weight, saved, device):
        """Give `key` the state `set_states` left in `saved`, now that its weight says which
        shape and dtype the state takes (and whether a master copy is in it)."""
        raise NotImplementedError

    def restore_master(self, key, weight, values, device):
        """The saved master copy of `key` back on `device`, in `weight`'s shape."""
        values = values.reshape(weight.shape).astype(FLOAT32)
        self.masters[key] = label_master(np.array(values, device=device))


class SGD(Optimizer):
    """Minibatch SGD with momentum and weight decay, by MXNet's rule.

    g = rescale_grad · grad + wd · weight;  momentum m ← momentum · m − learning_rate · g;
    weight ← weight + m. Without momentum: weight ← weight − learning_rate · g.

    Without multi_precision a float16 weight is updated in float16 (as MXNet's SGD), with a
    float16 momentum; with it, master and momentum are float32.
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, wd=0.0, rescale_grad=1.0,
                 multi_precision=False):
        super().__init__(rescale_grad, multi_precision, learning_rate=learning_rate,
                         momentum=momentum, wd=wd)
        if momentum >= 1:
            raise ValueError(f'SGD momentum must be below 1 (or the steps grow without bound), '
                             f'not {momentum}')
        self.learning_rate, self.momentum = float(learning_rate), float(momentum)
        self.wd = float(wd)

    def step(self, key, weight, grad, rescale_grad):
        velocity = None
        if self.momentum:
            velocity = self.states.get(key)
            if velocity is None:
                velocity = self.states[key] = new_state(weight)
        settings = (self.learning_rate, self.momentum, self.wd, rescale_grad)
        fused('sgd_update', sgd_rule, settings, grad, weight, velocity)

    def state_of(self, weight):
        """(shape, dtype) of the state `get_states` gives for `weight`: its momentum's, or,
        with a master copy, [momentum, master] stacked in float32."""
        shape = tuple(weight.shape)
        if self.keeps_master(weight):
            return (1 + bool(self.momentum),) + shape, FLOAT32
        return shape, numpy.dtype(weight.dtype)

    def get_states(self):
        """{key: numpy.ndarray}: the momentum of every key (stacked over its master copy
        where there is one), copied to the host."""
        states = {key: saved for key, (saved, _) in self.saved.items()}
        for key in self.states.keys() | self.masters.keys():
            parts = [self.states[key]] if key in self.states else []
            if key in self.masters:
                parts.append(self.masters[key])
                states[key] = numpy.stack([part.asnumpy() for part in parts])
            else:
                states[key] = parts[0].asnumpy()
        return states

    def set_states(self, states, device_of):
        """Take `states` ({key: numpy array}) back; `device_of(key)` says where each lives.
        Under multi_precision they wait for each key's weight, which says whether a master
        copy is stacked in."""
        if self.momentum == 0 and states and not self.multi_precision:
            raise ValueError(f'these optimizer states hold momentum for {len(states)} keys, '
                             'but this SGD has momentum=0: create it with the momentum the '
                             'states were saved with')
        if self.multi_precision:
            self.states, self.masters = {}, {}
            self.saved = {key: (numpy.asarray(value), device_of(key))
                          for key, value in states.items()}
            return
        self.states = {key: label(np.array(numpy.asarray(value), device=device_of(key)),
                                  'optimizer state')
                       for key, value in states.items()}

    def restore(self, key, weight, saved, device):
        shape, dtype = self.state_of(weight)
        if saved.shape != shape or saved.dtype != dtype:
            raise ValueError(f'the saved SGD state of key {key!r} is {saved.dtype}'
                             f'{list(saved.shape)}, but its weight needs {dtype}{list(shape)}')
        if not self.keeps_master(weight):
            self.states[key] = label(np.array(saved, device=device), 'optimizer state')
            return
        self.restore_master(key, weight, saved[-1], device)
        if self.momentum:
            self.states[key] = label(np.array(saved[0], device=device), 'optimizer state')


class Adam(Optimizer):
    """Adam (Kingma and Ba, 2015), by MXNet's rule and defaults.

    g = rescale_grad · grad + wd · weight;  mean ← β1 · mean + (1 − β1) · g;
    var ← β2 · var + (1 − β2) · g²;  weight ← weight − lr_t · mean / (√var + ε), where
    lr_t = learning_rate · √(1 − β2^t) / (1 − β1^t) at the key's t-th update (bias correction,
    folded into the rate as MXNet does). Two states the size of the weight, where SGD with
    momentum keeps one: why sharding the optimizer's state over devices pays (ZeRO).
    """

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, wd=0.0,
                 rescale_grad=1.0, multi_precision=False):
        super().__init__(rescale_grad, multi_precision, learning_rate=learning_rate,
                         beta1=beta1, beta2=beta2, epsilon=epsilon, wd=wd)
        for name, value in (('beta1', beta1), ('beta2', beta2)):
            if value >= 1:
                raise ValueError(f'Adam needs {name} below 1 (the bias correction divides by '
                                 f'1 - {name}^t), not {value}')
        self.learning_rate, self.beta1, self.beta2 = float(learning_rate), beta1, beta2
        self.epsilon, self.wd = float(epsilon), float(wd)
        self.counts = {}             # key -> updates so far (t)

    def step(self, key, weight, grad, rescale_grad):
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = (new_state(weight), new_state(weight))
        self.counts.setdefault(key, 0)
        rate = functools.partial(self.counted_rate, key, self.learning_rate)
        settings = (rate, self.beta1, self.beta2, self.epsilon, self.wd, rescale_grad)
        fused('adam_update', adam_rule, settings, grad, weight, *state)

    def counted_rate(self, key, learning_rate):
        """Count `key`'s update t and give its bias-corrected rate. The update operation calls
        it as it runs, so that an update skipped for a failed gradient moves no count (the
        updates of one key run in order: each writes its weight)."""
        t = self.counts[key] = self.counts[key] + 1
        return learning_rate * math.sqrt(1 - self.beta2 ** t) / (1 - self.beta1 ** t)

    def low_precision_hazard(self, dtype):
        if dtype.type(self.epsilon) == 0 < self.epsilon:
            return (f' and epsilon={self.epsilon:g} rounds to 0 (a weight whose gradient is '
                    '0 then steps by 0 / 0: NaN)')
        return ''

    def state_of(self, weight):
        """(shape, dtype) of the state `get_states` gives for `weight`."""
        return ((2 + self.keeps_master(weight)) * weight.size + 1,), numpy.dtype(numpy.float64)

    def get_states(self):
        """{key: numpy.ndarray}: one flat float64 array a key, [t, mean..., var...] and, with a
        master copy, master... after them, so that a store saves it as it saves SGD's momentum
        (float64 holds every float32 and t exactly)."""
        states = {key: saved for key, (saved, _) in self.saved.items()}
        for key, (mean, var) in self.states.items():
            parts = [mean.asnumpy(), var.asnumpy()]          # waits: the count is done too
            parts.insert(0, [self.counts[key]])
            if key in self.masters:
                parts.append(self.masters[key].asnumpy())
            states[key] = numpy.concatenate([numpy.ravel(p) for p in parts]).astype(numpy.float64)
        return states

    def set_states(self, states, device_of):
        """Take `states` (as `get_states` gives them) back; each key's mean and var get its
        weight's shape and dtype at the key's next update."""
        counts, saved = {}, {}
        for key, flat in states.items():
            flat = numpy.asarray(flat, numpy.float64)
            if flat.ndim != 1 or not self.could_hold(flat.size - 1):
                raise ValueError(f'the saved Adam state of key {key!r} is not [t, mean..., '
                                 f'var...] (shape {flat.shape}): it was not saved by Adam')
            counts[key] = int(flat[0])
            saved[key] = (flat, device_of(key))
        self.states, self.masters, self.counts, self.saved = {}, {}, counts, saved

    def could_hold(self, size):
        """Whether `size` values can be mean and var (and, under multi_precision, a master)."""
        return size % 2 == 0 or (self.multi_precision and size % 3 == 0)

    def restore(self, key, weight, flat, device):
        if flat.shape != self.state_of(weight)[0]:
            raise ValueError(f'the saved Adam state of key {key!r} holds {flat.size} values, '
                             f'its {weight.dtype} weight needs {self.state_of(weight)[0][0]}: '
                             'states and weights do not match')
        n = weight.size
        dtype = FLOAT32 if self.keeps_master(weight) else weight.dtype
        self.states[key] = tuple(label(np.array(v.reshape(weight.shape).astype(dtype),
                                                device=device), 'optimizer state')
                                 for v in (flat[1:1 + n], flat[1 + n:1 + 2 * n]))
        if self.keeps_master(weight):
            self.restore_master(key, weight, flat[1 + 2 * n:], device)


def fused(name, rule, settings, grad, weight, *states):
    """One engine operation that reads `grad` and updates `weight` and its `states` in place
    by `rule`, as MXNet's fused update operators do (sgd_mom_update, adam_update). Written as
    array operations, Adam is a dozen pushes a parameter, each a hand-off to a worker and a
    temporary array; as one, a step's cost is its arithmetic. Pushed as an update
    (`engine.push_update`): a failed gradient skips it, and the weight stays good."""
    updated = [weight] + [state for state in states if state is not None]
    reads = [grad.var] if all(grad.var is not array.var for array in updated) else []
    run = functools.partial(run_rule, rule, weight.device.xp, settings, grad, states, weight)
    engine.push_update(run, reads, [array.var for array in updated], weight.device, name)


def run_rule(rule, xp, settings, grad, states, weight):
    """The rule on the arrays' data, read when the operation runs (their producers have)."""
    rule(xp, *settings, grad.data, weight.data,
         *(None if state is None else state.data for state in states))


def sgd_rule(xp, learning_rate, momentum, wd, rescale_grad, grad, weight, velocity):
    """MXNet's SGD on NumPy or CuPy arrays, in place, in the order the text writes it; on a
    GPU one kernel (`kernels.sgd`)."""
    if kernels.fits(xp, weight):
        return kernels.sgd(xp, learning_rate, momentum, wd, rescale_grad, grad, weight, velocity)
    if velocity is None and not wd:                    # the common case: one product
        weight -= (learning_rate * rescale_grad) * grad
        return
    g = grad * rescale_grad if rescale_grad != 1 else grad
    if wd:
        g = g + wd * weight
    if velocity is None:
        weight -= learning_rate * g
        return
    velocity *= momentum
    velocity -= learning_rate * g
    weight += velocity


def adam_rule(xp, rate, beta1, beta2, epsilon, wd, rescale_grad, grad, weight, mean, var):
    """MXNet's Adam on NumPy or CuPy arrays, in place; `rate()` counts the update and gives
    its bias-corrected rate (`Adam.counted_rate`); on a GPU one kernel (`kernels.adam`)."""
    rate = rate()
    if kernels.fits(xp, weight):
        return kernels.adam(xp, rate, beta1, beta2, epsilon, wd, rescale_grad, grad, weight,
                            mean, var)
    g = grad * rescale_grad if rescale_grad != 1 else grad
    if wd:
        g = g + wd * weight
    mean *= beta1
    mean += (1 - beta1) * g
    var *= beta2
    var += (1 - beta2) * (g * g)
    weight -= rate * mean / (xp.sqrt(var) + epsilon)


def label_master(array):
    """Count `array` as master weights, a kind of its own: ZeRO's papers count it with the
    optimizer state (K = 12 bytes for Adam), Megatron's apart (4 of its 18)."""
    return label(array, 'master weights')


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
