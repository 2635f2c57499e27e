"""`d2lperf.nn`: blocks, layers, losses, initializers and parameters, and the networks the
training chapters build from them (LeNet, ResNet-18, a small GPT)."""
from . import init
from .block import (Activation, Block, Dense, Dropout, HybridBlock, HybridSequential,
                    Sequential, SymbolBlock)
from .conv_layers import AvgPool2D, BatchNorm, Conv2D, Flatten, GlobalAvgPool2D, MaxPool2D
from .loss import L2Loss, SoftmaxCrossEntropyLoss
from .parameter import DeferredInitializationError, Parameter
from .models import Residual, lenet, resnet18
from .moe import MoE
from .transformer import (GPT, CausalSelfAttention, Embedding, GPTEmbedding, LanguageModelHead,
                          LayerNorm, MLP, TransformerLayer)
