"""The Trainer: sum each parameter's gradients over its device copies, then update every copy."""
from . import comm
from .nn.parameter import Parameter


class Trainer:
    """Minibatch SGD over a dict of parameters (`net.collect_params()`).

    A parameter initialized on several devices has a gradient on each, from that device's
    slice of the batch. `step` adds them up (`comm.allreduce`) before updating, so every copy
    takes the same step and the copies stay identical, as with one device and the whole batch.
    """

    OPTIMIZERS = ('sgd',)
    KVSTORES = ('device', 'local', None)

    def __init__(self, params, optimizer='sgd', optimizer_params=None, kvstore='device'):
        if optimizer not in self.OPTIMIZERS:
            raise ValueError(f'unknown optimizer {optimizer!r}; this Trainer offers {self.OPTIMIZERS}')
        if kvstore not in self.KVSTORES:
            raise ValueError(f'unknown kvstore {kvstore!r}; this Trainer sums gradients in this '
                             f'process and takes one of {self.KVSTORES}, which all mean that')
        params = list(params.values()) if isinstance(params, dict) else list(params)
        if not all(isinstance(p, Parameter) for p in params):
            raise TypeError('Trainer takes net.collect_params() or a list of Parameters')
        self.params = [p for p in params if p.grad_req == 'write']    # not running statistics
        self.kvstore = kvstore
        self.learning_rate = (optimizer_params or {}).get('learning_rate', 0.01)

    def step(self, batch_size):
        """w -= learning_rate / batch_size * (sum of w's gradients), on every device."""
        scale = self.learning_rate / batch_size
        for param in self.params:
            weights = param.list_data()
            comm.allreduce([weight.grad for weight in weights])
            for weight in weights:
                weight -= scale * weight.grad
