"""Winograd's minimal filtering, F(2×2, 3×3): 3×3 convolutions with 2.25× fewer multiplications.

im2col computes each output pixel with 9·C multiply-adds. Lavin and Gray ("Fast Algorithms for
Convolutional Neural Networks", 2016) compute a 2×2 tile of outputs from a 4×4 tile of input
with 16·C: each tile of input d and each filter g are first *transformed*, V = Bᵀ d B and
U = G g Gᵀ (4×4 each), multiplied elementwise and summed over channels, M = Σ_c U ⊙ V, and
transformed back, Y = Aᵀ M A. The sum over channels of one of the 16 positions, for every
filter and every tile at once, is a matrix product (F, C) × (C, tiles), so the work is 16
products where im2col's was one 2.25 times larger. What it costs: Bᵀ d B and Aᵀ M A are
additions only (the matrices hold 0 and ±1), but NumPy runs each as a pass over memory, and
the tiles' transform holds 4 values for each input pixel (im2col: 9).

Layout. An image is batch-last, (C, H, W, N), as `convolution` keeps it. Tiles overlap by two
pixels and start every second column, so a tile's k-th column is column 2b + k: the image is
first copied with its even and odd columns apart, (C, H, 2, W/2, N), which makes every
column of every tile a plain slice, (tiles, N) contiguous, and every pass after it a long run
of memory. The weight's gradient is the adjoint of each step in reverse order (16 products,
transposed); the input's is the convolution of the output's gradient with the filters turned
around, again a 3×3 convolution at stride 1.

Used by `convolution` on NumPy for 3×3 kernels at stride 1 with at least 64 channels in and
out, whose output's sides are even and at least 8 (`applies`); im2col keeps the others.
Measured against im2col in "Concise Implementation for Multiple GPUs" (a layer of ResNet-18)
and in benchmarks/RESULTS.md.
"""
from ..engine import pieces


def applies(xp, weight_shape, stride, pad, grid):
    """Whether F(2×2, 3×3) computes this convolution and its input's gradient faster: a 3×3
    kernel, stride 1, padding at most 2, an output that 2×2 tiles cover exactly, and enough
    work for the transforms to pay. Below 8 × 8 outputs, or 64 channels in or out, they cost
    more than the products save (measured on one core: a first layer with one input channel
    took 4.4 ms this way against 0.2 ms by im2col). On NumPy only: on a GPU each of its
    forty-odd passes is a kernel launch, and on an H200 every ResNet-18 layer it fits ran
    2.4 to 11 times slower this way (`benchmarks/training.py gpu`)."""
    filters, channels, kh, kw = weight_shape
    return (xp.__name__ == 'numpy' and (kh, kw) == (3, 3) and tuple(stride) == (1, 1)
            and max(pad) <= 2 and min(filters, channels) >= 64
            and all(n % 2 == 0 and n >= 8 for n in grid))


