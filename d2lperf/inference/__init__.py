"""Inference: a GPT served fast. Generation with a KV cache (generate.py, cache.py; with
cache='static' each decode step is one compiled program), the cache in pages (paged.py), and
a draft GPT's guesses checked by the target in one pass (speculative.py). Taught in
"Inference"."""
from .cache import ContiguousCache, KVCache, cache_bytes
from .generate import agreement, forward, generate, sampler
from .paged import (BLOCK_SIZE, BlockAllocator, BlockTables, PagedCache, corpus_requests,
                    utilization)

__all__ = ['ContiguousCache', 'KVCache', 'cache_bytes', 'agreement', 'forward', 'generate',
           'sampler', 'BLOCK_SIZE', 'BlockAllocator', 'BlockTables', 'PagedCache',
           'corpus_requests', 'utilization']
