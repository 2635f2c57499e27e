"""cuDNN's convolutions against im2col, and its fused attention against the tiles and the
whole matrix, on gpu(0): errors and times, one row a case.

    python3 tests/cudnn_check.py        # what `tests/gpu_check.py` runs as its cudnn step
    python3 tests/cudnn_check.py attention batch_norm     # some sections (or convolution)

For ResNet-18's layer shapes and a few odd ones, in float32 (strict, then TF32) and float16,
the forward pass, the data gradient and the weight gradient are computed through cuDNN
graphs and by im2col (`cudnn.off()`), each compared with im2col in float64 on the same GPU:
the largest error over the largest reference value. Times are CUDA-event times of the three
passes, the median of a few runs, on the GPU's current stream. It exits 1 when convolutions
did not run through cuDNN or an error is over its bound, so a GPU lease shows at once
whether the graphs work. Nothing here is timed against PyTorch: benchmarks/ does that.

Attention, in float16 (cuDNN's fused attention has no float32; CuPy no bfloat16), for the
GPT at 12 layers × 768 (12 heads of 64, sequence 1024, batch 8), causal and not: the output
and the gradients of q, k and v through cuDNN's sdpa and sdpa_backward, through the tiles of
cuBLAS products (`cudnn.off()`), and by the whole (seq, seq) matrix as the GPT computes it
today, each against the whole matrix in float64; times of forward and backward together.
The upstream gradient has a nonzero column for L too, as the ring attention's merge gives.

Batch normalization in training, in float32, at ResNet-18's shapes: the output, the running
statistics and the three gradients through cuDNN's batchnorm and batchnorm_backward and
through CuPy (`cudnn.off()`), each against CuPy in float64; times of forward and backward.
"""
import os
import pathlib
import statistics
import sys
import traceback

import numpy

# (name, batch, channels, side, filters, kernel, stride, pad)
RESNET18 = [('conv1 7x7/2', 16, 3, 224, 64, 7, 2, 3), ('layer1 3x3', 16, 64, 56, 64, 3, 1, 1),
            ('layer2 3x3/2', 16, 64, 56, 128, 3, 2, 1), ('layer2 1x1/2', 16, 64, 56, 128, 1, 2, 0),
            ('layer4 3x3', 16, 512, 7, 512, 3, 1, 1), ('layer1 3x3 b128', 128, 64, 56, 64, 3, 1, 1)]
ODD = [('odd 2x3', 3, 5, (9, 7), 4, (2, 3), (2, 1), (1, 0))]
# (dtype, CUPY_TF32, the bound on cuDNN's error relative to the largest reference value)
MODES = [('float32', '0', 1e-4), ('float32', '1', 1e-2), ('float16', '0', 1e-2)]
# (name, batch, heads, seq, head width, causal)
GPT_ATTENTION = [('GPT 12x768 causal', 8, 12, 1024, 64, True),
                 ('GPT 12x768 full', 8, 12, 1024, 64, False)]
ODD_ATTENTION = [('odd attention', 2, 3, 40, 16, True)]
ATTENTION_BOUND = 1e-2        # float16: the largest error over the largest reference value
# (name, batch, channels, sides or None for (N, C)): each of ResNet-18's 20 batch norms has one
RESNET18_BATCH_NORM = [('bn1 112x112', 16, 64, 112), ('layer1', 16, 64, 56),
                       ('layer2', 16, 128, 28), ('layer3', 16, 256, 14), ('layer4', 16, 512, 7),
                       ('layer1 b128', 128, 64, 56)]
ODD_BATCH_NORM = [('odd', 3, 5, (7, 3)), ('dense (N, C)', 6, 10, None)]
BATCH_NORM_BOUND = 1e-5


def pair(v):
    return tuple(v) if isinstance(v, tuple) else (v, v)


def passes(xp, x, w, g, kernel, stride, pad):
    """Forward, data gradient and weight gradient by whichever road is on."""
    from d2lperf.ops import convolution
    args = (kernel, stride, pad, len(w))
    y = convolution.convolution(xp, x, w, None, *args)
    d_x, d_w, _ = convolution.convolution_vjp(xp, g, y, x, w, None, *args)
    return y, d_x, d_w


