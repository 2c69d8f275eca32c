"""The performance targets of the README (Performance) and the figures that check them.

    python benchmarks/targets.py [--quick]

prints every target, its bound, the measured figure and whether it is met. The figures are
float32 at TARGET_SHAPE: the ratios come from calls that alternate in one loop (the median of
their ratios in each round), plus the cost of a tiny call and the peak memory of a long one.
benchmarks/update_readme.py writes them into the README.
"""
import argparse
import os
import subprocess
import sys

import numpy as np

import orchard_ops
from orchard import benchmark

TARGET_SHAPE = (4, 8, 1024, 64)

# The performance targets (README, Performance): figure, what it is, bound, and whether the
# figure must be at least (True) or at most (False) the bound.
TARGETS = [
    ("fwd_vs_sgemm", "native forward GFLOP/s / matrix product GFLOP/s", 0.65, True),
    ("bwd_vs_sgemm", "native backward GFLOP/s / matrix product GFLOP/s", 0.45, True),
    ("fwd_vs_torch", "native forward speed / torch SDPA forward speed", 1.2, True),
    ("bwd_vs_torch", "native backward speed / torch SDPA backward speed", 1.5, True),
    ("causal_speedup", "causal forward speed / non-causal forward speed", 1.8, True),
    ("opencl_vs_native", "OpenCL forward speed / native forward speed", 0.5, True),
    ("staged_overhead_pct", "staged (non-contiguous) input, % over the zero-copy call", 3, False),
    ("tiny_call_us", "a call on (1, 1, 16, 16), microseconds", 20, False),
    ("peak_mib_n16384", "forward at N=16384, D=64: growth of peak memory, MiB", 96, False),
]


# The growth of peak resident memory over the call, outputs included; the kernel's high-water
# mark is reset first (Linux), since an earlier peak (imports, input creation) would hide it,
# and a tiny call first loads the OpenCL runtime (devices are listed on first use).
PEAK_MEMORY_SCRIPT = """
import numpy as np, orchard_ops
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))
n, d = 16384, 64
q = np.random.default_rng(0).standard_normal((1, 1, n, d)).astype(np.float32)
orchard_ops.flash_attn_fwd(q[..., :16, :], q[..., :16, :], q[..., :16, :], device="cpu")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
out, lse = orchard_ops.flash_attn_fwd(q, q, q, device="cpu")
print((status("VmHWM:") - before) / 1024)
"""


def target_figures(repeats, shape=TARGET_SHAPE):
    """The figures of TARGETS at `shape`, float32: all the calls alternate in one loop, and a
    ratio is the median of its ratios in each round."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    staged = np.ascontiguousarray(q[..., ::-1])[..., ::-1]     # same values, reversed last dim
    out, lse = orchard_ops.flash_attn_fwd(q, k, v, device="cpu")
    a = rng.standard_normal((2048, 2048)).astype(np.float32)
    opencl = [d["id"] for d in orchard_ops.devices() if d["id"].startswith("opencl")]
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    # In this order the call after the pause is one with a wide margin, and the matrix
    # product follows orchard's workers (they block; torch's OpenMP threads spin a little).
    calls = {"sgemm": lambda: a @ a}
    if opencl:
        calls["opencl"] = lambda: orchard_ops.flash_attn_fwd(q, k, v, device=opencl[0])
    calls["fwd"] = lambda: orchard_ops.flash_attn_fwd(q, k, v, device="cpu")
    calls["causal"] = lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=True, device="cpu")
    calls["staged"] = lambda: orchard_ops.flash_attn_fwd(staged, k, v, device="cpu")
    if torch is not None:
        tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, dout))
        tq.requires_grad_(True), tk.requires_grad_(True), tv.requires_grad_(True)
        tout = F.scaled_dot_product_attention(tq, tk, tv)
        calls["torch_fwd"] = lambda: F.scaled_dot_product_attention(
            tq.detach(), tk.detach(), tv.detach())
        calls["torch_bwd"] = lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo,
                                                         retain_graph=True)
    calls["bwd"] = lambda: orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse, device="cpu")
    times = benchmark.round_robin(calls, 6 * repeats, settle=("sgemm",))
    ratio = lambda slow, fast: float(np.median(times[slow] / times[fast]))
    flops, sgemm_flops = benchmark.attention_flops(*shape, False), 2.0 * 2048 ** 3
    figures = {"shape": list(shape), "sgemm_gflops": sgemm_flops / times["sgemm"].min() / 1e9,
               "best_ms": {name: float(t.min() * 1e3) for name, t in times.items()},
               "fwd_vs_sgemm": ratio("sgemm", "fwd") * flops / sgemm_flops,
               "bwd_vs_sgemm": ratio("sgemm", "bwd") * 2.5 * flops / sgemm_flops,
               "causal_speedup": ratio("fwd", "causal"),
               "staged_overhead_pct": (ratio("staged", "fwd") - 1) * 100}
    if opencl:
        figures["opencl_device"] = opencl[0]
        figures["opencl_vs_native"] = ratio("fwd", "opencl")
    if torch is not None:
        figures["fwd_vs_torch"] = ratio("torch_fwd", "fwd")
        figures["bwd_vs_torch"] = ratio("torch_bwd", "bwd")
    tiny = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    figures["tiny_call_us"] = benchmark.best_time(
        lambda: orchard_ops.flash_attn_fwd(tiny, tiny, tiny, device="cpu"), 200 * repeats) * 1e6
    peak = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT], capture_output=True,
                          text=True, check=True)
    figures["peak_mib_n16384"] = float(peak.stdout.split()[-1])
    return figures


def target_rows(figures):
    """(description, bound, measured, verdict) for every target with a figure."""
    rows = []
    for key, what, bound, at_least in TARGETS:
        if key in figures:
            met = figures[key] >= bound if at_least else figures[key] <= bound
            rows.append((what, "%s %g" % (">=" if at_least else "<=", bound),
                         "%.2f" % figures[key], "met" if met else "missed"))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape, one repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("ORCHARD_BENCH_QUICK") == "1"
    figures = (target_figures(1, benchmark.QUICK_SHAPES[-1]) if quick
               else target_figures(args.repeats))
    print("targets at B,H,N,D = %s:" % ",".join(map(str, figures["shape"])))
    for what, bound, measured, verdict in target_rows(figures):
        print("  %-60s %-7s %8s  %s" % (what, bound, measured, verdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
