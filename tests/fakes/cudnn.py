"""A stand-in for NVIDIA's cuDNN frontend (`import cudnn`), so that d2lperf's cuDNN paths for
convolutions and attention run on machines without a GPU.

It keeps the frontend's names (1.28's Python API: `pygraph`, `tensor`, `conv_fprop`,
`conv_dgrad`, `conv_wgrad`, `sdpa`, `sdpa_backward`, the build steps, `execute` with a
variant pack of device pointers and a workspace, `create_handle`, `set_stream`) and computes
each graph with NumPy as cuDNN does: NCHW dims with explicit strides, read and written
through the pointers it is given; cross-correlation with the padding, stride and dilation it
was told; attention with the scale and causal band it was told (no scale means 1), in
float32 from half inputs, the backward from the o and stats it is given. A wrong argument
gives a wrong value. A float32 graph whose tensor-core plans were not deselected rounds its
inputs to TF32 (a 10-bit mantissa), as tensor cores do. It records what a test checks: the
graphs built, each execution (handle, its stream, pointers, workspace), and it refuses the
graphs `refuse` names, as cuDNN may.

    fake = make_module()
    monkeypatch.setitem(sys.modules, 'cudnn', fake)   # `import cudnn` now finds it
"""
import ctypes
import enum
import types

import ml_dtypes
import numpy

data_type = enum.Enum('data_type', 'NOT_SET FLOAT HALF BFLOAT16 DOUBLE')
heur_mode = enum.Enum('heur_mode', 'A B FALLBACK')
diagonal_alignment = enum.Enum('diagonal_alignment', 'TOP_LEFT BOTTOM_RIGHT')
numerical_note = enum.Enum('numerical_note', 'TENSOR_CORE DOWN_CONVERT_INPUTS WINOGRAD FFT')
NUMPY_TYPES = {data_type.FLOAT: numpy.float32, data_type.HALF: numpy.float16,
               data_type.BFLOAT16: ml_dtypes.bfloat16, data_type.DOUBLE: numpy.float64}
# The compute types cuDNN takes for each I/O type (double only with double).
COMPUTE_TYPES = {data_type.FLOAT: {data_type.FLOAT}, data_type.HALF: {data_type.FLOAT},
                 data_type.BFLOAT16: {data_type.FLOAT}, data_type.DOUBLE: {data_type.DOUBLE}}


class cudnnGraphNotSupportedError(Exception):  # noqa: N801 - the frontend's name
    pass


class FakeHandle:
    def __init__(self):
        self.stream = 0                   # a fresh handle runs on the legacy default stream


class FakeTensor:
    def __init__(self, uid, dim, stride, dtype, name, virtual=False, by_value=False):
        self.uid, self.dim, self.stride, self.data_type = uid, dim, stride, dtype
        self.name, self.virtual, self.by_value = name, virtual, by_value

    def set_output(self, value):
        self.virtual = not value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, dtype):
        self.data_type = dtype
        return self

    def get_uid(self):
        return self.uid


def memory(pointer, tensor):
    """The tensor's values where `pointer` says, through its dims and strides (in elements)."""
    dtype = numpy.dtype(NUMPY_TYPES[tensor.data_type])
    extent = 1 + sum((d - 1) * s for d, s in zip(tensor.dim, tensor.stride))
    raw = numpy.ctypeslib.as_array((ctypes.c_uint8 * (extent * dtype.itemsize))
                                   .from_address(pointer))
    return numpy.lib.stride_tricks.as_strided(
        raw.view(dtype), tensor.dim, [s * dtype.itemsize for s in tensor.stride])


def to_tf32(values):
    """float32 values rounded to TF32's 10-bit mantissa (to nearest), as tensor cores read them."""
    bits = values.astype(numpy.float32).view(numpy.uint32)
    return ((bits + numpy.uint32(0x1000)) & numpy.uint32(0xFFFFE000)).view(numpy.float32)


def windows(padded, kernel_offset, dilation, stride, grid):
    """The (N, C, OH, OW) inputs that kernel offset (r, s) meets in every output position."""
    (r, s), (dh, dw), (sh, sw), (oh, ow) = kernel_offset, dilation, stride, grid
    return padded[:, :, r * dh:r * dh + sh * (oh - 1) + 1:sh, s * dw:s * dw + sw * (ow - 1) + 1:sw]


