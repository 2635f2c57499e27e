"""Training throughput: d2lperf against PyTorch and a hand-written NumPy floor, in one run.

    python benchmarks/training.py            # full sizes
    D2LPERF_QUICK=1 python benchmarks/training.py
    python benchmarks/training.py sharded memory      # only these sections
    python benchmarks/training.py gpu                 # every GPU row (gpu_lenet, gpu_resnet,
                                                      # gpu_gpt, gpu_memory, gpu_winograd)
    python benchmarks/training.py gpu_resnet --precision strict    # one precision's process

Rows, all measured side by side in this run:
* LeNet (the toy net of "Training on Multiple GPUs"), images per second at batch 256 on
  28×28 inputs for one training step (forward, backward, SGD): d2lperf imperative and
  hybridized, PyTorch eager with the same thread count (skipped without torch), and a
  hand-written NumPy im2col implementation, the floor any NumPy library pays. Each at one
  thread and at every core.
* Where the time of a d2lperf step goes, per kind of operation (the engine's records).
* The small GPT's passes (GELU, the causal softmax, layer norm) and steps with their large
  passes cut into pieces (`engine.pieces`) and whole, in turns in one process (`pieces`).
* Data parallelism: the same batch split over two virtual CPU devices with one BLAS thread
  each, against one device with every core (with its large operations in pieces, and whole).
* Past the source ("Data Parallelism at Scale"): one step of LeNet with Adam on four virtual
  devices, its gradients summed a parameter at a time during backward (the Trainer's way), in
  64 KiB buckets, flat after backward, and with ZeRO stages 1-3 (stage 3 a unit at a time, with
  the next unit gathered ahead or not), each against the first, with the step's peak memory
  on the first device.
* Memory ("Memory"): one training step of a deep MLP with Adam in float32, in float16 and
  bfloat16 (multi_precision, and for float16 the loss scaler), and with its layers
  recomputed in √L segments (`autograd.checkpoint`), each with its peak memory beside its time.
* The small GPT ("Model Parallelism"): one training step (Adam) imperative and hybridized,
  against the same model in PyTorch eager at equal threads (skipped without torch); and on
  four virtual devices, split by a 1F1B pipeline, by tensor parallelism (t = 2, 4) and with
  sequence parallelism, each with its peak memory on the first device beside its time.
* ResNet-18 (the chapter's variant), seconds per step at batch 16, imperative and hybridized,
  against the same network in PyTorch eager with the same threads, at one thread and at every
  core; the header names the BLAS kernels, which decide most of it.
* ResNet-18's convolutions one at a time, forward and backward, at one thread and at every
  core: by im2col and as the op runs them (Winograd's F(2×2, 3×3) where it applies), each an
  engine operation (its large passes cut in pieces as in a step), against a floor of every
  product at the BLAS peak measured in the same run at that thread count.
* GPU rows with CuPy, where a GPU is present, each table with both sides' precision settings
  (benchmarks/precision.py) and each row beside PyTorch eager on the same GPU: LeNet;
  ResNet-18 at batch 16 and 128 by each convolution road (cuDNN graphs where built, im2col),
  in strict FP32 and in TF32 (a process each), against a floor of its products at the rate
  the Hardware chapter's measurement gives; the small GPT at a GPU size in bfloat16; the peak
  memory of a ResNet-18 step; Winograd against im2col. benchmarks/gpu_session.sh runs them
  for a GPU lease.
Each figure is the best of several interleaved repeats.
"""
import argparse
import collections
import contextlib
import functools
import os
import platform
import statistics
import sys
import time

# d2lperf before NumPy, as the chapters: OpenBLAS then loads with its brief spin
# (engine/blas.py, spin_briefly), which the rows measured so far ran with.
import d2lperf as d2l
import numpy
from numpy.lib.stride_tricks import sliding_window_view
from threadpoolctl import threadpool_info, threadpool_limits

from d2lperf import autograd, engine, hardware, nn, np, npx
from d2lperf.device import available_cores
from d2lperf.engine import pieces

import precision          # benchmarks/precision.py: both sides' float32 settings on a GPU

BATCH = 256
STEPS = d2l.workload(8, 2)
REPEATS = d2l.workload(5, 2)
LR = 0.1


def best_seconds(step, steps=STEPS, repeats=REPEATS):
    """Best over repeats of the mean seconds per call of `step()` (which waits for itself)."""
    step()
    best = float('inf')
    for _ in range(repeats):
        timer = d2l.Timer()
        for _ in range(steps):
            step()
        best = min(best, timer.stop() / steps)
    return best


