"""Convolution, pooling and batch normalization on NCHW arrays, each one engine operation.

A convolution is turned into one matrix product: *im2col* lays every kh×kw patch of the
(padded) input out as a column, so that the filters, flattened to a (F, C·kh·kw) matrix,
times those columns give every output pixel of every example at once. BLAS (or cuBLAS) does
the work; Python never loops over pixels or examples. The backward pass runs the same
products transposed, and `col2im` adds the patches' gradients back into place with one loop
over the kh·kw kernel offsets. A 3×3 layer at stride 1 whose output has even sides takes
another road with 2.25 times fewer multiplications, Winograd's F(2×2, 3×3) (`winograd.py`).
On a GPU, a convolution and its gradients run as cuDNN graphs where NVIDIA's cuDNN frontend
is installed (`cudnn.py`); im2col stays there as the version to read and to time against.
Pooling reads the same windows, as a strided view that copies nothing.

Layout matters as much as arithmetic. The columns are (C·kh·kw, OH·OW·N), the batch axis
innermost, so the product comes out (F, OH·OW·N) and the op returns it as an (N, F, OH, OW)
*view*: NCHW to the reader, (F, OH, OW, N) in memory, with no copy back. NumPy's (and
CuPy's) elementwise results keep their input's memory order, so a ReLU after it keeps the
layout too, and the next convolution or pooling reads its input in place (`batch_last` is
free). The copies that build and undo the columns move runs of N values, not a few pixels.

Batch normalization in training mode also updates the running statistics of its layer: the
op declares that it writes them (`writes=(3, 4)`), so the engine orders that update against
every other use of those arrays. On a GPU in float32 it and its gradient run as cuDNN
graphs where the frontend is installed (`cudnn.py`). Taught in "Training on Multiple GPUs".
"""
import numpy

from ..engine import pieces
from . import cudnn, winograd
from .registry import defop


def out_size(size, kernel, stride, pad):
    return (size + 2 * pad - kernel) // stride + 1


def batch_last(xp, x, pad=(0, 0), fill=0):
    """x (N, C, H, W) as a contiguous (C, H + 2·ph, W + 2·pw, N) array, padded with `fill`:
    free (a view) when x already lies in memory that way, as these ops' results do."""
    image = x.transpose(1, 2, 3, 0)
    ph, pw = pad
    if not ph and not pw:
        return xp.ascontiguousarray(image)
    c, h, w, n = image.shape
    out = xp.full((c, h + 2 * ph, w + 2 * pw, n), fill, x.dtype)
    out[:, ph:ph + h, pw:pw + w] = image
    return out


def batch_first(image, shape, pad):
    """The inverse of `batch_last`: the (N, C, H, W) view of a padded (C, H', W', N) image."""
    (ph, pw), (h, w) = pad, shape[2:]
    return image[:, ph:ph + h, pw:pw + w].transpose(3, 0, 1, 2)


def windows(xp, image, kernel, stride):
    """A (C, kh, kw, OH, OW, N) view of every window of a batch-last image: no data copied."""
    (kh, kw), (sh, sw) = kernel, stride
    c, h, w, n = image.shape
    oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    s = image.strides
    return xp.lib.stride_tricks.as_strided(
        image, (c, kh, kw, oh, ow, n), (s[0], s[1], s[2], s[1] * sh, s[2] * sw, s[3]))


def im2col(xp, x, kernel, stride, pad):
    """Every patch as a column: (C·kh·kw, OH·OW·N), the right factor of the product; a large
    copy runs in pieces on every core the device has (`pieces.copy`)."""
    patches = windows(xp, batch_last(xp, x, pad), kernel, stride)
    c, kh, kw = patches.shape[:3]
    return pieces.copy(xp, patches).reshape(c * kh * kw, -1)


def offsets(kernel, stride, grid):
    """For each kernel offset (i, j): its index i·kw + j, and the slices that pick, from a
    padded batch-last image, the pixel at that offset in every window."""
    (kh, kw), (sh, sw), (oh, ow) = kernel, stride, grid
    for i in range(kh):
        for j in range(kw):
            yield i * kw + j, (slice(None), slice(i, i + sh * (oh - 1) + 1, sh),
                               slice(j, j + sw * (ow - 1) + 1, sw))


def col2im(xp, cols, x_shape, kernel, stride, pad):
    """The adjoint of im2col: add each column back onto the input pixels it came from."""
    (kh, kw), (ph, pw) = kernel, pad
    n, c, h, w = x_shape
    grid = out_size(h, kh, stride[0], ph), out_size(w, kw, stride[1], pw)
    cols = cols.reshape((c, kh * kw) + grid + (n,))
    image = xp.zeros((c, h + 2 * ph, w + 2 * pw, n), cols.dtype)

    def channels(start, stop):                  # channels never mix: a piece per block
        block, block_cols = image[start:stop], cols[start:stop]
        for k, where in offsets(kernel, stride, grid):
            block[where] += block_cols[:, k]
    pieces.over_axis(xp, c, cols.nbytes, channels)
    return batch_first(image, x_shape, pad)


