"""A decode step under torch.compile: one new token per sequence written into a contiguous KV
cache and attended over it, by orchard's flash_attn_with_kvcache and by torch SDPA (the new
keys and values written by index, then attention over the whole cache with a mask of the
filled keys), each eager and compiled by Inductor (fullgraph=True), the four interleaved in
rounds (orchard.benchmark.round_robin; the first round compiles). Microseconds a step,
medians.

    python3 benchmarks/compiled_decode.py [--rounds 30] [--steps 20]
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from orchard import benchmark  # noqa: E402
from orchard.flash_attn import flash_attn_with_kvcache  # noqa: E402

# (batch, query heads, kv heads, head dim, cache length, filled): a small model's step, where
# the calls' overhead shows, and a Llama-3-8B layer's at 4k
SHAPES = [(1, 8, 8, 64, 512, 300), (4, 32, 8, 128, 4096, 3000)]


def orchard_step(q, k_cache, v_cache, k, v, lengths):
    return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                   causal=True)


def sdpa_step(q, k_cache, v_cache, k, v, lengths):
    """The same step in torch: caches (B, N, Hkv, D) as orchard's, attention in (B, H, N, D)."""
    rows = torch.arange(q.shape[0])[:, None]
    pos = lengths.long()[:, None]
    k_cache[rows, pos] = k
    v_cache[rows, pos] = v
    filled = torch.arange(k_cache.shape[1])[None, :] <= pos            # (B, N)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        attn_mask=filled[:, None, None, :], enable_gqa=True)
    return out.transpose(1, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20, help="decode steps a timed call makes")
    args = parser.parse_args()
    print("| B, H, Hkv, D, cache (filled) | orchard eager | orchard compiled | torch SDPA eager "
          "| torch SDPA compiled | orchard compiled: speed-up | orchard vs torch, compiled: speed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b, h, hk, d, n, filled in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, 1, h, d, generator=g)
        k, v = (torch.randn(b, 1, hk, d, generator=g) for _ in range(2))
        lengths = torch.full((b,), filled, dtype=torch.int32)
        calls = {}
        for name, step in (("orchard", orchard_step), ("sdpa", sdpa_step)):
            for compiled in (False, True):
                fn = torch.compile(step, fullgraph=True) if compiled else step
                caches = [torch.randn(b, n, hk, d, generator=g) for _ in range(2)]

                def call(fn=fn, caches=caches):
                    for _ in range(args.steps):
                        fn(q, *caches, k, v, lengths)

                calls[name + (" compiled" if compiled else "")] = call
        torch._dynamo.reset()
        t = benchmark.round_robin(calls, args.rounds)
        us = {name: 1e6 * float(np.median(x)) / args.steps for name, x in t.items()}
        print("| %d, %d, %d, %d, %d (%d) | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f |" % (
            b, h, hk, d, n, filled, us["orchard"], us["orchard compiled"], us["sdpa"],
            us["sdpa compiled"], us["orchard"] / us["orchard compiled"],
            us["sdpa compiled"] / us["orchard compiled"]))


if __name__ == "__main__":
    main()