def lenet_shapes():
    return [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def initial_params(seed=0):
    rng = numpy.random.default_rng(seed)
    return [(rng.normal(0, 0.01, shape) if len(shape) > 1 else numpy.zeros(shape))
            .astype(numpy.float32) for shape in lenet_shapes()]


def batch(seed=1):
    rng = numpy.random.default_rng(seed)
    return (rng.uniform(size=(BATCH, 1, 28, 28)).astype(numpy.float32),
            rng.integers(0, 10, BATCH))


# -- the NumPy floor: im2col by hand, forward and backward ---------------------------------
# Activations are kept as (C, H, W, N), batch innermost, the layout a product of the filters
# (F, C·k·k) with the columns (C·k·k, OH·OW·N) produces: nothing is transposed back.

def im2col(x, k):
    """(C, H, W, N) → (C·k·k, OH·OW·N) columns, one per output pixel of every example."""
    patches = sliding_window_view(x, (k, k), axis=(1, 2))       # C, OH, OW, N, k, k
    c, oh, ow, n = patches.shape[:4]
    return patches.transpose(0, 4, 5, 1, 2, 3).reshape(c * k * k, oh * ow * n), (oh, ow, n)


def conv_forward(x, w, bias):
    cols, grid = im2col(x, w.shape[-1])
    out = w.reshape(len(w), -1) @ cols + bias[:, None]
    return out.reshape((len(w),) + grid), cols


def conv_backward(dout, cols, w, x_shape):
    f, c, k, _ = w.shape
    d2 = dout.reshape(f, -1)
    dw, db = (d2 @ cols.T).reshape(w.shape), d2.sum(1)
    if x_shape is None:
        return None, dw, db
    oh, ow, n = dout.shape[1:]
    dcols = (w.reshape(f, -1).T @ d2).reshape(c, k, k, oh, ow, n)
    dx = numpy.zeros(x_shape, numpy.float32)
    for i in range(k):
        for j in range(k):
            dx[:, i:i + oh, j:j + ow] += dcols[:, i, j]
    return dx, dw, db


def avg_pool(x):
    c, h, w, n = x.shape
    return x[:, :h // 2 * 2, :w // 2 * 2].reshape(c, h // 2, 2, w // 2, 2, n).mean((2, 4))


def avg_pool_backward(dout, shape):
    dx = numpy.zeros(shape, numpy.float32)
    oh, ow = dout.shape[1:3]
    dx[:, :2 * oh, :2 * ow] = numpy.repeat(numpy.repeat(dout / 4, 2, 1), 2, 2)
    return dx


def numpy_step(params, x, y):
    """One SGD step of the toy LeNet, written by hand: the floor for a NumPy library."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    x = numpy.ascontiguousarray(x.transpose(1, 2, 3, 0))          # C, H, W, N
    c1, cols1 = conv_forward(x, w1, b1)
    r1 = numpy.maximum(c1, 0)
    p1 = avg_pool(r1)
    c2, cols2 = conv_forward(p1, w2, b2)
    r2 = numpy.maximum(c2, 0)
    p2 = avg_pool(r2)
    flat = p2.reshape(-1, len(y)).T                               # N, C·H·W
    h3 = numpy.maximum(flat @ w3 + b3, 0)
    logits = h3 @ w4 + b4
    probs = numpy.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    probs[numpy.arange(len(y)), y] -= 1                          # d loss / d logits
    dh3 = (probs @ w4.T) * (h3 > 0)
    dflat = dh3 @ w3.T
    dr2 = avg_pool_backward(dflat.T.reshape(p2.shape), r2.shape) * (c2 > 0)
    dp1, dw2, db2 = conv_backward(dr2, cols2, w2, p1.shape)
    dr1 = avg_pool_backward(dp1, r1.shape) * (c1 > 0)
    _, dw1, db1 = conv_backward(dr1, cols1, w1, None)
    grads = [dw1, db1, dw2, db2, flat.T @ dh3, dh3.sum(0), h3.T @ probs, probs.sum(0)]
    for p, g in zip(params, grads):
        p -= (LR / len(y)) * g


def check_floor_against_d2lperf():
    """The hand-written step must be the step d2lperf takes: one step each, same weights."""
    x, y = batch()
    by_hand = initial_params()
    numpy_step(by_hand, x, y)
    d2lperf_step_fn([d2l.cpu(0)], x, y, keep=(kept := []))()
    for name, a, b in zip(('w1', 'b1', 'w2', 'b2', 'w3', 'b3', 'w4', 'b4'), by_hand, kept[0]):
        numpy.testing.assert_allclose(a, b.asnumpy(), rtol=1e-4, atol=1e-6, err_msg=name)


# -- d2lperf --------------------------------------------------------------------------------

def lenet(x, params):
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    h = npx.relu(npx.convolution(x, w1, b1, kernel=(3, 3), num_filter=20))
    h = npx.pooling(h, kernel=(2, 2), stride=(2, 2), pool_type='avg')
    h = npx.relu(npx.convolution(h, w2, b2, kernel=(5, 5), num_filter=50))
    h = npx.pooling(h, kernel=(2, 2), stride=(2, 2), pool_type='avg')
    h = npx.relu(np.dot(h.reshape(h.shape[0], -1), w3) + b3)
    return np.dot(h, w4) + b4


LOSS = d2l.SoftmaxCrossEntropyLoss()


def d2lperf_step_fn(devices, x_host, y_host, keep=None):
    """One data-parallel SGD step over `devices` (one device: plain SGD); `keep` (a list)
    receives the parameters, for checking."""
    params = [d2l.get_params([np.array(p, device=d) for p in initial_params()], d)
              for d in devices]
    if keep is not None:
        keep.extend(params)
    xs = d2l.split_and_load(np.array(x_host), devices)
    ys = d2l.split_and_load(np.array(y_host), devices)

    def step():
        with autograd.record():
            losses = [LOSS(lenet(x, p), y) for x, y, p in zip(xs, ys, params)]
        for loss in losses:
            loss.backward()
        if len(devices) > 1:
            for i in range(len(params[0])):
                d2l.allreduce([p[i].grad for p in params])
        for p in params:
            d2l.sgd(p, LR, len(x_host))
        npx.waitall()
    return step


def hybrid_lenet_step_fn(x_host, y_host):
    net = d2l.lenet()
    net.initialize(d2l.nn.init.Normal(0.01))
    net.hybridize()
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': LR})
    x, y = np.array(x_host), np.array(y_host)

    def step():
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        trainer.step(len(x_host))
        npx.waitall()
    return step


# -- PyTorch eager, when installed -----------------------------------------------------------

def torch_step_fn(x_host, y_host):
    try:
        import torch
    except ImportError:
        return None
    f = torch.nn.functional
    params = [torch.tensor(p, requires_grad=True) for p in initial_params()]
    x, y = torch.from_numpy(x_host), torch.from_numpy(y_host)

    def step():
        w1, b1, w2, b2, w3, b3, w4, b4 = params
        h = f.avg_pool2d(f.relu(f.conv2d(x, w1, b1)), 2)
        h = f.avg_pool2d(f.relu(f.conv2d(h, w2, b2)), 2)
        h = f.relu(h.flatten(1) @ w3 + b3)
        loss = f.cross_entropy(h @ w4 + b4, y, reduction='sum')
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= (LR / len(x_host)) * p.grad
                p.grad = None
    return step, torch


def with_threads(threads, make_step, torch=None, steps=STEPS):
    """Time `make_step()` with BLAS (and torch) limited to `threads`."""
    with threadpool_limits(threads):
        if torch is not None:
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            return best_seconds(make_step, steps=steps)
        finally:
            if torch is not None:
                torch.set_num_threads(old)


def lenet_rows(cores):
    x, y = batch()
    host_params = initial_params()
    steps = {'NumPy im2col by hand (floor)': lambda: numpy_step(host_params, x, y),
             'd2lperf, imperative': d2lperf_step_fn([d2l.cpu(0)], x, y),
             'd2lperf, hybridized (Gluon layers)': hybrid_lenet_step_fn(x, y)}
    torch_step = torch_step_fn(x, y)
    rows = []
    for threads in sorted({1, cores}):
        for name, step in steps.items():
            rows.append((name, threads, BATCH / with_threads(threads, step)))
        if torch_step is not None:
            rows.append(('PyTorch eager', threads,
                         BATCH / with_threads(threads, torch_step[0], torch_step[1])))
    return rows


def lenet_step_profile(cores, steps=5):
    """Milliseconds per step spent in each kind of operation, d2lperf imperative at every core:
    where the step's time goes (from the engine's records)."""
    x, y = batch()
    step = d2lperf_step_fn([d2l.cpu(0)], x, y)
    with threadpool_limits(cores):
        step()
        with d2l.profiler.profile() as records:
            for _ in range(steps):
                step()
    per_op = {}
    for r in records:
        per_op[r.name] = per_op.get(r.name, 0.0) + (r.end - r.start) * 1e3 / steps
    return sorted(per_op.items(), key=lambda item: -item[1])


def data_parallel_rows(cores):
    """Two virtual devices sharing the cores, against one device that has them all."""
    x, y = batch()
    one = d2lperf_step_fn([d2l.cpu(0)], x, y)
    two = d2lperf_step_fn([d2l.cpu(0), d2l.cpu(1)], x, y)
    old = engine.set_blas_division(True)
    try:
        two_seconds = best_seconds(two)
    finally:
        engine.set_blas_division(old)
    one_seconds = with_threads(cores, one)
    split_bytes, pieces.SPLIT_BYTES = pieces.SPLIT_BYTES, float('inf')
    try:
        whole_seconds = with_threads(cores, one)
    finally:
        pieces.SPLIT_BYTES = split_bytes
    return [('one device, every core', cores, BATCH / one_seconds),
            ('one device, every core, no operation cut into pieces', cores,
             BATCH / whole_seconds),
            ('two virtual devices, BLAS threads divided', cores, BATCH / two_seconds)]


def trainer_step_fn(devices, x_host, y_host):
    """One step of `nn.lenet()` through the Trainer (kvstore 'device') on `devices`: the global
    batch, on cpu(0), split over them each step, as the chapters train."""
    net = nn.lenet()
    net.initialize(init=nn.init.Normal(0.01), device=devices)
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': LR}, kvstore='device')
    x, y = np.array(x_host), np.array(y_host)

    def step():
        xs, ys = d2l.split_and_load(x, devices), d2l.split_and_load(y, devices)
        with autograd.record():
            losses = [LOSS(net(a), b) for a, b in zip(xs, ys)]
        for loss in losses:
            loss.backward()
        trainer.step(len(x_host))
        npx.waitall()
    return step


def more_devices_than_cores_rows(counts=(1, 2, 4)):
    """Seconds a step of LeNet at global batch 256 through the Trainer on 1, 2 and 4 virtual
    devices (`try_devices`), timed round robin: the same work on the same cores, so each should
    take about one device's time however many devices share it."""
    x, y = batch()
    steps = {n: trainer_step_fn(d2l.try_devices(n), x, y) for n in counts}
    for step in steps.values():
        step()                                   # the first step allocates what later reuse
    return d2l.median_seconds(steps, repeats=3 * REPEATS, min_seconds=0)


def sharded_rows():
    """(what, seconds a step, peak bytes on the first device) on four virtual devices."""
    from d2lperf.data_parallel import Buckets, Zero
    devices = [d2l.cpu(i) for i in range(1, 5)]
    x, y = batch()
    loss = d2l.SoftmaxCrossEntropyLoss()
    buckets = lambda **kw: (lambda net: Buckets(net.collect_params(), 'adam', **kw))
    ways = {'one sum a parameter, during backward': buckets(cap_bytes=1),
            'buckets of 64 KiB, during backward': buckets(cap_bytes=2**16),
            'one flat sum, after backward': buckets(overlap=False),
            'ZeRO stage 1': lambda net: Zero(net, 1, 'adam'),
            'ZeRO stage 2': lambda net: Zero(net, 2, 'adam'),
            'ZeRO stage 3, a unit gathered ahead': lambda net: Zero(net, 3, 'adam'),
            'ZeRO stage 3, no unit gathered ahead': lambda net: Zero(net, 3, 'adam',
                                                                      prefetch=0)}
    steps, peaks = {}, {}
    for name, make in ways.items():
        net = d2l.nn.models.lenet()
        net.initialize(init=d2l.nn.init.Normal(sigma=0.1), device=devices)
        x_parts, y_parts = d2l.split_batch(np.array(x), np.array(y), devices)
        net(x_parts[0]).wait_to_read()
        strategy = make(net)

        def step(strategy=strategy, net=net, x_parts=x_parts, y_parts=y_parts):
            strategy.step(lambda: [loss(net(a), b) for a, b in zip(x_parts, y_parts)], BATCH)
            npx.waitall()
        steps[name] = step
        peaks[name] = peak_of(step, devices[0])
    seconds = d2l.utils.median_seconds(steps, repeats=REPEATS * 2, min_seconds=0)
    return [(name, seconds[name], peaks[name]) for name in ways]


def peak_of(step, device):
    """The most bytes held on `device` while `step()` runs, above what it held before (after a
    first step has made what every step keeps). On the naive engine, which finishes each
    operation as it is pushed: the threaded engine frees an array once the operations reading
    it are done, so its peak also says how far Python ran ahead of them."""
    step()
    engine.use('naive')
    try:
        d2l.device.reset_peak(device)
        before = d2l.device.memory(device).total
        step()
        return d2l.device.memory(device).peak - before
    finally:
        engine.use('threaded')


MLP_LAYERS, MLP_WIDTH = d2l.workload(12, 8), d2l.workload(512, 256)


def memory_rows():
    """(what, seconds a step, peak bytes) for a deep MLP in three precisions and recomputed."""
    from d2lperf import amp, nn
    rng = numpy.random.default_rng(0)
    x_host = rng.standard_normal((BATCH, MLP_WIDTH)).astype(numpy.float32)
    y = np.array(rng.integers(0, 10, BATCH))
    loss = d2l.SoftmaxCrossEntropyLoss()
    segments = max(1, round(MLP_LAYERS ** 0.5))

    def make(dtype=None, scaler=False, checkpoints=0):
        net = nn.Sequential()
        for _ in range(MLP_LAYERS):
            net.add(nn.Dense(MLP_WIDTH, in_units=MLP_WIDTH, activation='relu'))
        net.add(nn.Dense(10, in_units=MLP_WIDTH))
        net.initialize(init=d2l.nn.init.Normal(sigma=0.05))
        if dtype:
            net.cast(dtype)
        trainer = d2l.Trainer(net.collect_params(), 'adam',
                              {'learning_rate': 1e-3, 'multi_precision': bool(dtype)})
        if scaler:
            amp.init_trainer(trainer)
        x = np.array(x_host).astype(dtype or 'float32')
        layers = list(net)
        bounds = numpy.linspace(0, len(layers), segments + 1).astype(int)
        parts = [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

        def run(part):
            def block(h):
                for layer in part:
                    h = layer(h)
                return h
            return block

        def forward():
            if not checkpoints:
                return net(x)
            h = x
            for part in parts:
                h = autograd.checkpoint(run(part), h)
            return h

        def step():
            with autograd.record():
                value = loss(forward().astype('float32'), y)
            if scaler:
                with amp.scale_loss(value, trainer) as scaled:
                    scaled.backward()
            else:
                value.backward()
            trainer.step(BATCH)
            npx.waitall()
        return step
    ways = {'float32': make(),
            'float16, multi_precision, loss scaler': make('float16', scaler=True),
            'bfloat16, multi_precision': make('bfloat16'),
            f'float32, recomputed in {segments} segments': make(checkpoints=segments)}
    peaks = {name: peak_of(step, d2l.cpu()) for name, step in ways.items()}
    seconds = d2l.utils.median_seconds(ways, repeats=REPEATS, min_seconds=0)
    return [(name, seconds[name], peaks[name]) for name in ways]


GPT_SIZES = dict(vocab_size=96, num_layers=d2l.workload(4, 2), num_hiddens=d2l.workload(128, 64),
                 num_heads=4, max_len=d2l.workload(128, 32))
GPT_BATCH = d2l.workload(16, 4)
# The rows against PyTorch: "4×128" (the sizes above) and "4×256": 4 layers, 256 wide, 8 heads,
# sequence 256, batch 8 (smaller in quick mode).
GPT_SHAPES = {'4×128': (GPT_SIZES, GPT_BATCH),
              '4×256': (dict(vocab_size=96, num_layers=d2l.workload(4, 2),
                             num_hiddens=d2l.workload(256, 64), num_heads=d2l.workload(8, 4),
                             max_len=d2l.workload(256, 32)), d2l.workload(8, 2))}


def gpt_data(sizes=GPT_SIZES, batch=GPT_BATCH):
    rng = numpy.random.default_rng(0)
    shape = (batch, sizes['max_len'])
    return (rng.integers(0, sizes['vocab_size'], shape),
            rng.integers(0, sizes['vocab_size'], shape))


def small_gpt(device=None, sizes=GPT_SIZES):
    np.random.seed(0)
    net = d2l.nn.GPT(**sizes)
    net.initialize(device=device)
    return net


def gpt_step_fn(hybridize, device=None, sizes=GPT_SIZES, batch=GPT_BATCH, dtype=None):
    """One Adam step of the small GPT; with `dtype` ('bfloat16'), its weights in that dtype
    with float32 master weights (multi_precision) and the loss taken in float32."""
    net = small_gpt(device, sizes)
    if dtype:
        net.cast(dtype)
    if hybridize:
        net.hybridize()
    trainer = d2l.Trainer(net.collect_params(), 'adam',
                          {'learning_rate': 1e-3} | ({'multi_precision': True} if dtype else {}))
    tokens, labels = (np.array(a, device=device) for a in gpt_data(sizes, batch))
    loss = d2l.SoftmaxCrossEntropyLoss()
    as_float32 = (lambda logits: logits.astype('float32')) if dtype else (lambda logits: logits)

    def step():
        with autograd.record():
            value = loss(as_float32(net(tokens)), labels).mean()
        value.backward()
        trainer.step(1)
        npx.waitall()
    return step


def torch_gpt_step_fn(sizes=GPT_SIZES, batch=GPT_BATCH):
    """The same GPT in PyTorch eager (tests/test_gpt.py writes it with torch.nn.functional over
    our parameters' names, attention by hand), the same weights, Adam."""
    try:
        import torch
    except ImportError:
        return None
    import importlib.util
    import pathlib
    tests = pathlib.Path(__file__).parents[1] / 'tests'
    sys.path.insert(0, str(tests))                      # test_gpt imports its neighbours
    spec = importlib.util.spec_from_file_location('test_gpt', tests / 'test_gpt.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    weights = {name: torch.tensor(p.data().asnumpy(), requires_grad=True)
               for name, p in small_gpt(sizes=sizes).collect_params().items()}
    optimizer = torch.optim.Adam(weights.values(), lr=1e-3)
    tokens, labels = (torch.from_numpy(a) for a in gpt_data(sizes, batch))

    def step():
        optimizer.zero_grad()
        _, value = module.torch_gpt_loss(torch, weights, tokens, labels,
                                         sizes['num_layers'], sizes['num_heads'])
        value.backward()
        optimizer.step()
    return step, torch


def torch_module_gpt_step_fn(sizes=GPT_SIZES, batch=GPT_BATCH, device='cpu', autocast=None):
    """The GPT as PyTorch's users write it: nn.Module layers, nn.LayerNorm,
    F.scaled_dot_product_attention(is_causal=True), tanh GELU, an untied head with a bias,
    torch.optim.Adam. Same shapes and FLOPs as d2lperf's; its own initial weights (a row
    times a step). On 'cuda', each step waits for the GPU; `autocast` (torch.float16 or bfloat16) runs
    the step under torch.autocast, float32 weights and optimizer."""
    try:
        import torch
    except ImportError:
        return None
    if device != 'cpu' and not torch.cuda.is_available():
        return None
    nn, F = torch.nn, torch.nn.functional
    width, heads = sizes['num_hiddens'], sizes['num_heads']

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, heads, width // heads).transpose(1, 2)
                       for t in self.qkv(self.norm1(x)).split(width, dim=-1))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attended.transpose(1, 2).reshape(b, s, width))
            return x + self.down(F.gelu(self.up(self.norm2(x)), approximate='tanh'))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(sizes['vocab_size'], width)
            self.positions = nn.Embedding(sizes['max_len'], width)
            self.layers = nn.ModuleList(Layer() for _ in range(sizes['num_layers']))
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, sizes['vocab_size'])

        def forward(self, ids):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    net = GPT().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    tokens, labels = (torch.from_numpy(a).to(device) for a in gpt_data(sizes, batch))
    in_precision = ((lambda: torch.autocast(device, dtype=autocast)) if autocast is not None
                    else contextlib.nullcontext)

    def step():
        optimizer.zero_grad()
        with in_precision():
            logits = net(tokens)
            value = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        value.backward()
        optimizer.step()
        if device != 'cpu':
            torch.cuda.synchronize()
    return step, torch


