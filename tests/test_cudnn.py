"""Tests of d2lperf.ops.cudnn: convolutions on a GPU through cuDNN graphs, on fake GPUs
(tests/fakes/cupy.py) and a fake cuDNN frontend (tests/fakes/cudnn.py) that computes each
graph with NumPy from the dims, strides and geometry it was given.

The forward pass and both gradients equal the NumPy path's; a graph is built once per key
and reused; the tensors, the workspace and the stream reach execute; TF32 follows CUPY_TF32
and NVIDIA_TF32_OVERRIDE; `off()` gives im2col; without the frontend, or where cuDNN refuses
a graph, im2col gives the values and a warning says so once. The GPU lease's side is checked
here too: tests/cudnn_check.py on the fakes, and tests/gpu_check.py's carried wheel and the
cuDNN runtime it puts on each step's library path."""
import importlib.util
import os
import platform
import subprocess
import sys
import warnings
import zipfile

import numpy
import pytest
from hypothesis import assume, given, strategies as st

import d2lperf as d2l
from d2lperf import autograd, np, npx
from d2lperf.ops import convolution, cudnn
import cudnn_check
import gpu_check
from fakes import cudnn as fake_cudnn, cupy as fake_cupy
from strategies import checks


def batch_last_view(x):
    """x (N, C, H, W) on the fake GPU, laid out (C, H, W, N) as im2col's results are."""
    return fake_cupy.on_device(numpy.ascontiguousarray(x.transpose(1, 2, 3, 0))).transpose(
        3, 0, 1, 2)


def on_gpu(x, batch_last):
    return batch_last_view(x) if batch_last else fake_cupy.on_device(x)


def both_roads(case, dtype, batch_last=False):
    """(forward, d_data, d_weight, d_bias) on the fake GPU and by NumPy, for one case."""
    shape, filters, kernel, stride, pad, seed = case
    rng = numpy.random.default_rng(seed)
    x, w = rng.normal(size=shape).astype(dtype), rng.normal(size=(filters, shape[1]) + kernel)
    w, b = w.astype(dtype), rng.normal(size=filters).astype(dtype)
    args = (kernel, stride, pad, filters)
    out = convolution.convolution(numpy, x, w, b, *args)
    g = rng.normal(size=out.shape).astype(dtype)
    want = (out,) + convolution.convolution_vjp(numpy, g, out, x, w, b, *args)
    cupy = sys.modules['cupy']
    x_gpu, w_gpu, b_gpu = on_gpu(x, batch_last), fake_cupy.on_device(w), fake_cupy.on_device(b)
    y = convolution.convolution(cupy, x_gpu, w_gpu, b_gpu, *args)
    got = (y,) + convolution.convolution_vjp(cupy, on_gpu(g, batch_last), y, x_gpu, w_gpu,
                                             b_gpu, *args)
    return [numpy.asarray(v) for v in got], want


@st.composite
def conv_cases(draw):
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    pad = (draw(st.integers(0, kernel[0] - 1)), draw(st.integers(0, kernel[1] - 1)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)),
             draw(st.integers(kernel[0], 7)), draw(st.integers(kernel[1], 7)))
    return shape, draw(st.integers(1, 4)), kernel, stride, pad, draw(st.integers(0, 2**16))


TOLERANCE = {'float32': 2e-5, 'float64': 1e-12}


@checks(40)
@given(conv_cases(), st.sampled_from(['float32', 'float64']), st.booleans())
def test_forward_and_both_gradients_equal_the_numpy_path(frontend, case, dtype, batch_last):
    before = len(frontend.executions)
    got, want = both_roads(case, dtype, batch_last)
    for name, g, w in zip(('forward', 'd_data', 'd_weight', 'd_bias'), got, want):
        assert g.dtype == w.dtype, name
        numpy.testing.assert_allclose(g, w, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                      err_msg=name)
    assert [e.graph.kind for e in frontend.executions[before:]] == ['fprop', 'dgrad', 'wgrad']


