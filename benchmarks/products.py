"""The float32 forward and backward against their own matrix products alone, one core, in the
same rounds.

    python3 benchmarks/products.py [--rounds 25]

For head dims 64 and 128, forward and backward: the native float32 kernel on B 1, H 8, N 1024
on one thread, per head; the same head's products alone in the kernels' tiling (two forward,
five backward: benchmarks/products.c, built with the machine's cc -O3 -march=native); and the
machine's FMA peak on one thread (fma_peak.c, as kernel_targets.py times it). Best of --rounds
each, the three alternating. Prints the products' share of the kernel's time (what the softmax,
transposes, loads and stores leave: the most any change to them can gain is its inverse) and
both against the FMA peak.
"""
import argparse
import ctypes
import time

import numpy as np
import torch

import orchard_ops
from orchard import benchmark
from kernel_targets import BACKWARD_PRODUCTS, c_library, fma_peak_call

HEAD_DIMS = (64, 128)
B, H, N = 1, 8, 1024


PASSES = ("forward", "backward")


def products_call(d, backward):
    """A call timing one head's products alone (products.c, -O3 as the extension is built), of
    the forward or the backward: its seconds."""
    lib = c_library("products", "-O3")
    lib.products.restype = ctypes.c_double
    lib.products.argtypes = (ctypes.c_int, ctypes.c_int)
    return lambda: lib.products(d, int(backward))


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
    print("| D | pass | kernel per head, ms | products alone, ms | products / kernel "
          "| kernel, % of FMA peak | products, % of FMA peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for d in HEAD_DIMS:
        _, ops = benchmark.operands((B, H, N, d), "float32", rng, torch)   # as kernel_targets'
        kernels = benchmark.orchard_calls(*ops, False, "cpu")
        for backward, (name, kernel) in enumerate(zip(PASSES, kernels)):
            flops = benchmark.attention_flops(1, 1, N, d, False) * (BACKWARD_PRODUCTS if backward else 1)
            products = products_call(d, backward)
            peak, peak_flops = fma_peak_call(flops, 1)
            for fn in (kernel, products, peak):      # a warm-up each
                fn()
            ker = prod = roof = float("inf")         # one head's seconds, the best of the rounds
            for _ in range(args.rounds):
                ker = min(ker, timed(kernel) / H)
                prod = min(prod, products())
                roof = min(roof, timed(peak) * flops / peak_flops)
            print("| %d | %s | %.2f | %.2f | %.2f | %.0f | %.0f |"
                  % (d, name, 1e3 * ker, 1e3 * prod, prod / ker, 100 * roof / ker,
                     100 * roof / prod))


if __name__ == "__main__":
    main()
