"""Per-call overhead of orchard.flash_attn over orchard_ops on a tiny shape.

Times flash_attn_func(q, k, v) on (batch, seqlen, nheads, headdim) torch tensors against
orchard_ops.flash_attn_fwd on the same tensors seen as (batch, nheads, seqlen, headdim) (what
the torch layer adds: its checks and autograd; target at most 15 us), and
against orchard_ops on the same data as NumPy arrays (which adds orchard_ops' DLPack
hand-over of tensors in and out): forward without autograd, and forward + backward with q, k,
v requiring gradients. Then a decode step's call as a model makes it, between other torch
operations (a few small matrix products, which leave the caches to them): orchard_ops on torch
tensors with and without a KV cache's seqused_k and leftpad_k, on NumPy arrays, and torch's
scaled_dot_product_attention, medians over --between rounds. Last a decode step over a paged
KV cache (one new token per request written and read in place through a block_table) by
flash_attn_with_kvcache against orchard_ops over the same pages: the cost of its checks and
writes as the requests and their pages grow; and the same step by orchard.hf, as transformers'
continuous batching makes it (where transformers is installed).

    ORCHARD_NUM_THREADS=1 python benchmarks/flash_attn_overhead.py [--repeats N] [--between N]

One thread keeps the figure steady on a busy machine: waking the thread pool then costs
more than the tiny kernel, and varies.
"""
import argparse
import os
import statistics
import sys
import time
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402

import orchard_ops  # noqa: E402
from orchard.flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: E402