def output_grid(image_dims, filter_dims, pad, stride, dilation):
    return tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, p, s, d in
                 zip(image_dims[2:], filter_dims[2:], pad, stride, dilation))


def pad_image(x, pad):
    return numpy.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2))


def conv_fprop(x, w, pad, stride, dilation):
    grid = output_grid(x.shape, w.shape, pad, stride, dilation)
    padded, y = pad_image(x, pad), numpy.zeros(x.shape[:1] + w.shape[:1] + grid)
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            y += numpy.einsum('ncij,fc->nfij', windows(padded, (r, s), dilation, stride, grid),
                              w[:, :, r, s])
    return y


def conv_dgrad(dy, w, x_dims, pad, stride, dilation):
    if output_grid(x_dims, w.shape, pad, stride, dilation) != dy.shape[2:]:
        raise RuntimeError(f'CUDNN_STATUS_BAD_PARAM: dx dims {x_dims} do not give dy {dy.shape}')
    padded = numpy.zeros(pad_image(numpy.zeros(x_dims), pad).shape)
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            windows(padded, (r, s), dilation, stride, dy.shape[2:])[...] += numpy.einsum(
                'nfij,fc->ncij', dy, w[:, :, r, s])
    return padded[:, :, pad[0]:pad[0] + x_dims[2], pad[1]:pad[1] + x_dims[3]]


def conv_wgrad(x, dy, w_dims, pad, stride, dilation):
    if output_grid(x.shape, w_dims, pad, stride, dilation) != dy.shape[2:]:
        raise RuntimeError(f'CUDNN_STATUS_BAD_PARAM: dw dims {w_dims} do not give dy {dy.shape}')
    padded, dw = pad_image(x, pad), numpy.zeros(w_dims)
    for r in range(w_dims[2]):
        for s in range(w_dims[3]):
            dw[:, :, r, s] = numpy.einsum('ncij,nfij->fc', windows(padded, (r, s), dilation,
                                                                   stride, dy.shape[2:]), dy)
    return dw