def d2lperf_seconds(threads, step, steps=STEPS):
    """`with_threads` for a d2lperf step, and a note for the row's name where the engine gave
    BLAS fewer threads than asked, because other programs held a core (`blas.SharedCores`):
    PyTorch's row then still ran on all of them."""
    used = []

    def step_noting_threads():
        step()
        used.append(engine.current().threads_per_operation())
    seconds = with_threads(threads, step_noting_threads, steps=steps)
    fewest = min(used)
    return seconds, (f' (BLAS on {fewest} of {threads} threads at times: other programs held '
                     'a core)' if fewest < threads else '')


def gpt_rows(cores, sizes=GPT_SIZES, batch=GPT_BATCH):
    """(what, threads, seconds a step) for one device. "PyTorch eager" is the row the ratios
    are taken against: PyTorch's GPT as its users write it (`torch_module_gpt_step_fn`)."""
    steps = {'d2lperf, imperative': gpt_step_fn(False, None, sizes, batch),
             'd2lperf, hybridized': gpt_step_fn(True, None, sizes, batch)}
    torch_steps = {'PyTorch eager': torch_module_gpt_step_fn(sizes, batch),
                   'PyTorch eager, attention by hand': torch_gpt_step_fn(sizes, batch)}
    rows = []
    for threads in sorted({1, 2, cores}):
        for name, step in steps.items():
            seconds, note = d2lperf_seconds(threads, step)
            rows.append((name + note, threads, seconds))
        for name, torch_step in torch_steps.items():
            if torch_step is not None:
                rows.append((name, threads, with_threads(threads, *torch_step)))
    return rows