def test_half_precision_graphs_compute_in_float32(frontend):
    got, want = both_roads(((2, 3, 6, 6), 4, (3, 3), (1, 1), (1, 1), 0), 'float16')
    for g, w in zip(got, want):
        assert g.dtype == numpy.float16
        numpy.testing.assert_allclose(g.astype(float), w.astype(float), rtol=2e-2, atol=5e-2)
    assert {(g.io, g.op_compute) for g in frontend.built} == {
        (fake_cudnn.data_type.HALF, fake_cudnn.data_type.FLOAT)}


def test_a_graph_is_built_once_per_key_and_reused(frontend):
    case = ((2, 3, 6, 6), 4, (3, 3), (1, 1), (1, 1), 0)
    for _ in range(3):
        both_roads(case, 'float32')
    assert [g.kind for g in frontend.built] == ['fprop', 'dgrad', 'wgrad']
    assert len(frontend.executions) == 9
    assert {e.graph for e in frontend.executions} == set(frontend.built)
    both_roads(((3,) + case[0][1:],) + case[1:], 'float32')             # a new batch size
    both_roads(case, 'float64')                                          # a new dtype
    both_roads(case[:3] + ((2, 2),) + case[4:], 'float32')               # a new stride
    assert len(frontend.built) == 12 and len(frontend.attempts) == 12
    assert cudnn.settings()['graphs'] == 12


def test_execute_gets_the_tensors_a_workspace_and_the_streams_of_each_gpu(frontend):
    cupy = sys.modules['cupy']
    rng = numpy.random.default_rng(1)
    x, w = rng.normal(size=(2, 3, 5, 5)), rng.normal(size=(4, 3, 3, 3))
    for gpu in (0, 1):
        cupy.cuda.Device(gpu).use()
        stream = cupy.cuda.Stream(non_blocking=True).use()
        x_gpu, w_gpu = fake_cupy.on_device(x), fake_cupy.on_device(w)
        y = cudnn.forward(cupy, x_gpu, w_gpu, (1, 1), (0, 0))
        run = frontend.executions[-1]
        assert run.handle is run.graph.handle is cudnn.state.handles[gpu]   # built there
        assert run.stream == stream.ptr != 0
        a, b, out = run.graph.tensors
        assert (run.pointers[a.uid], run.pointers[b.uid], run.pointers[out.uid]) == (
            x_gpu.data.ptr, w_gpu.data.ptr, y.data.ptr)
        space = cudnn.state.workspaces[(gpu, stream.ptr)]
        assert run.workspace == space.data.ptr and space.nbytes >= run.workspace_size > 0
    assert len(frontend.handles) == 2 and set(cudnn.state.handles) == {0, 1}
    cupy.cuda.Device(0).use()


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_a_convolution_net_on_a_gpu_runs_through_cudnn_on_its_lane_stream(frontend, hybridize):
    """Through the engine, imperative or compiled: each graph runs on the stream of gpu(0)'s
    compute lane, and the loss and gradients equal cpu(0)'s."""
    x = numpy.random.default_rng(2).uniform(size=(4, 1, 8, 8)).astype('float32')
    net = d2l.nn.HybridSequential()
    net.add(d2l.nn.Conv2D(3, kernel_size=3, padding=1, activation='relu'), d2l.nn.MaxPool2D(2),
            d2l.nn.Conv2D(4, kernel_size=2, strides=2), d2l.nn.Flatten(), d2l.nn.Dense(3))
    net.initialize(d2l.nn.init.Normal(0.5), device=[d2l.cpu(0), d2l.gpu(0)])
    net.hybridize(hybridize)
    results = []
    for device in (d2l.cpu(0), d2l.gpu(0)):
        with autograd.record():
            loss = (net(np.array(x, device=device)) ** 2).sum()
        loss.backward()
        results.append([loss.asnumpy()] + [p.grad(device).asnumpy()
                                           for p in net.collect_params().values()])
    for cpu, gpu in zip(*results):
        numpy.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-5)
    kinds = sorted(e.graph.kind for e in frontend.executions)
    assert kinds == ['dgrad', 'fprop', 'fprop', 'wgrad', 'wgrad']     # no data gradient of x
    assert len({e.stream for e in frontend.executions}) == 1
    assert frontend.executions[0].stream not in (0, None)