# -- convolution ----------------------------------------------------------------------------

def convolution_infer(data, weight, bias, kernel, stride, pad, num_filter):
    if len(data.shape) != 4:
        raise ValueError(f'convolution needs NCHW input (4 dimensions), got shape {data.shape}')
    f, c, kh, kw = weight.shape
    if data.shape[1] != c:
        raise ValueError(f'a convolution with weight {tuple(weight.shape)} expects inputs with '
                         f'{c} channels, got input of shape {tuple(data.shape)}: check the '
                         'previous layer\'s channels')
    if (kh, kw) != tuple(kernel) or f != num_filter:
        raise ValueError(f'weight {tuple(weight.shape)} does not match kernel={tuple(kernel)} '
                         f'and num_filter={num_filter}')
    if hasattr(bias, 'shape') and tuple(bias.shape) != (f,):
        raise ValueError(f'a convolution with {f} filters needs a bias of shape ({f},), '
                         f'got {tuple(bias.shape)}')
    oh, ow = (out_size(n, k, s, p) for n, k, s, p in zip(data.shape[2:], kernel, stride, pad))
    if oh < 1 or ow < 1:
        raise ValueError(f'kernel {tuple(kernel)} is larger than the padded input '
                         f'{tuple(data.shape[2:])} (pad {tuple(pad)})')
    return (data.shape[0], f, oh, ow), numpy.result_type(data.dtype, weight.dtype)


def by_columns(xp, data, weight, kernel, stride, pad):
    """im2col's road: every patch a column, one product; (F, OH, OW, N), batch-last."""
    grid = tuple(out_size(n, k, s, p) for n, k, s, p in zip(data.shape[2:], kernel, stride, pad))
    out = weight.reshape(len(weight), -1) @ im2col(xp, data, kernel, stride, pad)
    return out.reshape((len(weight),) + grid + data.shape[:1])


def by_columns_vjp(xp, g_image, data, weight, kernel, stride, pad, needs_data):
    """The same products transposed, from the output's gradient g_image (F, OH, OW, N); the
    columns are built again rather than kept from the forward pass."""
    g_rows = g_image.reshape(len(weight), -1)
    d_weight = (g_rows @ im2col(xp, data, kernel, stride, pad).T).reshape(weight.shape)
    d_data = None
    if needs_data:
        d_data = col2im(xp, weight.reshape(len(weight), -1).T @ g_rows, data.shape, kernel,
                        stride, pad)
    return d_data, d_weight


def convolution(xp, data, weight, bias, kernel, stride, pad, num_filter):
    """On a GPU by a cuDNN graph where it can; else a 3×3 layer at stride 1 by Winograd's
    F(2×2, 3×3) where it pays, else by im2col."""
    out = None if xp is numpy else cudnn.forward(xp, data, weight, stride, pad)
    if out is not None:                                     # (N, F, OH, OW), NCHW
        if hasattr(bias, 'shape'):
            out += bias[:, None, None]
        return out
    grid = tuple(out_size(n, k, s, p) for n, k, s, p in zip(data.shape[2:], kernel, stride, pad))
    if winograd.applies(xp, weight.shape, stride, pad, grid):
        out = winograd.convolution(xp, data, weight, pad)
    else:
        out = by_columns(xp, data, weight, kernel, stride, pad)
    if hasattr(bias, 'shape'):
        out += bias[:, None, None, None]
    return out.transpose(3, 0, 1, 2)


def convolution_vjp(xp, g, out, data, weight, bias, kernel, stride, pad, num_filter,
                    needs=(True, True, True)):
    """The input's gradient only where it is needed: not for a first layer, whose input is
    the data."""
    grads = None if xp is numpy else cudnn.gradients(xp, g, data, weight, stride, pad, needs[:2])
    if grads is not None:
        return grads + (g.sum(axis=(0, 2, 3)) if hasattr(bias, 'shape') else None,)
    g_image = batch_last(xp, g)                             # (F, OH, OW, N), as the product
    if winograd.applies(xp, weight.shape, stride, pad, g.shape[2:]):
        d_data, d_weight = winograd.convolution_vjp(xp, g_image, data, weight, pad, needs[0])
    else:
        d_data, d_weight = by_columns_vjp(xp, g_image, data, weight, kernel, stride, pad,
                                          needs[0])
    d_bias = g_image.reshape(num_filter, -1).sum(axis=1) if hasattr(bias, 'shape') else None
    return d_data, d_weight, d_bias


