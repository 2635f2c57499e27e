"""Matrix products: `dot` and `matmul`, with NumPy's rules for vectors and batches.

Both are contractions: the compiler writes them into a buffer and lets an elementwise chain
(a bias, an activation) follow them in one fused step.
"""
import numpy

from ..engine import current, pieces
from .registry import defop
from .rules import dot_shape, dtype_of, matmul_shape, rounded, unbroadcast

# OpenBLAS runs a product of m·n·k at most this on the calling thread alone (its
# GEMM_MULTITHREAD_THRESHOLD, 4, times 65,536); above, it wakes every thread it has.
ONE_THREAD_WORK = 4 * 65536
# Below this many multiply-adds in all, a stack is not worth waking a second core for.
STACK_WORK = 1 << 22


def matmul(xp, a, b):
    """a @ b; a stack of small products (attention's scores, a batch of heads) in pieces.

    Each of 64 products of 128 × 32 × 128 is too small to share out among BLAS's threads:
    with two of them the stack took 2 to 20 times as long as with one (the threads meet
    for every product), on the course's 2-core VM. So the stack is cut along its batch axis
    into a piece a core (`pieces`), and each product into blocks of rows that OpenBLAS runs
    on its caller's thread alone (`ONE_THREAD_WORK`)."""
    rows = row_blocks(a, b)
    if xp.__name__ != 'numpy' or rows is None:
        return rounded(xp.matmul(a, b), a, b)
    m, n = a.shape[-2], b.shape[-1]
    out = xp.empty(a.shape[:-1] + (n,), xp.result_type(a, b))
    blocks = lambda x: x.reshape(x.shape[:-2] + (rows, m // rows, x.shape[-1]))
    a_blocks, out_blocks, b_each = blocks(a), blocks(out), b[..., None, :, :]

    def piece(start, stop):
        xp.matmul(a_blocks[start:stop], b_each[start:stop], out=out_blocks[start:stop])
    work = a.size * n
    pieces.run(piece, len(a), current().threads_per_operation() if work >= STACK_WORK else 1)
    return rounded(out, a, b)


def row_blocks(a, b):
    """How many blocks of rows make each product of the stack a @ b one-thread work for
    OpenBLAS; None where the stack is no plain stack of float32 or float64 matrices (a
    broadcast batch, a vector) or no block of whole rows is small enough."""
    if (a.ndim < 3 or a.shape[:-2] != b.shape[:-2]
            or a.dtype != b.dtype or a.dtype not in (numpy.float32, numpy.float64)):
        return None
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    return next((r for r in range(1, m + 1) if m % r == 0 and m // r * k * n <= ONE_THREAD_WORK),
                None)


def matmul_vjp(xp, g, out, a, b):
    """Gradients of a @ b for any batch shape: treat vectors as 1-row / 1-column matrices."""
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g.reshape(matmul_shape(a2, b2))
    grad_a = unbroadcast(matmul(xp, g2, xp.swapaxes(b2, -1, -2)), a2.shape).reshape(a.shape)
    grad_b = unbroadcast(matmul(xp, xp.swapaxes(a2, -1, -2), g2), b2.shape).reshape(b.shape)
    return grad_a, grad_b


def dot_vjp(xp, g, out, a, b):
    if a.ndim > 2 or b.ndim > 2 or not a.ndim or not b.ndim:
        raise NotImplementedError('the gradient of dot is defined here for 1-D and 2-D arrays; '
                                  'use matmul for batched products')
    return matmul_vjp(xp, g, out, a, b)


defop('dot', lambda xp, a, b: xp.dot(a, b),
      lambda a, b: (dot_shape(a, b), numpy.result_type(a.dtype, b.dtype)), dot_vjp,
      kind='contraction')
defop('matmul', matmul,
      lambda a, b: (matmul_shape(a, b), numpy.result_type(dtype_of(a), dtype_of(b))),
      matmul_vjp, kind='contraction')
