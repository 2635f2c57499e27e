"""Networks the training chapters use: the LeNet of "Training on Multiple GPUs" as layers, and
the residual block and the ResNet-18 variant for small images of the MXNet edition of Dive into
Deep Learning. Taught in "Concise Implementation for Multiple GPUs"."""
from ..np import extension as npx
from .block import Activation, Dense, HybridBlock, HybridSequential
from .conv_layers import AvgPool2D, BatchNorm, Conv2D, Flatten, GlobalAvgPool2D


def lenet(num_classes=10):
    """The toy LeNet of "Training on Multiple GPUs": two ReLU convolutions with average
    pooling, then two dense layers."""
    net = HybridSequential()
    net.add(Conv2D(20, kernel_size=3, activation='relu'), AvgPool2D(2),
            Conv2D(50, kernel_size=5, activation='relu'), AvgPool2D(2),
            Dense(128, activation='relu'), Dense(num_classes))
    return net


class Residual(HybridBlock):
    """Two 3×3 convolutions with batch normalization, added to the block's input; a 1×1
    convolution reshapes the input where the block changes channels or resolution."""

    def __init__(self, num_channels, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = Conv2D(num_channels, kernel_size=3, padding=1, strides=strides)
        self.conv2 = Conv2D(num_channels, kernel_size=3, padding=1)
        self.conv3 = Conv2D(num_channels, kernel_size=1, strides=strides) if use_1x1conv else None
        self.bn1, self.bn2 = BatchNorm(), BatchNorm()

    def forward(self, X):
        Y = npx.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3 is not None:
            X = self.conv3(X)
        return npx.relu(Y + X)


def resnet_block(num_channels, num_residuals, first_block=False):
    """`num_residuals` residual blocks; all but the first stage halve the resolution."""
    blk = HybridSequential()
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blk.add(Residual(num_channels, use_1x1conv=True, strides=2))
        else:
            blk.add(Residual(num_channels))
    return blk


def resnet18(num_classes, in_channels=1):
    """ResNet-18 for small images: a 3×3 stride-1 first convolution and no max-pooling, so that
    28×28 inputs keep their resolution into the first stage. `in_channels` is learnt from the
    first batch; the argument is kept for the signature the chapters know."""
    net = HybridSequential()
    net.add(Conv2D(64, kernel_size=3, strides=1, padding=1, in_channels=in_channels),
            BatchNorm(), Activation('relu'))
    net.add(resnet_block(64, 2, first_block=True), resnet_block(128, 2),
            resnet_block(256, 2), resnet_block(512, 2))
    net.add(GlobalAvgPool2D(), Flatten(), Dense(num_classes))
    return net

