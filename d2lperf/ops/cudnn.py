"""Convolutions and attention through cuDNN graphs on a GPU: the library the frameworks call,
beside im2col and the tiles of attention.py.

im2col (convolution.py) teaches the idea: every patch a column, one product. On a GPU it
writes those columns to device memory and reads them back; cuDNN's implicit GEMM forms them
on chip and never stores them. With NVIDIA's cuDNN frontend (`import cudnn`, the package
`nvidia-cudnn-frontend` of the `gpu` extra), a convolution's forward pass, its data gradient
and its weight gradient each run as a cuDNN graph: described once per key (the op, each
tensor's dims and strides, the dtype, the stride, padding and dilation, the math mode),
built once (cuDNN's heuristics pick an engine), kept with the workspace it needs, and
executed on the CUDA stream the op runs on. `convolution.py` asks here first and takes
im2col where the answer is None: inside `off()`, where the frontend or cuDNN's runtime is
missing (said once), or where cuDNN refuses a graph (remembered, so never built again).

Attention in float16 runs as cuDNN's fused attention (`sdpa`, `sdpa_backward`) the same way,
cached by the same rules, where attention.py asks; float32 attention never does. Batch
normalization in training, in float32, runs as cuDNN's `batchnorm` and `batchnorm_backward`.

    available()      whether convolutions on a GPU can go through cuDNN here
    settings()       the frontend's and cuDNN's versions, TF32 or not: benchmarks print it
    with off(): ...  im2col and tiles on the GPU meanwhile, so both can be timed side by side
    forward(...), gradients(...)    the convolution graphs, as convolution.py calls them
    attention_forward(...), attention_backward(...)    the attention graphs, for attention.py
    batch_norm_forward(...), batch_norm_backward(...)  batch norm's, for convolution.py

The convolutions of "Training on Multiple GPUs" run here on a GPU; tests/cudnn_check.py
checks and times them against im2col, and attention against the tiles, on a GPU lease.
"""
import collections
import contextlib
import importlib
import math
import os
import threading
import warnings

import numpy

from .. import engine
from ..device import num_gpus

INSTALL = ("pip install 'd2lperf[gpu]' installs both the frontend and cuDNN's runtime "
           "(nvidia-cudnn-frontend, nvidia-cudnn-cu12; '[gpu-cuda13]' for CUDA 13)")
# cuDNN's name for each dtype its graphs take, and the type they accumulate in: float32 for
# the 16-bit types too, as the frameworks do.
DATA_TYPES = {'float16': ('HALF', 'FLOAT'), 'bfloat16': ('BFLOAT16', 'FLOAT'),
              'float32': ('FLOAT', 'FLOAT'), 'float64': ('DOUBLE', 'DOUBLE')}
DILATION = (1, 1)              # d2lperf's convolutions are not dilated; the graphs are told
# Each graph: the frontend's method, and the names of its two inputs.
METHODS = {'fprop': ('conv_fprop', 'image', 'weight'), 'dgrad': ('conv_dgrad', 'loss', 'filter'),
           'wgrad': ('conv_wgrad', 'image', 'loss')}

Graph = collections.namedtuple('Graph', 'graph tensors workspace_size')


class State:
    """What this process knows of cuDNN: the frontend (None where it does not import, with
    why), the graphs built and the keys refused, a handle per GPU, a workspace per stream."""

    def __init__(self):
        self.tried, self.frontend, self.missing = False, None, None
        self.graphs, self.refused = {}, {}          # key -> Graph; key -> cuDNN's message
        self.handles, self.workspaces = {}, {}      # GPU -> handle; (GPU, stream) -> bytes
        self.off, self.warned = 0, set()
        self.lock = threading.RLock()


state = State()


def frontend():
    """The `cudnn` module, imported on first use; None where it does not import."""
    with state.lock:
        if not state.tried:
            state.tried = True
            try:
                state.frontend = importlib.import_module('cudnn')
            except Exception as err:      # not installed, or its library failed as it loaded
                state.missing = (f'the cuDNN frontend does not import '
                                 f'({type(err).__name__}: {err})')
    return state.frontend


