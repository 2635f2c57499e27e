"""Generation with a KV cache against recomputing the prefix, each beside its floor.

For each GPT it times `inference.generate` of N new tokens after a batch of prompts, with the
contiguous cache, with the static one (the same cache, each decode step one compiled
program, one engine push), and with `cache=None` (every step recomputes the whole prefix
through the same blocks), and a greedy loop of the hybridized GPT's own forward over the whole prefix
(what speculative decoding's `recomputed` does). Each beside its floor from this run: the sum
over its passes of max(bytes / bandwidth, FLOPs / peak) (`inference.roofline`: a cached pass
reads the weights and the cache; a recomputing pass is a prefill of the whole prefix), with
the bandwidth (triad) and the float32 product's peak measured as the Hardware chapter does.
Timed at a few N, to see from which N the cache wins. The GPTs: the chapter's quick (2 × 64,
4 heads) and full (4 × 256, 8 heads) ones with its prompts, and speculative decoding's target
(2 × 128, 4 heads, one prompt of 8, 57 new tokens). The static cache's first call, which
traces and compiles its step for that batch and length, is timed apart ("static_first_s";
the medians exclude it). Last, one decode step of the full GPT at
long contexts, where the cache is most of the bytes it reads, beside its floor.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/kv_cache.py [--repeats 3]
"""
import argparse
import time

import numpy

import d2lperf as d2l
from d2lperf import hardware, np
from d2lperf.hardware import print_table
from d2lperf.inference import generate, roofline
from serving import machine_and_roof       # the same header and roof as the serving tables

VOCAB = 96
GPTS = {'chapter quick': ((2, 64, 4), 48, 24, 4), 'chapter full': ((4, 256, 8), 128, 64, 4),
        'speculative target': ((2, 128, 4), 8, 57, 1)}


def gpt(layers, width, heads, max_len=1024):
    np.random.seed(0)
    return d2l.nn.GPT(VOCAB, layers, width, heads, max_len).initialize()


def prompts_of(longest, batch):
    """The chapter's prompts' lengths: longest · (i + 2) / 5 for i = 0 .. 3 (one: longest)."""
    rng = numpy.random.default_rng(0)
    lengths = [longest] if batch == 1 else [longest * (i + 2) // 5 for i in range(batch)]
    return [rng.integers(0, VOCAB, n) for n in lengths]


def hybrid_recompute(net, prompts, new):
    """Greedy tokens by the hybridized GPT's own forward over the whole (unpadded) prefix."""
    def run():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new):
                logits = net(np.array(numpy.array([ids], numpy.int64))).asnumpy()
                ids.append(int(logits[0, -1].argmax()))
    return run


def pass_floor(net, batch, tokens, context, bandwidth, peak):
    """max(bytes / bandwidth, FLOPs / peak) of a pass of `tokens` new columns after `context`
    cached ones (context 0: a prefill)."""
    if context == 0:
        memory, flops = (roofline.prefill_bytes(net, batch, tokens),
                         roofline.prefill_flops(net, batch, tokens))
    else:
        memory, flops = (roofline.decode_bytes(net, batch, context + 1),
                         roofline.decode_flops(net, batch, context + 1))
    return max(memory / (bandwidth * 1e9), flops / (peak * 1e9))


def floors(net, prompts, new, bandwidth, peak):
    """Seconds: (cached, recomputed) floors of `new` tokens after the left-padded prompts."""
    batch, longest = len(prompts), max(map(len, prompts))
    cached = pass_floor(net, batch, longest, 0, bandwidth, peak) + sum(
        pass_floor(net, batch, 1, longest + i, bandwidth, peak) for i in range(new - 1))
    recomputed = sum(pass_floor(net, batch, longest + i, 0, bandwidth, peak)
                     for i in range(new))
    return cached, recomputed


def timed(net, hybrid, prompts, new, repeats):
    runs = {cache or 'recompute': lambda cache=cache: generate(net, prompts, new, cache=cache)
            for cache in ('contiguous', 'static', None)}
    runs['recompute, hybridized'] = hybrid_recompute(hybrid, prompts, new)
    start = time.perf_counter()
    runs['static']()                        # compiles the step for this batch and length
    first = time.perf_counter() - start
    return dict(d2l.median_seconds(runs, repeats=repeats, min_seconds=0), static_first=first)


def compare(name, sizes, longest, new, batch, bandwidth, peak, repeats):
    net, hybrid = gpt(*sizes), gpt(*sizes).hybridize()
    prompts = prompts_of(longest, batch)
    rows = []
    for count in sorted({1, 2, 4, 8, 16, 24, new}):
        if count > new:
            continue
        seconds = timed(net, hybrid, prompts, count, repeats)
        cached_floor, recomputed_floor = floors(net, prompts, count, bandwidth, peak)
        rows.append({'new': count, 'cached_s': seconds['contiguous'],
                     'static_s': seconds['static'], 'static_first_s': seconds['static_first'],
                     'cached_floor_s': cached_floor, 'recompute_s': seconds['recompute'],
                     'hybrid_recompute_s': seconds['recompute, hybridized'],
                     'recompute_floor_s': recomputed_floor,
                     'speedup': seconds['recompute'] / seconds['contiguous'],
                     'speedup_over_hybrid': seconds['recompute, hybridized']
                     / seconds['contiguous'],
                     'static_over_hybrid': seconds['recompute, hybridized'] / seconds['static']})
    print(f'\n{name} {sizes}: prompts {[len(p) for p in prompts]}')
    print_table(rows)


def long_context_steps(sizes, batch, contexts, bandwidth, peak, repeats):
    """One decode step of the chapter's full GPT after `context` cached tokens, where the
    cache, not the weights, is most of the bytes: the step beside its floor."""
    net, rows = gpt(*sizes), []
    for context in contexts:
        seconds = d2l.median_seconds(roofline.decode_step(net, batch, context), repeats)
        floor = pass_floor(net, batch, 1, context - 1, bandwidth, peak)
        rows.append({'context': context, 'cache_MiB': roofline.kv_cache_bytes(
            net, batch, context) / 2**20, 'step_ms': seconds * 1e3, 'floor_ms': floor * 1e3,
            'step_over_floor': seconds / floor})
    print(f'\none decode step, {sizes}, batch {batch}')
    print_table(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--only', nargs='*', default=list(GPTS))
    parser.add_argument('--contexts', type=int, nargs='*', default=[128, 512, 1000])
    args = parser.parse_args()
    start = hardware.cpu_times()
    bandwidth, peak = machine_and_roof()
    for name in args.only:
        compare(name, *GPTS[name], bandwidth, peak, args.repeats)
    if args.contexts:
        long_context_steps(GPTS['chapter full'][0], 16, args.contexts, bandwidth, peak,
                           args.repeats)
    print(f'\nother processes kept {hardware.load_by_others(start, hardware.cpu_times()):.2f} '
          'CPUs busy on average during this run')


if __name__ == '__main__':
    main()