def split_columns(xp, x, pad):
    """The zero-padded batch-last image of x (N, C, H, W), its even and odd columns apart:
    (C, H + 2·ph, 2, (W + 2·pw) / 2, N)."""
    (ph, pw), image = pad, x.transpose(1, 2, 3, 0)
    c, h, w, n = image.shape
    out = xp.zeros((c, h + 2 * ph, 2, (w + 2 * pw) // 2, n), x.dtype)
    for parity in (0, 1):
        first = (parity - pw) % 2               # the first image column of this parity
        start = (first + pw - parity) // 2
        count = len(range(first, w, 2))
        out[:, ph:ph + h, parity, start:start + count] = image[:, :, first::2]
    return out


def tile_columns(split, k, tiles):
    """Column k (0–3) of every tile of a split image (..., 2, W/2, N): (..., tiles, N)."""
    return split[..., k % 2, k // 2:k // 2 + tiles, :]


def filter_transform(xp, dtype):
    """G ⊗ G (16×9): U = G g Gᵀ for a 3×3 filter g, flattened, is this matrix times g.
    G's rows are (1, 0, 0), (½, ½, ½), (½, −½, ½), (0, 0, 1)."""
    g = xp.asarray([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], dtype)
    return xp.kron(g, g)


def transform_filters(xp, weight):
    """U for every filter and channel, (16, F, C): one product, (16×9) × (9, F·C)."""
    f, c = weight.shape[:2]
    flat = weight.reshape(f * c, 9)
    return (filter_transform(xp, weight.dtype) @ flat.T).reshape(16, f, c)


def filters_gradient(xp, d_u, weight):
    """The adjoint of `transform_filters`: dUᵀ (F·C, 16) × (G ⊗ G), as weight (F, C, 3, 3)."""
    f, c = weight.shape[:2]
    return (d_u.reshape(16, f * c).T @ filter_transform(xp, weight.dtype)).reshape(weight.shape)


def bt_into(xp, out, d0, d1, d2, d3):
    """Bᵀ along one axis, four rows (or columns) of tiles into four transformed ones, out[0]
    = d0 − d2, out[1] = d1 + d2, out[2] = d2 − d1, out[3] = d1 − d3: additions only."""
    xp.subtract(d0, d2, out=out[0])
    xp.add(d1, d2, out=out[1])
    xp.subtract(d2, d1, out=out[2])
    xp.subtract(d1, d3, out=out[3])


def transform_tiles(xp, split, rows, tiles):
    """V = Bᵀ d B for every 4×4 input tile: (16, C, rows·tiles·N), first along the rows of
    the split image, then along the columns, in pieces of channels."""
    c, n = split.shape[0], split.shape[-1]
    v = xp.empty((4, 4, c, rows, tiles, n), split.dtype)

    def channels(start, stop):
        part = split[start:stop]
        along_rows = xp.empty((4,) + part[:, :rows].shape, part.dtype)
        bt_into(xp, along_rows, *(part[:, k:k + 2 * rows:2] for k in range(4)))
        for i, r in enumerate(along_rows):
            bt_into(xp, v[i, :, start:stop], *(tile_columns(r, k, tiles) for k in range(4)))
    pieces.over_axis(xp, c, v.nbytes, channels)
    return v.reshape(16, c, -1)


def at(xp, m0, m1, m2, m3):
    """Aᵀ along one axis: four rows of M to the two rows of output."""
    first = m0 + m1
    first += m2
    second = m1 - m2
    second -= m3
    return first, second


def untransform_tiles(xp, m, out):
    """Y = Aᵀ M A for every tile, into out (F, rows, 2, tiles, 2, N): Aᵀ's first row adds
    rows 0, 1 and 2 of a tile, its second takes row 1 less rows 2 and 3."""
    def filters(start, stop):
        part = m[:, :, start:stop]
        for i, r in enumerate(at(xp, *part)):
            for j, y in enumerate(at(xp, *r)):
                out[start:stop, :, i, :, j] = y
    pieces.over_axis(xp, m.shape[2], m.nbytes, filters)


def input_tiles(xp, data, pad):
    """V for every 4×4 tile of data (N, C, H, W) padded by pad, (16, C, rows·tiles·N), and
    the grid of tiles: rows, and tiles a row."""
    split = split_columns(xp, data, pad)
    rows, tiles = split.shape[1] // 2 - 1, split.shape[3] - 1
    return transform_tiles(xp, split, rows, tiles), rows, tiles


def convolution(xp, data, weight, pad):
    """The 3×3, stride-1 convolution of data (N, C, H, W): (F, OH, OW, N), batch-last."""
    f = weight.shape[0]
    v, rows, tiles = input_tiles(xp, data, pad)
    m = xp.matmul(transform_filters(xp, weight), v)
    out = xp.empty((f, rows, 2, tiles, 2, data.shape[0]), m.dtype)
    untransform_tiles(xp, m.reshape(4, 4, f, rows, tiles, -1), out)
    return out.reshape(f, 2 * rows, 2 * tiles, -1)


def a_into(xp, out, y0, y1):
    """The adjoint of Aᵀ along one axis, two output rows' gradients into M's four rows:
    y0, y0 + y1, y0 − y1, −y1."""
    out[0] = y0
    xp.add(y0, y1, out=out[1])
    xp.subtract(y0, y1, out=out[2])
    xp.negative(y1, out=out[3])


def tiles_gradient(xp, g):
    """dM = A dY Aᵀ for every tile of the output's gradient g (F, OH, OW, N), batch-last:
    (16, F, rows·tiles·N)."""
    f, oh, ow, n = g.shape
    tiled = g.reshape(f, oh // 2, 2, ow // 2, 2, n)
    d_m = xp.empty((4, 4, f, oh // 2, ow // 2, n), g.dtype)

    def filters(start, stop):
        part = xp.ascontiguousarray(tiled[start:stop].transpose(2, 4, 0, 1, 3, 5))
        along_rows = xp.empty((4,) + part.shape[1:], g.dtype)
        a_into(xp, along_rows, *part)
        for i, r in enumerate(along_rows):
            a_into(xp, d_m[i, :, start:stop], *r)
    pieces.over_axis(xp, f, d_m.nbytes, filters)
    return d_m.reshape(16, f, -1)


def convolution_vjp(xp, g, data, weight, pad, needs_data):
    """The weight's gradient from the output's g (F, OH, OW, N), batch-last, by the adjoint
    of each step in reverse order (16 products, transposed); the input's (where needed) as the
    convolution of g with the filters turned around, which is again a 3×3 convolution."""
    v = input_tiles(xp, data, pad)[0]
    d_u = xp.matmul(tiles_gradient(xp, g), v.transpose(0, 2, 1))
    d_data = None
    if needs_data:
        turned = weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
        d_data = convolution(xp, g.transpose(3, 0, 1, 2), turned, (2 - pad[0], 2 - pad[1]))
        d_data = d_data.transpose(3, 0, 1, 2)
    return d_data, filters_gradient(xp, d_u, weight)
