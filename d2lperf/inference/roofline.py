"""Why one token is slow: the roofline of a GPT's prefill and decode steps.

A decode step feeds each of `batch` sequences one token, so every weight matrix is read from
memory to be used `batch` times: about b/2 FLOP per byte in float32. Below the machine's
ridge (peak FLOP/s over bandwidth) the step cannot be faster than the bytes it reads,
weights and KV cache, over the bandwidth the Hardware chapter measures. Prefill feeds the
whole prompt at once and reuses each weight `batch · prompt` times. Taught in "Inference",
section "Why one token is slow".

Counts follow the GPT of `nn.transformer` (config: vocab V, layers L, width h): matrix
products count 2 FLOPs a multiply-add, elementwise work (norms, GELU, softmax) is not counted;
a layer's Dense weights are 12 h² (query, key, value, output: 4 h²; MLP: 8 h²).
"""
import numpy

from ..hardware import gpu, matmul_flops, memory_bandwidth
from ..nn import GPT
from ..utils import median_seconds
from .cache import ContiguousCache
from .generate import forward


def sizes(net):
    """(vocab V, layers L, width h) of a GPT."""
    vocab, layers, hiddens = net.config[:3]
    return vocab, layers, hiddens


def a_weight(net):
    """One of the GPT's weight arrays: its dtype and device are the GPT's (a Parameter's
    own dtype is None until `cast`)."""
    return next(iter(net.collect_params().values())).list_data()[0]


def itemsize(net):
    return numpy.dtype(a_weight(net).dtype).itemsize


def matmul_weights(net):
    """Weights that multiply every token: L · 12 h² in the layers, h · V in the head."""
    vocab, layers, h = sizes(net)
    return layers * 12 * h * h + h * vocab


def step_weight_bytes(net, tokens):
    """Bytes of parameters a step over `tokens` tokens reads: all of them once, except the
    two embedding tables (token and position), of which it reads one row per token."""
    vocab, layers, h = sizes(net)
    per_layer = 12 * h * h + 13 * h                # Dense weights and biases, two norms
    head = 2 * h + vocab * (h + 1)                 # norm, projection and its bias
    return itemsize(net) * (layers * per_layer + head + 2 * tokens * h)


def kv_cache_bytes(net, batch, context):
    """Keys and values of `context` tokens of `batch` sequences: 2 · L · b · s · h items."""
    _, layers, h = sizes(net)
    return itemsize(net) * 2 * layers * batch * context * h


def decode_flops(net, batch, context):
    """FLOPs of one decode step: each new token through every weight (2 · b · weights), and
    its query against `context` cached keys and values (4 · L · b · s · h)."""
    _, layers, h = sizes(net)
    return 2 * batch * matmul_weights(net) + 4 * layers * batch * context * h


def decode_bytes(net, batch, context):
    """The bytes a decode step must read: weights once, and the whole KV cache."""
    return step_weight_bytes(net, batch) + kv_cache_bytes(net, batch, context)


def prefill_flops(net, batch, prompt):
    """FLOPs of a prefill: every prompt token through every weight, and the whole (s, s)
    score matrix, as the GPT's attention computes it (4 · L · b · s² · h)."""
    _, layers, h = sizes(net)
    return 2 * batch * prompt * matmul_weights(net) + 4 * layers * batch * prompt ** 2 * h


def prefill_bytes(net, batch, prompt):
    """The bytes a prefill must move: weights once, and the KV cache it writes."""
    return step_weight_bytes(net, batch * prompt) + kv_cache_bytes(net, batch, prompt)


def decode_intensity(net, batch, context):
    """FLOP a byte of a decode step: about b/2 in float32 at short context."""
    return decode_flops(net, batch, context) / decode_bytes(net, batch, context)


def prefill_intensity(net, batch, prompt):
    return prefill_flops(net, batch, prompt) / prefill_bytes(net, batch, prompt)


def decode_bound_seconds(net, batch, context, bandwidth_gb_per_s, peak_gflop_per_s=None):
    """The roofline's floor under a decode step: its bytes over the bandwidth, or, when the
    peak is given and larger, its FLOPs over the peak."""
    memory = decode_bytes(net, batch, context) / (bandwidth_gb_per_s * 1e9)
    if peak_gflop_per_s is None:
        return memory
    return max(memory, decode_flops(net, batch, context) / (peak_gflop_per_s * 1e9))


