"""Decode-step benchmark: one new query token over a long KV cache, orchard against torch's
scaled_dot_product_attention on the same tensors, and both against the machine's read
bandwidth (a large multithreaded sum measured in the same run). orchard-bench --decode and
benchmarks/decode.py print it.

A decode step reads every key and value once and does little arithmetic with them, so its
roof is memory bandwidth: GB/s here are bytes of K and V per second, against a sum over
evict_bytes() (memory: 1 GiB on the Xeons measured) and a sum over as many bytes as the cache
(memory, or the CPU's cache where it fits).

Each step is timed twice: warm, the fastest of calls made back to back (the cache stays in the
CPU's caches where it fits there, as a 4,096-key cache of 32 heads does in a 300 MB L3), and
with the caches evicted, each call after a write over evict_bytes(), as a step of a model of
many layers finds its cache after the other layers' (there orchard asks for every line ahead,
which a warm cache in the L3 does not need: attn_native.c DECODE_STREAM_BYTES).

Each case has a second row: the same keys and values laid out as FlashAttention's caches are,
(1, n, kv heads, D), the heads of each row side by side, read in place through a strided view;
and a third: as a paged cache (pages of PAGE rows, (num_pages, PAGE, kv heads, D), in scrambled
order, read in place through a block_table). Both against torch SDPA on the contiguous
tensors, timed alongside.
"""
import glob
import statistics
import time

import torch
import torch.nn.functional as F

import orchard_ops
from orchard.benchmark import best_time

# (query heads, kv heads, head dim, cache length): the shapes, a Llama-style model
CASES = [(32, 8, 128, 4096), (32, 8, 128, 16384), (32, 32, 128, 4096), (32, 32, 128, 16384)]
DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = tuple(str(dt).split(".")[-1] for dt in DTYPES)    # as --dtypes names them
PAGE = 256  # rows per page of the paged rows (vLLM's and FlashAttention's usual sizes: 16-256)


# torch's OpenMP threads keep spinning for 5-10 ms after a torch call (measured here), and an
# orchard call made meanwhile shares the cores with them (a bfloat16 GQA step at 4,096 keys:
# 1.23-1.30 ms instead of 0.80): each side is timed over this long a run of its own calls
SETTLE = 0.025
# at most this many bytes swept to evict the caches: more than the last-level cache of any CPU
# this runs on (300 MB on the Xeons measured)
EVICT_BYTES = 1 << 30


