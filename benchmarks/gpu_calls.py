"""What a ResNet-18 training step asks of a GPU, counted on the stand-in GPU of the tests.

    python benchmarks/gpu_calls.py [--batch 4]

At batch 16 on an H200 a step is bound by the host: each kernel launch costs Python and
CuPy several microseconds, whatever the kernel does. So the number of launches a step makes
is the host's share of the step, and it can be counted without a GPU: the stand-in CuPy
(`tests/fakes/cupy.py`) and cuDNN frontend (`tests/fakes/cudnn.py`) run every call in NumPy
on the calling thread, and this script counts them. Counted: the launches CuPy's module
functions and kernels make, the ufuncs applied to arrays (`a + b`, `x.sum()`: one kernel
each on a GPU), the cuDNN graphs executed, and the copies `ascontiguousarray` makes. Work
inside a kernel or a graph is one call, as it is one launch on a GPU. Rows: convolutions by
im2col (`cudnn.off()`) and through cuDNN graphs, imperative and hybridized; beside them the
engine's operations a step.
"""
import argparse
import collections
import contextlib
import pathlib
import sys

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'tests'))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fakes import cudnn as fake_cudnn, cupy as fake_cupy    # noqa: E402


class Counts:
    """Calls made at the top: those a kernel or a cuDNN graph makes inside are its own."""

    def __init__(self):
        self.depth, self.by_kind = 0, collections.Counter()

    def count(self, kind):
        if not self.depth:
            self.by_kind[kind] += 1

    @contextlib.contextmanager
    def inside(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def install(counts):
    """The stand-ins as `cupy` and `cudnn`, every call they make counted."""
    cupy, frontend = fake_cupy.make_module(gpus=1), fake_cudnn.make_module()
    launch, execute = cupy.launch, fake_cudnn.FakeGraph.execute
    module_function = type(cupy).__getattr__

    def counted_launch(function, *args, **kwargs):
        counts.count('kernel launches')
        with counts.inside():
            return launch(function, *args, **kwargs)

    def counted_execute(graph, *args, **kwargs):
        counts.count('cuDNN graphs')
        with counts.inside():
            return execute(graph, *args, **kwargs)

    def counted_function(module, name):
        function = module_function(module, name)
        if name != 'ascontiguousarray':
            return function

        def copy(a, *args, **kwargs):
            result = function(a, *args, **kwargs)
            if not numpy.shares_memory(numpy.asarray(result), numpy.asarray(a)):
                counts.count('copies to a packed layout')
            return result
        return copy

    def counted_ufunc(array, ufunc, method, *inputs, **kwargs):
        counts.count('ufuncs on arrays')
        plain = [numpy.asarray(x) if isinstance(x, fake_cupy.FakeArray) else x for x in inputs]
        if 'out' in kwargs:
            kwargs['out'] = tuple(numpy.asarray(o) for o in kwargs['out'])
        with counts.inside():
            return fake_cupy.on_device(getattr(ufunc, method)(*plain, **kwargs))

    cupy.launch = counted_launch
    fake_cudnn.FakeGraph.execute = counted_execute
    type(cupy).__getattr__ = counted_function
    fake_cupy.FakeArray.__array_ufunc__ = counted_ufunc
    sys.modules['cupy'], sys.modules['cudnn'] = cupy, frontend


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch', type=int, default=4)
    args = parser.parse_args(argv)
    counts = Counts()
    install(counts)
    import d2lperf as d2l
    from d2lperf.ops import cudnn
    from training import resnet_step_fn         # benchmarks/training.py's step, as it times it
    kinds = ['kernel launches', 'ufuncs on arrays', 'cuDNN graphs', 'copies to a packed layout']
    print(f'ResNet-18 (28x28, batch {args.batch}), one SGD step on the stand-in GPU: '
          'calls that each launch GPU work')
    print('| convolutions | | engine operations | ' + ' | '.join(kinds) + ' | all |')
    print('|---|---|' + '--:|' * (len(kinds) + 2))
    for road in ('im2col', 'cuDNN'):
        for hybridize in (False, True):
            with cudnn.off() if road == 'im2col' else contextlib.nullcontext():
                step = resnet_step_fn(hybridize, d2l.gpu(0), args.batch)
                step()                              # builds the graphs, compiles the program
                counts.by_kind.clear()
                with d2l.profiler.profile() as records:
                    step()
            found = [counts.by_kind[k] for k in kinds]
            print(f'| {road} | {"hybridized" if hybridize else "imperative"} | {len(records)} | '
                  + ' | '.join(map(str, found)) + f' | {sum(found)} |')


if __name__ == '__main__':
    main()