def available():
    """Whether a convolution on a GPU can run through cuDNN here: the frontend imports and
    a GPU is visible (cuDNN's runtime itself is looked for when the first handle is made)."""
    return frontend() is not None and not state.missing and num_gpus() > 0


def tf32_allowed():
    """TF32 for float32 convolutions, only where CuPy's products take it too: CUPY_TF32=1,
    and never under NVIDIA_TF32_OVERRIDE=0 (which cuDNN obeys by itself as well). Read as a
    graph is built, and part of its key: strict FP32 is the default."""
    return (os.environ.get('CUPY_TF32', '0') == '1'
            and os.environ.get('NVIDIA_TF32_OVERRIDE') != '0')


def settings():
    """What a GPU benchmark prints beside its rows: which road convolutions take, the
    frontend's and cuDNN's versions, TF32 or not, graphs built and graphs refused."""
    module = frontend()
    return {'convolutions': 'cudnn' if available() and not state.off else 'im2col',
            'frontend': getattr(module, '__version__', None), 'backend': backend_version(),
            'tf32': tf32_allowed(), 'graphs': len(state.graphs), 'refused': len(state.refused)}


def backend_version():
    try:
        return state.frontend.backend_version_string()
    except Exception:      # no frontend, or no cuDNN runtime for it to ask
        return None


@contextlib.contextmanager
def off():
    """Convolutions on the GPU by im2col, attention by tiles, batch norm by CuPy, meanwhile:
    exactly those pushed inside the block, since the work pushed before it and inside it is
    waited for."""
    engine.wait_all()
    with state.lock:
        state.off += 1
    try:
        yield
        engine.wait_all()
    finally:
        with state.lock:
            state.off -= 1


def warn_once(topic, message):
    with state.lock:
        if topic in state.warned:
            return
        state.warned.add(topic)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# -- the three graphs, as convolution.py calls them ------------------------------------------
# cuDNN's engines take packed NCHW tensors (and NHWC), not the batch-last views im2col's
# results are: such an input is copied to NCHW first (`ascontiguousarray`: one read and one
# write of it, nothing where it is NCHW already, as cuDNN's own results are). That copy is
# 1/(kh·kw) of the columns im2col would write; batch norm and pooling then read these NCHW
# results through their own batch-last copy.