defop('convolution', convolution, convolution_infer, convolution_vjp, partial_vjp=True)


# -- pooling --------------------------------------------------------------------------------

def pooling_infer(data, kernel, stride, pad, pool_type):
    if len(data.shape) != 4:
        raise ValueError(f'pooling needs NCHW input (4 dimensions), got shape {data.shape}')
    if pool_type not in ('max', 'avg'):
        raise ValueError(f"pool_type must be 'max' or 'avg', not {pool_type!r}")
    oh, ow = (out_size(n, k, s, p) for n, k, s, p in zip(data.shape[2:], kernel, stride, pad))
    if oh < 1 or ow < 1:
        raise ValueError(f'pooling window {tuple(kernel)} is larger than the padded input '
                         f'{tuple(data.shape[2:])}')
    return data.shape[:2] + (oh, ow), numpy.dtype(data.dtype)


def pool_windows(xp, data, kernel, stride, pad, pool_type):
    fill = -numpy.inf if pool_type == 'max' else 0
    return windows(xp, batch_last(xp, data, pad, fill), kernel, stride)


def pooling(xp, data, kernel, stride, pad, pool_type):
    """Max or average over each window; an average counts padding as zeros (MXNet's rule)."""
    patches = pool_windows(xp, data, kernel, stride, pad, pool_type)
    out = xp.empty((patches.shape[0],) + patches.shape[3:], data.dtype)

    def channels(start, stop):
        if pool_type == 'max':
            patches[start:stop].max(axis=(1, 2), out=out[start:stop])
        else:
            patches[start:stop].mean(axis=(1, 2), dtype=data.dtype, out=out[start:stop])
    pieces.over_axis(xp, len(out), data.size * data.itemsize, channels)
    return out.transpose(3, 0, 1, 2)


def pooling_vjp(xp, g, out, data, kernel, stride, pad, pool_type):
    (kh, kw), (ph, pw) = kernel, pad
    n, c, h, w = data.shape
    g_image = batch_last(xp, g)                         # (C, OH, OW, N)
    dx = xp.zeros((c, h + 2 * ph, w + 2 * pw, n), g.dtype)
    if pool_type == 'max':       # the gradient goes to the first maximum of each window
        patches = pool_windows(xp, data, kernel, stride, pad, pool_type)
        winner = patches.reshape((c, kh * kw) + patches.shape[3:]).argmax(axis=1)
    else:
        share = g_image / (kh * kw)
    def channels(start, stop):
        block = dx[start:stop]
        for k, where in offsets(kernel, stride, g.shape[2:]):
            block[where] += (g_image[start:stop] * (winner[start:stop] == k)
                             if pool_type == 'max' else share[start:stop])
    pieces.over_axis(xp, c, dx.nbytes, channels)
    return (batch_first(dx, data.shape, pad),)


defop('pooling', pooling, pooling_infer, pooling_vjp)


# -- batch normalization --------------------------------------------------------------------

def stats_axes(ndim):
    """Statistics per channel: over the batch, and over pixels for images."""
    return (0,) if ndim == 2 else (0, 2, 3)


def per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def batch_norm_infer(data, gamma, beta, running_mean, running_var, eps, momentum):
    channels = data.shape[1] if len(data.shape) > 1 else None
    if len(data.shape) not in (2, 4):
        raise ValueError(f'batch_norm needs (N, C) or (N, C, H, W) input, got {data.shape}')
    for name, v in (('gamma', gamma), ('beta', beta), ('running_mean', running_mean),
                    ('running_var', running_var)):
        if tuple(v.shape) != (channels,):
            raise ValueError(f'batch_norm on {channels} channels needs {name} of shape '
                             f'({channels},), got {tuple(v.shape)}')
    return tuple(data.shape), numpy.dtype(data.dtype)


def channel_rows(xp, x):
    """x (N, C, ...) as a contiguous (C, ...·N) array, a row per channel: free (a view) when x
    lies in memory batch last, as these ops' results do."""
    image = x.transpose((1,) + tuple(range(2, x.ndim)) + (0,))
    return xp.ascontiguousarray(image).reshape(x.shape[1], -1)


def from_rows(rows, shape):
    """The (N, C, ...) view of rows made by `channel_rows`."""
    image = rows.reshape((shape[1],) + tuple(shape[2:]) + (shape[0],))
    return image.transpose((image.ndim - 1,) + tuple(range(image.ndim - 1)))


