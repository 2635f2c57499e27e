"""`d2lperf.nn`: blocks, layers, losses, initializers and parameters."""
from . import init
from .block import Block, Dense, Sequential
from .loss import L2Loss, SoftmaxCrossEntropyLoss
from .parameter import DeferredInitializationError, Parameter
