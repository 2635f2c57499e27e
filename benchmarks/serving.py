"""Serving a GPT: the decode step against its roofline, and two batching policies compared.

The first table times a decode step (`inference.roofline.decode_step`: generation's own step,
one token a sequence after --context tokens in a contiguous KV cache) for each batch size,
beside its two floors: bytes (weights + KV cache) over the main-memory bandwidth, and FLOPs
over the float32 matrix-product peak, both measured in the same run as the Hardware chapter
measures them; and beside its overhead, the same step of a thin copy of the GPT (same
operations, one feature a head), timed round-robin with it. The verdict names the largest of
the three. It runs on two GPTs: a large one whose weights leave the caches, and a small one.

The second fits a step-cost model to timed prefill and decode steps of the serving GPT,
prints the fit's largest relative error beside it, and then serves --requests requests (their
prompt and output lengths: a paragraph of the course's text corpus and the paragraph after
it, `paged.corpus_requests`, in characters, prompts cut to --max-len / 2) by static batching
and by iteration-level scheduling at each load (arrival rate over the rate one request at a
time can be served), on the simulated clock the fit drives. The simulation is exact given
the fit; the fit is this machine's, measured under its load. Last, the same at the highest
load with every request at the mean lengths: what is left of the gain without their spread.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/serving.py \
        [--large 8 512 8] [--small 2 128 4] [--serve 4 256 4] [--context 128]
        [--batches 1 2 4 ... 64] [--requests 400] [--max-len 1024]
        [--loads 0.5 1 2 4 8 16 32] [--batch-size 4 16] [--repeats 5]
"""
import argparse
import os

import numpy

import d2lperf as d2l
from d2lperf import data
from d2lperf import hardware
from d2lperf.hardware import print_table
from d2lperf.inference import batching, paged, roofline


def machine_and_roof():
    """Print the machine, its BLAS and the two OpenBLAS settings a reader's laptop leaves unset,
    then measure its roof: every figure after is read beside these. (bandwidth, peak)."""
    machine = hardware.system_summary()
    print(f"machine: {machine['cpu_model']}, {machine['logical_cpus']} CPUs, BLAS "
          f"{machine['blas']}; "
          + ', '.join(f'{name}={os.environ.get(name, "(unset)")}'
                      for name in ('OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE')))
    bandwidth, peak = roofline.machine_roof()
    print(f'main-memory bandwidth (triad, 256 MiB): {bandwidth:.1f} GB/s; float32 matrix '
          f'product: {peak:.0f} GFLOP/s; ridge {peak / bandwidth:.1f} FLOP/byte')
    return bandwidth, peak


def gpt(layers, width, heads, vocab=96, max_len=1024):
    net = d2l.nn.GPT(vocab, layers, width, heads, max_len)
    net.initialize()
    return net


def roofline_table(net, name, batches, context, bandwidth, peak, repeats):
    weights = roofline.step_weight_bytes(net, 1)
    print(f'\n{name}: {weights / 2**20:.1f} MiB of weights read a step, context {context}')
    rows = roofline.decode_rows(net, batches, context, bandwidth, peak, repeats)
    limits = roofline.verdict(rows)
    for row in rows:
        row['limit'] = limits[row['batch']]
    print_table(rows)


def serving_tables(net, pairs, loads, batch_sizes, repeats):
    cost, errors = batching.measure_cost(net, [1, 4, 16, 64], [16, 64, 256], repeats=repeats)
    print(f'\nstep cost: {cost}\nlargest relative error of the fit on the timed steps: '
          + ', '.join(f'{phase} {error:.0%}' for phase, error in errors.items()))
    print(f'one request at a time: {batching.solo_rate(cost, pairs):.2f} requests/s')
    for batch_size in batch_sizes:
        print(f'\n{len(pairs)} requests; static batches of {batch_size}, the same KV memory '
              'for both')
        rows = batching.compare_policies(pairs, cost, loads, batch_size)
        print_table([{k: v for k, v in row.items() if not k.endswith('_mean')} for row in rows])
        for load in loads:
            pair = {r['policy']: r for r in rows if r['load'] == load}
            gain = pair['iteration-level']['tokens_per_s'] / pair['static']['tokens_per_s']
            faster = pair['static']['latency_p50'] / pair['iteration-level']['latency_p50']
            print(f'load {load:>5}: iteration-level gives {gain:.2f}x the tokens/s, '
                  f'p50 latency {faster:.2f}x shorter')
        mean = [tuple(int(n) for n in numpy.round(numpy.mean(pairs, axis=0)))] * len(pairs)
        print(f'every request at the mean lengths {mean[0]}, load {loads[-1]}:')
        print_table([{k: v for k, v in row.items() if not k.endswith('_mean')}
                     for row in batching.compare_policies(mean, cost, loads[-1:], batch_size)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--large', type=int, nargs=3, default=[8, 512, 8],
                        metavar=('LAYERS', 'WIDTH', 'HEADS'))
    parser.add_argument('--small', type=int, nargs=3, default=[2, 128, 4],
                        metavar=('LAYERS', 'WIDTH', 'HEADS'))
    parser.add_argument('--serve', type=int, nargs=3, default=[4, 256, 4],
                        metavar=('LAYERS', 'WIDTH', 'HEADS'))
    parser.add_argument('--context', type=int, default=128)
    parser.add_argument('--batches', type=int, nargs='+', default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument('--requests', type=int, default=400)
    parser.add_argument('--max-len', type=int, default=1024)
    parser.add_argument('--loads', type=float, nargs='+', default=[0.5, 1, 2, 4, 8, 16, 32])
    parser.add_argument('--batch-size', type=int, nargs='+', default=[4, 16])
    parser.add_argument('--repeats', type=int, default=5)
    args = parser.parse_args()
    start = hardware.cpu_times()
    bandwidth, peak = machine_and_roof()
    for name, sizes in (('large GPT', args.large), ('small GPT', args.small)):
        roofline_table(gpt(*sizes), f'{name} {sizes}', args.batches, args.context, bandwidth,
                       peak, args.repeats)
    pairs = paged.corpus_requests(data.python_docs(), args.requests, args.max_len)
    serving_tables(gpt(*args.serve), pairs, args.loads, args.batch_size, args.repeats)
    print(f'\nother processes kept {hardware.load_by_others(start, hardware.cpu_times()):.2f} '
          'CPUs busy on average during this run')


if __name__ == '__main__':
    main()
