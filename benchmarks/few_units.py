"""Attention of fewer kv units (batch x kv heads) than work items, float32, against torch SDPA.

    python3 benchmarks/few_units.py [--shapes B,H,HKV,N,D[,causal] ...] [--rounds 7]

The native backward splits each kv unit's keys in parts, an item each, where units are fewer
than orchard.h's OR_BWD_ITEMS (one sequence, multi-query attention at micro-batch 1), and so
does the OpenCL tiled family's (a work-group each part); before, such a backward ran on as many
threads as it had units. Forward and backward of each shape, orchard's and torch's calls
alternating in rounds (orchard.benchmark.round_robin, torch calls followed by a pause, as
benchmarks/kernel_targets.py), a ratio being the median of its rounds' ratios; where an OpenCL
CPU device (PoCL) is listed, its backward too, against the native one. Prints a Markdown table.
"""
import argparse
import sys

import numpy as np
import orchard_ops
import torch

from orchard import benchmark

SHAPES = ["1,1,1,4096,64", "1,1,1,4096,64,causal", "1,8,1,2048,64", "1,8,1,2048,64,causal",
          "1,8,2,2048,128,causal", "1,2,2,4096,128"]


def shape_of(text):
    """(b, h, hkv, n, d, causal) from B,H,HKV,N,D[,causal]."""
    parts = text.split(",")
    if len(parts) not in (5, 6) or not all(p.isdigit() for p in parts[:5]) \
            or parts[5:] not in ([], ["causal"]):
        raise argparse.ArgumentTypeError("must be B,H,HKV,N,D or B,H,HKV,N,D,causal (got %r)"
                                         % text)
    b, h, hkv, n, d = (int(p) for p in parts[:5])
    if min(b, h, hkv, n, d) < 1 or h % hkv:
        raise argparse.ArgumentTypeError("needs sizes of 1 or more, HKV dividing H (got %r)"
                                         % text)
    return b, h, hkv, n, d, len(parts) == 6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=shape_of, default=[shape_of(s) for s in SHAPES])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    opencl = [x["id"] for x in orchard_ops.devices()
              if x["id"].startswith("opencl") and x["kind"] == "cpu"][:1]
    print(benchmark.against_torch_header(torch, args.rounds) + "\n")
    print("| B,H,HKV,N,D | causal | forward (ms) | torch (ms) | vs torch | backward (ms) "
          "| torch (ms) | vs torch | %s backward (ms) | vs native |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
          % (opencl[0] if opencl else "OpenCL CPU device"))
    gen = torch.Generator().manual_seed(0)
    for b, h, hkv, n, d, causal in args.shapes:
        q, dout = (torch.randn(b, h, n, d, generator=gen) for _ in range(2))
        k, v = (torch.randn(b, hkv, n, d, generator=gen) for _ in range(2))
        calls = {}
        calls["fwd"], calls["bwd"] = benchmark.orchard_calls(q, k, v, dout, causal, "cpu")
        calls["torch_fwd"], calls["torch_bwd"] = benchmark.sdpa_calls(q, k, v, dout, causal)
        if opencl:
            calls["cl_bwd"] = benchmark.orchard_calls(q, k, v, dout, causal, opencl[0])[1]
        t = benchmark.round_robin(calls, args.rounds, settle=("torch_fwd", "torch_bwd"))
        ms = {name: 1e3 * float(np.median(times)) for name, times in t.items()}
        vs = lambda name: float(np.median(t["torch_" + name] / t[name]))   # noqa: E731
        cl = ("%.1f | %.2f" % (ms["cl_bwd"], np.median(t["bwd"] / t["cl_bwd"])) if opencl
              else "- | -")
        print("| %d,%d,%d,%d,%d | %s | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %s |"
              % (b, h, hkv, n, d, "yes" if causal else "no", ms["fwd"], ms["torch_fwd"],
                 vs("fwd"), ms["bwd"], ms["torch_bwd"], vs("bwd"), cl), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
