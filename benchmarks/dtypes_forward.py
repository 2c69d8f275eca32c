"""Forward time of float16 and bfloat16 against orchard's own float32, and against torch SDPA
at each dtype, on one shape, in one run (rounds alternate the calls; ratios are medians of
per-round ratios).

    python3 benchmarks/dtypes_forward.py [--shape 4,8,1024,64] [--rounds 7] [--device cpu]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

import orchard_ops
from orchard.benchmark import best_time

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,8,1024,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(shape, generator=g) for _ in range(3)]
    times = {(dt, who): [] for dt in DTYPES for who in ("orchard", "torch")}
    for _ in range(args.rounds):
        for dt in DTYPES:
            q, k, v = (t.to(dt) for t in base)
            times[dt, "orchard"].append(best_time(
                lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=True, device=args.device), 3))
            times[dt, "torch"].append(best_time(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3))
    f32 = times[torch.float32, "orchard"]
    print("causal forward, B,H,N,D = %s, orchard device %s, %d rounds"
          % (args.shape, args.device, args.rounds))
    print("| dtype | orchard ms | torch SDPA ms | orchard float32 / orchard | torch / orchard |")
    print("| --- | --- | --- | --- | --- |")
    for dt in DTYPES:
        mine, theirs = times[dt, "orchard"], times[dt, "torch"]
        print("| %s | %.1f | %.1f | %.2f | %.2f |" % (
            str(dt).replace("torch.", ""), min(mine) * 1e3, min(theirs) * 1e3,
            statistics.median(a / b for a, b in zip(f32, mine)),
            statistics.median(a / b for a, b in zip(theirs, mine))))


if __name__ == "__main__":
    main()
