"""The native kernels' targets (README Performance, "Kernel targets"), measured in one run.

    python3 benchmarks/kernel_targets.py [--shapes 4,8,1024,64 2,16,4096,128] [--rounds 7]
                                         [--dtypes float32 float16 bfloat16]

At every shape: float32 forward and backward against torch SDPA, and the forward's GFLOP/s
against torch's float32 matrix product (2048^3); float16 and bfloat16, causal and not, forward
and forward+backward against torch SDPA at the same dtype; the first OpenCL device (PoCL here)
against the native path, forward and backward (with float32). --dtypes picks some of the three.
A whole run took 8 minutes on a Sapphire Rapids Xeon (2 cores, seven rounds), 16 on an AVX2
EPYC (three rounds): seven by default since three-round runs of one build there moved by up to
a quarter (README "Kernel targets", thirty-fourth session). Calls alternate in rounds (benchmark.round_robin,
one warm-up round), every torch call followed by a pause (TORCH_CALLS: torch's OpenMP threads
spin for 5-10 ms after a call, and would share the cores with the next call, orchard's); a ratio
is the median of its ratios in each round. The machine's float32 FMA peak (benchmarks/fma_peak.c,
built with the machine's cc, as many threads as orchard's) is timed in the same rounds: each
float32 figure also reads "at the FMA peak", the value it would take if orchard's matrix
products ran at that peak and nothing else took time, which no float32 kernel can exceed; a
target above it is "missed, above the roof". Prints a Markdown table, then the float32 calls'
GFLOP/s and their share of the peak.
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

import orchard_ops
from orchard import benchmark

DTYPES = ("float32", "float16", "bfloat16")
TORCH_CALLS = ("torch_fwd", "torch_bwd", "sgemm")
# A backward's matrix products against a forward's: S = q K^T again, dP, dV, dK, dQ
BACKWARD_PRODUCTS = 2.5


def ratio(times, slow, fast):
    """Median over rounds of time(slow) / time(fast); names may be tuples, whose times add."""
    total = lambda names: sum(times[n] for n in (names if isinstance(names, tuple) else (names,)))
    return float(np.median(total(slow) / total(fast)))


def c_library(name, *flags):
    """benchmarks/<name>.c built for this machine (the machine's cc, -march=native, flags) and
    loaded."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".c")
    with tempfile.TemporaryDirectory() as build:     # a loaded library outlives its file
        path = os.path.join(build, name + ".so")
        subprocess.run([os.environ.get("CC", "cc"), *flags, "-march=native", "-shared", "-fPIC",
                        source, "-o", path], check=True)
        return ctypes.CDLL(path)


def fma_peak_call(flops, threads):
    """(a call doing about `flops` float32 operations in FMAs on `threads` threads at the
    machine's peak, the operations it does): benchmarks/fma_peak.c, built for this machine."""
    lib = c_library("fma_peak", "-O2", "-pthread")
    lib.fma_peak.restype = ctypes.c_double
    lib.fma_peak.argtypes = (ctypes.c_int, ctypes.c_long)
    per_iteration = lib.fma_peak(threads, 1)
    iterations = max(1, round(flops / per_iteration))
    return (lambda: lib.fma_peak(threads, iterations)), per_iteration * iterations


def float32_figures(shape, rounds, rng):
    arrays, ops = benchmark.operands(shape, "float32", rng, torch)
    flops = benchmark.attention_flops(*shape, False)
    calls = {}
    calls["peak"], peak_flops = fma_peak_call(flops, orchard_ops.devices()[0]["compute_units"])
    calls["fwd"], calls["bwd"] = benchmark.orchard_calls(*ops, False, "cpu")
    calls["torch_fwd"], calls["torch_bwd"] = benchmark.sdpa_calls(*ops, False)
    a = torch.randn(2048, 2048)
    calls["sgemm"] = lambda: a @ a
    opencl = [d["id"] for d in orchard_ops.devices() if d["id"].startswith("opencl")]
    if opencl:
        calls["cl_fwd"], calls["cl_bwd"] = benchmark.orchard_calls(*arrays, False, opencl[0])
    t = benchmark.round_robin(calls, rounds, settle=TORCH_CALLS)
    sgemm_flops = 2.0 * 2048 ** 3
    # A call's time if its products ran at the round's FMA peak: the least any kernel takes
    t["fwd_roof"] = t["peak"] * flops / peak_flops
    t["bwd_roof"] = t["fwd_roof"] * BACKWARD_PRODUCTS
    t["sgemm_roof"] = t["peak"] * sgemm_flops / peak_flops
    rate = lambda name, times: times * flops / float(np.median(t[name])) / 1e9
    of_peak = lambda name, roof: 100 * ratio(t, roof, name)
    rates = ("%s: FMA peak %.0f; orchard forward %.0f (%.0f %% of the peak), backward %.0f "
             "(%.0f %%); torch forward %.0f (%.0f %%), backward %.0f (%.0f %%); sgemm %.0f %%"
             % (",".join(map(str, shape)), peak_flops / float(np.median(t["peak"])) / 1e9,
                rate("fwd", 1), of_peak("fwd", "fwd_roof"),
                rate("bwd", BACKWARD_PRODUCTS), of_peak("bwd", "bwd_roof"),
                rate("torch_fwd", 1), of_peak("torch_fwd", "fwd_roof"),
                rate("torch_bwd", BACKWARD_PRODUCTS), of_peak("torch_bwd", "bwd_roof"),
                of_peak("sgemm", "sgemm_roof")))
    to_sgemm = flops / sgemm_flops
    rows = [("float32 forward vs torch", 1.2, ratio(t, "torch_fwd", "fwd"),
             ratio(t, "torch_fwd", "fwd_roof")),
            ("float32 backward vs torch", 1.5, ratio(t, "torch_bwd", "bwd"),
             ratio(t, "torch_bwd", "bwd_roof")),
            ("float32 forward vs sgemm GFLOP/s", 0.8, ratio(t, "sgemm", "fwd") * to_sgemm,
             ratio(t, "sgemm", "fwd_roof") * to_sgemm)]
    if opencl:
        rows += [("OpenCL forward vs native", 0.9, ratio(t, "fwd", "cl_fwd"), None),
                 ("OpenCL backward vs native", 0.9, ratio(t, "bwd", "cl_bwd"), None)]
    return rows, rates


def half_figures(shape, dtype, causal, rounds, rng):
    _, ops = benchmark.operands(shape, dtype, rng, torch)
    calls = {}
    calls["fwd"], calls["bwd"] = benchmark.orchard_calls(*ops, causal, "cpu")
    calls["torch_fwd"], calls["torch_bwd"] = benchmark.sdpa_calls(*ops, causal)
    t = benchmark.round_robin(calls, rounds, settle=TORCH_CALLS)
    what = "%s%s " % (dtype, " causal" if causal else "")
    return [(what + "forward vs torch", 1.0, ratio(t, "torch_fwd", "fwd"), None),
            (what + "forward+backward vs torch", 1.0,
             ratio(t, ("torch_fwd", "torch_bwd"), ("fwd", "bwd")), None)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4,8,1024,64", "2,16,4096,128"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(benchmark.against_torch_header(torch, args.rounds))
    print("\n| B,H,N,D | figure | target | measured | at the FMA peak | |\n"
          "| --- | --- | --- | --- | --- | --- |")
    rates = []
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        rows = []
        if "float32" in args.dtypes:
            rows, shape_rates = float32_figures(shape, args.rounds, rng)
            rates.append(shape_rates)
        for dtype in [d for d in args.dtypes if d != "float32"]:
            for causal in (False, True):
                rows += half_figures(shape, dtype, causal, args.rounds, rng)
        for what, bound, value, roof in rows:
            verdict = ("met" if value >= bound
                       else "missed, above the roof" if roof is not None and roof < bound
                       else "missed")
            print("| %s | %s | >= %.1f | %.2f | %s | %s |"
                  % (text, what, bound, value, "-" if roof is None else "%.2f" % roof, verdict),
                  flush=True)
    if rates:
        print("\nfloat32 GFLOP/s (medians; a backward counted as %.1f forwards' products):"
              % BACKWARD_PRODUCTS)
    for line in rates:
        print("- " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
