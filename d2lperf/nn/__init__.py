"""`d2lperf.nn`: blocks, layers, losses, initializers and parameters."""
from . import init
from .block import (Activation, Block, Dense, Dropout, HybridBlock, HybridSequential,
                    Sequential, SymbolBlock)
from .loss import L2Loss, SoftmaxCrossEntropyLoss
from .parameter import DeferredInitializationError, Parameter
