"""`d2lperf.npx`: operators NumPy lacks (activations, softmax, picking) and engine controls."""
from . import engine
from .ndarray import apply


def relu(x):
    return apply('relu', x)


def sigmoid(x):
    return apply('sigmoid', x)


def softmax(x):
    """Softmax along the last axis."""
    return apply('softmax', x)


def log_softmax(x):
    """Log-softmax along the last axis, computed stably in one operation."""
    return apply('log_softmax', x)


def pick(x, index):
    """`x[i, ..., index[i, ...]]` along the last axis: the score of each example's label."""
    return apply('pick', x, index)


def fully_connected(x, weight, bias):
    """`x @ weight.T + bias`, the whole of a Dense layer as one operation."""
    return apply('fully_connected', x, weight, bias)


def waitall():
    """Block until every pushed operation has finished (a barrier for the whole engine)."""
    engine.wait_all()
