"""Losses: one value per example, averaged over everything but the batch axis."""
from ..np import extension as npx
from .block import HybridBlock


class L2Loss(HybridBlock):
    """(pred - label)² / 2 per example."""

    def forward(self, pred, label):
        diff = pred - label.reshape(pred.shape)
        per_value = diff * diff / 2
        return per_value.mean(axis=tuple(range(1, pred.ndim))) if pred.ndim > 1 else per_value


class SoftmaxCrossEntropyLoss(HybridBlock):
    """-log softmax(pred)[label] per example; labels are class indices."""

    def forward(self, pred, label):
        return -npx.pick(npx.log_softmax(pred), label)