class FakeGraph:
    """One convolution graph: described, planned, built, then executed any number of times."""

    def __init__(self, fake, io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None, handle=None, name='test_graph', **unused):
        self.fake, self.io, self.handle = fake, io_data_type, handle
        self.compute = compute_data_type
        self.tensors, self.kind, self.stage, self.excluded = [], None, 'described', set()
        fake.attempts.append(self)

    def tensor(self, dim, stride=None, data_type=None, is_virtual=False, is_pass_by_value=False,
               name='', **unused):
        t = FakeTensor(len(self.tensors) + 1, list(dim), list(stride), data_type or self.io, name,
                       by_value=is_pass_by_value)
        self.tensors.append(t)
        return t

    def conv_fprop(self, image, weight, padding=(), stride=(), dilation=(), compute_data_type=None,
                   name=''):
        return self.convolution('fprop', image, weight, padding, stride, dilation,
                                compute_data_type)

    def conv_dgrad(self, loss, filter, padding=(), stride=(), dilation=(),  # noqa: A002
                   compute_data_type=None, name=''):
        return self.convolution('dgrad', loss, filter, padding, stride, dilation,
                                compute_data_type)

    def conv_wgrad(self, image, loss, padding=(), stride=(), dilation=(), compute_data_type=None,
                   name=''):
        return self.convolution('wgrad', image, loss, padding, stride, dilation,
                                compute_data_type)

    def convolution(self, kind, a, b, padding, stride, dilation, compute_data_type):
        self.operation(kind, (a, b), compute_data_type)
        self.geometry = tuple(map(tuple, (padding, stride, dilation)))
        dims = (a.dim[:1] + b.dim[:1] + list(output_grid(a.dim, b.dim, *self.geometry))
                if kind == 'fprop' else None)          # a gradient's dims must be given
        return self.made(dims, self.io, kind)

    def sdpa(self, q, k, v, generate_stats=None, attn_scale=None, compute_data_type=None,
             name='', **masks):
        """cuDNN's fused attention: out (dims of q, width of v) and, with generate_stats,
        each row's log-sum-exp of the scaled scores in float32."""
        self.operation('sdpa', (q, k, v), compute_data_type)
        self.attention = attention_attributes(attn_scale, masks)
        out = self.made(q.dim[:3] + v.dim[3:], self.io, 'o')
        return [out, self.made(q.dim[:3] + [1], data_type.FLOAT, 'stats')
                if generate_stats else None]

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None,  # noqa: N803 - its names
                      compute_data_type=None, name='', **masks):
        self.operation('sdpa_backward', (q, k, v, o, dO, stats), compute_data_type)
        self.attention = attention_attributes(attn_scale, masks)
        return [self.made(t.dim, self.io, f'd{t.name}') for t in (q, k, v)]

    def batchnorm(self, input, scale, bias, in_running_mean, in_running_var,  # noqa: A002
                  epsilon, momentum, peer_stats=(), compute_data_type=None, name=''):
        """Training's batch norm: the output, the batch's mean and inverse deviation, and the
        next running mean and variance, (1 - momentum)·previous + momentum·batch."""
        self.operation('batchnorm', (input, scale, bias, in_running_mean, in_running_var,
                                     epsilon, momentum), compute_data_type)
        stats = [1, input.dim[1], 1, 1]
        return [self.made(input.dim, self.io, 'y')] + [
            self.made(stats, None, name) for name in ('mean', 'inv_variance',
                                                      'next_running_mean', 'next_running_var')]

    def batchnorm_backward(self, grad, input, scale, mean, inv_variance,  # noqa: A002
                           peer_stats=(), compute_data_type=None, name=''):
        self.operation('batchnorm_backward', (grad, input, scale, mean, inv_variance),
                       compute_data_type)
        return [self.made(input.dim, self.io, 'dx'), self.made(scale.dim, None, 'dscale'),
                self.made(scale.dim, None, 'dbias')]

    def operation(self, kind, inputs, compute_data_type):
        assert self.kind is None, 'this fake holds one operation a graph'
        self.kind, self.inputs, self.outputs = kind, inputs, []
        self.op_compute = compute_data_type or self.compute

    def made(self, dims, dtype, name):
        """A new output tensor of the operation: virtual until set_output(True)."""
        t = FakeTensor(len(self.tensors) + 1, dims, None, dtype, name, virtual=True)
        self.tensors.append(t)
        self.outputs.append(t)
        return t

    @property
    def output(self):
        return self.outputs[0]

    def advance(self, before, after):
        if self.stage != before:
            raise RuntimeError(f'{after} called on a graph that is {self.stage}, not {before}')
        self.stage = after

    def validate(self):
        for y in self.outputs:
            if y.virtual or y.dim is None or y.stride is None:
                raise RuntimeError(f'the {self.kind} output {y.name} needs set_output, dims '
                                   'and strides')
        if self.op_compute not in COMPUTE_TYPES[self.io]:
            raise cudnnGraphNotSupportedError(f'{self.io} with compute {self.op_compute}')
        if self.kind.startswith('sdpa'):
            check_attention(self)
        elif self.kind.startswith('batchnorm'):
            check_norm(self)
        elif any(len(v) != 2 for v in self.geometry):
            raise cudnnGraphNotSupportedError(f'geometry {self.geometry}')
        self.advance('described', 'validated')

    def build_operation_graph(self):
        assert isinstance(self.handle, FakeHandle), 'the graph was made without a handle'
        self.advance('validated', 'lowered')

    def create_execution_plans(self, modes):
        self.modes = list(modes)
        self.advance('lowered', 'planned')

    def deselect_numeric_notes(self, notes):
        if self.stage != 'planned':           # the C++ frontends filter existing plans only
            raise RuntimeError('deselect_numeric_notes before create_execution_plans')
        self.excluded.update(notes)

    def check_support(self):
        message = self.fake.refuse(self)
        if message:
            raise cudnnGraphNotSupportedError(message)
        self.advance('planned', 'supported')

    def build_plans(self, *args, **kwargs):
        self.advance('supported', 'built')
        self.fake.built.append(self)

    def get_workspace_size(self):
        if self.stage != 'built':
            raise RuntimeError('Call build() first')
        return 256 * (1 + list(METHODS).index(self.kind)) + 4 * len(self.tensors)

    @property
    def tf32(self):
        return self.io == data_type.FLOAT and numerical_note.TENSOR_CORE not in self.excluded

    def execute(self, variant_pack, workspace, handle=None):
        if self.stage != 'built':
            raise RuntimeError('execute called before build')
        handle = handle or self.handle
        pointers = {(key if isinstance(key, int) else key.get_uid()): value
                    for key, value in variant_pack.items()}
        assert set(pointers) == {t.uid for t in self.tensors}, 'a tensor of the graph is unbound'
        assert all(isinstance(p, int) for p in pointers.values()) and isinstance(workspace, int)
        size = self.get_workspace_size()
        self.fake.executions.append(types.SimpleNamespace(
            graph=self, handle=handle, stream=handle.stream, pointers=pointers,
            workspace=workspace, workspace_size=size))
        ctypes.memset(workspace, 0xFF, size)           # cuDNN's scratch: its bytes are its own
        if self.kind.startswith('sdpa'):       # half inputs, accumulated in float32
            values = [numpy.array(memory(pointers[t.uid], t), numpy.float32)
                      for t in self.inputs]
            results = METHODS[self.kind](*values, *self.attention)
        elif self.kind.startswith('batchnorm'):  # every input read before any output is written
            values = [numpy.array(memory(pointers[t.uid], t), numpy.float64)
                      for t in self.inputs]
            results = METHODS[self.kind](*values)
        else:
            a, b = (numpy.array(memory(pointers[t.uid], t), numpy.float64) for t in self.inputs)
            if self.tf32:
                a, b = to_tf32(a), to_tf32(b)
            results = [METHODS[self.kind](a, b, self.output.dim, *self.geometry)]
        for y, result in zip(self.outputs, results):
            if result.shape != tuple(y.dim):
                raise RuntimeError(f'CUDNN_STATUS_BAD_PARAM: {self.kind} gives {result.shape}, '
                                   f'its output tensor {y.name} has dims {y.dim}')
            memory(pointers[y.uid], y)[...] = result.astype(NUMPY_TYPES[y.data_type])


