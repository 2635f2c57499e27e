"""Is a change slower? The GPT's split rows, or one device's steps, on two trees, alternated.

A row's time moves by ±20 % between processes on a shared 2-core VM, so one run of each tree
says little. This runs each tree in a fresh child process per run, the trees in turns, and
prints the median over runs of every tree (with the runs' spread) and its ratio to the first
tree. Make the trees with `git worktree add --detach /tmp/before REV`.

- `--rows split` (the default): the GPT step on one device, tensor parallel over 2 devices,
  data parallel over 4 replicas, the 1F1B pipeline over 4 stages, each row over the same
  process's one-device step.
- `--rows threads`: one device's step at 1 and 2 threads (the small GPT 4×128 and 4×256, and
  LeNet), in ms, in turns with references timed in the same process: LeNet's NumPy floor, and
  PyTorch's LeNet and GPT (as its users write it) where PyTorch is installed.

    python benchmarks/compare_trees.py --runs 6 before=/tmp/before after=.
    python benchmarks/compare_trees.py --rows threads --quiet --runs 3 before=/tmp/before after=.

Benchmark with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, as a reader's machine has them
(`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`); both are printed.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROWS = ('one device', 'tensor parallel, t = 2', 'data parallel, 4 replicas',
        '1F1B pipeline, 4 stages')


def child_rows(steps=5):
    """{row: seconds over the one-device step} for the tree on sys.path (run in a child)."""
    import numpy
    import training
    import d2lperf as d2l
    from d2lperf import autograd, np, npx
    from d2lperf.model_parallel import Pipeline, parallel_gpt, tensor_parallel
    devices = [d2l.cpu(i) for i in range(1, 5)]
    tokens, labels = training.gpt_data()
    loss = d2l.SoftmaxCrossEntropyLoss()

    def tensor(t):
        split = tensor_parallel(training.small_gpt(devices[0]), devices[:t])
        trainer = d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 1e-3})
        x = np.array(tokens)

        def step():
            with autograd.record():
                values = [loss(out, np.array(labels, device=out.device)).sum()
                          for out in split(x)]
            split.backward(values)
            trainer.step(1)
            npx.waitall()
        return step

    def data_parallel():
        split = parallel_gpt(training.small_gpt(devices[0]), devices, 4, 1, 1, '1f1b')
        trainer = d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 1e-3})
        x, y = np.array(tokens), np.array(labels)

        def step():
            split.forward_backward(x, y, loss, 1)
            trainer.update(1)           # forward_backward summed over the replicas
            npx.waitall()
        return step

    def pipeline():
        net = training.small_gpt(devices[0])
        split = Pipeline(net, devices, '1f1b')
        trainer = d2l.Trainer(net.collect_params(), 'adam', {'learning_rate': 1e-3})
        parts = numpy.array_split(numpy.arange(training.GPT_BATCH), len(devices))
        xs, ys = ([np.array(a[p]) for p in parts] for a in (tokens, labels))

        def step():
            split.forward_backward(xs, ys, loss)
            trainer.step(1)
            npx.waitall()
        return step
    steps_of = dict(zip(ROWS, (training.gpt_step_fn(False, devices[0]), tensor(2),
                               data_parallel(), pipeline())))
    for step in steps_of.values():
        step(), step()                          # warm: memory, compiled kernels, threads
    seconds = {row: [] for row in ROWS}
    for _ in range(steps):                      # rows in turns: a slow moment hits them all
        for row, step in steps_of.items():
            start = time.perf_counter()
            step()
            seconds[row].append(time.perf_counter() - start)
    one = statistics.median(seconds[ROWS[0]])
    return {row: statistics.median(s) / one for row, s in seconds.items()} | {
        'one device, ms': one * 1e3}


def child_thread_rows(steps=5):
    """{row: ms a step, median of `steps`} at 1 and 2 threads for the tree on sys.path (run in
    a child): each d2lperf step and the references, in turns (PyTorch's where installed)."""
    import training
    import d2lperf as d2l
    from d2lperf import hardware
    from threadpoolctl import threadpool_limits
    x, y = training.batch()
    params = training.initial_params()
    steps_of = {'LeNet': training.d2lperf_step_fn([d2l.cpu(0)], x, y),
                'LeNet, NumPy floor': lambda: training.numpy_step(params, x, y)}
    torch = (training.torch_step_fn(x, y) or (None, None))[1]
    if torch:
        steps_of['LeNet, PyTorch'] = training.torch_step_fn(x, y)[0]
    for shape, (sizes, batch) in training.GPT_SHAPES.items():
        steps_of[f'GPT {shape}'] = training.gpt_step_fn(False, None, sizes, batch)
        if torch:
            steps_of[f'GPT {shape}, PyTorch'] = training.torch_module_gpt_step_fn(sizes,
                                                                                  batch)[0]
    ms, before = {}, hardware.cpu_times()
    for threads in (1, 2):
        with threadpool_limits(threads):
            if torch:
                torch.set_num_threads(threads)
            for step in steps_of.values():
                step()                                  # warm at this thread count
            seconds = {row: [] for row in steps_of}
            for _ in range(steps):
                for row, step in steps_of.items():
                    start = time.perf_counter()
                    step()
                    seconds[row].append(time.perf_counter() - start)
        ms |= {f'{row}, {threads} thread(s), ms': 1e3 * statistics.median(s)
               for row, s in seconds.items()}
    return ms | {'cores other programs kept busy': hardware.load_by_others(
        before, hardware.cpu_times())}


def busy_cores(seconds=2.0):
    """How many cores were busy over `seconds` (/proc/stat; None where it is missing)."""
    def times():
        with open('/proc/stat') as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return sum(values), values[3] + values[4]            # all, idle + iowait
    try:
        (total_a, idle_a), _, (total_b, idle_b) = times(), time.sleep(seconds), times()
    except OSError:
        return None
    return (os.cpu_count() or 1) * (1 - (idle_b - idle_a) / max(1, total_b - total_a))


def wait_for_quiet(most=0.2, limit_s=600):
    """Wait until other programs keep fewer than `most` cores busy (at most `limit_s`): on a
    shared machine a run while another program holds a core times that program."""
    deadline = time.time() + limit_s
    while time.time() < deadline and (busy_cores() or 0) >= most:
        pass


CHILDREN = {'split': 'child_rows', 'threads': 'child_thread_rows'}


def run_tree(path, rows='split'):
    """One child process on the tree at `path`: its rows."""
    code = (f'import sys, json; sys.path[:0] = [{str(path / "benchmarks")!r}, '
            f'{str(pathlib.Path(__file__).parent)!r}]; import compare_trees; '
            f'print(json.dumps(compare_trees.{CHILDREN[rows]}()))')
    env = dict(os.environ, PYTHONPATH=str(path))
    done = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode:
        raise RuntimeError(f'{path}: {done.stderr[-2000:]}')
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('trees', nargs='+',
                        help='NAME=PATH of each source tree, the reference first')
    parser.add_argument('--runs', type=int, default=4)
    parser.add_argument('--rows', choices=sorted(CHILDREN), default='split')
    parser.add_argument('--quiet', action='store_true',
                        help='start each run once other programs leave the cores idle')
    args = parser.parse_args()
    trees = {name: pathlib.Path(path).resolve()
             for name, path in (tree.split('=', 1) for tree in args.trees)}
    print({name: os.environ.get(name) for name in ('OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE')})
    runs = {name: [] for name in trees}
    for r in range(args.runs):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            if args.quiet:
                wait_for_quiet()
            runs[name].append(run_tree(trees[name], args.rows))
            print(name, {k: round(v, 2) for k, v in runs[name][-1].items()}, os.getloadavg(),
                  flush=True)
    first = next(iter(trees))
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
               for name, rs in runs.items()}
    spread = {name: {k: (min(run[k] for run in rs), max(run[k] for run in rs)) for k in rs[0]}
              for name, rs in runs.items()}
    print(f'\n| row | {" | ".join(trees)} | ' + ' | '.join(f'{n} / {first}' for n in trees
                                                          if n != first) + ' |')
    print('|---|' + '--:|' * (2 * len(trees) - 1))
    for row in medians[first]:
        values = [f'{medians[n][row]:.2f} ({spread[n][row][0]:.2f}–{spread[n][row][1]:.2f})'
                  for n in trees]
        ratios = [f'{medians[n][row] / medians[first][row]:.2f}' for n in trees if n != first]
        print(f'| {row} | ' + ' | '.join(values + ratios) + ' |')


if __name__ == '__main__':
    main()