def parallel_gpt_rows():
    """(what, seconds a step, peak bytes on cpu(1)) for the GPT split over virtual devices."""
    from d2lperf.model_parallel import Pipeline, parallel_gpt, tensor_parallel
    devices = [d2l.cpu(i) for i in range(1, 5)]
    tokens, labels = gpt_data()
    loss = d2l.SoftmaxCrossEntropyLoss()

    def pipeline():
        net = small_gpt(devices[0])
        split = Pipeline(net, devices, '1f1b')
        trainer = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 1e-3})
        parts = numpy.array_split(numpy.arange(GPT_BATCH), len(devices))
        xs = [np.array(tokens[p]) for p in parts]
        ys = [np.array(labels[p]) for p in parts]

        def step():
            split.forward_backward(xs, ys, loss)
            trainer.step(1)
            npx.waitall()
        return step

    def tensor(t, sequence=False):
        split = tensor_parallel(small_gpt(devices[0]), devices[:t], sequence=sequence)
        trainer = d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 1e-3})
        x = np.array(tokens)

        def step():
            with autograd.record():
                logits = split(x)
                values = [loss(out, np.array(labels, device=out.device)).sum()
                          for out in logits]
            split.backward(values)
            split.finish_gradients()        # with sequence parallelism, the copies' sum
            trainer.step(1)
            npx.waitall()
        return step

    def layout(d, t, p, microbatches=2):
        split = parallel_gpt(small_gpt(devices[0]), devices, d, t, p, '1f1b')
        trainer = d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 1e-3})
        x, y = np.array(tokens), np.array(labels)

        def step():
            split.forward_backward(x, y, loss, microbatches)
            trainer.update(1)           # forward_backward summed over the replicas
            npx.waitall()
        return step
    ways = {'one device': gpt_step_fn(False, devices[0]),
            '1F1B pipeline, 4 stages, 4 micro-batches': pipeline(),
            'tensor parallel, t = 2': tensor(2), 'tensor parallel, t = 4': tensor(4),
            'tensor and sequence parallel, t = 4': tensor(4, True),
            'data parallel, 4 replicas (4 × 1 × 1)': layout(4, 1, 1, 1),
            'data × tensor, 2 × 2 × 1': layout(2, 2, 1, 1),
            'tensor × pipeline, 1 × 2 × 2, 2 micro-batches': layout(1, 2, 2),
            'data × pipeline, 2 × 1 × 2, 2 micro-batches': layout(2, 1, 2)}
    peaks = {name: peak_of(step, devices[0]) for name, step in ways.items()}
    seconds = d2l.utils.median_seconds(ways, repeats=REPEATS, min_seconds=0)
    return [(name, seconds[name], peaks[name]) for name in ways]


def against_torch(rows):
    """(threads, seconds) -> PyTorch eager's seconds at those threads over these, as text
    ('-' where PyTorch is not installed), from the same run's (name, threads, seconds) rows."""
    torch_seconds = {threads: seconds for name, threads, seconds in rows
                     if name == 'PyTorch eager'}
    return lambda threads, seconds: (f'{torch_seconds[threads] / seconds:.2f}'
                                     if threads in torch_seconds else '-')


def gpt_section(cores):
    for shape, (sizes, batch) in GPT_SHAPES.items():
        described = ', '.join(f'{k} {v}' for k, v in sizes.items())
        print(f'\nThe small GPT {shape} ({described}), batch {batch}, one Adam step; '
              f'{load_average()}')
        rows = gpt_rows(cores, sizes, batch)
        ratio = against_torch(rows)
        print('| what | threads | ms per step | × PyTorch |\n|---|--:|--:|--:|')
        for name, threads, seconds in rows:
            print(f'| {name} | {threads} | {seconds * 1e3:.1f} | {ratio(threads, seconds)} |')
    print('\nThe same GPT split over four virtual devices, and its peak memory (naive engine)')
    print_time_and_peak(parallel_gpt_rows(), 'one device')


RESNET_BATCH = 16


def resnet_step_fn(hybridize=False, device=None, batch_size=RESNET_BATCH, static_alloc=False):
    net = d2l.resnet18(10)
    net.initialize(d2l.nn.init.Normal(0.01), device=device)
    if hybridize:
        net.hybridize(static_alloc=static_alloc, static_shape=static_alloc)
    trainer = d2l.Trainer(net.collect_params(), 'sgd', {'learning_rate': LR})
    x = np.random.uniform(size=(batch_size, 1, 28, 28), device=device)
    y = np.array(numpy.arange(batch_size) % 10, device=device)

    def step():
        with autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        trainer.step(batch_size)
        npx.waitall()
    return step


def torch_resnet_step_fn(device='cpu', batch_size=RESNET_BATCH):
    """The same ResNet-18 (3×3 stride-1 stem, no max-pooling, batch norm in training mode)
    in PyTorch eager, one SGD step on the same batch size; on 'cuda', each step waits for
    the GPU, as d2lperf's does."""
    try:
        import torch
    except ImportError:
        return None
    if device != 'cpu' and not torch.cuda.is_available():
        return None
    nn = torch.nn

    class Residual(nn.Module):
        def __init__(self, cin, cout, strides):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, strides, 1)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
            self.conv3 = nn.Conv2d(cin, cout, 1, strides) if strides > 1 or cin != cout else None
            self.bn1, self.bn2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)

        def forward(self, x):
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + (self.conv3(x) if self.conv3 is not None else x))

    layers, cin = [nn.Conv2d(1, 64, 3, 1, 1), nn.BatchNorm2d(64), nn.ReLU()], 64
    for cout, first in ((64, True), (128, False), (256, False), (512, False)):
        layers += [Residual(cin, cout, 1 if first else 2), Residual(cout, cout, 1)]
        cin = cout
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(512, 10)).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x = torch.rand(batch_size, 1, 28, 28, device=device)
    y = torch.arange(batch_size, device=device) % 10

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        if device != 'cpu':
            torch.cuda.synchronize()
    return step, torch


def resnet_rows(cores):
    """(what, threads, seconds a step) of ResNet-18 at batch 16, d2lperf imperative and
    hybridized and PyTorch eager, at one thread and at every core."""
    steps = {'d2lperf, imperative (Gluon layers)': resnet_step_fn(),
             'd2lperf, hybridized': resnet_step_fn(hybridize=True)}
    torch_step = torch_resnet_step_fn()
    rows = []
    for threads in sorted({1, cores}):
        for name, step in steps.items():
            seconds, note = d2lperf_seconds(threads, step, steps=d2l.workload(3, 1))
            rows.append((name + note, threads, seconds))
        if torch_step is not None:
            rows.append(('PyTorch eager', threads, with_threads(
                threads, torch_step[0], torch_step[1], steps=d2l.workload(3, 1))))
    return rows


def load_average():
    """Other programs on the cores change every ratio here: PyTorch's threads wait for a core
    another program holds, where d2lperf's engine gives BLAS only the free ones."""
    return 'load average before: {:.2f}'.format(os.getloadavg()[0])


def blas_kernels():
    """Which kernels do the products: a ResNet step is almost all products, and OpenBLAS
    picks its kernels by CPU unless OPENBLAS_CORETYPE names others (this VM's environment sets
    Haswell's AVX2 ones on an AVX-512 CPU, where PyTorch's oneDNN uses AVX-512)."""
    found = ', '.join(f"{lib['internal_api']} {lib.get('architecture')}"
                      for lib in threadpool_info() if lib['user_api'] == 'blas')
    chosen = ', '.join(f'{name}={os.environ.get(name, "(unset)")}'
                       for name in ('OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE'))
    try:
        import torch
        theirs = f'; PyTorch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}'
    except ImportError:
        theirs = ''
    return f'NumPy: {found} ({chosen}){theirs}'


