"""What the model-parallel tests share: the small GPT they split, drawn the same way each
time, and the virtual devices they split it over."""
import d2lperf as d2l
from d2lperf import autograd, nn, np

VOCAB, HIDDEN, HEADS, SEQ = 20, 16, 4, 8


def gpt(layers, device=d2l.cpu(0), vocab=VOCAB, hidden=HIDDEN, heads=HEADS, seq=SEQ):
    """A GPT of `layers` layers on `device`, its weights drawn from seed 0."""
    np.random.seed(0)
    net = nn.GPT(vocab, layers, hidden, heads, seq)
    net.initialize(device=device)
    return net


def devices(count, first=1):
    """`count` virtual devices from cpu(first) on (cpu(0) is left to the whole net)."""
    return [d2l.cpu(first + i) for i in range(count)]


def split_step(split, tokens, labels):
    """The logits (as NumPy, one a device) and a finished backward pass of a split GPT on
    `tokens`, its loss the cross-entropy against `labels` summed on every device."""
    loss = d2l.SoftmaxCrossEntropyLoss()
    with autograd.record():
        logits = split(np.array(tokens))
        losses = [loss(out, np.array(labels, device=out.device)).sum() for out in logits]
    split.backward(losses)
    split.finish_gradients()
    return [out.asnumpy() for out in logits]
