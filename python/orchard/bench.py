"""orchard-bench: attention throughput of every device and backend, measured in one run.

    orchard-bench [--shapes B,H,N,D ...] [--devices cpu,opencl:0] [--dtypes float32,float16]
                  [--causal both] [--repeats 5] [--json FILE] [--plot FILE.png] [--train]
                  [--targets] [--readme README.md]

For each shape, dtype, causal flag and device it times orchard's forward and backward (one
warm-up call, then the best of --repeats) and reports ms and GFLOP/s with FlashAttention-2's
accounting: forward 4*B*H*N*N*D flops, halved when causal; backward 2.5x the forward. In the
same run it measures NumPy's float32 matrix product (the practical roofline of this machine),
naive NumPy attention, and PyTorch's scaled_dot_product_attention on the CPU when torch is
installed, so every ratio compares figures taken side by side. --train adds the tokens/s of
the demo model trained with orchard's attention against the same model on torch SDPA.
--targets adds the figures of the performance targets (README, Performance) and --readme
rewrites the part of a README between "<!-- bench:start -->" and "<!-- bench:end -->" with the
results as Markdown.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np

import orchard_ops

DEFAULT_SHAPES = [(4, 8, 256, 64), (4, 8, 512, 64), (4, 8, 1024, 64), (1, 8, 2048, 64)]
QUICK_SHAPES = [(1, 2, 64, 32), (1, 2, 128, 32)]


def attention_flops(b, h, n, d, causal):
    flops = 4.0 * b * h * n * n * d
    return flops / 2 if causal else flops


def best_time(fn, repeats):
    """Seconds of the fastest of `repeats` calls, after one warm-up call."""
    return float(round_robin({"fn": fn}, repeats)["fn"].min())


def sgemm_gflops(repeats, n=1024):
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    return 2.0 * n ** 3 / best_time(lambda: a @ a, repeats) / 1e9


def naive_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v the textbook way, materialising the N x N scores."""
    s = q @ np.swapaxes(k, -1, -2) / np.float32(np.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def machine_facts():
    cpu = orchard_ops.devices()[0]
    return {"cpu": cpu["name"], "logical_cores": cpu["compute_units"], "simd": cpu.get("simd"),
            "memory_gib": round(cpu["global_mem_bytes"] / 2 ** 30, 1),
            "threads": orchard_ops.get_num_threads(), "python": platform.python_version(),
            "numpy": np.__version__, "orchard": orchard_ops.__version__,
            "devices": [{k: d[k] for k in ("id", "name", "platform", "kind")}
                        for d in orchard_ops.devices()]}


def measure(shapes, devices, dtypes, causal_flags, repeats):
    """One row per (backend, shape, dtype, causal); every figure from this process."""
    rows = []
    rng = np.random.default_rng(0)
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    for b, h, n, d in shapes:
        for dtype in dtypes:
            q, k, v, dout = (rng.standard_normal((b, h, n, d)).astype(dtype) for _ in range(4))
            for causal in causal_flags:
                flops = attention_flops(b, h, n, d, causal)

                def row(backend, device, fwd, bwd=None):
                    r = {"backend": backend, "device": device, "B": b, "H": h, "N": n, "D": d,
                         "dtype": np.dtype(dtype).name, "causal": causal}
                    r["fwd_ms"] = best_time(fwd, repeats) * 1e3
                    r["fwd_gflops"] = flops / r["fwd_ms"] / 1e6
                    if bwd is not None:
                        r["bwd_ms"] = best_time(bwd, repeats) * 1e3
                        r["bwd_gflops"] = 2.5 * flops / r["bwd_ms"] / 1e6
                    rows.append(r)

                for dev in devices:
                    out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=dev)
                    row("orchard", dev,
                        lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=dev),
                        lambda: orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse,
                                                           causal=causal, device=dev))
                if n <= 2048 and dtype == np.float32:
                    row("numpy-naive", "cpu", lambda: naive_attention(q, k, v, causal))
                if torch is not None:
                    tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, dout))
                    tq.requires_grad_(True), tk.requires_grad_(True), tv.requires_grad_(True)
                    tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    row("torch-sdpa", "cpu",
                        lambda: F.scaled_dot_product_attention(tq.detach(), tk.detach(),
                                                               tv.detach(), is_causal=causal),
                        lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True))
    return rows


def comparisons(rows):
    """Sentences "X is 1.7x faster than Y" for every pair of backends on the same problem."""
    lines = []
    key = lambda r: (r["B"], r["H"], r["N"], r["D"], r["dtype"], r["causal"])
    for problem in sorted({key(r) for r in rows}):
        same = [r for r in rows if key(r) == problem]
        name = "B=%d H=%d N=%d D=%d %s%s" % (*problem[:5], " causal" if problem[5] else "")
        for direction in ("fwd", "bwd"):
            have = sorted((r for r in same if direction + "_ms" in r),
                          key=lambda r: r[direction + "_ms"])
            for slower in have[1:]:
                fast = have[0]
                lines.append("%s %s: %s %s is %.1fx faster than %s %s" % (
                    name, direction, fast["backend"], fast["device"],
                    slower[direction + "_ms"] / fast[direction + "_ms"], slower["backend"],
                    slower["device"]))
    return lines


