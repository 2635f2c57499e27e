"""Matrix products: `dot` and `matmul`, with NumPy's rules for vectors and batches.

Both are contractions: the compiler writes them into a buffer and lets an elementwise chain
(a bias, an activation) follow them in one fused step.
"""
import numpy

from .registry import defop
from .rules import dot_shape, dtype_of, matmul_shape, rounded, unbroadcast


def matmul_vjp(xp, g, out, a, b):
    """Gradients of a @ b for any batch shape: treat vectors as 1-row / 1-column matrices."""
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g.reshape(matmul_shape(a2, b2))
    grad_a = unbroadcast(xp.matmul(g2, xp.swapaxes(b2, -1, -2)), a2.shape).reshape(a.shape)
    grad_b = unbroadcast(xp.matmul(xp.swapaxes(a2, -1, -2), g2), b2.shape).reshape(b.shape)
    return grad_a, grad_b


def dot_vjp(xp, g, out, a, b):
    if a.ndim > 2 or b.ndim > 2 or not a.ndim or not b.ndim:
        raise NotImplementedError('the gradient of dot is defined here for 1-D and 2-D arrays; '
                                  'use matmul for batched products')
    return matmul_vjp(xp, g, out, a, b)


defop('dot', lambda xp, a, b: xp.dot(a, b),
      lambda a, b: (dot_shape(a, b), numpy.result_type(a.dtype, b.dtype)), dot_vjp,
      kind='contraction')
defop('matmul', lambda xp, a, b: rounded(xp.matmul(a, b), a, b),
      lambda a, b: (matmul_shape(a, b), numpy.result_type(dtype_of(a), dtype_of(b))),
      matmul_vjp, kind='contraction')
