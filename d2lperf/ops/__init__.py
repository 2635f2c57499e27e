"""`d2lperf.ops`: every array operation, as the engine, autograd and the compiler all see it.

An `Op` is a name, three small functions (compute, infer, vjp) and the facts the compiler
needs (its `kind` and, for elementwise ops, a C expression); `registry.py` says what each
means. Ops are registered with `defop` by family, one module each:

    registry.py     Op, REGISTRY, defop, the kinds; as_array
    rules.py        shape, dtype and gradient rules many ops share
    elementwise.py  arithmetic, comparisons, math functions
    linalg.py       dot, matmul
    reduction.py    sum, mean, max, argmax
    shape.py        reshape, transpose, broadcast_to, astype, copy, getitem, concatenate, where
    nn.py           relu, sigmoid, softmax, log_softmax, pick, fully_connected
    transformer.py  embedding, add_position_embedding, layer_norm, gelu, causal_softmax
    attention.py    attention in tiles (FlashAttention): online softmax, the bytes it moves
    random.py       one generator per device; dropout_mask
    convolution.py  convolution (im2col and one product), pooling, batch normalization
    cudnn.py        on a GPU, convolutions and their gradients as cuDNN graphs, beside im2col
    winograd.py     3×3 convolutions by Winograd's F(2×2, 3×3): fewer multiplications

Adding an op is one `defop` call in its family's module: every frontend (`np`, `npx`),
autograd and the compiler find it in REGISTRY.
"""
from .registry import OP_KINDS, REGISTRY, Op, as_array, defop
from .rules import (compare, differentiable, dot_shape, dtype_of, expand_reduced, floating,
                    index_shape, input_grads, matmul_shape, normalize_axes, promote, reduced_shape,
                    reshape_shape, same, shape_of, sum_dtype, unbroadcast)
from . import elementwise, linalg, reduction, shape, nn, random, convolution  # noqa: F401
from . import transformer, attention  # noqa: F401

__all__ = ['OP_KINDS', 'REGISTRY', 'Op', 'as_array', 'defop', 'compare', 'dot_shape', 'dtype_of',
           'expand_reduced', 'floating', 'index_shape', 'input_grads', 'matmul_shape',
           'normalize_axes', 'promote', 'reduced_shape', 'reshape_shape', 'same', 'shape_of',
           'sum_dtype', 'unbroadcast']