def table(rows, roofline):
    out = ["%-12s %-9s %-17s %-8s %-6s %9s %8s %9s %8s %8s" % (
        "backend", "device", "B,H,N,D", "dtype", "causal", "fwd ms", "GFLOP/s", "bwd ms",
        "GFLOP/s", "fwd/sgemm")]
    for r in rows:
        out.append("%-12s %-9s %-17s %-8s %-6s %9.2f %8.1f %9s %8s %8.2f" % (
            r["backend"], r["device"], "%d,%d,%d,%d" % (r["B"], r["H"], r["N"], r["D"]),
            r["dtype"], "yes" if r["causal"] else "no", r["fwd_ms"], r["fwd_gflops"],
            "%.2f" % r["bwd_ms"] if "bwd_ms" in r else "-",
            "%.1f" % r["bwd_gflops"] if "bwd_gflops" in r else "-",
            r["fwd_gflops"] / roofline))
    return "\n".join(out)


def plot(rows, path):
    """GFLOP/s (forward) against N, one line per backend and device, float32 non-causal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    picked = [r for r in rows if r["dtype"] == "float32" and not r["causal"]]
    for label in sorted({(r["backend"], r["device"]) for r in picked}):
        line = sorted((r for r in picked if (r["backend"], r["device"]) == label),
                      key=lambda r: r["N"])
        ax.plot([r["N"] for r in line], [r["fwd_gflops"] for r in line], marker="o",
                label="%s (%s)" % label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("forward GFLOP/s (FlashAttention-2 accounting)")
    ax.set_title("attention forward, float32, non-causal")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def training_tokens_per_s(steps=6, batch=8, seq=256):
    """Tokens/s of the demo model's training step, orchard attention versus torch SDPA: the
    best step of each, the two models' steps interleaved so that both see the same machine."""
    import torch

    from orchard.model import GPT, GPTConfig
    from orchard.torch import patch_model
    x = torch.randint(0, 256, (batch, seq))
    steps_of = {}
    for backend in ("torch-sdpa", "orchard"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(context=seq))
        if backend == "orchard":
            patch_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt):
            _, loss = model(x, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()                          # warm-up
        steps_of[backend] = step
    best = dict.fromkeys(steps_of, float("inf"))
    for _ in range(steps):
        for backend, step in steps_of.items():
            start = time.perf_counter()
            step()
            best[backend] = min(best[backend], time.perf_counter() - start)
    return {backend: batch * seq / t for backend, t in best.items()}


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


def round_robin(calls, rounds, settle=()):
    """Seconds of every call in each of `rounds` rounds of all of them in turn. A shared VM
    drifts by 10 to 20 % over a minute; the ratio of two calls made side by side, taken in
    every round, drifts much less (the median of those ratios is what the targets quote).
    The calls named in `settle` are followed by a pause: after a NumPy matrix product
    OpenBLAS's threads spin for about 0.1 s, and the next call would run on fewer cores."""
    times = {name: [] for name in calls}
    for n in range(rounds + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if n > 0:       # round 0 is the warm-up
                times[name].append(time.perf_counter() - start)
            if name in settle:
                time.sleep(0.2)
    return {name: np.array(t) for name, t in times.items()}


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
    times = round_robin(calls, 6 * repeats, settle=("sgemm",))
    ratio = lambda slow, fast: float(np.median(times[slow] / times[fast]))
    flops, sgemm_flops = attention_flops(*shape, False), 2.0 * 2048 ** 3
    figures = {"shape": list(shape), "sgemm_gflops": sgemm_flops / times["sgemm"].min() / 1e9,
               "best_ms": {name: float(t.min() * 1e3) for name, t in times.items()},
               "fwd_vs_sgemm": ratio("sgemm", "fwd") * flops / sgemm_flops,
               "bwd_vs_sgemm": ratio("sgemm", "bwd") * 2.5 * flops / sgemm_flops,
               "causal_speedup": ratio("fwd", "causal"),
               "staged_overhead_pct": (ratio("staged", "fwd") - 1) * 100}
    if opencl:
        figures["opencl_device"] = opencl[0]
        figures["opencl_vs_native"] = ratio("opencl", "fwd")
    if torch is not None:
        figures["fwd_vs_torch"] = ratio("torch_fwd", "fwd")
        figures["bwd_vs_torch"] = ratio("torch_bwd", "bwd")
    tiny = rng.standard_normal((1, 1, 16, 16)).astype(np.float32)
    figures["tiny_call_us"] = best_time(
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


def markdown(report):
    """The results as Markdown: machine, table, comparisons, targets."""
    m = report["machine"]
    lines = ["Measured %s on %s (%d logical cores, %s SIMD, %.0f GiB), %d threads, Python %s, "
             "NumPy %s; devices: %s. NumPy float32 matrix product (the roofline): %.1f GFLOP/s."
             % (time.strftime("%Y-%m-%d"), m["cpu"], m["logical_cores"], m["simd"],
                m["memory_gib"], m["threads"], m["python"], m["numpy"],
                ", ".join("%s (%s)" % (d["id"], d["name"]) for d in m["devices"]),
                report["sgemm_gflops"]), "",
             "| backend | device | B,H,N,D | dtype | causal | fwd ms | fwd GFLOP/s | bwd ms | "
             "bwd GFLOP/s | fwd / sgemm |", "|" + " --- |" * 10]
    for r in report["results"]:
        lines.append("| %s | %s | %d,%d,%d,%d | %s | %s | %.2f | %.1f | %s | %s | %.2f |" % (
            r["backend"], r["device"], r["B"], r["H"], r["N"], r["D"], r["dtype"],
            "yes" if r["causal"] else "no", r["fwd_ms"], r["fwd_gflops"],
            "%.2f" % r["bwd_ms"] if "bwd_ms" in r else "-",
            "%.1f" % r["bwd_gflops"] if "bwd_gflops" in r else "-",
            r["fwd_gflops"] / report["sgemm_gflops"]))
    lines += [""] + ["- " + c for c in report["comparisons"] if c.split(": ")[1].startswith(
        "orchard") or " than orchard" in c]
    if "training_tokens_per_s" in report:
        t = report["training_tokens_per_s"]
        lines.append("- training the demo model: orchard %.0f tokens/s, torch SDPA %.0f tokens/s"
                     % (t["orchard"], t["torch-sdpa"]))
    if "targets" in report:
        t = report["targets"]
        lines += ["", "Targets (float32, B,H,N,D = %s; the calls alternate in one loop and a ratio "
                  "is the median of its ratios in each round; the matrix product at %.1f "
                  "GFLOP/s):" % (
                      ",".join(map(str, t["shape"])), t["sgemm_gflops"]), "",
                  "| target | bound | measured | |", "| --- | --- | --- | --- |"]
        lines += ["| %s | %s | %s | %s |" % row for row in target_rows(t)]
    return "\n".join(lines)


def write_readme(path, text):
    with open(path) as f:
        old = f.read()
    new, count = re.subn(r"(<!-- bench:start -->\n).*?(<!-- bench:end -->)",
                         lambda m: m.group(1) + text + "\n" + m.group(2), old, flags=re.S)
    if count != 1:
        raise SystemExit("%s has no <!-- bench:start --> ... <!-- bench:end --> block" % path)
    with open(path, "w") as f:
        f.write(new)


def parse_shape(text):
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 4:
        raise argparse.ArgumentTypeError("a shape is B,H,N,D")
    return shape


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", help="B,H,N,D ...")
    parser.add_argument("--devices", help="comma-separated orchard devices (default: all)")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of GFLOP/s against N here")
    parser.add_argument("--train", action="store_true",
                        help="also time training steps of the demo model (needs torch)")
    parser.add_argument("--targets", action="store_true",
                        help="also measure call overhead, staging cost and peak memory")
    parser.add_argument("--readme", help="rewrite the bench block of this README")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("ORCHARD_BENCH_QUICK") == "1"
    shapes = args.shapes or (QUICK_SHAPES if quick else DEFAULT_SHAPES)
    repeats = 1 if quick else args.repeats
    devices = args.devices.split(",") if args.devices else [d["id"] for d in orchard_ops.devices()]
    causal_flags = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    dtypes = [np.dtype(t).type for t in args.dtypes.split(",")]

    report = {"machine": machine_facts(), "sgemm_gflops": sgemm_gflops(repeats)}
    report["results"] = measure(shapes, devices, dtypes, causal_flags, repeats)
    # the roofline is the best the machine did: measured before and after the grid, so that a
    # busy moment of a shared machine at the start does not lower it
    report["sgemm_gflops"] = max(report["sgemm_gflops"], sgemm_gflops(repeats))
    report["comparisons"] = comparisons(report["results"])
    if args.train:
        report["training_tokens_per_s"] = training_tokens_per_s(steps=2 if quick else 12)
    if args.targets:
        report["targets"] = target_figures(repeats, shapes[-1] if quick else TARGET_SHAPE)
    print("machine: %(cpu)s, %(logical_cores)d logical cores, %(threads)d threads"
          % report["machine"])
    print("NumPy float32 matrix product (roofline): %.1f GFLOP/s" % report["sgemm_gflops"])
    print(table(report["results"], report["sgemm_gflops"]))
    print("\n".join(report["comparisons"]))
    if "training_tokens_per_s" in report:
        t = report["training_tokens_per_s"]
        print("training, demo model: orchard %.0f tokens/s, torch SDPA %.0f tokens/s (%.2fx)"
              % (t["orchard"], t["torch-sdpa"], t["orchard"] / t["torch-sdpa"]))
    if "targets" in report:
        print("targets at B,H,N,D = %s:" % ",".join(map(str, report["targets"]["shape"])))
        for what, bound, measured, verdict in target_rows(report["targets"]):
            print("  %-60s %-7s %8s  %s" % (what, bound, measured, verdict))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report["results"], args.plot)
    if args.readme:
        write_readme(args.readme, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