def deviation_from_float64(frontend, monkeypatch, environment):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    rng = numpy.random.default_rng(3)
    x, w = rng.normal(size=(2, 8, 6, 6)), rng.normal(size=(4, 8, 3, 3))
    y = cudnn.forward(sys.modules['cupy'], fake_cupy.on_device(x.astype('float32')),
                      fake_cupy.on_device(w.astype('float32')), (1, 1), (1, 1))
    exact = fake_cudnn.conv_fprop(x, w, (1, 1), (1, 1), (1, 1))
    return numpy.abs(numpy.asarray(y) - exact).max() / numpy.abs(exact).max()


def test_float32_is_strict_unless_cupy_tf32_and_nvidia_tf32_override_allow_tf32(frontend,
                                                                               monkeypatch):
    assert not cudnn.settings()['tf32']
    assert deviation_from_float64(frontend, monkeypatch, {}) < 1e-6
    assert deviation_from_float64(frontend, monkeypatch, {'CUPY_TF32': '1'}) > 1e-4
    assert cudnn.settings()['tf32']
    assert deviation_from_float64(frontend, monkeypatch, {'NVIDIA_TF32_OVERRIDE': '0'}) < 1e-6
    assert not cudnn.settings()['tf32']
    assert len(frontend.built) == 2            # the math mode is part of the key
    strict, tf32 = frontend.built
    assert fake_cudnn.numerical_note.DOWN_CONVERT_INPUTS in strict.excluded & tf32.excluded


def test_off_gives_im2col_for_the_work_pushed_inside_it(frontend):
    rng = numpy.random.default_rng(4)
    x, w = rng.normal(size=(2, 3, 6, 6)), rng.normal(size=(4, 3, 3, 3))

    def convolve():
        return npx.convolution(np.array(x, device=d2l.gpu(0)), np.array(w, device=d2l.gpu(0)),
                               kernel=(3, 3), num_filter=4)
    by_cudnn = convolve()
    with cudnn.off():
        assert cudnn.settings()['convolutions'] == 'im2col'
        by_im2col = convolve()
    by_im2col.wait_to_read()
    assert len(frontend.executions) == 1 and cudnn.settings()['convolutions'] == 'cudnn'
    numpy.testing.assert_allclose(by_im2col.asnumpy(), by_cudnn.asnumpy(), rtol=1e-12)
    convolve().wait_to_read()
    assert len(frontend.executions) == 2


