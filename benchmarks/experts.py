"""The all-to-all on virtual devices, in nccl-tests' columns, and the capacity factor's
effect on a mixture of experts split over them, each measured beside its formula.

    python benchmarks/experts.py
    D2LPERF_QUICK=1 python benchmarks/experts.py

All-to-all columns: size (bytes of float32 on each device), devices, time (median of
interleaved repeats, µs), algbw = size / time and busbw = algbw · (n-1)/n (GB/s: what left
each device), #wrong (elements that differ from NumPy's transpose of the chunks). The `floor`
row is one NumPy copy of the array on one memory system. The capacity rows split a mixture of
E experts over n devices and report, for a router at its initial weights, the dropped share and
the padding (rows of the buffers no token took), and the bytes each device sent through the
four all-to-alls of a step (two forward, two backward), read off the engine's records, beside
4 · (n-1)/n · E · C · hiddens · 4 with C = ⌈k · tokens / E · capacity factor⌉.
"""
import os
import platform

import d2lperf as d2l
import numpy

from d2lperf import autograd, comm, np, npx, profiler
from d2lperf.comm.all_to_all import bytes_each_sends
from d2lperf.model_parallel import expert_parallel
from d2lperf.nn.moe import capacity
from d2lperf.utils import median_seconds
from parallel import report_other_load

SIZES = [2 ** k for k in d2l.workload(range(12, 27, 2), [12, 18, 24])]
DEVICE_COUNTS = (2, 4, 8)
REPEATS = d2l.workload(5, 3)
HIDDEN, EXPERTS, TOKENS = d2l.workload((64, 8, 512), (32, 8, 128))


def wrong_elements(hosts, outs):
    n = len(hosts)
    chunks = [numpy.split(h, n) for h in hosts]
    return sum(int((out.asnumpy() != numpy.concatenate([c[j] for c in chunks])).sum())
               for j, out in enumerate(outs))


def all_to_all_rows():
    print(f'{"size":>10s}  {"devices":>7s}  {"time (µs)":>11s}  {"algbw GB/s":>11s}  '
          f'{"busbw GB/s":>11s}  {"#wrong":>6s}')
    for n in DEVICE_COUNTS:
        devices = [d2l.cpu(i) for i in range(1, n + 1)]
        for size in SIZES:
            rng = numpy.random.default_rng(size)
            hosts = [rng.standard_normal(size // 4, dtype=numpy.float32) for _ in devices]
            arrays = [np.array(h, device=d) for h, d in zip(hosts, devices)]
            wrong = wrong_elements(hosts, comm.all_to_all(arrays))
            source, target = hosts[0], numpy.empty_like(hosts[0])
            times = median_seconds({
                'all-to-all': lambda: (comm.all_to_all(arrays), npx.waitall()),
                'floor': lambda: numpy.copyto(target, source)}, REPEATS, min_seconds=0.02)
            for name, seconds in times.items():
                algbw = size / seconds / 1e9
                busbw = algbw * (n - 1) / n if name == 'all-to-all' else algbw
                print(f'{size:>10d}  {n:>7d}  {seconds * 1e6:>11.1f}  {algbw:>11.3f}  '
                      f'{busbw:>11.3f}  {wrong if name == "all-to-all" else "-":>6}'
                      f'{"  floor" if name == "floor" else ""}', flush=True)


def capacity_rows(n=4):
    print(f'\n# {EXPERTS} experts over {n} devices, {TOKENS} tokens a device, {HIDDEN} '
          'hiddens, the router at its initial weights')
    print(f'{"k":>2s}  {"factor":>6s}  {"C":>4s}  {"dropped":>8s}  {"padding":>8s}  '
          f'{"sent B":>9s}  {"formula B":>9s}')
    devices = [d2l.cpu(i) for i in range(1, n + 1)]
    for top_k in (1, 2):
        for factor in (0.5, 1.0, 1.25, 2.0):
            np.random.seed(0)
            moe = d2l.nn.MoE(HIDDEN, EXPERTS, top_k, factor).initialize()
            ep = expert_parallel(moe, devices)
            xs = [np.random.normal(size=(TOKENS, HIDDEN)).copyto(d) for d in devices]
            for x in xs:              # as inside a network: the layer's input needs gradients
                x.attach_grad()
            npx.waitall()
            with profiler.profile() as records:
                with autograd.record():
                    losses = [(out * out).sum() for out in ep(xs)]
                ep.backward(losses)
            sent = sum(t['bytes'] for t in comm.transfers_in(records)
                       if t['action'] == 'send' and t['source'] == devices[0])
            rows = capacity(TOKENS, EXPERTS, top_k, factor)
            padding = EXPERTS * rows * n - (top_k * TOKENS * n - ep.dropped)
            formula = 4 * bytes_each_sends(EXPERTS * rows * HIDDEN * 4, n)
            print(f'{top_k:>2d}  {factor:>6.2f}  {rows:>4d}  '
                  f'{ep.dropped / (top_k * TOKENS * n):>8.3f}  '
                  f'{padding / (EXPERTS * rows * n):>8.3f}  {sent:>9d}  {formula:>9d}')


def main():
    print(f'# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
          f'{"quick" if os.environ.get("D2LPERF_QUICK") else "full"} sizes')
    all_to_all_rows()
    capacity_rows()


if __name__ == '__main__':
    report_other_load(main, '# ')
