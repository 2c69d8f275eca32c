"""Scaling tables: attention ms and GFLOP/s against the sequence length N (256 to 16384), for
each dtype, head dim D, causal flag and direction, orchard beside torch's
scaled_dot_product_attention and a naive NumPy attention, with the machine's matrix products
as rooflines. orchard-bench --scaling prints them, writes them as JSON and plots them.

Work per call: B = 1 and H = TOKENS / N heads, so every call holds TOKENS rows of each
operand (the same memory at every N) and its FLOPs grow linearly with N. N = 16384 still has
two heads: orchard's backward gives each head to one worker, and one head would leave a
core of two idle.

The naive attention materialises the H x N x N scores, in NumPy at the table's dtype, so it
runs only in float32 and float64 tables (NumPy has no bfloat16 and no fast float16 matrix
product) and only where those scores take at most NAIVE_BYTES; its backward holds about four
such arrays at once.

Timing: in each row the calls (naive, orchard on every device, torch; forward and backward)
alternate in one loop of `rounds` rounds after a warm-up round (benchmark.round_robin); ms
is the median of a call's times, and "vs torch" the median of the ratio torch / orchard of
each round (above 1: orchard is faster). The rooflines are measured once, before the tables
(rooflines(): the fastest round of each): NumPy's float32 matrix product, and torch.matmul on
bfloat16, which is the roofline of the bfloat16 tables (the float32 product that of the
others). FLOPs as in orchard.benchmark.
"""
import math

import numpy as np

from . import benchmark

NS = tuple(256 << i for i in range(7))          # 256, 512, ..., 16384
HEAD_DIMS = (64, 128, 256)
TOKENS = 32768
QUICK_NS, QUICK_HEAD_DIMS, QUICK_TOKENS = (256, 512), (32,), 1024
NAIVE_BYTES = 256 << 20
ROOF_ROUNDS = 10
NAIVE_DTYPES = ("float32", "float64")
DIRECTIONS = ("fwd", "bwd")