def milliseconds(xp, run, repeats):
    stream, times = xp.cuda.get_current_stream(), []
    for _ in range(repeats):
        start = stream.record()
        run()
        end = stream.record()
        end.synchronize()
        times.append(xp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def relative_errors(got, want):
    return [float(abs(a.astype('float64') - b).max() / max(float(abs(b).max()), 1e-30))
            for a, b in zip(got, want)]


def compare(device, cases, modes=MODES, repeats=5):
    """One row a (case, mode): relative errors of cuDNN and of im2col, times, within bound."""
    from d2lperf.ops import cudnn
    xp, rows = device.xp, []
    with xp.cuda.Device(device.index):
        for name, n, c, side, f, kernel, stride, pad in cases:
            kernel, stride, pad, sides = pair(kernel), pair(stride), pair(pad), pair(side)
            rng = numpy.random.default_rng(0)
            x = rng.normal(size=(n, c) + sides)
            w = rng.normal(size=(f, c) + kernel) / numpy.sqrt(c * kernel[0] * kernel[1])
            grid = tuple((s + 2 * p - k) // t + 1 for s, k, t, p in zip(sides, kernel, stride, pad))
            g = rng.normal(size=(n, f) + grid)
            with cudnn.off():
                exact = passes(xp, *(xp.asarray(a) for a in (x, w, g)), kernel, stride, pad)
            for dtype, tf32, bound in modes:
                os.environ['CUPY_TF32'] = tf32        # read by cuDNN's graphs as they are built
                x_d, w_d, g_d = (xp.asarray(a.astype(dtype)) for a in (x, w, g))
                run = lambda: passes(xp, x_d, w_d, g_d, kernel, stride, pad)  # noqa: E731
                built = cudnn.settings()['graphs']
                errors = relative_errors(run(), exact)
                by_cudnn = cudnn.settings()['graphs'] == built + 3   # its three, all new
                cudnn_ms = milliseconds(xp, run, repeats)
                with cudnn.off():
                    im2col_errors = relative_errors(run(), exact)
                    im2col_ms = milliseconds(xp, run, repeats)
                rows.append({'case': name, 'dtype': dtype, 'tf32': tf32 == '1',
                             'errors': errors, 'im2col_errors': im2col_errors,
                             'cudnn_ms': cudnn_ms, 'im2col_ms': im2col_ms,
                             'ok': by_cudnn and max(errors) <= bound})
    os.environ.pop('CUPY_TF32', None)
    return rows


def table(rows):
    lines = ['| case | dtype | errors cuDNN (fwd, dgrad, wgrad) | errors im2col | ms cuDNN | '
             'ms im2col | ok |', '|---|---|---|---|--:|--:|---|']
    for r in rows:
        errors, im2col = (', '.join(f'{e:.1e}' for e in r[k]) for k in ('errors', 'im2col_errors'))
        dtype = r['dtype'] + (' TF32' if r['tf32'] else '')
        lines.append(f"| {r['case']} | {dtype} | {errors} | {im2col} | {r['cudnn_ms']:.3f} | "
                     f"{r['im2col_ms']:.3f} | {'ok' if r['ok'] else 'FAILED'} |")
    return '\n'.join(lines)


def whole_matrix(xp, q, k, v, g, causal):
    """out, dq, dk, dv through the whole (seq, seq) matrix of scores, as the GPT's attention
    computes them (nn/transformer.py: products, a masked softmax, a product), in q's dtype."""
    scale = 1 / numpy.sqrt(q.shape[-1])
    scores = (q @ xp.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if causal:
        seq = q.shape[-2]
        scores = xp.where(xp.triu(xp.ones((seq, seq), bool), 1), -numpy.inf, scores)
    p = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    d_p = g @ xp.swapaxes(v, -1, -2)
    d_scores = p * (d_p - (d_p * p).sum(axis=-1, keepdims=True)) * q.dtype.type(scale)
    return (p @ v, d_scores @ k, xp.swapaxes(d_scores, -1, -2) @ q,
            xp.swapaxes(p, -1, -2) @ g)


def attention_passes(xp, q, k, v, g, causal):
    """out, dq, dk, dv by the attention op (cuDNN's, or the tiles inside `cudnn.off()`)."""
    from d2lperf.ops import attention
    packed = attention.attention(xp, q, k, v, causal)
    return (packed[..., :q.shape[-1]],) + attention.attention_vjp(xp, g, packed, q, k, v,
                                                                   causal)


def compare_attention(device, cases, repeats=5):
    """One row a case, in float16: relative errors of cuDNN, the tiles and the whole matrix
    against the whole matrix in float64, and their times (forward and backward)."""
    from d2lperf.ops import cudnn
    xp, rows = device.xp, []
    with xp.cuda.Device(device.index):
        for name, batch, heads, seq, width, causal in cases:
            rng = numpy.random.default_rng(1)
            q, k, v, g_out = (rng.normal(size=(batch, heads, seq, width)) for _ in range(4))
            g_log_sum_exp = rng.normal(size=(batch, heads, seq, 1))
            exact = whole_matrix(xp, *(xp.asarray(a) for a in (q, k, v, g_out)), causal)
            exact = exact[:1] + lse_gradients(xp, exact[1:], q, k, g_log_sum_exp, causal)
            half = [xp.asarray(a.astype('float16')) for a in (q, k, v, g_out)]
            packed_g = xp.asarray(numpy.concatenate([g_out, g_log_sum_exp], -1)
                                  .astype('float32'))
            fused = lambda: attention_passes(xp, *half[:3], packed_g, causal)  # noqa: E731
            built = cudnn.settings()['graphs']
            errors = relative_errors(fused(), exact)
            by_cudnn = cudnn.settings()['graphs'] == built + 2
            cudnn_ms = milliseconds(xp, fused, repeats)
            with cudnn.off():
                tiles_errors = relative_errors(fused(), exact)
                tiles_ms = milliseconds(xp, fused, max(1, repeats // 2))
            matrix = lambda: whole_matrix(xp, *half, causal)  # noqa: E731
            rows.append({'case': name, 'causal': causal, 'errors': errors,
                         'tiles_errors': tiles_errors, 'cudnn_ms': cudnn_ms,
                         'tiles_ms': tiles_ms, 'matrix_ms': milliseconds(xp, matrix, repeats),
                         'backward_ms': backward_ms(xp, half[:3], packed_g, causal, repeats),
                         'ok': by_cudnn and max(errors) <= ATTENTION_BOUND})
    return rows


def backward_ms(xp, qkv, g, causal, repeats):
    """(cuDNN's backward as the op runs it, with L's column; the same graph without it, v, o
    and dO of width d): what carrying L's gradient costs. None where cuDNN refused either."""
    from d2lperf.ops import attention, cudnn
    q, k, v = qkv
    width = q.shape[-1]
    packed = attention.attention(xp, q, k, v, causal)
    with_l = milliseconds(xp, lambda: attention.attention_vjp(xp, g, packed, q, k, v, causal),
                          repeats)
    arrays = (q, k, v, packed[..., :width].astype(q.dtype), g[..., :width].astype(q.dtype),
              xp.ascontiguousarray(packed[..., width:])) + tuple(xp.empty_like(a)
                                                                for a in (q, k, v))
    graph = cudnn.attention_graph(xp, 'sdpa_backward', arrays, causal, width)
    if graph is None:
        return None
    return with_l, milliseconds(xp, lambda: cudnn.run(xp, graph, arrays), repeats)


def lse_gradients(xp, grads, q, k, g_log_sum_exp, causal):
    """The whole matrix's dq, dk, dv with L's gradient added: dL/dS = P, so dS gains
    P · dL (scaled), and dv nothing. In float64."""
    dq, dk, dv = grads
    q, k, d_l = (xp.asarray(a) for a in (q, k, g_log_sum_exp))
    scale = 1 / numpy.sqrt(q.shape[-1])
    scores = (q @ xp.swapaxes(k, -1, -2)) * scale
    if causal:
        seq = q.shape[-2]
        scores = xp.where(xp.triu(xp.ones((seq, seq), bool), 1), -numpy.inf, scores)
    p = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    d_scores = p * d_l * scale
    return dq + d_scores @ k, dk + xp.swapaxes(d_scores, -1, -2) @ q, dv


def attention_table(rows):
    lines = ['| case | errors cuDNN (out, dq, dk, dv) | errors tiles | ms cuDNN | ms tiles | '
             'ms whole matrix | ms cuDNN backward, with L / without | ok |',
             '|---|---|---|--:|--:|--:|--:|---|']
    for r in rows:
        errors, tiles = (', '.join(f'{e:.1e}' for e in r[k]) for k in ('errors', 'tiles_errors'))
        backward = ('refused' if r['backward_ms'] is None
                    else ' / '.join(f'{t:.3f}' for t in r['backward_ms']))
        lines.append(f"| {r['case']} | {errors} | {tiles} | {r['cudnn_ms']:.3f} | "
                     f"{r['tiles_ms']:.3f} | {r['matrix_ms']:.3f} | {backward} | "
                     f"{'ok' if r['ok'] else 'FAILED'} |")
    return '\n'.join(lines)


def batch_norm_passes(xp, x, g, params, eps=1e-5, momentum=0.9):
    """out, running mean and variance (updated from copies of params' own), d_data, d_gamma,
    d_beta by whichever road is on."""
    from d2lperf.ops import convolution
    gamma, beta, mean, var = (p.copy() for p in params)
    out = convolution.batch_norm_train(xp, x, gamma, beta, mean, var, eps, momentum)
    grads = convolution.batch_norm_train_vjp(xp, g, out, x, gamma, beta, mean, var, eps,
                                             momentum)
    return (out, mean, var) + grads[:3]


def compare_batch_norm(device, cases, repeats=5):
    """One row a case, in float32: relative errors of cuDNN and of CuPy against CuPy in
    float64, and their times (forward and backward)."""
    from d2lperf.ops import cudnn
    xp, rows = device.xp, []
    with xp.cuda.Device(device.index):
        for name, n, c, sides in cases:
            shape = (n, c) + (pair(sides) if sides is not None else ())
            rng = numpy.random.default_rng(2)
            x, g = rng.normal(1.0, 2.0, size=shape), rng.normal(size=shape)
            params = [rng.uniform(0.5, 1.5, size=c) for _ in range(4)]
            with cudnn.off():
                exact = batch_norm_passes(xp, xp.asarray(x), xp.asarray(g),
                                          [xp.asarray(p) for p in params])
            x_d, g_d = (xp.asarray(a.astype('float32')) for a in (x, g))
            params_d = [xp.asarray(p.astype('float32')) for p in params]
            run = lambda: batch_norm_passes(xp, x_d, g_d, params_d)  # noqa: E731
            built = cudnn.settings()['graphs']
            errors = relative_errors(run(), exact)
            by_cudnn = cudnn.settings()['graphs'] == built + 2
            cudnn_ms = milliseconds(xp, run, repeats)
            with cudnn.off():
                cupy_errors = relative_errors(run(), exact)
                cupy_ms = milliseconds(xp, run, repeats)
            rows.append({'case': f'{name} {shape}', 'errors': errors,
                         'cupy_errors': cupy_errors, 'cudnn_ms': cudnn_ms, 'cupy_ms': cupy_ms,
                         'ok': by_cudnn and max(errors) <= BATCH_NORM_BOUND})
    return rows


def batch_norm_table(rows):
    lines = ['| case | errors cuDNN (out, running mean, var, d_data, d_gamma, d_beta) | '
             'errors CuPy | ms cuDNN | ms CuPy | ok |', '|---|---|---|--:|--:|---|']
    for r in rows:
        errors, cupy = (', '.join(f'{e:.1e}' for e in r[k]) for k in ('errors', 'cupy_errors'))
        lines.append(f"| {r['case']} | {errors} | {cupy} | {r['cudnn_ms']:.3f} | "
                     f"{r['cupy_ms']:.3f} | {'ok' if r['ok'] else 'FAILED'} |")
    return '\n'.join(lines)


def main():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import d2lperf as d2l
    from d2lperf.ops import cudnn
    if not d2l.num_gpus():
        print('no GPU: nothing compared')      # left out, as a benchmark's GPU rows are
        return 0
    sections = {
        'convolution': ('Convolutions, cuDNN against im2col:', compare, table, RESNET18 + ODD),
        'attention': ('Attention in float16, forward and backward:', compare_attention,
                      attention_table, GPT_ATTENTION + ODD_ATTENTION),
        'batch_norm': ('Batch normalization in training, float32, forward and backward:',
                       compare_batch_norm, batch_norm_table,
                       RESNET18_BATCH_NORM + ODD_BATCH_NORM)}
    chosen = sys.argv[1:] or list(sections)
    if set(chosen) - set(sections):
        print(f'unknown section(s) {sorted(set(chosen) - set(sections))}; '
              f'choose from {list(sections)}')
        return 2
    failed = False
    for title, compare_cases, show, cases in (sections[name] for name in chosen):
        print(f'\n{title}')
        try:              # one section failing to run leaves the others' tables to read
            rows = compare_cases(d2l.gpu(0), cases)
        except Exception:
            traceback.print_exc()
            failed = True
            continue
        print(show(rows))
        failed = failed or not all(r['ok'] for r in rows)
    print(f'cuDNN settings: {cudnn.settings()}; refused: {list(cudnn.state.refused.values())}')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
