"""Blocks: the layers and networks a model is built from, as in Gluon.

A Block registers the child blocks and parameters assigned to it as attributes, so
`collect_params()` finds every parameter by walking the tree. `forward` is ordinary Python
on asynchronous arrays ("imperative"); the compiler chapter turns it into a graph.
"""
import collections

from .. import np, npx
from .init import Zero
from .parameter import Parameter


class Block:
    def __init__(self):
        object.__setattr__(self, '_children', collections.OrderedDict())
        object.__setattr__(self, '_params', collections.OrderedDict())

    def __setattr__(self, name, value):
        if isinstance(value, Block):
            self._children[name] = value
        elif isinstance(value, Parameter):
            self._params[name] = value
        object.__setattr__(self, name, value)

    def collect_params(self, prefix=''):
        """Every parameter of this block and its children, by dotted name."""
        params = collections.OrderedDict((prefix + n, p) for n, p in self._params.items())
        for name, child in self._children.items():
            params.update(child.collect_params(f'{prefix}{name}.'))
        return params

    def initialize(self, init=None, device=None, force_reinit=False):
        """Draw every parameter's first values on `device` (one Device or a list of them)."""
        for param in self.collect_params().values():
            param.initialize(init=init, device=device, force_reinit=force_reinit)
        return self

    def __call__(self, *args):
        return self.forward(*args)

    def forward(self, *args):
        raise NotImplementedError(f'{type(self).__name__} must define forward(self, x)')

    def __repr__(self):
        lines = [f'  ({name}): {child!r}'.replace('\n', '\n  ')
                 for name, child in self._children.items()]
        return f'{type(self).__name__}(\n' + '\n'.join(lines) + '\n)' if lines else \
            f'{type(self).__name__}()'


class Sequential(Block):
    """Children run one after the other."""

    def add(self, *blocks):
        for block in blocks:
            setattr(self, str(len(self._children)), block)
        return self

    def forward(self, x):
        for block in self._children.values():
            x = block(x)
        return x

    def __getitem__(self, i):
        return list(self._children.values())[i]

    def __len__(self):
        return len(self._children)


ACTIVATIONS = {'relu': npx.relu, 'sigmoid': npx.sigmoid, 'tanh': np.tanh}


def _activation(name):
    if name is not None and name not in ACTIVATIONS:
        raise ValueError(f'unknown activation {name!r}; use one of {sorted(ACTIVATIONS)} or None')
    return ACTIVATIONS.get(name)


class Dense(Block):
    """A fully connected layer; its input size is learnt from the first batch it sees."""

    def __init__(self, units, activation=None, in_units=0):
        super().__init__()
        self.units, self.act = units, _activation(activation)
        self.activation = activation
        self.weight = Parameter('weight', (units, in_units))
        self.bias = Parameter('bias', (units,), init=Zero())

    def forward(self, x):
        if 0 in self.weight.shape:
            self.weight.infer_shape((self.units, x.shape[-1]))
        device = x.device
        y = npx.fully_connected(x, self.weight.data(device), self.bias.data(device))
        return self.act(y) if self.act else y

    def __repr__(self):
        return (f'Dense({self.weight.shape[1] or None} -> {self.units}, '
                f'{self.activation or "linear"})')
