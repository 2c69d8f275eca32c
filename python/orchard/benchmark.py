"""Attention throughput of every device and backend, measured side by side in one process.

For each shape, dtype, causal flag and device it times orchard's forward and backward (one
warm-up call, then the median of `repeats` >= 3 calls: never one timing, and a median, unlike
a best, is not set by one lucky call) and reports ms and GFLOP/s with FlashAttention-2's
accounting: forward 4*B*H*N*N*D flops, halved when causal; backward 2.5x the forward. In the
same run it measures NumPy's float32 matrix product (the practical roofline of this machine),
the NumPy reference (orchard.reference: float64, the N x N scores materialised; where they
fit, reference_fits) and PyTorch's scaled_dot_product_attention on the CPU when torch is
installed, so every ratio compares figures taken side by side. orchard-bench prints these;
benchmarks/ adds the README's figures.
"""
import os
import platform
import time

import numpy as np

import orchard_ops

from .reference import ref_fwd

DEFAULT_SHAPES = [(4, 8, 256, 64), (4, 8, 512, 64), (4, 8, 1024, 64), (1, 8, 2048, 64)]
QUICK_SHAPES = [(1, 2, 64, 32), (1, 2, 128, 32)]
# float32 arrays of B x H x N x D a problem holds at once: the operands, orchard's and torch's
# outputs and gradients, torch's copies, standard_normal's float64 (18.6 measured at
# 2,8,4096,128 by the peak resident size); orchard-tune's shape holds about as many on PoCL,
# its operands, outputs and gradients on the host and in the device's buffers
ARRAYS_HELD = 20
# float64 B x H x N x N arrays the NumPy reference holds at once (5.2 measured), and the
# largest N it is timed at
REFERENCE_SCORES, REFERENCE_MAX_N = 6, 2048


def physical_memory():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def reference_fits(b, h, n):
    """Whether the grid times the NumPy reference at this shape: N at most REFERENCE_MAX_N,
    its N x N scores within half of the machine's memory (B 64 H 64 N 2048 needed 1.4 TB)."""
    return n <= REFERENCE_MAX_N and REFERENCE_SCORES * 8 * b * h * n * n <= physical_memory() / 2


def attention_flops(b, h, n, d, causal):
    flops = 4.0 * b * h * n * n * d
    return flops / 2 if causal else flops


MIN_REPEATS = 3


def best_time(fn, repeats):
    """Seconds of the fastest of `repeats` calls, after one warm-up call."""
    return float(round_robin({"fn": fn}, repeats)["fn"].min())


def median_time(fn, repeats):
    """Seconds of the median of `repeats` (at least MIN_REPEATS) calls, after one warm-up."""
    if repeats < MIN_REPEATS:
        raise ValueError("median_time(): 'repeats' must be >= %d, got %r"
                         % (MIN_REPEATS, repeats))
    return float(np.median(round_robin({"fn": fn}, repeats)["fn"]))


def sgemm_gflops(repeats, n=1024):
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    return 2.0 * n ** 3 / median_time(lambda: a @ a, repeats) / 1e9


def machine_facts():
    cpu = orchard_ops.devices()[0]
    return {"cpu": cpu["name"], "logical_cores": cpu["compute_units"], "simd": cpu.get("simd"),
            "kernel_isa": cpu.get("kernel_isa"),
            "memory_gib": round(cpu["global_mem_bytes"] / 2 ** 30, 1),
            "threads": orchard_ops.get_num_threads(), "python": platform.python_version(),
            "numpy": np.__version__, "orchard": orchard_ops.__version__,
            "devices": [{k: d[k] for k in ("id", "name", "platform", "kind")}
                        for d in orchard_ops.devices()]}


DTYPES = ("float32", "float16", "bfloat16", "float64")


def operands(shape, dtype, rng, torch=None):
    """(the float32 arrays, the operands): q, k, v and dout of `shape`, standard normal, and
    the same in dtype (a DTYPES name), as torch tensors when torch is given (bfloat16 needs
    it), else as NumPy arrays."""
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    if torch is None:
        return arrays, [a.astype(dtype) for a in arrays]
    return arrays, [torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrays]


def orchard_calls(q, k, v, dout, causal, device):
    """(forward, backward): orchard's calls on these operands, the backward's out and lse
    computed once here."""
    out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
    return (lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=device),
            lambda: orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal,
                                               device=device))


def sdpa_calls(q, k, v, dout, causal):
    """(forward, backward): torch's scaled_dot_product_attention on these torch tensors (fewer
    heads in k and v than in q: grouped-query attention); the backward is the gradient of one
    forward graph, kept for every call."""
    import torch
    import torch.nn.functional as F
    tq, tk, tv = (t.clone().requires_grad_(True) for t in (q, k, v))
    gqa = q.shape[-3] != k.shape[-3]
    tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
    return (lambda: F.scaled_dot_product_attention(tq.detach(), tk.detach(), tv.detach(),
                                                   is_causal=causal, enable_gqa=gqa),
            lambda: torch.autograd.grad(tout, (tq, tk, tv), dout, retain_graph=True))


