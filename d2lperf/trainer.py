"""The Trainer: update every parameter copy from its gradient after `backward()`."""
from .nn.parameter import Parameter


class Trainer:
    """Minibatch SGD over a dict of parameters (`net.collect_params()`)."""

    OPTIMIZERS = ('sgd',)

    def __init__(self, params, optimizer='sgd', optimizer_params=None):
        if optimizer not in self.OPTIMIZERS:
            raise ValueError(f'unknown optimizer {optimizer!r}; this Trainer offers {self.OPTIMIZERS}')
        params = list(params.values()) if isinstance(params, dict) else list(params)
        if not all(isinstance(p, Parameter) for p in params):
            raise TypeError('Trainer takes net.collect_params() or a list of Parameters')
        self.params = params
        self.learning_rate = (optimizer_params or {}).get('learning_rate', 0.01)

    def step(self, batch_size):
        """w -= learning_rate / batch_size * grad, on every device, as engine operations."""
        scale = self.learning_rate / batch_size
        for param in self.params:
            for weight in param.list_data():
                weight -= scale * weight.grad