def attention_attributes(attn_scale, masks):
    """(scale, causal) from sdpa's arguments: no scale means 1, as in cuDNN; causal is the
    band that ends at the diagonal, top-left aligned. Other masks are not faked."""
    alignment = masks.pop('diagonal_alignment', diagonal_alignment.TOP_LEFT)
    right_bound = masks.pop('diagonal_band_right_bound', None)
    if any(value not in (None, False) for value in masks.values()):
        raise NotImplementedError(f'the fake has no {sorted(masks)}')
    if right_bound not in (None, 0) or (right_bound == 0 and alignment is not
                                        diagonal_alignment.TOP_LEFT):
        raise NotImplementedError(f'the fake has no band {alignment}, {right_bound}')
    return (1.0 if attn_scale is None else attn_scale), right_bound == 0


def check_attention(graph):
    """cuDNN's rules for fused attention (Hopper's): half types, head dims in multiples of 8
    up to 256, stats in float32."""
    q, k, v = graph.inputs[:3]
    if graph.io not in (data_type.HALF, data_type.BFLOAT16):
        raise cudnnGraphNotSupportedError(f'sdpa takes half types, not {graph.io}')
    if any(d % 8 or d > 256 for d in (q.dim[3], v.dim[3])) or k.dim[3] != q.dim[3]:
        raise cudnnGraphNotSupportedError(f'head dims {q.dim[3]}, {k.dim[3]}, {v.dim[3]}: '
                                          'multiples of 8, at most 256')
    stats = graph.inputs[5] if graph.kind == 'sdpa_backward' else graph.outputs[1]
    if stats is not None and stats.data_type != data_type.FLOAT:
        raise cudnnGraphNotSupportedError('stats are float32')


def probabilities(q, k, scale, causal, log_sum_exp=None):
    """softmax(scale · q kᵀ) with keys after their query masked, (P, each row's L); or, given
    L, exp(scores - L), as the backward recomputes it."""
    scores = scale * (q @ numpy.swapaxes(k, -1, -2))
    if causal:
        seq = scores.shape[-1]
        scores = numpy.where(numpy.triu(numpy.ones((seq, seq), bool), 1), -numpy.inf, scores)
    if log_sum_exp is None:
        top = scores.max(axis=-1, keepdims=True)
        log_sum_exp = top + numpy.log(numpy.exp(scores - top).sum(axis=-1, keepdims=True))
    return numpy.exp(scores - log_sum_exp), log_sum_exp


def sdpa_forward(q, k, v, scale, causal):
    p, log_sum_exp = probabilities(q, k, scale, causal)
    return p @ v, log_sum_exp