def machine_roof(device=None, working_set_bytes=2 ** 28, matmul_size=1024):
    """(memory GB/s, float32 matrix-product GFLOP/s) of the device a GPT runs on, measured as
    the Hardware chapter does: triad over a working set far larger than the caches, and a
    square product (on a GPU: in device memory, and cuBLAS in float32)."""
    if device is not None and device.kind == 'gpu':
        triad = gpu.gpu_memory_bandwidth([4 * working_set_bytes], repeats=3)
        peak = gpu.gpu_matmul_flops(4 * matmul_size, modes=('float32',), repeats=3)
        return triad[-1]['gb_per_s'], peak[0]['tflop_per_s'] * 1e3
    triad = [r for r in memory_bandwidth([working_set_bytes], repeats=3)
             if r['kernel'] == 'triad']
    peak = matmul_flops([matmul_size], dtypes=('float32',))
    return triad[0]['gb_per_s'], peak[0]['gflop_per_s']


def step(net, batch, start, count, seed=0):
    """A function that runs one step of generation (`generate.forward`) on `batch` sequences:
    `count` new tokens each after `start` already in a contiguous KV cache, and waits for its
    logits. Prefill is start 0; a decode step is count 1. The cache's earlier keys and values
    are zeros: the step reads them all the same."""
    vocab, layers, h = sizes(net)
    weight = a_weight(net)
    cache = ContiguousCache(layers, batch, start + count, h, weight.dtype, weight.device,
                            heads=net.config[3])
    tokens = numpy.random.default_rng(seed).integers(0, vocab, (batch, count))
    pads = numpy.zeros(batch, numpy.int64)
    return lambda: forward(net, tokens, start, pads, cache)


def decode_step(net, batch, context, seed=0):
    """One decode step after `context` tokens: it reads every weight and the whole cache."""
    return step(net, batch, context, 1, seed)


def prefill_step(net, batch, prompt, seed=0):
    """The prefill of `batch` prompts of `prompt` tokens."""
    return step(net, batch, 0, prompt, seed)


def thin_copy(net):
    """The same GPT, as many layers, heads and operations, one feature a head: its steps
    move almost no bytes and do almost no FLOPs, so what they take is the framework's cost
    a step (pushing each operation, Python), the part of a step no hardware bound sees."""
    vocab, layers, _, heads, max_len = net.config[:5]
    thin = GPT(vocab, layers, heads, heads, max_len)
    weight = a_weight(net)
    thin.initialize(device=weight.device)
    thin.cast(weight.dtype)
    return thin


def decode_rows(net, batches, context, bandwidth_gb_per_s, peak_gflop_per_s, repeats=3):
    """For each batch size: the measured decode step beside its floors (memory, compute) and
    its overhead (the same step of `thin_copy(net)`, timed round-robin with it)."""
    thin, rows = thin_copy(net), []
    for batch in batches:
        seconds = median_seconds({'step': decode_step(net, batch, context),
                                  'overhead': decode_step(thin, batch, context)}, repeats)
        memory = decode_bound_seconds(net, batch, context, bandwidth_gb_per_s)
        compute = decode_flops(net, batch, context) / (peak_gflop_per_s * 1e9)
        rows.append({'batch': batch, 'step_ms': seconds['step'] * 1e3,
                     'overhead_ms': seconds['overhead'] * 1e3, 'memory_floor_ms': memory * 1e3,
                     'compute_floor_ms': compute * 1e3,
                     'flop_per_byte': decode_intensity(net, batch, context),
                     'over_floor': seconds['step'] / max(memory, compute)})
    return rows


def verdict(rows):
    """Which of the three a step spends most on: the framework's overhead, or the floor set
    by bandwidth or by compute (a step takes at least the overhead plus the higher floor)."""
    names = {'overhead_ms': 'overhead', 'memory_floor_ms': 'bandwidth',
             'compute_floor_ms': 'compute'}
    return {row['batch']: names[max(names, key=row.get)] for row in rows}