def batch_norm_train(xp, data, gamma, beta, running_mean, running_var, eps, momentum,
                     saved=None):
    """Normalize with the batch's statistics, and move the running ones towards them.

    Each channel's statistics are sums along its own contiguous row, so they do not depend on
    how many channels are computed together: a large batch is done in blocks of channels at
    once (`pieces`), with the values of the whole, bit for bit. The output's rows hold the
    centred input first, then are scaled in place: five passes over memory, no temporaries.
    On a GPU, one cuDNN graph does it all where cuDNN is installed (cudnn.py). When autograd
    records, `saved` keeps the batch's mean and inverse deviation for the backward pass, which
    would otherwise make two passes over the batch to find them again (`Op.saves`)."""
    fused = None if xp is numpy else cudnn.batch_norm_forward(
        xp, data, gamma, beta, running_mean, running_var, eps, momentum, saved)
    if fused is not None:
        return fused
    rows, n = channel_rows(xp, data), data.size // data.shape[1]
    out = xp.empty_like(rows)
    if saved is not None:
        saved['mean'], saved['inv_std'] = (xp.empty(len(rows), rows.dtype) for _ in range(2))

    def channels(start, stop):
        block, c = rows[start:stop], slice(start, stop)
        mean, centred = block.mean(axis=1), out[c]
        xp.subtract(block, mean[:, None], out=centred)
        var = row_dots(xp, centred, centred) / n
        running_mean[c] *= momentum
        running_mean[c] += (1 - momentum) * mean
        running_var[c] *= momentum
        running_var[c] += (1 - momentum) * var * (n / max(n - 1, 1))   # unbiased, as MXNet's
        if saved is not None:           # as the backward pass would find them again
            saved['mean'][c], saved['inv_std'][c] = mean, 1 / xp.sqrt(var + eps)
        centred *= (gamma[c] / xp.sqrt(var + eps))[:, None]
        centred += beta[c, None]
    pieces.over_axis(xp, len(rows), data.nbytes, channels)
    return from_rows(out, data.shape)


def row_dots(xp, a, b):
    """Each row of a dotted with the same row of b, in one pass and no temporary."""
    return xp.einsum('ij,ij->i', a, b)


def batch_norm_train_vjp(xp, g, out, data, gamma, beta, running_mean, running_var, eps,
                         momentum, saved=None):
    """dx = k·g − (k/n)·(x̂·dγ + dβ), with k = γ/σ, built in place in the rows that first
    hold x̂. On a GPU, one cuDNN graph where cuDNN is installed (cudnn.py). The batch's mean
    and inverse deviation come from the forward pass (`saved`), or are found again where it
    kept none."""
    kept = (saved['mean'], saved['inv_std']) if saved else None
    fused = None if xp is numpy else cudnn.batch_norm_backward(xp, g, data, gamma, eps, kept)
    if fused is not None:
        return fused + (None, None)
    rows, g_rows, n = channel_rows(xp, data), channel_rows(xp, g), data.size // data.shape[1]
    d_rows = xp.empty(rows.shape, xp.result_type(g, data))
    d_gamma, d_beta = (xp.empty(len(rows), d_rows.dtype) for _ in range(2))

    def channels(start, stop):
        block, g_block, c = rows[start:stop], g_rows[start:stop], slice(start, stop)
        x_hat = d_rows[c]
        if kept:
            xp.subtract(block, kept[0][c, None], out=x_hat)
            inv_std = kept[1][c]
        else:
            xp.subtract(block, block.mean(axis=1)[:, None], out=x_hat)
            inv_std = 1 / xp.sqrt(row_dots(xp, x_hat, x_hat) / n + eps)
        x_hat *= inv_std[:, None]
        d_beta[c], d_gamma[c] = g_block.sum(axis=1), row_dots(xp, g_block, x_hat)
        k = gamma[c] * inv_std
        x_hat *= (-k / n * d_gamma[c])[:, None]
        x_hat -= (k / n * d_beta[c])[:, None]
        x_hat += g_block * k[:, None]
    pieces.over_axis(xp, len(rows), data.nbytes, channels)
    return from_rows(d_rows, data.shape), d_gamma, d_beta, None, None


def batch_norm_predict(xp, data, gamma, beta, running_mean, running_var, eps, momentum):
    scale = gamma / xp.sqrt(running_var + eps)
    return (data * per_channel(scale, data.ndim)
            + per_channel(beta - running_mean * scale, data.ndim))


def batch_norm_predict_vjp(xp, g, out, data, gamma, beta, running_mean, running_var, eps,
                           momentum):
    axes, ndim = stats_axes(data.ndim), data.ndim
    inv_std = 1 / xp.sqrt(running_var + eps)
    x_hat = (data - per_channel(running_mean, ndim)) * per_channel(inv_std, ndim)
    return (g * per_channel(gamma * inv_std, ndim), (g * x_hat).sum(axis=axes),
            g.sum(axis=axes), None, None)


defop('batch_norm_train', batch_norm_train, batch_norm_infer, batch_norm_train_vjp,
      writes=(3, 4), saves=True)
defop('batch_norm_predict', batch_norm_predict, batch_norm_infer, batch_norm_predict_vjp)
