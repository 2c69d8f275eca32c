"""Decode step over a paged KV cache (pages in scrambled order, D 128): the pages read in place
through a block_table, against the same call after gathering the pages into a contiguous copy
(torch indexing: what a kernel without paged reads needs first) and against a contiguous
cache. All three on one device, alternating, in one run; each figure the median over rounds of
the fastest of 5 calls.

    python3 benchmarks/paged_decode.py [--device opencl:0] [--rounds 15]
"""
import argparse
import statistics

import torch

import orchard_ops
from orchard.benchmark import best_time

# (query heads, kv heads, cache length, page size, dtype)
CASES = [(32, 8, 4096, 256, torch.float32), (32, 8, 4096, 16, torch.float32),
         (32, 8, 16384, 256, torch.float32), (32, 8, 4096, 256, torch.bfloat16),
         (32, 32, 4096, 256, torch.float32)]


def calls(h, hkv, n, page, dtype, device):
    """The in-place, gathered and contiguous calls of one case; their outputs are equal."""
    g = torch.Generator().manual_seed(0)
    kp, vp = (torch.randn(n // page, page, hkv, 128, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(n // page, generator=g)[None].to(torch.int32)
    q = torch.randn(1, h, 128, generator=g).to(dtype)
    cu_q, cu_k = (torch.tensor([0, m], dtype=torch.int32) for m in (1, n))
    rows = (table[0].long()[:, None] * page + torch.arange(page)).flatten()
    k, v = kp.flatten(0, 1)[rows], vp.flatten(0, 1)[rows]

    def run(k, v, **kw):
        return orchard_ops.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, causal=True, device=device,
                                                 **kw)[0]
    return {"in place": lambda: run(kp, vp, block_table=table),
            "gathered": lambda: run(kp.flatten(0, 1)[rows], vp.flatten(0, 1)[rows]),
            "contiguous": lambda: run(k, v)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="orchard device id")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the three calls")
    args = parser.parse_args()
    print("paged decode step, one query token, D 128, device %s\n" % args.device)
    print("| heads / kv heads | cache | page | dtype | in place ms | gathered ms | contiguous ms "
          "| gathered / in place | in place / contiguous |")
    print("|" + " --- |" * 9)
    for h, hkv, n, page, dtype in CASES:
        fns = calls(h, hkv, n, page, dtype, args.device)
        assert all(torch.equal(f(), fns["in place"]()) for f in fns.values())
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(best_time(fn, 5))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
        print("| %d / %d | %d | %d | %s | %.2f | %.2f | %.2f | %.2fx | %.2fx |" % (
            h, hkv, n, page, str(dtype).split(".")[-1], ms["in place"], ms["gathered"],
            ms["contiguous"], ratio("gathered", "in place"), ratio("in place", "contiguous")))


if __name__ == "__main__":
    main()