def measure(shapes, devices, dtypes, causal_flags, repeats, progress=None):
    """One row per (backend, shape, dtype, causal); every figure from this process. dtypes
    are names from DTYPES; the operands are torch tensors when torch is installed (bfloat16
    needs it: NumPy has no such type), else NumPy arrays. progress (orchard.progress.Progress,
    of len(shapes) * len(dtypes) * len(causal_flags)) is updated after each problem."""
    rows, done = [], 0
    rng = np.random.default_rng(0)
    try:
        import torch
    except ImportError:
        torch = None
    for b, h, n, d in shapes:
        for dtype in dtypes:
            arrays, (q, k, v, dout) = operands((b, h, n, d), dtype, rng, torch)
            for causal in causal_flags:
                flops = attention_flops(b, h, n, d, causal)

                def row(backend, device, fwd, bwd=None):
                    r = {"backend": backend, "device": device, "B": b, "H": h, "N": n, "D": d,
                         "dtype": dtype, "causal": causal}
                    r["fwd_ms"] = median_time(fwd, repeats) * 1e3
                    r["fwd_gflops"] = flops / r["fwd_ms"] / 1e6
                    if bwd is not None:
                        r["bwd_ms"] = median_time(bwd, repeats) * 1e3
                        r["bwd_gflops"] = 2.5 * flops / r["bwd_ms"] / 1e6
                    rows.append(r)

                for dev in devices:
                    row("orchard", dev, *orchard_calls(q, k, v, dout, causal, dev))
                if dtype == "float32" and reference_fits(b, h, n):
                    row("numpy-reference", "cpu", lambda: ref_fwd(*arrays[:3], causal=causal))
                if torch is not None:
                    row("torch-sdpa", "cpu", *sdpa_calls(q, k, v, dout, causal))
                done += 1
                if progress is not None:
                    progress.update(done, "B,H,N,D=%d,%d,%d,%d %s" % (b, h, n, d, dtype))
    return rows


def comparisons(rows):
    """Sentences "X is 1.72x faster than Y" for every pair of backends on the same problem
    (two decimals: 1.04x would read as 1.0x, no faster)."""
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
                lines.append("%s %s: %s %s is %.2fx faster than %s %s" % (
                    name, direction, fast["backend"], fast["device"],
                    slower[direction + "_ms"] / fast[direction + "_ms"], slower["backend"],
                    slower["device"]))
    return lines


def table(rows, roofline):
    out = ["%-15s %-9s %-17s %-8s %-6s %9s %8s %9s %8s %8s" % (
        "backend", "device", "B,H,N,D", "dtype", "causal", "fwd ms", "GFLOP/s", "bwd ms",
        "GFLOP/s", "fwd/sgemm")]
    for r in rows:
        out.append("%-15s %-9s %-17s %-8s %-6s %9.2f %8.1f %9s %8s %8.2f" % (
            r["backend"], r["device"], "%d,%d,%d,%d" % (r["B"], r["H"], r["N"], r["D"]),
            r["dtype"], "yes" if r["causal"] else "no", r["fwd_ms"], r["fwd_gflops"],
            "%.2f" % r["bwd_ms"] if "bwd_ms" in r else "-",
            "%.1f" % r["bwd_gflops"] if "bwd_gflops" in r else "-",
            r["fwd_gflops"] / roofline))
    return "\n".join(out)


def plot_kind(rows):
    """(dtype, causal) of the problems plot draws: float32 non-causal where they were timed,
    else the first of float32 first, non-causal first, then by name."""
    return min({(r["dtype"], r["causal"]) for r in rows},
               key=lambda kind: (kind[0] != "float32", kind[1], kind[0]))