def forward(xp, data, weight, stride, pad):
    """The convolution (N, F, OH, OW) by a cuDNN graph, or None where im2col must do it."""
    if not usable(xp, data, weight):
        return None
    x, w = xp.ascontiguousarray(data), xp.ascontiguousarray(weight)
    shape = x.shape[:1] + w.shape[:1] + tuple(
        (n + 2 * p - k) // s + 1 for n, k, s, p in zip(x.shape[2:], w.shape[2:], stride, pad))
    graph = graph_for(xp, 'fprop', (x, w), shape, stride, pad)
    return None if graph is None else execute(xp, graph, (x, w), shape)


def gradients(xp, g, data, weight, stride, pad, needs=(True, True)):
    """(d_data, d_weight) by cuDNN graphs, None for one not needed; None where im2col must
    give both (one graph refused means both come from im2col's shared columns)."""
    if not usable(xp, g, data, weight):
        return None
    g = xp.ascontiguousarray(g)
    wanted = [('dgrad', lambda: (g, xp.ascontiguousarray(weight)), data.shape, needs[0]),
              ('wgrad', lambda: (xp.ascontiguousarray(data), g), weight.shape, needs[1])]
    runs = [(kind, inputs(), shape) for kind, inputs, shape, needed in wanted if needed]
    graphs = [graph_for(xp, kind, inputs, shape, stride, pad) for kind, inputs, shape in runs]
    if None in graphs:
        return None
    done = {kind: execute(xp, graph, inputs, shape)
            for (kind, inputs, shape), graph in zip(runs, graphs)}
    return done.get('dgrad'), done.get('wgrad')


def usable(xp, *arrays):
    """Whether these arrays' convolution may go through cuDNN: not inside `off()`, one
    dtype that cuDNN's graphs take, and a handle for this GPU (the first try warns once
    where the frontend or cuDNN's runtime is missing)."""
    dtype = arrays[0].dtype
    if state.off or dtype.name not in DATA_TYPES or any(a.dtype != dtype for a in arrays):
        return False
    return handle(xp) is not None


def handle(xp):
    """This GPU's cuDNN handle, made on first use with the GPU current; None (said once)
    where the frontend or cuDNN's runtime is missing."""
    made = None
    if frontend() is not None and not state.missing:
        device = xp.cuda.runtime.getDevice()
        made = state.handles.get(device)
        if made is None:
            with state.lock:
                try:
                    if device not in state.handles:
                        state.handles[device] = state.frontend.create_handle()
                except Exception as err:   # the frontend loads, but finds no cuDNN library
                    state.missing = f'the cuDNN frontend finds no cuDNN runtime ({err})'
                made = state.handles.get(device)
    if made is None:
        warn_once('missing', f'convolutions, attention and batch norm on the GPU run without '
                             f'cuDNN (by im2col, tiles of cuBLAS products and CuPy): '
                             f'{state.missing}. {INSTALL}')
    return made


def packed_strides(shape):
    """The strides (in elements) of a C-contiguous array: NCHW for images, KCRS for filters."""
    strides, step = [], 1
    for side in reversed(shape):
        strides.insert(0, step)
        step *= side
    return tuple(strides)


def graph_for(xp, kind, inputs, out_shape, stride, pad):
    """The built convolution graph of this key, or None where cuDNN refuses it."""
    dtype, tf32 = inputs[0].dtype.name, tf32_allowed()
    tensors = tuple((tuple(shape), packed_strides(shape))
                    for shape in (inputs[0].shape, inputs[1].shape, out_shape))
    key = (kind, xp.cuda.runtime.getDevice(), dtype, tensors, tuple(stride), tuple(pad),
           DILATION, tf32)
    said = (f'a convolution graph ({kind}, {dtype}, shapes {[t[0] for t in tensors]}, '
            f'stride {tuple(stride)}, pad {tuple(pad)})')
    return cached(xp, key, said, 'im2col', lambda: build(
        state.frontend, handle(xp), kind, tensors, dtype, stride, pad, tf32))


def cached(xp, key, said, fallback, make):
    """The built graph of `key`, made by `make()` on first use; None where cuDNN refuses it
    (said the first time for each fallback, and remembered so that it is never built again)."""
    built = state.graphs.get(key)
    if built is not None or key in state.refused:
        return built
    with state.lock:
        if key in state.graphs or key in state.refused:      # built while this thread waited
            return state.graphs.get(key)
        try:
            built = state.graphs[key] = make()
        except Exception as err:  # cudnnGraphNotSupportedError, or any failure to build:
            # a training step goes on by the fallback rather than stop on a graph
            state.refused[key] = f'{type(err).__name__}: {err}'
            warn_once(('refused', fallback),
                      f'cuDNN refused {said}: {state.refused[key]}. That key runs by '
                      f'{fallback} from now on; later refusals are counted in '
                      'cudnn.settings(), not said.')
    return built


def build(module, gpu_handle, kind, tensors, dtype, stride, pad, tf32):
    """Describe one convolution graph, let cuDNN's heuristics choose its engine, build it."""
    io, compute = (getattr(module.data_type, name) for name in DATA_TYPES[dtype])
    graph = module.pygraph(io_data_type=io, intermediate_data_type=compute,
                           compute_data_type=compute, handle=gpu_handle)
    method, first, second = METHODS[kind]
    a, b = (graph.tensor(dim=list(dims), stride=list(strides), data_type=io, name=name)
            for (dims, strides), name in zip(tensors, (first, second)))
    y = getattr(graph, method)(**{first: a, second: b}, padding=list(pad), stride=list(stride),
                               dilation=list(DILATION), compute_data_type=compute)
    # A gradient's dims cannot be inferred (a strided forward maps several input sizes onto
    # one output size), so every output's dims and strides are given.
    set_output(y, tensors[2], io)
    return finish(module, graph, (a, b, y), excluded_notes(module, dtype, tf32))


def set_output(tensor, layout, data_type):
    """Make a graph's tensor an output of these dims, strides and type. One setter a line:
    some frontends return a copy from a setter, so chaining would set the copy."""
    tensor.set_output(True)
    tensor.set_dim(list(layout[0]))
    tensor.set_stride(list(layout[1]))
    tensor.set_data_type(data_type)


def finish(module, graph, tensors, excluded=()):
    """Validate a described graph, let cuDNN's heuristics choose its engine, build it."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([module.heur_mode.A, module.heur_mode.FALLBACK])
    if excluded:                  # after the plans exist: older frontends filter only those
        graph.deselect_numeric_notes(list(excluded))
    graph.check_support()
    graph.build_plans()
    return Graph(graph, tensors, graph.get_workspace_size())


def excluded_notes(module, dtype, tf32):
    """Strict float32 leaves out the engines that compute on tensor cores (TF32 there) or
    convert their inputs down to 16 bits, as PyTorch does where TF32 is off; TF32 allows the
    first. The 16-bit types keep every engine."""
    if dtype != 'float32':
        return []
    notes = module.numerical_note
    return [notes.DOWN_CONVERT_INPUTS] + ([] if tf32 else [notes.TENSOR_CORE])


def execute(xp, built, inputs, out_shape):
    """Run a built convolution graph into a new output array."""
    out = xp.empty(out_shape, inputs[0].dtype)
    run(xp, built, inputs + (out,))
    return out


def run(xp, built, arrays):
    """Run a built graph on this thread's stream, its tensors bound in order to `arrays`."""
    device, stream = xp.cuda.runtime.getDevice(), xp.cuda.get_current_stream().ptr
    space = workspace(xp, device, stream, built.workspace_size)
    pointers = {tensor: address(array) for tensor, array in zip(built.tensors, arrays)}
    with state.lock:          # the GPU's one handle: its stream set and used in one step
        gpu_handle = state.handles[device]
        state.frontend.set_stream(handle=gpu_handle, stream=stream)
        built.graph.execute(pointers, space.data.ptr, handle=gpu_handle)


def address(array):
    """Where an array's values start: on the GPU, or on the host for a value a graph is
    handed by value (cuDNN reads those as it launches)."""
    return array.ctypes.data if type(array) is numpy.ndarray else array.data.ptr


def workspace(xp, device, stream, size):
    """One workspace per stream, grown to the largest graph's need. The buffer it replaces
    goes back to CuPy's pool for that stream, whose later allocations run after the kernels
    already queued there, as every temporary of a CuPy operation does."""
    key = (device, stream)
    space = state.workspaces.get(key)
    if space is None or space.nbytes < size:
        space = state.workspaces[key] = xp.empty(max(size, 1), xp.uint8)
    return space


# -- fused attention: cuDNN's sdpa and sdpa_backward, as attention.py calls them --------------
# cuDNN's fused attention takes half types only (float32 keeps attention.py's tiles of cuBLAS
# products), and head dims that are multiples of 8. Its forward also writes each row's
# log-sum-exp of the scaled scores ("stats", float32): the L the tiled op packs beside its
# output, so either road's (out, L) serves either road's backward.

ATTENTION_TYPES = ('float16', 'bfloat16')
SPARE = 8       # columns that carry L's gradient through sdpa_backward: a multiple of 8


def attention_forward(xp, q, k, v, causal):
    """(out, stats): out in q's dtype, stats (..., seq, 1) in float32, by a cuDNN sdpa graph;
    None where the tiles must do it."""
    if not attention_usable(xp, q, k, v):
        return None
    q, k, v = (aligned(xp, a) for a in (q, k, v))
    out = xp.empty(q.shape, q.dtype)
    stats = xp.empty(q.shape[:-1] + (1,), xp.float32)
    arrays = (q, k, v, out, stats)
    graph = attention_graph(xp, 'sdpa', arrays, causal, q.shape[-1])
    if graph is None:
        return None
    run(xp, graph, arrays)
    return out, stats


def attention_backward(xp, g, out, stats, q, k, v, causal):
    """(dq, dk, dv) in q's dtype by a cuDNN sdpa_backward graph, given the gradient g of the
    tiled op's packed output (out's, then L's: (..., seq, d + 1)); None where the tiles must.

    cuDNN takes no gradient for L, which the ring attention's merge gives. It rides through
    as a value column: with v' = [v, 1], dO' = [dO, dL] and o' = [o, 0], the backward's
    dP' = dO vᵀ + dL and its D' = rowsum(dO ∘ o) = D, so dS = P ∘ (dO vᵀ - D + dL), which is
    the gradient with L's part in it. dv is the first d columns of dv'. The spare columns
    are padded to SPARE, as cuDNN wants head dims in multiples of 8; g and out are cast to
    q's dtype anyway, so the padding costs one copy of v. Where cuDNN refuses a v wider than
    q and k, q and k are padded with zero columns too (their scores do not change), at one
    copy each."""
    if not attention_usable(xp, q, k, v):
        return None
    width, dtype = q.shape[-1], q.dtype
    wide = q.shape[:-1] + (width + SPARE,)
    v_wide, o_wide, g_wide = (xp.zeros(wide, dtype) for _ in range(3))
    v_wide[..., :width], v_wide[..., width] = v, 1
    o_wide[..., :width] = out
    g_wide[..., :width + 1] = g
    stats = xp.ascontiguousarray(stats)
    for pad in (aligned, widened):            # widened copies made only if asked for
        q_k = pad(xp, q), pad(xp, k)
        grads = tuple(xp.empty(a.shape, dtype) for a in q_k + (v_wide,))
        arrays = q_k + (v_wide, o_wide, g_wide, stats) + grads
        graph = attention_graph(xp, 'sdpa_backward', arrays, causal, width)
        if graph is not None:
            run(xp, graph, arrays)
            return tuple(d[..., :width] for d in grads)
    return None


def widened(xp, a):
    """a with SPARE columns of zeros after its own."""
    wide = xp.zeros(a.shape[:-1] + (a.shape[-1] + SPARE,), a.dtype)
    wide[..., :a.shape[-1]] = a
    return wide


def attention_usable(xp, q, k, v):
    """Whether this attention may go through cuDNN: a half type, head dims in multiples of
    8, not inside `off()`, and a handle for this GPU."""
    return (q.dtype.name in ATTENTION_TYPES and q.shape[-1] % 8 == 0
            and usable(xp, q, k, v))


def aligned(xp, array):
    """The array itself where cuDNN can read it through its strides (the last one 1, none
    negative or zero, the start 16-byte aligned), else a packed copy."""
    readable = (array.strides[-1] == array.itemsize and min(array.strides) > 0
                and array.data.ptr % 16 == 0)
    return array if readable else xp.ascontiguousarray(array)


def layout(array):
    """(dims, strides in elements): what a graph's tensor is told, and part of its key."""
    return tuple(array.shape), tuple(s // array.itemsize for s in array.strides)


def attention_graph(xp, kind, arrays, causal, width):
    """The built sdpa or sdpa_backward graph for these arrays' layouts, or None (refused).
    The width that sets the scale is part of the key: padded columns do not change it."""
    dtype, layouts = arrays[0].dtype.name, tuple(layout(a) for a in arrays)
    key = (kind, xp.cuda.runtime.getDevice(), dtype, layouts, bool(causal), width)
    said = (f'an attention graph ({kind}, {dtype}, q {layouts[0][0]}, '
            f'{"causal" if causal else "not causal"})')
    fallback = ('tiles of cuBLAS products' if kind == 'sdpa' else
                'q and k widened too where they were not, else tiles of cuBLAS products')
    return cached(xp, key, said, fallback, lambda: build_attention(
        state.frontend, handle(xp), kind, layouts, dtype, causal, 1 / math.sqrt(width)))


def build_attention(module, gpu_handle, kind, layouts, dtype, causal, scale):
    """Describe sdpa (q, k, v -> out, stats) or sdpa_backward (q, k, v, o, dO, stats -> dq,
    dk, dv) with the scale given (1/√d of the width before any padding), causal as a band
    that ends at the diagonal (top-left aligned: query i sees keys 0..i), and build it."""
    io, compute = (getattr(module.data_type, name) for name in DATA_TYPES[dtype])
    graph = module.pygraph(io_data_type=io, intermediate_data_type=compute,
                           compute_data_type=compute, handle=gpu_handle)
    names = ('q', 'k', 'v') if kind == 'sdpa' else ('q', 'k', 'v', 'o', 'dO', 'stats')
    given = [graph.tensor(dim=list(dims), stride=list(strides), name=name,
                          data_type=compute if name == 'stats' else io)
             for (dims, strides), name in zip(layouts, names)]
    mask = ({'diagonal_alignment': module.diagonal_alignment.TOP_LEFT,
             'diagonal_band_right_bound': 0} if causal else {})
    named = dict(zip(names, given), attn_scale=scale, compute_data_type=compute, **mask)
    if kind == 'sdpa':
        made = graph.sdpa(**named, generate_stats=True, name='attention')
    else:
        made = graph.sdpa_backward(**named, name='attention_backward')
    types = [io, compute] if kind == 'sdpa' else [io] * 3
    for tensor, where, data_type in zip(made, layouts[len(names):], types):
        set_output(tensor, where, data_type)
    return finish(module, graph, tuple(given) + tuple(made))


# -- batch normalization in training: cuDNN's batchnorm and batchnorm_backward ----------------
# d2lperf moves a running statistic as MXNet does, running = momentum·running + (1 -
# momentum)·batch; cuDNN's momentum is the weight of the batch, running = (1 - m)·running +
# m·batch. So cuDNN is told m = 1 - momentum. Both take the batch's unbiased variance for the
# running one (n/(n - 1) times the biased one the output is normalized with), so a batch of
# one value a channel stays on CuPy. Epsilon and m reach the graph by value at execution, so
# one graph serves every layer of a shape. float32 only, as ResNet-18 trains; the data is
# read in its own memory order where cuDNN takes that, else in NHWC (a copy).

def batch_norm_forward(xp, data, gamma, beta, running_mean, running_var, eps, momentum,
                       saved=None):
    """The normalized batch (data's shape, in data's memory order or NHWC) by a cuDNN
    batchnorm graph, with the running statistics updated in place and the batch's mean and
    inverse deviation kept in `saved` (when autograd records); None where CuPy must."""
    if not norm_usable(xp, data, gamma, beta, running_mean, running_var):
        return None
    channels = data.shape[1]
    for x in layouts_to_try(xp, image(data)):
        stats = [xp.empty(channels, xp.float32) for _ in range(2)]    # the batch's
        out = like(xp, x)
        arrays = (x, gamma, beta, running_mean, running_var, scalar(eps), scalar(1 - momentum),
                  out, *stats, running_mean, running_var)
        graph = norm_graph(xp, 'batchnorm', arrays)
        if graph is not None:
            run(xp, graph, arrays)
            if saved is not None:
                saved['mean'], saved['inv_std'] = stats
            return out.reshape(data.shape)
    return None


def batch_norm_backward(xp, g, data, gamma, eps, kept=None):
    """(d_data, d_gamma, d_beta) by a cuDNN batchnorm_backward graph; None where CuPy must.
    The batch's mean and inverse deviation are the forward pass's (`kept`), or are computed
    again here (two reductions) where it kept none."""
    if not norm_usable(xp, g, data, gamma):
        return None
    if kept:
        mean, inverse_deviation = kept
    else:
        axes = (0,) + tuple(range(2, data.ndim))
        mean = data.mean(axis=axes)
        inverse_deviation = 1 / xp.sqrt(data.var(axis=axes) + eps)
    for x in layouts_to_try(xp, image(data)):
        d_out = image(g)
        if d_out.strides != x.strides:                  # cuDNN reads both in one layout
            d_out = like(xp, x)
            d_out[...] = image(g)
        d_x, d_gamma, d_beta = like(xp, x), xp.empty_like(gamma), xp.empty_like(gamma)
        arrays = (d_out, x, gamma, mean, inverse_deviation, d_x, d_gamma, d_beta)
        graph = norm_graph(xp, 'batchnorm_backward', arrays)
        if graph is not None:
            run(xp, graph, arrays)
            return d_x.reshape(data.shape), d_gamma, d_beta
    return None


def norm_usable(xp, data, *others):
    """Whether this batch norm may go through cuDNN: float32 throughout, (N, C) or
    (N, C, H, W), more than one value a channel, not inside `off()`, a handle here."""
    return (data.dtype.name == 'float32' and data.ndim in (2, 4)
            and data.size > data.shape[1] and usable(xp, data, *others))


def image(x):
    """(N, C) as (N, C, 1, 1), a view: cuDNN's normalizations take 4-D tensors."""
    return x.reshape(x.shape + (1, 1)) if x.ndim == 2 else x


def layouts_to_try(xp, x):
    """x as it lies where it is a permutation of packed memory (NCHW, or the batch-last
    layout of im2col's results), then an NHWC copy, made only if asked for."""
    dense = sorted(zip(x.strides, x.shape))
    step = x.itemsize
    packed = True
    for stride, side in dense:
        packed = packed and (side == 1 or stride == step)
        step *= side
    if packed:
        yield x
    if not (packed and x.transpose(0, 2, 3, 1).flags.c_contiguous):     # NHWC already
        yield xp.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def like(xp, x):
    """A new array of x's shape and dtype, laid out in memory in x's order."""
    order = sorted(range(x.ndim), key=lambda axis: (-x.strides[axis], axis))
    new = xp.empty([x.shape[axis] for axis in order], x.dtype)
    return new.transpose([order.index(axis) for axis in range(x.ndim)])


def scalar(value):
    """A float32 on the host, handed to a graph by value (epsilon, momentum)."""
    return numpy.full((1, 1, 1, 1), value, numpy.float32)


def norm_graph(xp, kind, arrays):
    """The built batchnorm or batchnorm_backward graph for these layouts, or None."""
    layouts = tuple(layout(a if a.ndim == 4 else per_channel(a)) for a in arrays)
    key = (kind, xp.cuda.runtime.getDevice(), arrays[0].dtype.name, layouts)
    said = f'a batch norm graph ({kind}, {arrays[0].dtype.name}, layout {layouts[0]})'
    fallback = 'an NHWC copy where it was not NHWC, else CuPy'
    return cached(xp, key, said, fallback, lambda: build_norm(
        state.frontend, handle(xp), kind, layouts, arrays[0].dtype.name))


def per_channel(v):
    """A (C,) vector as cuDNN's (1, C, 1, 1) tensor."""
    return v.reshape(1, -1, 1, 1)


BATCHNORM_INPUTS = ('input', 'scale', 'bias', 'in_running_mean', 'in_running_var', 'epsilon',
                    'momentum')
BACKWARD_INPUTS = ('grad', 'input', 'scale', 'mean', 'inv_variance')


def build_norm(module, gpu_handle, kind, layouts, dtype):
    """Describe batchnorm (input, scale, bias, running mean and variance, epsilon and momentum
    by value -> output, the batch's mean and inverse deviation, the next running mean and
    variance) or batchnorm_backward (grad, input, scale, mean, inverse deviation -> d_input,
    d_scale, d_bias), every statistic in float32, and build it."""
    io, compute = (getattr(module.data_type, name) for name in DATA_TYPES[dtype])
    graph = module.pygraph(io_data_type=io, intermediate_data_type=compute,
                           compute_data_type=compute, handle=gpu_handle)
    names = BATCHNORM_INPUTS if kind == 'batchnorm' else BACKWARD_INPUTS
    given = [graph.tensor(dim=list(dims), stride=list(strides), name=name,
                          data_type=io if name in ('input', 'grad') else compute,
                          is_pass_by_value=name in ('epsilon', 'momentum'))
             for (dims, strides), name in zip(layouts, names)]
    made = getattr(graph, kind)(**dict(zip(names, given)), compute_data_type=compute,
                                name=kind)
    for i, (tensor, where) in enumerate(zip(made, layouts[len(names):])):
        set_output(tensor, where, io if i == 0 else compute)    # the statistics in float32
    return finish(module, graph, tuple(given) + tuple(made))
