"""cuDNN's convolutions against im2col on gpu(0): errors and times, one row a case.

    python3 tests/cudnn_check.py        # what `tests/gpu_check.py` runs as its cudnn step

For ResNet-18's layer shapes and a few odd ones, in float32 (strict, then TF32) and float16,
the forward pass, the data gradient and the weight gradient are computed through cuDNN
graphs and by im2col (`cudnn.off()`), each compared with im2col in float64 on the same GPU:
the largest error over the largest reference value. Times are CUDA-event times of the three
passes, the median of a few runs, on the GPU's current stream. It exits 1 when convolutions
did not run through cuDNN or an error is over its bound, so a GPU lease shows at once
whether the graphs work. Nothing here is timed against PyTorch: benchmarks/ does that.
"""
import os
import pathlib
import statistics
import sys

import numpy

# (name, batch, channels, side, filters, kernel, stride, pad)
RESNET18 = [('conv1 7x7/2', 16, 3, 224, 64, 7, 2, 3), ('layer1 3x3', 16, 64, 56, 64, 3, 1, 1),
            ('layer2 3x3/2', 16, 64, 56, 128, 3, 2, 1), ('layer2 1x1/2', 16, 64, 56, 128, 1, 2, 0),
            ('layer4 3x3', 16, 512, 7, 512, 3, 1, 1), ('layer1 3x3 b128', 128, 64, 56, 64, 3, 1, 1)]
ODD = [('odd 2x3', 3, 5, (9, 7), 4, (2, 3), (2, 1), (1, 0))]
# (dtype, CUPY_TF32, the bound on cuDNN's error relative to the largest reference value)
MODES = [('float32', '0', 1e-4), ('float32', '1', 1e-2), ('float16', '0', 1e-2)]


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


def main():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import d2lperf as d2l
    from d2lperf.ops import cudnn
    if not d2l.num_gpus():
        print('no GPU: nothing compared')      # left out, as a benchmark's GPU rows are
        return 0
    rows = compare(d2l.gpu(0), RESNET18 + ODD)
    print(f'cuDNN settings: {cudnn.settings()}')
    print(table(rows))
    return 0 if rows and all(r['ok'] for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