def lenet_section(cores):
    check_floor_against_d2lperf()
    print('\nLeNet, one training step (forward, backward, SGD); the floor checked against '
          'd2lperf')
    rows = lenet_rows(cores)
    floor = {threads: ips for name, threads, ips in rows if 'floor' in name}
    torch_ips = {threads: ips for name, threads, ips in rows if name == 'PyTorch eager'}
    print(f'| what | threads | img/s | × NumPy floor | × PyTorch |\n|---|--:|--:|--:|--:|')
    for name, threads, ips in rows:
        vs_torch = f'{ips / torch_ips[threads]:.2f}' if threads in torch_ips else '-'
        print(f'| {name} | {threads} | {ips:.0f} | {ips / floor[threads]:.2f} | {vs_torch} |')
    profile = lenet_step_profile(cores)
    print(f'\nWhere a step goes, d2lperf imperative at {cores} threads (ms per step): ' +
          ', '.join(f'{name} {ms:.1f}' for name, ms in profile[:6]) +
          f'; the other {len(profile) - 6} kinds {sum(ms for _, ms in profile[6:]):.1f}')


def per_kind_ms(step, threads, steps=5):
    """Milliseconds per step each kind of operation took at `threads` (engine records)."""
    per_op = collections.Counter()
    with threadpool_limits(threads):
        step()
        with d2l.profiler.profile() as records:
            for _ in range(steps):
                step()
    for r in records:
        per_op[r.name] += (r.end - r.start) * 1e3 / steps
    return per_op


def scaling_section(cores):
    """Where the second core goes idle: each kind of operation's time at one thread and at
    every core, from the engine's records, for LeNet and the small GPT. A kind whose time does
    not fall ran on one core while the others waited (a pass too small, for its weight, for
    `pieces.count` to cut)."""
    x, y = batch()
    sizes, gpt_batch = GPT_SHAPES['4×128']
    for name, step in (('LeNet, batch 256', d2lperf_step_fn([d2l.cpu(0)], x, y)),
                       ('GPT 4×128', gpt_step_fn(False, None, sizes, gpt_batch))):
        one, every = per_kind_ms(step, 1), per_kind_ms(step, cores)
        total_one, total_every = sum(one.values()), sum(every.values())
        print(f'\n{name}, imperative: operation time by kind at 1 and {cores} threads; '
              f'{load_average()}')
        print(f'| kind | ms at 1 | ms at {cores} | speed-up | share at {cores} |\n'
              '|---|--:|--:|--:|--:|')
        for kind, ms in sorted(every.items(), key=lambda item: -item[1])[:12]:
            print(f'| {kind} | {one[kind]:.2f} | {ms:.2f} | {one[kind] / ms:.2f} | '
                  f'{ms / total_every:.0%} |')
        flat = sum(ms for kind, ms in every.items() if one[kind] < 1.15 * ms)
        print(f'| all | {total_one:.1f} | {total_every:.1f} | {total_one / total_every:.2f} | '
              f'kinds sped up less than 1.15×: {flat / total_every:.0%} of the time |')


def pieces_rows(threads, steps=8):
    """(what, ms whole, ms in pieces) at `threads`: each Transformer pass at the small GPT's
    4×128 sizes, and the GPT steps, with the pieces off (`pieces.SPLIT_BYTES` past every
    operation) and on in turns in one process; a copy of 4 MB as the floor."""
    from d2lperf.ops import transformer
    rng = numpy.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(numpy.float32)   # noqa: E731
    x, g, s, gs, h, gh, w = (f32(16, 128, 512), f32(16, 128, 512), f32(16, 4, 128, 128),
                             f32(16, 4, 128, 128), f32(16, 128, 128), f32(16, 128, 128),
                             f32(128))
    p = transformer.causal_softmax(numpy, s)
    work = {'gelu': lambda: transformer.gelu(numpy, x),
            'gelu gradient': lambda: transformer.gelu_vjp(numpy, g, None, x),
            'causal softmax': lambda: transformer.causal_softmax(numpy, s),
            'causal softmax gradient': lambda: transformer.causal_softmax_vjp(numpy, gs, p, s),
            'layer norm': lambda: transformer.layer_norm(numpy, h, w, w),
            'layer norm gradient': lambda: transformer.layer_norm_vjp(numpy, gh, None, h, w, w),
            'a copy of 4 MB (floor)': x.copy}
    work |= {f'GPT {shape} step': gpt_step_fn(False, None, *GPT_SHAPES[shape])
             for shape in GPT_SHAPES}
    split_bytes, rows = pieces.SPLIT_BYTES, []
    with threadpool_limits(threads):
        for name, fn in work.items():
            fn()
            seconds = {'whole': [], 'cut': []}
            for _ in range(steps if 'step' in name else 5 * steps):
                for how in seconds:
                    pieces.SPLIT_BYTES = split_bytes if how == 'cut' else float('inf')
                    start = time.perf_counter()
                    fn()
                    seconds[how].append(time.perf_counter() - start)
            pieces.SPLIT_BYTES = split_bytes
            rows.append((name, 1e3 * statistics.median(seconds['whole']),
                         1e3 * statistics.median(seconds['cut'])))
    return rows


def pieces_section(cores):
    print(f'\nThe GPT\'s passes cut into pieces (`engine.pieces`), off and on in turns, median; '
          f'{load_average()}')
    before = hardware.cpu_times()
    for threads in sorted({1, cores}):
        print(f'| {threads} thread(s) | ms whole | ms in pieces | pieces / whole |\n'
              '|---|--:|--:|--:|')
        for name, whole, cut in pieces_rows(threads):
            print(f'| {name} | {whole:.2f} | {cut:.2f} | {cut / whole:.2f} |')
    print(f'other programs kept {hardware.load_by_others(before, hardware.cpu_times()):.2f} '
          'cores busy meanwhile')


def data_parallel_section(cores):
    print('\nData parallelism on virtual devices')
    rows = data_parallel_rows(cores)
    print(f'| what | cores | img/s | × one device |\n|---|--:|--:|--:|')
    for name, threads, ips in rows:
        print(f'| {name} | {threads} | {ips:.0f} | {ips / rows[0][2]:.2f} |')
    seconds = more_devices_than_cores_rows()
    print(f'\nLeNet through the Trainer at global batch {BATCH} on {cores} cores, median of '
          f'{3 * REPEATS} round-robin steps ({load_average()})')
    print('| virtual devices | ms a step | × one device |\n|--:|--:|--:|')
    for count, step in seconds.items():
        print(f'| {count} | {step * 1e3:.1f} | {step / seconds[1]:.2f} |')


def print_time_and_peak(rows, first):
    """A table of (what, seconds a step, peak bytes on cpu(1)) rows, each beside the first's."""
    print(f'| what | ms per step | × {first} | peak on cpu(1), KiB | × {first} |\n'
          '|---|--:|--:|--:|--:|')
    for name, seconds, peak in rows:
        print(f'| {name} | {seconds * 1e3:.1f} | {rows[0][1] / seconds:.2f} | '
              f'{peak / 1024:.0f} | {peak / rows[0][2]:.2f} |')


def sharded_section(cores):
    print('\nLeNet with Adam on four virtual devices: how the gradients are summed, and the '
          "step's peak memory (naive engine)")
    print_time_and_peak(sharded_rows(), 'the first')


def memory_section(cores):
    print(f'\nA {MLP_LAYERS}-layer MLP of width {MLP_WIDTH} with Adam, one step on cpu(0), '
          'and its peak memory (naive engine)')
    rows = memory_rows()
    print('| what | ms per step | × float32 | peak, MiB | × float32 |\n|---|--:|--:|--:|--:|')
    for name, seconds, peak in rows:
        print(f'| {name} | {seconds * 1e3:.1f} | {rows[0][1] / seconds:.2f} | '
              f'{peak / 2**20:.1f} | {peak / rows[0][2]:.2f} |')


def resnet_section(cores):
    print(f'\nResNet-18 (28x28, batch {RESNET_BATCH}), one training step; {blas_kernels()}; '
          f'{load_average()}')
    rows = resnet_rows(cores)
    ratio = against_torch(rows)
    print('| what | threads | ms per step | img/s | × PyTorch |\n|---|--:|--:|--:|--:|')
    for name, threads, seconds in rows:
        print(f'| {name} | {threads} | {seconds * 1e3:.0f} | {RESNET_BATCH / seconds:.1f} | '
              f'{ratio(threads, seconds)} |')


# d2l.resnet18's convolutions on 28×28 images: (how many, in, out, input side, kernel, stride)
RESNET_CONVOLUTIONS = [(1, 1, 64, 28, 3, 1), (4, 64, 64, 28, 3, 1), (1, 64, 128, 28, 3, 2),
                       (1, 64, 128, 28, 1, 2), (3, 128, 128, 14, 3, 1), (1, 128, 256, 14, 3, 2),
                       (1, 128, 256, 14, 1, 2), (3, 256, 256, 7, 3, 1), (1, 256, 512, 7, 3, 2),
                       (1, 256, 512, 7, 1, 2), (3, 512, 512, 4, 3, 1)]