def plot(rows, path):
    """GFLOP/s (forward) against N of the problems of plot_kind, one line per backend and
    device."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dtype, causal = plot_kind(rows)
    picked = [r for r in rows if (r["dtype"], r["causal"]) == (dtype, causal)]
    for label in sorted({(r["backend"], r["device"]) for r in picked}):
        line = sorted((r for r in picked if (r["backend"], r["device"]) == label),
                      key=lambda r: r["N"])
        ax.plot([r["N"] for r in line], [r["fwd_gflops"] for r in line], marker="o",
                label="%s (%s)" % label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("forward GFLOP/s (FlashAttention-2 accounting)")
    ax.set_title("attention forward, %s, %s" % (dtype, "causal" if causal else "non-causal"))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, 120)


def save_figure(fig, path, dpi):
    """fig into path in the format its suffix names (PNG without one: a device such as
    /dev/null), replacing the file atomically (written straight, a failure midway had left a
    cut file where an --overwrite'd plot was), and closed."""
    import matplotlib.pyplot as plt

    from .atomic import write_atomically
    try:
        write_atomically(path, lambda f: fig.savefig(
            f, format=os.path.splitext(path)[1][1:].lower() or "png", dpi=dpi))
    finally:
        plt.close(fig)


def training_tokens_per_s(steps=6, batch=8, seq=256, compiled=False):
    """Tokens/s of the demo model's training step, orchard attention versus torch SDPA: the
    median step of each (steps >= 3), the models' steps interleaved so that all see the same
    machine. compiled: each also under torch.compile (Inductor), as "<backend> compiled"."""
    import torch

    from orchard.model import GPT, GPTConfig
    from orchard.torch import patch_model
    if steps < MIN_REPEATS:
        raise ValueError("training_tokens_per_s(): 'steps' must be >= %d, got %r"
                         % (MIN_REPEATS, steps))
    x = torch.randint(0, 256, (batch, seq))
    steps_of = {}
    for backend in ("torch-sdpa", "orchard"):
        for compile_it in (False, True) if compiled else (False,):
            torch.manual_seed(0)
            model = GPT(GPTConfig(context=seq))
            if backend == "orchard":
                patch_model(model)
            forward = torch.compile(model) if compile_it else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(forward=forward, opt=opt):
                _, loss = forward(x, x)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            # round_robin's first round is the warm-up (and a compiled model's compilation)
            steps_of[backend + (" compiled" if compile_it else "")] = step
    times = round_robin(steps_of, steps)
    return {backend: batch * seq / float(np.median(t)) for backend, t in times.items()}


def against_torch_header(torch, rounds):
    """The first line of a comparison with torch on the CPU: the CPU, its cores, orchard's
    native kernel set, torch's version and threads, the rounds."""
    cpu = orchard_ops.devices()[0]
    return ("%s, %d cores, native kernel set %s; torch %s, %d threads; %d rounds"
            % (cpu["name"], cpu["compute_units"], cpu["kernel_isa"], torch.__version__,
               torch.get_num_threads(), rounds))


def round_robin(calls, rounds, settle=()):
    """Seconds of every call in each of `rounds` rounds of all of them in turn. A shared VM
    drifts by 10 to 20 % over a minute; the ratio of two calls made side by side, taken in
    every round, drifts much less (the median of those ratios is what the targets quote).
    The calls named in `settle` are followed by a pause: after a NumPy matrix product
    OpenBLAS's threads spin for about 0.1 s, after a torch call its OpenMP threads for 5-10 ms,
    and the next call would run on fewer cores."""
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


def _bytes_copied(device, calls):
    """Bytes each of calls {name: fn} copies between host and device memory (stats())."""
    out = {}
    for name, fn in calls.items():
        orchard_ops.reset_stats()
        fn()
        st = orchard_ops.stats()["per_device"][device]
        out[name] = st["host_to_device_bytes"] + st["device_to_host_bytes"]
    return out


def resident_vs_host(shape, device, causal, rounds, rng):
    """Forward, and forward+backward ("step"), of float32 operands of shape (B, H, N, D) on
    OpenCL device `device`: host arrays against DeviceArrays (orchard_ops.to_device, made
    once), alternating in rounds. Medians in ms, the median of the per-round ratios
    host / resident, and the bytes a host-array call copies."""
    arrays, _ = operands(shape, "float32", rng)
    resident = [orchard_ops.to_device(a, device) for a in arrays]

    def step(q, k, v, dout):
        out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
        return orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, device=device)

    calls = {"host_fwd": orchard_calls(*arrays, causal, device)[0],
             "resident_fwd": orchard_calls(*resident, causal, device)[0],
             "host_step": lambda: step(*arrays),
             "resident_step": lambda: step(*resident)}
    row = {"shape": list(shape), "causal": causal,
           "bytes_copied_per_host_call": _bytes_copied(device, {"fwd": calls["host_fwd"],
                                                                "step": calls["host_step"]})}
    t = round_robin(calls, rounds)
    for what in ("fwd", "step"):
        row[what] = {"host_ms": float(np.median(t["host_" + what])) * 1e3,
                     "resident_ms": float(np.median(t["resident_" + what])) * 1e3,
                     "ratio": float(np.median(t["host_" + what] / t["resident_" + what]))}
    return row


def run(shapes, devices, dtypes, causal_flags, repeats, train_steps=0, progress=None):
    """The report orchard-bench prints and writes: machine facts, the roofline, one row per
    measurement, the comparisons, and with train_steps > 0 the training tokens/s. Every
    figure is a median of `repeats` (>= MIN_REPEATS) timings."""
    report = {"machine": machine_facts(), "repeats": repeats,
              "sgemm_gflops": sgemm_gflops(repeats)}
    report["results"] = measure(shapes, devices, dtypes, causal_flags, repeats, progress)
    # the roofline is the best the machine did: measured before and after the grid, so that a
    # busy moment of a shared machine at the start does not lower it
    report["sgemm_gflops"] = max(report["sgemm_gflops"], sgemm_gflops(repeats))
    report["comparisons"] = comparisons(report["results"])
    if train_steps:
        report["training_tokens_per_s"] = training_tokens_per_s(steps=train_steps)
    return report