def evict_bytes():
    """Bytes a write must cover to leave nothing of a cache in the CPU's caches: four times
    its largest cache as Linux lists it (at least 64 MiB), at most EVICT_BYTES, which is also
    taken where the sizes cannot be read; so that a small machine need not hold 1 GiB."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            pass
    return min(EVICT_BYTES, max(64 << 20, 4 * max(sizes))) if sizes else EVICT_BYTES


def settled_time(fn, seconds=SETTLE):
    """Seconds of the fastest call of fn among at least 3 made back to back for `seconds`."""
    best, end, n = float("inf"), time.perf_counter() + seconds, 0
    while n < 3 or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        n += 1
    return best


def evicted_time(fn, sweep, calls=3):
    """Seconds of the fastest of `calls` calls of fn, each made after a write over `sweep`
    (a tensor of evict_bytes()) and a pause for torch's threads to stop spinning."""
    best = float("inf")
    for _ in range(calls):
        sweep.add_(1.0)
        time.sleep(SETTLE)
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(repeats=5, nbytes=None):
    """GB/s of a sum over `nbytes` (None: evict_bytes()) of float32 with all of torch's
    threads: the machine's read bandwidth as a program sees it (from memory for evict_bytes();
    from the last-level cache for a size that fits there, as a 4,096-key cache of 32 heads
    does in a 260 MiB L3)."""
    if nbytes is None:
        nbytes = evict_bytes()
    x = torch.ones(nbytes // 4)
    return nbytes / best_time(lambda: x.sum(), repeats) / 1e9


def paged(x, order):
    """x (1, kv heads, n, D) as pages (num_pages, PAGE, kv heads, D), page i of the sequence
    stored at order[i]."""
    pages = len(order)
    rows = torch.zeros(pages * PAGE, x.shape[1], x.shape[3], dtype=x.dtype)
    rows[:x.shape[2]] = x[0].transpose(0, 1)
    out = torch.empty(pages, PAGE, x.shape[1], x.shape[3], dtype=x.dtype)
    out[order] = rows.view(pages, PAGE, x.shape[1], x.shape[3])
    return out


def measure(cases=CASES, dtypes=DTYPES, rounds=5, device="cpu"):
    """One row per (case, dtype, layout): orchard and torch ms (medians over rounds of
    settled_time), their GB/s of K and V read, the median of the rounds' ratios, and the
    fractions of the machine's bandwidth and of a sum over as many bytes as the cache (the
    roof where the cache fits in a cache of the CPU's)."""
    bandwidth = read_bandwidth()
    sweep = torch.zeros(evict_bytes() // 4)
    rows = []
    for h, hkv, d, n in cases:
        g = torch.Generator().manual_seed(0)
        for dt in dtypes:
            q = torch.randn(1, h, 1, d, generator=g).to(dt)
            k = torch.randn(1, hkv, n, d, generator=g).to(dt)
            v = torch.randn(1, hkv, n, d, generator=g).to(dt)
            gqa = hkv != h
            kv_bytes = 2 * hkv * n * d * k.element_size()
            cache_sum = read_bandwidth(nbytes=kv_bytes)
            ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
            order = torch.randperm(-(-n // PAGE), generator=g)     # scrambled pages
            kp, vp, qp = paged(k, order), paged(v, order), q[0].transpose(0, 1)
            table = order[None].to(torch.int32)
            cu_q, cu_k = (torch.tensor([0, m], dtype=torch.int32) for m in (1, n))
            calls = {"contiguous": lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=True,
                                                                      device=device),
                     "side by side": lambda: orchard_ops.flash_attn_fwd(q, ks, vs, causal=True,
                                                                        device=device),
                     "paged %d" % PAGE: lambda: orchard_ops.flash_attn_varlen_fwd(
                         qp, kp, vp, cu_q, cu_k, causal=True, block_table=table,
                         device=device)}
            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            for layout, call in calls.items():
                ours, theirs, ours_cold, theirs_cold = [], [], [], []
                for _ in range(rounds):
                    ours.append(settled_time(call))
                    theirs.append(settled_time(sdpa))
                    ours_cold.append(evicted_time(call, sweep))
                    theirs_cold.append(evicted_time(sdpa, sweep))
                t_o, t_t = statistics.median(ours), statistics.median(theirs)
                # the ratio of each round's pair, taken side by side, drifts less than the
                # ratio of two medians
                speedup = statistics.median(t / o for o, t in zip(ours, theirs))
                cold_speedup = statistics.median(t / o for o, t in zip(ours_cold, theirs_cold))
                rows.append(dict(heads=h, kv_heads=hkv, d=d, n=n, dtype=str(dt).split(".")[-1],
                                 layout=layout, orchard_ms=t_o * 1e3, torch_ms=t_t * 1e3,
                                 orchard_gbs=kv_bytes / t_o / 1e9, torch_gbs=kv_bytes / t_t / 1e9,
                                 speedup=speedup,
                                 orchard_evicted_ms=statistics.median(ours_cold) * 1e3,
                                 torch_evicted_ms=statistics.median(theirs_cold) * 1e3,
                                 evicted_speedup=cold_speedup,
                                 bandwidth_fraction=kv_bytes / t_o / 1e9 / bandwidth,
                                 cache_sum_gbs=cache_sum,
                                 cache_sum_fraction=kv_bytes / t_o / 1e9 / cache_sum))
    return bandwidth, rows


def table(bandwidth, rows, device="cpu"):
    """Markdown table of measure()'s rows."""
    lines = ["decode, batch 1, one query token, orchard device %s; machine read bandwidth "
             "%.1f GB/s (multithreaded sum, this run)" % (device, bandwidth), "",
             "| heads / kv heads | D | cache | layout | dtype | orchard ms | torch SDPA ms "
             "| orchard GB/s | torch GB/s | orchard vs torch | orchard / bandwidth "
             "| same-size sum GB/s | orchard / same-size sum | caches evicted: orchard ms "
             "| torch SDPA ms | orchard vs torch |",
             "|" + " --- |" * 16]
    for r in rows:
        lines.append("| %d / %d | %d | %d | %s | %s | %.3f | %.3f | %.1f | %.1f | %.2fx | %.0f %% "
                     "| %.1f | %.0f %% | %.3f | %.3f | %.2fx |" % (
                         r["heads"], r["kv_heads"], r["d"], r["n"], r["layout"], r["dtype"],
                         r["orchard_ms"], r["torch_ms"], r["orchard_gbs"], r["torch_gbs"],
                         r["speedup"], 100 * r["bandwidth_fraction"], r["cache_sum_gbs"],
                         100 * r["cache_sum_fraction"], r["orchard_evicted_ms"],
                         r["torch_evicted_ms"], r["evicted_speedup"]))
    return "\n".join(lines)
