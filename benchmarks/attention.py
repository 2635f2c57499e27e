"""Attention in tiles against the whole score matrix: bytes moved, memory kept, time.

Two tables from one run. The first sweeps the block size B (square tiles) against the
on-chip memory M one tile step needs (the q and out tiles, the k and v tiles, the scores:
4Bd + B² values) and prints the bytes the tile loop moved, counted as it ran, beside Dao et
al. (2022), Theorem 2: Θ(N²d²/M) for FlashAttention, Θ(Nd + N²) for standard attention (here
the whole matrix's four operations, 4Nd + 6N² values, each reading its inputs and writing its
output once). Under the causal mask k and v are read N(N + B)/2B times d values each, so the
count over N²d²/M tends to M/(Bd) = 4 + B/d as N grows (the column "N → ∞"); at small N,
reading q and writing out, Θ(Nd), still weigh. The count must equal the formula
(`ops.attention.tiled_traffic`): the script stops if it does not.

The second times forward and backward through `npx.attention` at each sequence length,
whole matrix and tiles round-robin (`median_seconds`), with the ratio to the whole matrix
from the same run, and the peak bytes of the memory ledger for each: the machine is noisy
and shared, so only the ratios mean much. On a GPU (`--gpu`, CuPy) the same tiles run over
CuPy; the whole matrix is then cuBLAS products and one softmax kernel.

    python benchmarks/attention.py [--seq 256 512 1024] [--width 64] [--heads 4]
                                   [--blocks 16 32 64 128] [--repeats 5] [--gpu]
"""
import argparse
import gc

import d2lperf as d2l
import numpy

from d2lperf import autograd, np, npx
from d2lperf.ops import attention as tiles
from d2lperf.utils import median_seconds


def traffic_rows(seqs, width, blocks, dtype='float32'):
    """One row per (seq, B): M, counted bytes, the formula's, and Theorem 2's two bounds."""
    itemsize = numpy.dtype(dtype).itemsize
    for seq in seqs:
        whole = tiles.whole_matrix_traffic(seq, width, dtype)
        for block in blocks:
            if block > seq:
                continue
            counted = tiles.counted_traffic(seq, width, (block, block), True, dtype)
            formula = tiles.tiled_traffic(seq, width, (block, block), True, dtype)
            if counted != formula:
                raise SystemExit(f'seq {seq}, B {block}: counted {counted} != formula {formula}')
            on_chip = tiles.on_chip_elements((block, block), width)
            bound = itemsize * seq * seq * width * width / on_chip
            limit = on_chip / (block * width)        # the k, v reads' N²d/B over N²d²/M
            yield seq, block, on_chip, counted, counted / bound, limit, whole, counted / whole


def print_traffic(rows, width):
    print(f'Bytes moved by the causal forward, d = {width}, float32 inputs (out and L saved '
          'in float64); the count equals tiles.tiled_traffic on every row')
    print(f'{"N":>6} {"B":>5} {"M (values)":>11} {"tiles: bytes":>14} {"/ (N²d²/M)":>11} '
          f'{"N → ∞":>6} {"whole: bytes":>14} {"tiles/whole":>11}')
    for seq, block, on_chip, counted, per_bound, limit, whole, ratio in rows:
        print(f'{seq:>6} {block:>5} {on_chip:>11} {counted:>14,} {per_bound:>11.2f} '
              f'{limit:>6.2f} {whole:>14,} {ratio:>11.2f}')


def step(q, k, v, block_size):
    """Forward and backward of one attention: the training step's share."""
    with autograd.record():
        out = npx.attention(q, k, v, causal=True, block_size=block_size)
    out.backward()
    npx.waitall()


def peak_bytes(device, run):
    gc.collect()
    before = d2l.device.memory(device).total
    d2l.device.reset_peak(device)
    run()
    return d2l.device.memory(device).peak - before


def timing_rows(device, seqs, width, heads, blocks, repeats):
    rng = numpy.random.default_rng(0)
    for seq in seqs:
        xs = [np.array(rng.normal(size=(1, heads, seq, width)).astype('float32'), device=device)
              for _ in range(3)]
        for x in xs:
            x.attach_grad()
        ways = {'whole': None, **{f'B={b}': b for b in blocks if b <= seq}}
        runs = {name: (lambda b=b: step(*xs, b)) for name, b in ways.items()}
        times = median_seconds(runs, repeats=repeats)
        peaks = {name: peak_bytes(device, run) for name, run in runs.items()}
        for name in ways:
            yield seq, name, times[name], times[name] / times['whole'], peaks[name]


def print_timing(rows, device, width, heads):
    print(f'\nForward + backward, causal, batch 1, {heads} heads, d = {width}, float32, on '
          f'{device}; median of repeats, round-robin; ratios to the whole matrix, same run')
    print(f'{"N":>6} {"version":>8} {"ms":>9} {"/ whole":>8} {"peak (ledger)":>15}')
    for seq, name, seconds, ratio, peak in rows:
        print(f'{seq:>6} {name:>8} {seconds * 1e3:>9.2f} {ratio:>8.2f} {peak:>15,}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--seq', type=int, nargs='+', default=[256, 512, 1024])
    parser.add_argument('--width', type=int, default=64)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--blocks', type=int, nargs='+', default=[16, 32, 64, 128])
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--gpu', action='store_true', help='time on gpu(0) (needs CuPy)')
    args = parser.parse_args()
    device = d2l.gpu() if args.gpu else d2l.cpu()
    print_traffic(traffic_rows(args.seq, args.width, args.blocks), args.width)
    print_timing(timing_rows(device, args.seq, args.width, args.heads, args.blocks,
                             args.repeats), device, args.width, args.heads)


if __name__ == '__main__':
    main()