def blas_peak_gflops(n=1024):
    """A large float32 product's rate: what BLAS reaches on this machine now."""
    a, b = numpy.ones((n, n), numpy.float32), numpy.ones((n, n), numpy.float32)
    return 2 * n ** 3 / best_seconds(lambda: a @ b, steps=1) / 1e9


def as_an_operation(fn):
    """`fn` as one engine operation on cpu(0), waited for: its large passes are then cut in
    pieces for the cores, as in a training step (`engine.pieces`)."""
    var = engine.Var()

    def step():
        engine.push(fn, [], [var], d2l.cpu(0), 'convolution')
        engine.wait_for(var)
    return step


def convolution_rows(threads):
    """Each ResNet-18 convolution, forward and backward (input and weight gradients) at batch
    16, each an engine operation: by im2col, and as the op runs it (Winograd's road where
    `winograd.applies`)."""
    from d2lperf.ops import convolution, winograd
    rng = numpy.random.default_rng(0)
    rows = []
    for count, c, f, side, k, s in RESNET_CONVOLUTIONS:
        pad, stride = (k // 2,) * 2, (s, s)
        x = rng.standard_normal((c, side, side, RESNET_BATCH), numpy.float32).transpose(3, 0, 1, 2)
        w = rng.standard_normal((f, c, k, k), numpy.float32)
        out = convolution.by_columns(numpy, x, w, (k, k), stride, pad)
        g = rng.standard_normal(out.shape, numpy.float32)
        needs = (c > 1, True, True)                  # a first layer's input needs no gradient

        def by_columns():
            convolution.by_columns(numpy, x, w, (k, k), stride, pad)
            convolution.by_columns_vjp(numpy, g, x, w, (k, k), stride, pad, needs[0])

        def as_the_op_runs():
            convolution.convolution(numpy, x, w, None, (k, k), stride, pad, f)
            convolution.convolution_vjp(numpy, g.transpose(3, 0, 1, 2), None, x, w, None, (k, k),
                                        stride, pad, f, needs)
        flops = 2 * out.size * c * k * k * (3 if needs[0] else 2)
        winograds = winograd.applies(numpy, w.shape, stride, pad, out.shape[1:3])
        road = 'Winograd' if winograds else 'im2col'
        rows.append((f'{count} × {c}→{f}, {side}×{side}, {k}×{k}/{s}', count, flops, road,
                     with_threads(threads, as_an_operation(by_columns)),
                     with_threads(threads, as_an_operation(as_the_op_runs))))
    return rows


def convolutions_section(cores):
    print(f'\nResNet-18\'s convolutions (batch {RESNET_BATCH}, forward and backward); '
          f'{blas_kernels()}; {load_average()}')
    for threads in sorted({1, cores}):
        convolutions_table(threads)


def convolutions_table(threads):
    with threadpool_limits(threads):
        peak = blas_peak_gflops()
    rows = convolution_rows(threads)
    print(f'\n{threads} thread(s). Floor: every product at the BLAS peak measured now, '
          f'{peak:.0f} GFLOP/s on a 1024² float32 product (im2col\'s multiplications)')
    print('| layer | road | im2col ms | the op ms | im2col / op | floor ms | op / floor |')
    print('|---|---|--:|--:|--:|--:|--:|')
    totals = numpy.zeros(3)
    for name, count, flops, road, columns_s, op_s in rows:
        floor_s = flops / peak / 1e9
        totals += count * numpy.array([columns_s, op_s, floor_s])
        print(f'| {name} | {road} | {columns_s * 1e3:.2f} | {op_s * 1e3:.2f} | '
              f'{columns_s / op_s:.2f} | {floor_s * 1e3:.2f} | {op_s / floor_s:.2f} |')
    columns_s, op_s, floor_s = totals
    print(f'| all, a step | | {columns_s * 1e3:.0f} | {op_s * 1e3:.0f} | {columns_s / op_s:.2f} | '
          f'{floor_s * 1e3:.0f} | {op_s / floor_s:.2f} |')


def gpu_winograd_rows(batch_sizes=(RESNET_BATCH, 128)):
    """(layer, batch, im2col seconds, Winograd seconds) for ResNet-18's 3×3 stride-1 layers
    of ≥ 64 channels, forward only, on gpu(0) with CuPy: whether `winograd.applies` should
    let the GPU take that road (its transforms are many small kernels there)."""
    import cupy
    from d2lperf.hardware.gpu import gpu_seconds
    from d2lperf.ops import convolution, winograd
    rng, rows = numpy.random.default_rng(0), []
    for batch_size in batch_sizes:
        for count, c, f, side, k, s in RESNET_CONVOLUTIONS:
            if k != 3 or s != 1 or c < 64 or side % 2:
                continue
            x = cupy.asarray(rng.standard_normal((batch_size, c, side, side), numpy.float32))
            w = cupy.asarray(rng.standard_normal((f, c, 3, 3), numpy.float32))
            ours = winograd.convolution(cupy, x, w, (1, 1))
            theirs = convolution.by_columns(cupy, x, w, (3, 3), (1, 1), (1, 1))
            error = float(cupy.linalg.norm(ours - theirs) / cupy.linalg.norm(theirs))
            assert error < 1e-4, f'Winograd on the GPU differs from im2col by {error:.1e}'
            rows.append((f'{c}→{f}, {side}×{side}', batch_size, gpu_seconds(
                cupy, lambda: convolution.by_columns(cupy, x, w, (3, 3), (1, 1), (1, 1)), 5),
                gpu_seconds(cupy, lambda: winograd.convolution(cupy, x, w, (1, 1)), 5)))
    return rows


# -- On a GPU: each row against PyTorch eager on the same GPU, both sides' precision printed --
# Sections of their own (`gpu_resnet`, `gpu_gpt`, `gpu_memory`, ...) so that a short GPU lease
# runs each under its own time limit (benchmarks/gpu_session.sh); `gpu` runs them all.

# best of GPU_ROUNDS rounds of GPU_STEPS steps each; D2LPERF_QUICK=1 makes every size tiny
GPU_ROUNDS, GPU_STEPS = d2l.workload(3, 2), d2l.workload(5, 1)
GPU_RESNET_BATCHES = d2l.workload((RESNET_BATCH, 128), (2, 4))
GPU_MEMORY_BATCH = d2l.workload(128, 4)
# The small GPT at a GPU size, in bfloat16: 12 layers, 768 wide, 12 heads, sequence 1024.
GPU_GPT_SIZES = d2l.workload(
    dict(vocab_size=96, num_layers=12, num_hiddens=768, num_heads=12, max_len=1024),
    dict(vocab_size=96, num_layers=1, num_hiddens=32, num_heads=2, max_len=16))
GPU_GPT_BATCH = d2l.workload(8, 2)
SLOW_FIRST_STEP = 60.0          # seconds to build a row and take its first step (compiling
                                # every kernel): a slower row is left out
SLOW_STEP = 3.0                 # seconds a step: a slower row is timed by one step, not rounds


def left_out_without_gpu(what):
    """True (having said so) where there is no GPU: the rows of `what` are then left out."""
    if d2l.num_gpus():
        return False
    print(f'\nNo GPU: {what} left out')
    return True


def round_robin(steps, steps_per_round=GPU_STEPS, rounds=GPU_ROUNDS):
    """{name: [seconds a step, one mean per round]}: each step (which waits for its GPU work)
    warmed up once, then timed in turns, so that a drift of the machine hits all alike."""
    for step in steps.values():
        step()
    seconds = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            seconds[name].append((time.perf_counter() - start) / steps_per_round)
    return seconds


def first_steps(name, make_step, notes):
    """(step, seconds of its second step): `make_step()`, a first step and a second one,
    timed and printed as they go (should a time limit stop the run, its output still has a
    figure for each row built); None, with the reason in `notes`, where a step fails or the
    first (which compiles every kernel) takes over SLOW_FIRST_STEP."""
    start = time.perf_counter()
    try:
        step = make_step()
        step()
        first = time.perf_counter() - start
        if first > SLOW_FIRST_STEP:
            notes[name] = f'left out: its first step took {first:.0f} s'
            return None
        start = time.perf_counter()
        step()
        second = time.perf_counter() - start
    except Exception as error:                  # noqa: BLE001 - the row says why, the run goes on
        notes[name] = f'left out: {type(error).__name__}: {error}'.replace('\n', ' ')[:400]
        engine_settled()
        return None
    print(f'  {name}: built and first step in {first:.1f} s, a second step '
          f'{second * 1e3:.1f} ms', flush=True)
    return step, second


def timed_rows(ways, batch_size, steps, rounds, notes):
    """[(name, batch, [seconds a step, one a round])] of each way {name: make_step} that
    builds and steps: in rounds, in turns, but for a way slower than SLOW_STEP a step, which
    its second step times alone (so noted)."""
    built = {}
    for name, make_step in ways.items():
        found = first_steps(f'{name}, batch {batch_size}', make_step, notes)
        if found is not None:
            built[name] = found
    slow = {name: [second] for name, (step, second) in built.items() if second > SLOW_STEP}
    for name in slow:
        notes[f'{name}, batch {batch_size}'] = (f'timed by one step: slower than {SLOW_STEP:.0f} '
                                                's a step')
    timed = round_robin({name: step for name, (step, _) in built.items() if name not in slow},
                        steps, rounds)
    return [(name, batch_size, timed.get(name) or slow[name]) for name in built]


def engine_settled():
    """Drop an error a failed row left on the engine, so that the next rows run."""
    try:
        npx.waitall()
    except Exception:                           # noqa: BLE001 - reported by the row already
        pass


def convolution_roads():
    """(road, context) for each way d2lperf's convolutions run on a GPU in this tree: cuDNN
    graphs where `d2lperf.ops.cudnn` is built and available, and im2col (`cudnn.off()`)."""
    cudnn = precision.cudnn
    if cudnn is None or not cudnn.available():
        return [('im2col', contextlib.nullcontext)]
    return [('cuDNN', contextlib.nullcontext), ('im2col', cudnn.off)]


def on_road(make_step, context):
    """A step built and run inside `context` (im2col's `cudnn.off()`, say)."""
    with context():
        step = make_step()

    def run():
        with context():
            step()
    return run


def resnet_flops(batch_size):
    """FLOPs of a ResNet-18 training step's products: every convolution forward, its input
    gradient (not the first layer's, whose input is the data) and its weight gradient, and
    the dense layer's three products."""
    total = 3 * 2 * batch_size * 512 * 10
    for count, c, f, side, k, s in RESNET_CONVOLUTIONS:
        out_side = (side + 2 * (k // 2) - k) // s + 1
        forward = 2 * batch_size * f * out_side ** 2 * c * k * k
        total += count * forward * (2 if c == 1 else 3)
    return total


def gpt_flops(sizes, batch):
    """FLOPs of a GPT training step's products (forward, and twice that in backward): the
    dense layers (12 d² a layer) and the head on every token, and attention's two products
    over the causal half of each score matrix."""
    d, layers, s = sizes['num_hiddens'], sizes['num_layers'], sizes['max_len']
    dense = 2 * batch * s * (12 * d * d * layers + d * sizes['vocab_size'])
    attention = 2 * batch * s * s * d * layers
    return 3 * (dense + attention)


def gpu_peak_flops(mode, n=4096):
    """(FLOP/s of an n² product in `mode`, note): the Hardware chapter's measurement
    (`hardware.gpu.gpu_matmul_flops`: 'float32', 'tf32' or 'bfloat16'), taken now."""
    try:
        rows = hardware.gpu.gpu_matmul_flops(n=n, modes=(mode,), repeats=3)
    except Exception as error:                  # noqa: BLE001 - no floor, the rows still run
        return None, f'floor not measured: {type(error).__name__}: {error}'[:200]
    if not rows:
        return None, f'floor not measured: the GPU refused a {mode} product'
    return rows[0]['tflop_per_s'] * 1e12, (f'floor: the products at {rows[0]["tflop_per_s"]:.1f} '
                                           f'TFLOP/s, an {n}² {mode} product measured now')


def float32_mode():
    """The mode of the Hardware chapter's product that this process's float32 runs in."""
    return 'tf32' if precision.current_mode() == 'tf32' else 'float32'


def print_gpu_table(title, rows, flops, peak, notes, against='PyTorch eager'):
    """Rows of (name, batch, [seconds per round]): the best round and the median, the ratio
    of the same run's PyTorch eager (best against best) and the floor, flops / peak; then
    the rows left out and why."""
    print(f'\n{title}\n{precision.settings()}')
    print('| what | batch | best ms | median ms | img/s | × PyTorch eager | floor ms | '
          '× floor |\n|---|--:|--:|--:|--:|--:|--:|--:|')
    theirs = {b: min(s) for name, b, s in rows if name.startswith(against)}
    for name, batch_size, seconds in rows:
        best = min(seconds)
        ratio = f'{theirs[batch_size] / best:.2f}' if batch_size in theirs else '-'
        floor = flops(batch_size) / peak if peak else None
        median = statistics.median(seconds)
        print(f'| {name} | {batch_size} | {best * 1e3:.1f} | {median * 1e3:.1f} '
              f'| {batch_size / best:.0f} | {ratio} | '
              + (f'{floor * 1e3:.2f} | {best / floor:.1f} |' if floor else '- | - |'))
    for name, why in notes.items():
        print(f'| {name} | | {why} | | | | | |')


def gpu_resnet_rows(batch_sizes, rounds, steps):
    """(rows, notes) of ResNet-18 training steps on the GPU, in this process's precision:
    d2lperf imperative, hybridized and hybridized with static_alloc by its first convolution
    road, with static_alloc by the others (im2col beside cuDNN), and PyTorch eager on the
    same GPU; rows are (name, batch, [seconds per round])."""
    device, rows, notes = d2l.gpu(0), [], {}
    torch, why = precision.torch_on_cuda()
    for batch_size in batch_sizes:
        ways = {}
        for i, (road, context) in enumerate(convolution_roads()):
            kinds = ((('imperative', False, False), ('hybridized', True, False)) if i == 0
                     else ()) + (('hybridized static_alloc', True, True),)
            for kind, hybridize, static in kinds:
                ways[f'd2lperf, {kind}, {road}'] = functools.partial(
                    on_road, functools.partial(resnet_step_fn, hybridize, device, batch_size,
                                               static), context)
        if torch is not None:
            ways['PyTorch eager (cuDNN)'] = lambda: torch_resnet_step_fn('cuda', batch_size)[0]
        else:
            notes[f'PyTorch eager, batch {batch_size}'] = why
        rows += timed_rows(ways, batch_size, steps, rounds, notes)
    return rows, notes


def print_resnet_targets(rows):
    """The issue's targets, read off the rows (best against best, in this precision)."""
    theirs = {b: min(s) for name, b, s in rows if name.startswith('PyTorch')}
    mode = precision.current_mode() or 'defaults'
    for batch_size, wanted in ((128, 'target ≥ 0.9× in strict FP32'),
                               (16, 'static_alloc, target ≥ 1.0×, aim 2×, in strict FP32')):
        ours = [(min(s), name) for name, b, s in rows
                if b == batch_size and name.startswith('d2lperf')
                and ('static_alloc' in name or batch_size != 16)]
        if batch_size in theirs and ours:
            best, name = min(ours)
            print(f'target: ResNet-18 step, batch {batch_size}, {mode}: {name} '
                  f'{theirs[batch_size] / best:.2f}× PyTorch eager ({wanted})')


def gpu_resnet_section(cores, modes=tuple(precision.MODES)):
    """ResNet-18 on the GPU in each precision of `modes`, each in a fresh process (CuPy
    reads CUPY_TF32 once): this process starts a child per mode, which prints the rows.
    Returns the modes whose child failed."""
    if left_out_without_gpu('the ResNet-18 rows on the GPU are'):
        return []
    if precision.current_mode() is None:
        statuses = precision.run_in_each_mode(modes, [os.path.abspath(__file__), 'gpu_resnet'])
        return [mode for mode, status in statuses.items() if status]
    rows, notes = gpu_resnet_rows(GPU_RESNET_BATCHES, GPU_ROUNDS, GPU_STEPS)
    peak, floor_note = gpu_peak_flops(float32_mode())
    print_gpu_table(f'ResNet-18 (28x28), one SGD step on the GPU, waited for; best of '
                    f'{GPU_ROUNDS} rounds of {GPU_STEPS} steps, in turns; {floor_note}',
                    rows, resnet_flops, peak, notes)
    print_resnet_targets(rows)
    return []


def gpu_gpt_rows(sizes, batch, dtype='bfloat16', rounds=2, steps=2):
    """(rows, notes) of the small GPT's Adam step on the GPU in `dtype` (bfloat16 or float16):
    PyTorch eager under autocast(dtype) with scaled_dot_product_attention, and d2lperf
    imperative and hybridized with weights in `dtype` and float32 master weights; a row that
    cannot run says why (CuPy has no bfloat16: float16 is the 16-bit type d2lperf reaches on
    a GPU, and the one cuDNN's fused attention runs there)."""
    device, ways, notes = d2l.gpu(0), {}, {}
    torch, why = precision.torch_on_cuda()
    theirs = f'PyTorch eager, autocast {dtype}, SDPA'
    if torch is not None:
        ways[theirs] = lambda: torch_module_gpt_step_fn(sizes, batch, 'cuda',
                                                       getattr(torch, dtype))[0]
    else:
        notes[theirs] = why
    for name, hybridize in (('imperative', False), ('hybridized', True)):
        ways[f'd2lperf, {name}, {dtype}, multi_precision'] = functools.partial(
            gpt_step_fn, hybridize, device, sizes, batch, dtype)
    return timed_rows(ways, batch, steps, rounds, notes), notes


def gpu_gpt_section(cores):
    if left_out_without_gpu('the GPT rows on the GPU are'):
        return
    for dtype in ('float16', 'bfloat16'):
        gpu_gpt_table(dtype)


def gpu_gpt_table(dtype):
    rows, notes = gpu_gpt_rows(GPU_GPT_SIZES, GPU_GPT_BATCH, dtype)
    peak, floor_note = gpu_peak_flops('bfloat16')     # float16's tensor-core rate is the same
    described = ', '.join(f'{k} {v}' for k, v in GPU_GPT_SIZES.items())
    print_gpu_table(f'The small GPT ({described}), batch {GPU_GPT_BATCH}, one Adam step in '
                    f'{dtype} on the GPU, waited for; best of 2 rounds of 2 steps; {floor_note} '
                    '(img/s: sequences/s)', rows, lambda b: gpt_flops(GPU_GPT_SIZES, b), peak,
                    notes)
    theirs = [min(s) for name, b, s in rows if name.startswith('PyTorch')]
    ours = [(min(s), name) for name, b, s in rows if name.startswith('d2lperf')]
    if theirs and ours:
        best, name = min(ours)
        print(f'target: GPT step in {dtype}: {name} {theirs[0] / best:.2f}× PyTorch eager '
              '(target ≥ 0.8×)')
    else:
        print(f'target: GPT step in {dtype}: not measured (' + '; '.join(
            f'{name}: {why}' for name, why in notes.items()) + ')')


def ledger_peak(step, device):
    """(bytes held before a step, the ledger's peak during it, the CuPy pool's bytes after it)
    on `device`, on the naive engine (see `peak_of`), after a first step. The ledger counts
    the arrays d2lperf holds, not the scratch an operation takes inside (im2col's columns,
    a cuDNN workspace): the pool, emptied of cached blocks before the step, holds those too."""
    step()
    engine.use('naive')
    try:
        pool = memory_pool(device)
        if pool is not None:
            pool.free_all_blocks()
        d2l.device.reset_peak(device)
        before = d2l.device.memory(device).total
        step()
        return before, d2l.device.memory(device).peak, pool.total_bytes() if pool else None
    finally:
        engine.use('threaded')


def memory_pool(device):
    try:
        return device.xp.get_default_memory_pool()
    except AttributeError:                      # a stand-in CuPy without one
        return None


def torch_peak(torch, step):
    """The same for PyTorch: allocated before, torch.cuda.max_memory_allocated during the
    step, and max_memory_reserved (its caching allocator's pool)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    return before, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def gpu_memory_rows(batch_size):
    """(what, bytes before, peak bytes, pool bytes or None) of a ResNet-18 step on the GPU,
    and the notes of rows left out."""
    device, rows, notes = d2l.gpu(0), [], {}
    for road, context in convolution_roads():
        for kind, hybridize in (('imperative', False), ('hybridized static_alloc', True)):
            name = f'd2lperf, {kind}, {road}: the ledger'
            try:
                step = on_road(functools.partial(resnet_step_fn, hybridize, device, batch_size,
                                                 hybridize), context)
                rows.append((name,) + ledger_peak(step, device))
            except Exception as error:          # noqa: BLE001 - the row says why
                notes[name] = f'left out: {type(error).__name__}: {error}'[:300]
                engine_settled()
    torch, why = precision.torch_on_cuda()
    if torch is None:
        notes['PyTorch eager: torch.cuda.max_memory_allocated'] = why
    else:
        step = torch_resnet_step_fn('cuda', batch_size)[0]
        rows.append(('PyTorch eager: torch.cuda.max_memory_allocated',)
                    + torch_peak(torch, step))
    return rows, notes


def gpu_memory_section(cores):
    if left_out_without_gpu('the peak memory rows on the GPU are'):
        return
    batch_size = GPU_MEMORY_BATCH
    rows, notes = gpu_memory_rows(batch_size)
    mib = lambda nbytes: f'{nbytes / 2**20:.1f}' if nbytes is not None else '-'  # noqa: E731
    print(f'\nPeak memory of one ResNet-18 SGD step at batch {batch_size} on the GPU, after a '
          'first step; the pool column: the CuPy memory pool after the step (emptied of '
          'cached blocks before it), PyTorch\'s max_memory_reserved\n' + precision.settings())
    print('| what | held before, MiB | peak, MiB | peak − before, MiB | pool, MiB |\n'
          '|---|--:|--:|--:|--:|')
    for name, before, peak, pool in rows:
        print(f'| {name} | {mib(before)} | {mib(peak)} | {mib(peak - before)} | {mib(pool)} |')
    for name, why in notes.items():
        print(f'| {name} | {why} | | | |')
    print('target: peak memory of a step, side by side: ' + '; '.join(
        f'{name} {mib(peak)} MiB' for name, before, peak, pool in rows))


def gpu_rows():
    x, y = batch()
    step = d2lperf_step_fn([d2l.gpu(0)], x, y)
    return [('d2lperf on gpu(0), imperative', 'GPU', BATCH / best_seconds(step))]


def gpu_lenet_section(cores):
    if left_out_without_gpu('the LeNet row on the GPU is'):
        return
    print(f'\nLeNet, one SGD step at batch {BATCH} on the GPU\n{precision.settings()}')
    print('| what | where | img/s |\n|---|---|--:|')
    for name, where, ips in gpu_rows():
        print(f'| {name} | {where} | {ips:.0f} |')


def gpu_winograd_section(cores):
    if left_out_without_gpu('the Winograd rows on the GPU are'):
        return
    print('\nA 3×3 stride-1 convolution on gpu(0), forward: im2col against Winograd F(2×2, 3×3)'
          f'\n{precision.settings()}')
    print('| layer | batch | im2col ms | Winograd ms | im2col / Winograd |\n|---|--:|--:|--:|--:|')
    for name, batch_size, columns_s, winograd_s in gpu_winograd_rows():
        print(f'| {name} (gpu) | {batch_size} | {columns_s * 1e3:.3f} | {winograd_s * 1e3:.3f} | '
              f'{columns_s / winograd_s:.2f} |')


GPU_SECTIONS = {'gpu_lenet': gpu_lenet_section, 'gpu_resnet': gpu_resnet_section,
                'gpu_gpt': gpu_gpt_section, 'gpu_memory': gpu_memory_section,
                'gpu_winograd': gpu_winograd_section}


def gpu_section(cores, modes=tuple(precision.MODES)):
    """Every GPU row: ResNet-18 in each precision of `modes` (a child process each)."""
    if left_out_without_gpu('the GPU rows (LeNet, ResNet-18 in each precision, the GPT in '
                            'bfloat16, peak memory, Winograd) are'):
        return
    gpu_lenet_section(cores)
    failed = gpu_resnet_section(cores, modes)
    gpu_gpt_section(cores)
    gpu_memory_section(cores)
    gpu_winograd_section(cores)
    return failed


SECTIONS = {'lenet': lenet_section, 'data_parallel': data_parallel_section,
            'sharded': sharded_section, 'memory': memory_section, 'gpt': gpt_section,
            'resnet': resnet_section, 'convolutions': convolutions_section,
            'scaling': scaling_section, 'pieces': pieces_section,
            'gpu': gpu_section, **GPU_SECTIONS}
DEFAULT_SECTIONS = [name for name in SECTIONS if name not in GPU_SECTIONS]


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('sections', nargs='*', metavar='section',
                        help=f'any of {list(SECTIONS)}; all but the gpu_* ones (which `gpu` '
                             'runs) by default')
    parser.add_argument('--precision', nargs='+', default=list(precision.MODES),
                        choices=list(precision.MODES),
                        help='the precisions the GPU ResNet-18 rows run in, a process each')
    args = parser.parse_args(argv)
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        parser.error(f'unknown section(s) {unknown}: choose from {list(SECTIONS)}')
    return args


def main(argv=None):
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    cores = available_cores()
    print(f'# {platform.machine()}, {cores} cores, Python {platform.python_version()}, '
          f'NumPy {numpy.__version__}; batch {BATCH}, 28x28, best of {REPEATS}')
    print(f'# {blas_kernels()}')
    sections = dict(SECTIONS, gpu=functools.partial(gpu_section, modes=args.precision),
                    gpu_resnet=functools.partial(gpu_resnet_section, modes=args.precision))
    failed = [name for name in args.sections or DEFAULT_SECTIONS if sections[name](cores)]
    if failed:                  # a child process of theirs failed: its output says how
        raise SystemExit(f'section(s) {failed} failed in a child process')


if __name__ == '__main__':
    main()
