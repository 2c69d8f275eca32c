"""Attention throughput of every orchard device against this machine's practical roofline,
in one run.

    python benchmarks/bench_attention.py [--shape B H N D] [--repeats 5] [--json FILE]

Reports, for float32, NumPy's sgemm GFLOP/s (the roofline), orchard's forward and backward on
every device (FlashAttention-2 accounting: forward 4*B*H*N*N*D flops, halved when causal;
backward 2.5x forward), naive NumPy attention, and torch SDPA when torch is installed; every
ratio is taken within this one run. The full grid and plots come with orchard-bench (a later
issue).
"""
import argparse
import json
import platform
import time

import numpy as np

import orchard_ops


def best_time(fn, repeats):
    fn()  # warm-up: thread start, page faults
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def naive_attention(q, k, v):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 8, 1024, 64],
                        metavar=("B", "H", "N", "D"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    b, h, n, d = args.shape
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
    flops = 4.0 * b * h * n * n * d
    results = {"machine": f"{platform.processor() or platform.machine()}, "
                          f"{orchard_ops.devices()[0]['name']}, "
                          f"{orchard_ops.get_num_threads()} threads",
               "shape": [b, h, n, d], "dtype": "float32"}

    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    results["sgemm_gflops"] = 2 * 2048 ** 3 / best_time(lambda: a @ a, args.repeats) / 1e9

    def gflops(name, fn, work):
        results[name + "_ms"] = best_time(fn, args.repeats) * 1e3
        results[name + "_gflops"] = work / results[name + "_ms"] / 1e6

    names = []
    for dev in (d["id"] for d in orchard_ops.devices()):
        tag = "orchard_" + dev.replace(":", "")
        gflops(tag + "_fwd", lambda: orchard_ops.flash_attn_fwd(q, k, v, device=dev), flops)
        gflops(tag + "_fwd_causal",
               lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=True, device=dev), flops / 2)
        out, lse = orchard_ops.flash_attn_fwd(q, k, v, device=dev)
        gflops(tag + "_bwd",
               lambda: orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse, device=dev),
               2.5 * flops)
        names += [tag + "_fwd", tag + "_fwd_causal", tag + "_bwd"]
    gflops("naive_numpy_fwd", lambda: naive_attention(q, k, v), flops)
    try:
        import torch
        import torch.nn.functional as F
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        gflops("torch_sdpa_fwd", lambda: F.scaled_dot_product_attention(tq, tk, tv), flops)
    except ImportError:
        pass

    print(f"machine: {results['machine']}; shape B,H,N,D = {b},{h},{n},{d}; float32")
    print(f"{'':28s}{'ms':>10s}{'GFLOP/s':>10s}{'x sgemm':>10s}")
    print(f"{'NumPy sgemm 2048^3':28s}{'':>10s}{results['sgemm_gflops']:10.1f}{1.0:10.2f}")
    for name in names + ["naive_numpy_fwd", "torch_sdpa_fwd"]:
        if name + "_ms" in results:
            g = results[name + "_gflops"]
            print(f"{name:28s}{results[name + '_ms']:10.1f}{g:10.1f}"
                  f"{g / results['sgemm_gflops']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