def heads(n, tokens=TOKENS):
    return max(1, tokens // n)


def naive_fits(h, n, dtype):
    return dtype in NAIVE_DTYPES and h * n * n * np.dtype(dtype).itemsize <= NAIVE_BYTES


def _naive_probs(q, k, causal):
    """softmax(q k^T / sqrt(D)) of (H, N, D) arrays, the whole (H, N, N) matrix at once."""
    s = q @ k.swapaxes(-1, -2)
    s *= 1.0 / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s[..., ~np.tri(n, dtype=bool)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def naive_fwd(q, k, v, causal):
    """Attention as it is written without FlashAttention: the out of (..., N, D) arrays."""
    return _naive_probs(q, k, causal) @ v


def naive_bwd(dout, q, k, v, causal):
    """(dq, dk, dv) of naive_fwd, the probabilities recomputed as orchard's backward does."""
    p = _naive_probs(q, k, causal)
    dv = p.swapaxes(-1, -2) @ dout
    ds = dout @ v.swapaxes(-1, -2)
    ds -= (ds * p).sum(axis=-1, keepdims=True)
    ds *= p
    ds *= 1.0 / math.sqrt(q.shape[-1])
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv


def roofline_of(dtype):
    return "bf16_gemm_gflops" if dtype == "bfloat16" else "sgemm_gflops"


def rooflines(rounds, torch=None, n=1024):
    """GFLOP/s of NumPy's float32 matrix product and (with torch) of torch.matmul on
    bfloat16, of (n, n) matrices: each the fastest of its rounds, since a shared VM's noise
    only ever slows a product down (the median of three read 88 GFLOP/s in one run, 120 in
    the next, 143 alone minutes later: AMD EPYC, 2 cores). The float32 product, about 15 ms,
    runs at least ROOF_ROUNDS rounds; each is followed by a pause (benchmark.round_robin), so
    that neither runs beside the other's spinning threads."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    calls = {"sgemm_gflops": (lambda: a @ a, max(rounds, ROOF_ROUNDS))}
    if torch is not None:
        b = torch.from_numpy(a).to(torch.bfloat16)
        calls["bf16_gemm_gflops"] = (lambda: torch.matmul(b, b), rounds)
    roofs = {}
    for name, (fn, runs) in calls.items():
        times = benchmark.round_robin({name: fn}, runs, settle=(name,))[name]
        roofs[name] = 2.0 * n ** 3 / float(times.min()) / 1e9
    return roofs


def problems(ns, head_dims, dtypes, causal_flags):
    """Every (dtype, D, causal, N) in the order of the tables."""
    return [(dtype, d, causal, n) for dtype in dtypes for d in head_dims
            for causal in causal_flags for n in ns]


def measure_problem(dtype, d, causal, n, devices, rounds, tokens, roofs, torch):
    """The two rows (forward, backward) of one problem, from one round_robin loop."""
    h = heads(n, tokens)
    rng = np.random.default_rng(0)
    _, (q, k, v, dout) = benchmark.operands((1, h, n, d), dtype, rng, torch)
    calls, settle = {}, []
    if naive_fits(h, n, dtype):
        nq, nk, nv, ndo = (np.asarray(x)[0] for x in (q, k, v, dout))
        calls["numpy-naive fwd"] = lambda: naive_fwd(nq, nk, nv, causal)
        calls["numpy-naive bwd"] = lambda: naive_bwd(ndo, nq, nk, nv, causal)
        settle = list(calls)        # OpenBLAS's threads spin for a while after a product
    pairs = {"orchard:" + dev: benchmark.orchard_calls(q, k, v, dout, causal, dev)
             for dev in devices}
    if torch is not None:
        pairs["torch-sdpa"] = benchmark.sdpa_calls(q, k, v, dout, causal)
    for i, direction in enumerate(DIRECTIONS):
        for name, pair in pairs.items():
            calls[name + " " + direction] = pair[i]
    times = benchmark.round_robin(calls, rounds, settle=settle)
    flops = benchmark.attention_flops(1, h, n, d, causal)
    rows = []
    for direction, gflop in (("fwd", flops / 1e9), ("bwd", 2.5 * flops / 1e9)):
        row = {"dtype": dtype, "D": d, "causal": causal, "direction": direction, "N": n,
               "B": 1, "H": h, "gflop": gflop, "roofline": roofline_of(dtype),
               "ms": {}, "gflops": {}, "round_ms": {}, "vs_torch": {}, "vs_roofline": {}}
        for name, t in times.items():
            backend, call_direction = name.split(" ")
            if call_direction == direction:
                median = float(np.median(t))
                row["round_ms"][backend] = [float(x) * 1e3 for x in t]
                row["ms"][backend] = median * 1e3
                row["gflops"][backend] = gflop / median
        for dev in devices:
            ours = times["orchard:%s %s" % (dev, direction)]
            if torch is not None:
                row["vs_torch"][dev] = float(np.median(times["torch-sdpa " + direction] / ours))
            row["vs_roofline"][dev] = row["gflops"]["orchard:" + dev] / roofs[row["roofline"]]
        rows.append(row)
    return rows


def measure(ns, head_dims, dtypes, causal_flags, devices, rounds, tokens=TOKENS, after=None):
    """The scaling report: the rooflines, the work and naive rules, notes on what was left
    out, and one row per (dtype, D, causal, direction, N). after(done, label, report), if
    given, is called after each problem with the report so far (the full grid takes the
    better part of an hour: orchard-bench shows its progress and saves what it has there)."""
    try:
        import torch
    except ImportError:
        torch = None
    report = {"tokens": tokens, "naive_bytes": NAIVE_BYTES, "rounds": rounds,
              "devices": list(devices), "notes": [],
              "rooflines": rooflines(rounds, torch), "rows": []}
    if torch is None:
        report["notes"].append("torch is not installed: no torch SDPA columns and no "
                               "bfloat16 matrix product roofline")
    todo = problems(ns, head_dims, dtypes, causal_flags)
    for done, (dtype, d, causal, n) in enumerate(todo, 1):
        report["rows"] += measure_problem(dtype, d, causal, n, devices, rounds, tokens,
                                          report["rooflines"], torch)
        if after is not None:
            after(done, "%s D=%d%s N=%d" % (dtype, d, " causal" if causal else "", n), report)
    return report


def _tables(report):
    """{(dtype, D, causal, direction): rows by N}, in the order they were measured."""
    tables = {}
    for row in report["rows"]:
        key = (row["dtype"], row["D"], row["causal"], row["direction"])
        tables.setdefault(key, []).append(row)
    return tables


ROOFLINE_NAMES = {"sgemm_gflops": "NumPy float32 matrix product",
                  "bf16_gemm_gflops": "torch.matmul bfloat16"}


def table(report):
    """Markdown: a header with the rooflines and rules, then one table per (dtype, D, causal,
    direction) with one row per N."""
    roofs = report["rooflines"]
    lines = ["Rooflines (this run): " + ", ".join(
        "%s %.1f GFLOP/s" % (ROOFLINE_NAMES[key], value) for key, value in roofs.items()),
        "Each call: B = 1, H = %d / N heads; naive NumPy where its H x N x N scores take "
        "<= %d MiB (float32 and float64 only); ms: median of %d rounds, the calls "
        "alternating." % (report["tokens"], report["naive_bytes"] >> 20, report["rounds"])]
    lines += report["notes"]
    for (dtype, d, causal, direction), rows in _tables(report).items():
        backends = [b for b in ["orchard:" + dev for dev in report["devices"]]
                    + ["torch-sdpa", "numpy-naive"] if any(b in r["ms"] for r in rows)]
        devs = report["devices"]
        head = ["N", "H"]
        for b in backends:
            head += ["%s ms" % b, "GFLOP/s"]
        if "torch-sdpa" in backends:
            head += ["orchard:%s vs torch" % dev for dev in devs]
        head += ["orchard:%s / roofline" % dev for dev in devs]
        lines += ["", "%s, D=%d, %s, %s (roofline: %s)" % (
            dtype, d, "causal" if causal else "non-causal",
            "forward" if direction == "fwd" else "backward", ROOFLINE_NAMES[rows[0]["roofline"]]),
            "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in rows:
            cells = [str(r["N"]), str(r["H"])]
            for b in backends:
                cells += (["%.2f" % r["ms"][b], "%.1f" % r["gflops"][b]] if b in r["ms"]
                          else ["-", "-"])
            if "torch-sdpa" in backends:
                cells += ["%.2fx" % r["vs_torch"][dev] for dev in devs]
            cells += ["%.2f" % r["vs_roofline"][dev] for dev in devs]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report, path):
    """A PNG of GFLOP/s against N: one panel per (dtype, causal) row and D column, a line per
    backend (one colour each) and direction (forward solid, backward dashed), the panel's
    roofline dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tables = _tables(report)
    panels = list(dict.fromkeys((dtype, causal) for dtype, _, causal, _ in tables))
    dims = sorted({d for _, d, _, _ in tables})
    backends = list(dict.fromkeys(b for r in report["rows"] for b in r["gflops"]))
    ns = sorted({r["N"] for r in report["rows"]})
    fig, axes = plt.subplots(len(panels), len(dims), squeeze=False,
                             figsize=(4.5 * len(dims), 3.2 * len(panels)))
    for i, (dtype, causal) in enumerate(panels):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            for direction, style in (("fwd", "-"), ("bwd", "--")):
                rows = tables.get((dtype, d, causal, direction), [])
                for colour, backend in enumerate(backends):
                    line = [r for r in rows if backend in r["gflops"]]
                    if line:
                        ax.plot([r["N"] for r in line], [r["gflops"][backend] for r in line],
                                style, color="C%d" % colour, marker="o", markersize=3,
                                label="%s %s" % (backend, direction))
            roof = report["rooflines"][roofline_of(dtype)]
            ax.axhline(roof, color="gray", linestyle=":", label=ROOFLINE_NAMES[roofline_of(dtype)])
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns], fontsize=7)
            ax.set_title("%s D=%d %s" % (dtype, d, "causal" if causal else "non-causal"),
                         fontsize=9)
            ax.set_xlabel("N")
            ax.set_ylabel("GFLOP/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    benchmark.save_figure(fig, path, 100)
