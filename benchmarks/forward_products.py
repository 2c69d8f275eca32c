"""The float32 forward against its own matrix products alone, one core, in the same rounds.

    python3 benchmarks/forward_products.py [--rounds 25]

For head dims 64 and 128: the native float32 forward of B 1, H 8, N 1024 on one thread, per
head; the same head's two products alone in the kernels' tiling (benchmarks/forward_products.c,
built with the machine's cc -O3 -march=native); and the machine's FMA peak on one thread
(fma_peak.c, as kernel_targets.py times it). Best of --rounds each, the three alternating.
Prints the products' share of the forward's time (what the softmax, transposes and stores
leave: the most any change to them can gain is its inverse) and both against the FMA peak.
"""
import argparse
import ctypes
import time

import numpy as np
import torch

import orchard_ops
from orchard import benchmark
from kernel_targets import c_library, fma_peak_call

HEAD_DIMS = (64, 128)
B, H, N = 1, 8, 1024


def products_call(d):
    """A call timing one head's products alone (forward_products.c, -O3 as the extension is
    built): its seconds."""
    lib = c_library("forward_products", "-O3")
    lib.forward_products.restype = ctypes.c_double
    lib.forward_products.argtypes = (ctypes.c_int,)
    return lambda: lib.forward_products(d)


def timed(fn):
    """One call's seconds."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args(argv)
    orchard_ops.set_num_threads(1)
    cpu = orchard_ops.devices()[0]
    print("%s, native kernel set %s, one thread, best of %d\n"
          % (cpu["name"], cpu["kernel_isa"], args.rounds))
    print("| D | forward per head, ms | products alone, ms | products / forward "
          "| forward, % of FMA peak | products, % of FMA peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for d in HEAD_DIMS:
        flops = benchmark.attention_flops(1, 1, N, d, False)
        _, ops = benchmark.operands((B, H, N, d), "float32", rng, torch)   # as kernel_targets'
        forward = benchmark.orchard_calls(*ops, False, "cpu")[0]
        products = products_call(d)
        peak, peak_flops = fma_peak_call(flops, 1)
        for fn in (forward, products, peak):     # a warm-up each
            fn()
        fwd = prod = roof = float("inf")            # one head's seconds, the best of the rounds
        for _ in range(args.rounds):
            fwd = min(fwd, timed(forward) / H)
            prod = min(prod, products())
            roof = min(roof, timed(peak) * flops / peak_flops)
        print("| %d | %.2f | %.2f | %.2f | %.0f | %.0f |"
              % (d, 1e3 * fwd, 1e3 * prod, prod / fwd, 100 * roof / fwd, 100 * roof / prod))


if __name__ == "__main__":
    main()