def sdpa_backward(q, k, v, o, d_o, stats, scale, causal):
    """From the recomputed P: dv = Pᵀ dO; dS = P ∘ (dO vᵀ - rowsum(dO ∘ o)) · scale;
    dq = dS k; dk = dSᵀ q. D comes from the o it is given, not from P v."""
    p, _ = probabilities(q, k, scale, causal, stats)
    d_scores = p * (d_o @ numpy.swapaxes(v, -1, -2) - (d_o * o).sum(axis=-1, keepdims=True))
    d_scores *= scale
    return (d_scores @ k, numpy.swapaxes(d_scores, -1, -2) @ q,
            numpy.swapaxes(p, -1, -2) @ d_o)


def check_norm(graph):
    """cuDNN's rules as the fake keeps them: 4-D data, statistics (1, C, 1, 1) in float32
    (its outputs' types must be set), epsilon and momentum by value (batchnorm)."""
    data = graph.inputs[1] if graph.kind == 'batchnorm_backward' else graph.inputs[0]
    channels = [1, data.dim[1], 1, 1]
    statistics = [t for t in graph.inputs + tuple(graph.outputs)
                  if t.dim == channels or t.by_value]
    if len(data.dim) != 4 or any(t.data_type != data_type.FLOAT for t in statistics):
        raise cudnnGraphNotSupportedError(f'{graph.kind}: 4-D data, float32 statistics')
    by_value = {t.name for t in graph.inputs if t.by_value}
    if graph.kind == 'batchnorm' and by_value != {graph.inputs[5].name, graph.inputs[6].name}:
        raise cudnnGraphNotSupportedError('epsilon and momentum are passed by value')
    if graph.fake.layouts is not None and tuple(data.stride) not in graph.fake.layouts(data):
        raise cudnnGraphNotSupportedError(f'{graph.kind}: no engine for strides {data.stride}')


def batchnorm_forward(x, scale, bias, running_mean, running_var, epsilon, momentum):
    axes, n = (0, 2, 3), x.size // x.shape[1]
    mean, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    inverse = 1 / numpy.sqrt(var + epsilon)
    m = momentum.item()
    return ((x - mean) * inverse * scale + bias, mean, inverse,
            (1 - m) * running_mean + m * mean, (1 - m) * running_var + m * var * n / (n - 1))


def batchnorm_backward(dy, x, scale, mean, inverse):
    axes, n = (0, 2, 3), x.size // x.shape[1]
    x_hat = (x - mean) * inverse
    d_bias, d_scale = dy.sum(axis=axes, keepdims=True), (dy * x_hat).sum(axis=axes, keepdims=True)
    return scale * inverse * (dy - d_bias / n - x_hat * d_scale / n), d_scale, d_bias


METHODS = {'fprop': lambda x, w, dims, *geometry: conv_fprop(x, w, *geometry),
           'dgrad': conv_dgrad, 'wgrad': conv_wgrad, 'sdpa': sdpa_forward,
           'sdpa_backward': sdpa_backward, 'batchnorm': batchnorm_forward,
           'batchnorm_backward': batchnorm_backward}


class FakeFrontend(types.ModuleType):
    """The frontend's names, with a fresh record of graphs and executions per `make_module`."""

    def __init__(self, version='1.28.0'):
        super().__init__('cudnn')
        self.__version__ = version
        self.data_type, self.heur_mode, self.numerical_note = data_type, heur_mode, numerical_note
        self.diagonal_alignment = diagonal_alignment
        self.cudnnGraphNotSupportedError = cudnnGraphNotSupportedError
        self.attempts, self.built, self.executions, self.handles = [], [], [], []
        self.refuse = lambda graph: None          # a test sets it to refuse some graphs
        self.layouts = None      # or data -> the strides batch norm takes, as an engine may

    def pygraph(self, *args, **kwargs):
        return FakeGraph(self, *args, **kwargs)

    def create_handle(self):
        self.handles.append(FakeHandle())
        return self.handles[-1]

    def set_stream(self, handle, stream):
        assert isinstance(handle, FakeHandle) and isinstance(stream, int)
        handle.stream = stream

    def backend_version(self):
        return 91000

    def backend_version_string(self):
        return '9.10.0'


def make_module(version='1.28.0'):
    """A fresh stand-in that answers to `import cudnn` once put in sys.modules."""
    return FakeFrontend(version)