def per_call_us(fns, number, repeats):
    """Microseconds per call of each function: the fastest of several short runs, taken in
    turn, since other processes on a shared machine only ever add time."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs (fastest taken)")
    parser.add_argument("--number", type=int, default=1000, help="calls per timed run")
    parser.add_argument("--between", type=int, default=300,
                        help="rounds of the calls between other operations")
    args = parser.parse_args()

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 16) for _ in range(3))
    qa, ka, va = (t.transpose(1, 2).contiguous().numpy() for t in (q, k, v))
    device = orchard_ops.default_device()

    def ops_fwd_bwd():
        out, lse = orchard_ops.flash_attn_fwd(qa, ka, va, device=device)
        orchard_ops.flash_attn_bwd(out, qa, ka, va, out, lse, device=device)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        flash_attn_func(qg, kg, vg, device=device).backward(q)

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ops, ops_t, ours, ops_b, ours_b = per_call_us(
        [lambda: orchard_ops.flash_attn_fwd(qa, ka, va, device=device),
         lambda: orchard_ops.flash_attn_fwd(qt, kt, vt, device=device),
         lambda: flash_attn_func(q, k, v, device=device), ops_fwd_bwd, fwd_bwd],
        args.number, args.repeats)
    print("shape (batch, seqlen, nheads, headdim) = (1, 4, 2, 16), float32, device %s" % device)
    print("%-36s %10s %12s %9s" % ("us per call", "orchard_ops", "flash_attn", "overhead"))
    print("%-36s %10.1f %12.1f %9.1f" % ("forward, orchard_ops on the tensors", ops_t, ours,
                                         ours - ops_t))
    print("%-36s %10.1f %12.1f %9.1f" % ("forward, orchard_ops on NumPy arrays", ops, ours,
                                         ours - ops))
    print("%-36s %10.1f %12.1f %9.1f" % ("forward + backward, NumPy arrays", ops_b, ours_b,
                                         ours_b - ops_b))
    print("torch layer overhead: %.1f us per forward call (target <= 15); with the DLPack "
          "hand-over: %.1f us" % (ours - ops_t, ours - ops))
    between_operations(device, args.between)
    paged_steps(device, args.repeats)


def between_operations(device, rounds):
    """A decode step's call (batch 2, 4 heads over 2, 64 cached keys, D 64) after a few small
    matrix products, as between a model's layers: median microseconds per call."""
    q, k, v = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 64, 64), torch.randn(2, 2, 64, 64)
    qa, ka, va = q.numpy(), k.numpy(), v.numpy()
    used, leftpad = torch.tensor([60, 64]), torch.tensor([8, 0], dtype=torch.int32)
    x, a, b = torch.randn(2, 256), torch.randn(256, 688), torch.randn(1024, 256)
    calls = {
        "orchard_ops, tensors": lambda: orchard_ops.flash_attn_fwd(q, k, v, causal=True,
                                                                   device=device),
        "orchard_ops, tensors, seqused_k and leftpad_k": lambda: orchard_ops.flash_attn_fwd(
            q, k, v, causal=True, seqused_k=used, leftpad_k=leftpad, device=device),
        "orchard_ops, NumPy arrays": lambda: orchard_ops.flash_attn_fwd(qa, ka, va, causal=True,
                                                                        device=device),
        "torch scaled_dot_product_attention": lambda: torch.nn.functional
        .scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    times = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in calls.items():
                for _ in range(3):
                    torch.nn.functional.silu(x @ a), x @ b.t()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    print("between other operations (batch 2, 4 heads over 2, 64 keys, D 64), median us per call:")
    for name, t in times.items():
        print("  %-48s %6.1f" % (name, statistics.median(t) * 1e6))


def paged_steps(device, repeats):
    """flash_attn_with_kvcache's decode step over pages (8 heads over 2, D 64, pages in
    scrambled order, every request the same length) against orchard_ops' call on them, and
    orchard.hf's, continuous batching's decode fast path, on the same pages (transformers'
    layout: one token of each request along the sequence axis) where transformers is
    installed."""
    try:
        from orchard import hf
    except ImportError:     # (no transformers)
        hf = None
    print("paged decode step (8 heads over 2, D 64), us per call, and over orchard_ops':")
    print("%-40s %12s %11s %9s %10s %9s" % ("requests x table entries, page, keys",
                                            "orchard_ops", "flash_attn", "overhead",
                                            "orchard.hf", "overhead"))
    g = torch.Generator().manual_seed(0)
    options = dict(softmax_scale=0.125, causal=True, window_size=(-1, -1), softcap=0.0)
    for batch, width, page, keys in ((1, 8, 16, 100), (8, 64, 16, 500), (32, 256, 16, 2000),
                                     (64, 128, 32, 1000)):
        pages = batch * width
        kc, vc = (torch.randn(pages, page, 2, 64, generator=g) for _ in range(2))
        table = torch.randperm(pages, generator=g).view(batch, width).to(torch.int32)
        q, k, v = (torch.randn(batch, 1, h, 64, generator=g) for h in (8, 2, 2))
        seqlens = torch.full((batch,), keys - 1, dtype=torch.int32)
        cu_q = torch.arange(batch + 1, dtype=torch.int32)
        calls = [lambda: orchard_ops.flash_attn_varlen_fwd(q[:, 0], kc, vc, cu_q, cu_q * keys,
                                                           causal=True, block_table=table,
                                                           device=device),
                 lambda: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                 block_table=table, causal=True, device=device)]
        if hf is not None:
            kwargs = dict(block_table=table, cu_seq_lens_k=cu_q * keys, k_cache=kc, v_cache=vc)
            query, key, value = (t.permute(1, 2, 0, 3) for t in (q, k, v))     # (1, H, batch, D)
            calls.append(lambda: hf._paged_decode(query, key, value, kwargs, options))
        times = per_call_us(calls, max(1, 20000 // (batch * keys // 100)), repeats)
        ops, ours = times[:2]
        hf_cells = ("%10.1f %9.1f" % (times[2], times[2] - ops)) if hf is not None else ""
        print("%-40s %12.1f %11.1f %9.1f %s" % ("%d x %d, %d, %d" % (batch, width, page, keys),
                                               ops, ours, ours - ops, hf_cells))


if __name__ == "__main__":
    main()