def warnings_of(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = run()
    return result, [str(w.message) for w in caught if w.category is RuntimeWarning]


@pytest.mark.parametrize('missing', ['frontend', 'runtime'])
def test_without_the_frontend_or_its_runtime_im2col_gives_the_values_and_says_so_once(
        frontend, monkeypatch, missing):
    if missing == 'frontend':
        monkeypatch.setitem(sys.modules, 'cudnn', None)      # `import cudnn` fails
    else:
        def no_library():
            raise RuntimeError('Unable to find symbol cudnnCreate')
        monkeypatch.setattr(frontend, 'create_handle', no_library)
    case = ((2, 3, 6, 6), 4, (3, 3), (2, 1), (1, 0), 5)
    (got, want), said = warnings_of(lambda: [both_roads(case, 'float32') for _ in range(2)][0])
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    assert len(said) == 1 and "pip install 'd2lperf[gpu]'" in said[0]
    assert ('does not import' if missing == 'frontend' else 'no cuDNN runtime') in said[0]
    assert not cudnn.available() and cudnn.settings()['convolutions'] == 'im2col'
    assert frontend.executions == []


def test_a_refused_graph_is_remembered_and_its_key_runs_by_im2col(frontend):
    frontend.refuse = lambda graph: 'no engine' if graph.kind == 'wgrad' else None
    case = ((2, 3, 6, 6), 4, (3, 3), (1, 1), (1, 1), 6)
    (got, want), said = warnings_of(lambda: [both_roads(case, 'float32') for _ in range(3)][0])
    for g, w in zip(got, want):
        numpy.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    assert len(said) == 1 and 'refused' in said[0] and 'no engine' in said[0]
    # fprop and dgrad were built once each, wgrad tried once; the gradients came from im2col
    assert [g.kind for g in frontend.attempts] == ['fprop', 'dgrad', 'wgrad']
    assert [e.graph.kind for e in frontend.executions] == ['fprop'] * 3
    assert cudnn.settings()['refused'] == 1


def test_settings_say_which_road_and_which_versions(frontend):
    assert cudnn.available()
    assert cudnn.settings() == {'convolutions': 'cudnn', 'frontend': '1.28.0',
                                'backend': '9.10.0', 'tf32': False, 'graphs': 0, 'refused': 0}


# -- the fake itself: cuDNN's semantics, so that the tests above mean something --------------

def loop_convolution(x, w, pad, stride, dilation):
    """The definition of cuDNN's cross-correlation, one output value at a time."""
    padded = fake_cudnn.pad_image(x, pad)
    grid = fake_cudnn.output_grid(x.shape, w.shape, pad, stride, dilation)
    out = numpy.zeros(x.shape[:1] + w.shape[:1] + grid)
    for index in numpy.ndindex(out.shape):
        n, f, i, j = index
        rows = slice(i * stride[0], i * stride[0] + dilation[0] * (w.shape[2] - 1) + 1, dilation[0])
        cols = slice(j * stride[1], j * stride[1] + dilation[1] * (w.shape[3] - 1) + 1, dilation[1])
        out[index] = (padded[n, :, rows, cols] * w[f]).sum()
    return out


@checks(20)
@given(conv_cases(), st.integers(1, 2))
def test_the_fake_computes_cudnns_convolutions_through_the_strides_it_is_given(case, dilation):
    shape, filters, kernel, stride, pad, seed = case
    rng = numpy.random.default_rng(seed)
    dilation = (dilation, dilation)
    x, w = rng.normal(size=shape), rng.normal(size=(filters, shape[1]) + kernel)
    grid = fake_cudnn.output_grid(x.shape, w.shape, pad, stride, dilation)
    assume(min(grid) >= 1)
    want = loop_convolution(x, w, pad, stride, dilation)
    fake = fake_cudnn.make_module()
    graph = fake.pygraph(io_data_type=fake.data_type.DOUBLE, handle=fake.create_handle(),
                         compute_data_type=fake.data_type.DOUBLE)
    image = numpy.ascontiguousarray(x.transpose(1, 2, 3, 0))             # batch-last memory
    strides = [s // 8 for s in image.transpose(3, 0, 1, 2).strides]
    a = graph.tensor(dim=list(x.shape), stride=strides, data_type=fake.data_type.DOUBLE)
    b = graph.tensor(dim=list(w.shape), stride=[s // 8 for s in w.strides])
    y = graph.conv_fprop(image=a, weight=b, padding=list(pad), stride=list(stride),
                         dilation=list(dilation))
    out = numpy.zeros(want.shape)
    y.set_output(True).set_dim(list(out.shape)).set_stride([s // 8 for s in out.strides])
    for step in ('validate', 'build_operation_graph'):
        getattr(graph, step)()
    graph.create_execution_plans([fake.heur_mode.A])
    graph.check_support()
    graph.build_plans()
    space = numpy.zeros(graph.get_workspace_size(), numpy.uint8)
    graph.execute({a: image.ctypes.data, b: w.ctypes.data, y: out.ctypes.data},
                  space.ctypes.data)
    numpy.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)
    # the gradients are the forward's adjoints: <dgrad(r), x'> = <r, fprop(x')>, and so for w
    r, other_x, other_w = rng.normal(size=want.shape), rng.normal(size=x.shape), rng.normal(
        size=w.shape)
    geometry = (pad, stride, dilation)
    numpy.testing.assert_allclose(
        (fake_cudnn.conv_dgrad(r, w, x.shape, *geometry) * other_x).sum(),
        (r * loop_convolution(other_x, w, *geometry)).sum(), rtol=1e-9, atol=1e-9)
    numpy.testing.assert_allclose(
        (fake_cudnn.conv_wgrad(x, r, w.shape, *geometry) * other_w).sum(),
        (r * loop_convolution(x, other_w, *geometry)).sum(), rtol=1e-9, atol=1e-9)


def test_the_gpu_check_compares_cudnn_with_im2col_and_fails_where_cudnn_is_not_used(frontend):
    """tests/cudnn_check.py, as a GPU lease runs it, on the fake GPU and frontend."""
    cases = cudnn_check.ODD + [('small 3x3', 2, 4, 6, 3, 3, 1, 1)]
    rows = cudnn_check.compare(d2l.gpu(0), cases, repeats=2)
    assert [(r['case'], r['dtype'], r['tf32']) for r in rows] == [
        (name, dtype, tf32 == '1') for name, *_ in cases for dtype, tf32, _ in cudnn_check.MODES]
    assert all(r['ok'] for r in rows), cudnn_check.table(rows)
    strict, tf32, half = (max(r['errors']) for r in rows[:3])
    assert strict < 1e-6 < 1e-4 < tf32 and half < 1e-2
    assert len(frontend.built) == 3 * len(rows)
    with cudnn.off():
        rows = cudnn_check.compare(d2l.gpu(0), cases[:1], repeats=1)
    assert not any(r['ok'] for r in rows) and 'FAILED' in cudnn_check.table(rows)


def test_a_carried_frontend_wheel_is_unpacked_onto_every_steps_path(tmp_path, monkeypatch):
    """tests/gpu_check.py on a machine with no package index: the wheel for this Python,
    carried in .gpu-wheels/, is unpacked under _build/ and put on each step's PYTHONPATH."""
    assert gpu_check.frontend_requirement() == 'nvidia-cudnn-frontend==1.28.0'
    tag = f'cp{sys.version_info.major}{sys.version_info.minor}'
    monkeypatch.setattr(gpu_check, 'ROOT', tmp_path)
    monkeypatch.setattr(gpu_check, 'WHEELS', tmp_path / '.gpu-wheels')
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name: None if name == 'cudnn' else real_find_spec(name))
    assert gpu_check.carried_frontend() is None                  # nothing carried
    gpu_check.WHEELS.mkdir()
    for python in (tag, 'cp39'):
        name = f'nvidia_cudnn_frontend-1.28.0-{python}-{python}-manylinux_2_28_{platform.machine()}'
        with zipfile.ZipFile(gpu_check.WHEELS / f'{name}.whl', 'w') as wheel:
            wheel.writestr('cudnn/__init__.py', f'python = {python!r}\n')
    where = gpu_check.carried_frontend()
    assert (where / 'cudnn' / '__init__.py').read_text() == f'python = {tag!r}\n'
    assert where.parent == tmp_path / '_build' / 'gpu-wheels'
    status, output, _ = gpu_check.run(
        [sys.executable, '-c', 'import cudnn; print(cudnn.python)'], 60, True, 'probe')
    assert status == 0 and output.strip() == tag
    assert f'| `cudnn` | `nvidia-cudnn-frontend' in '\n'.join(gpu_check.requirements_table())
    assert f'carried ({where.name})' in '\n'.join(gpu_check.requirements_table())


def test_each_step_finds_the_cudnn_runtime_pip_installed_for_pytorch(tmp_path, monkeypatch):
    library = tmp_path / 'nvidia' / 'cudnn' / 'lib'
    library.mkdir(parents=True)
    (library / 'libcudnn.so.9').write_bytes(b'')
    monkeypatch.setattr(gpu_check.sysconfig, 'get_path', lambda name: str(tmp_path))
    monkeypatch.setenv('LD_LIBRARY_PATH', '/opt/elsewhere')
    assert gpu_check.cudnn_runtime_dirs() == [str(library)]
    status, output, _ = gpu_check.run(
        [sys.executable, '-c', 'import os; print(os.environ["LD_LIBRARY_PATH"])'], 60, True, 'p')
    assert status == 0 and output.strip() == f'{library}{os.pathsep}/opt/elsewhere'


@pytest.mark.skipif(not d2l.num_gpus() or not cudnn.available(),
                    reason='runs where a GPU is here and the cuDNN frontend imports')
def test_on_a_real_gpu_cudnn_agrees_with_im2col():
    rows = cudnn_check.compare(d2l.gpu(0), cudnn_check.ODD, repeats=1)
    assert all(r['ok'] for r in rows), cudnn_check.table(rows)


DESCRIBE_WITH_THE_REAL_FRONTEND = '''
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import cudnn as module
from d2lperf.ops import cudnn as ours
image, weight, out = ((2, 3, 6, 6), (18, 36, 6, 1)), ((4, 3, 3, 3), (27, 9, 3, 1)), \\
    ((2, 4, 4, 4), (64, 16, 4, 1))
q, stats = ((2, 3, 16, 64), (3072, 1024, 64, 1)), ((2, 3, 16, 1), (48, 16, 1, 1))
wide = ((2, 3, 16, 72), (3456, 1152, 72, 1))
x, c, s = ((4, 8, 5, 5), (200, 25, 5, 1)), ((1, 8, 1, 1), (8, 1, 1, 1)), ((1,) * 4, (1,) * 4)
graphs = {
    'fprop': lambda: ours.build(module, None, 'fprop', (image, weight, out), 'float32',
                                (1, 1), (0, 0), False),
    'dgrad': lambda: ours.build(module, None, 'dgrad', (out, weight, image), 'float16',
                                (1, 1), (0, 0), False),
    'wgrad': lambda: ours.build(module, None, 'wgrad', (image, out, weight), 'float32',
                                (1, 1), (0, 0), True),
    'sdpa': lambda: ours.build_attention(module, None, 'sdpa', (q, q, q, q, stats),
                                         'float16', True, 0.125),
    'sdpa_backward': lambda: ours.build_attention(
        module, None, 'sdpa_backward', (q, q, wide, wide, wide, stats, q, q, wide), 'float16',
        False, 0.125),
    'batchnorm': lambda: ours.build_norm(module, None, 'batchnorm',
                                         (x, c, c, c, c, s, s, x, c, c, c, c), 'float32'),
    'batchnorm_backward': lambda: ours.build_norm(module, None, 'batchnorm_backward',
                                                  (x, x, c, c, c, x, c, c), 'float32')}
for kind, describe in graphs.items():
    try:
        describe()
        print(kind, 'built')
    except Exception as err:
        print(kind, type(err).__name__, str(err).splitlines()[0] if str(err) else '')
'''


def test_the_real_frontend_accepts_every_graph_description(tmp_path):
    """The carried nvidia-cudnn-frontend wheel, on a machine without cuDNN's runtime: each
    graph d2lperf builds (convolutions, attention, batch norm) is described, checked by the
    frontend's own Python side, and stops only where it looks for the library: the tensors,
    outputs and (for convolutions and batch norm) the argument names the fakes accept, the
    real frontend accepts too. sdpa's keyword arguments are handed on unchecked to the C++
    binding, which needs the library: its names are those of 1.28's docstrings."""
    where = gpu_check.carried_frontend()
    if where is None:
        pytest.skip('no frontend wheel carried in .gpu-wheels/ for this Python')
    done = subprocess.run([sys.executable, '-c', DESCRIBE_WITH_THE_REAL_FRONTEND, str(where),
                           str(gpu_check.ROOT)], capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert len(lines) == 7, done.stdout + done.stderr
    if any(line.endswith(' built') for line in lines):
        pytest.skip('cuDNN runtime found: the GPU checks build these graphs for real')
    for line in lines:
        assert 'cudnnCreate' in line or 'libcudnn' in line, line
