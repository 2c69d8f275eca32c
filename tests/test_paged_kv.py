"""Paged KV caches (block_table) read in place: flash_attn_with_kvcache and
flash_attn_varlen_func against the same cache laid out contiguously and against the float64
reference, for page sizes from 1 to past the cache, scrambled and shared pages, ragged and
left-padded sequences, GQA, decode and prefill, every native kernel set and every OpenCL kernel
family; that no copy of the pages is made; that bad tables are refused; and left padding
(leftpad_k) of contiguous keys, and a dense call's seqused_k and leftpad_k, on every device."""

import json
import re

import numpy as np
import pytest

from conftest import OPENCL_IDS, assert_close, needs_test_hooks, run_python

torch = pytest.importorskip("torch")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from orchard.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from orchard.reference import ref_fwd  # noqa: E402

import orchard_ops  # noqa: E402

H, HK, D = 8, 2, 64


def paginate(k_cache, v_cache, page, g, share_prefix=0):
    """The contiguous caches (B, cap, HK, D) as pages of `page` rows in scrambled order, plus
    unused pages of garbage; with share_prefix, sequence 1 lists sequence 0's first pages
    (whose rows must then be equal in the contiguous caches). Returns (kp, vp, table)."""
    batch, cap = k_cache.shape[:2]
    per_seq = -(-cap // page)
    n = batch * per_seq + 3
    order = torch.randperm(n, generator=g)
    table = order[:batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    if share_prefix:
        table[1, :share_prefix] = table[0, :share_prefix]
    kp = torch.randn((n, page) + tuple(k_cache.shape[2:]), generator=g).to(k_cache.dtype)
    vp = torch.randn((n, page) + tuple(v_cache.shape[2:]), generator=g).to(v_cache.dtype)
    for b in range(batch):
        for i in range(per_seq):
            rows = slice(i * page, min((i + 1) * page, cap))
            kp[table[b, i], :rows.stop - rows.start] = k_cache[b, rows]
            vp[table[b, i], :rows.stop - rows.start] = v_cache[b, rows]
    return kp, vp, table


def caches(g, batch, cap, dtype, share_prefix_rows=0):
    k = torch.randn(batch, cap, HK, D, generator=g).to(dtype)
    v = torch.randn(batch, cap, HK, D, generator=g).to(dtype)
    if share_prefix_rows:       # sequences 0 and 1 share their first rows
        k[1, :share_prefix_rows] = k[0, :share_prefix_rows]
        v[1, :share_prefix_rows] = v[0, :share_prefix_rows]
    return k, v


def reference(q, k_cache, v_cache, starts, ends, causal):
    """float64 out (B, Nq, H, D) of q over cache rows [starts[b], ends[b]) of sequence b."""
    outs = []
    for b, (s, e) in enumerate(zip(starts, ends)):
        qb = q[b].double().transpose(0, 1).numpy()[None]
        kb = k_cache[b, s:e].double().transpose(0, 1).numpy()[None]
        vb = v_cache[b, s:e].double().transpose(0, 1).numpy()[None]
        o, _ = ref_fwd(qb, kb, vb, causal=causal)
        outs.append(o[0].transpose(1, 0, 2))
    return np.stack(outs)


def tol(dtype):     # half precision: the output's rounding
    return {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page", [1, 7, 16, 256, 1000])
def test_decode_paged_equals_contiguous(dtype, page):
    """Ragged lengths (an empty one too), scrambled pages, two sequences sharing their first
    pages, GQA: the paged result is the contiguous one bit for bit (same splits, same order),
    and both match the reference."""
    g = torch.Generator().manual_seed(page)
    seqlens = [300, 777, 0, 1]
    batch, cap = len(seqlens), 800
    shared = 2 * page if 2 * page <= 300 else 0
    k_cache, v_cache = caches(g, batch, cap, dtype, share_prefix_rows=shared)
    kp, vp, table = paginate(k_cache, v_cache, page, g, share_prefix=shared // page)
    q = torch.randn(batch, 1, H, D, generator=g).to(dtype)
    kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), causal=True,
              return_softmax_lse=True)
    out_p, lse_p = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
    out_c, lse_c = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    ref = reference(q, k_cache, v_cache, [0] * batch, seqlens, causal=True)
    assert_close(out_p.float().numpy(), ref, np.float32, "out", "page %d" % page, t=tol(dtype))


@pytest.mark.parametrize("nq", [1, 5, 40], ids=["decode", "speculative", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
def test_new_tokens_leftpad_and_prefill(nq, dtype):
    """New keys written into the pages, left padding, and more than 16 query rows (the
    forward's pre-pass reads the pages, a run of rows at a time; float16 on AMX: a row at a
    time, split into two bfloat16)."""
    g = torch.Generator().manual_seed(nq)
    seqlens, leftpad, page = [100, 37, 250], [5, 0, 70], 13
    batch, cap = len(seqlens), 300
    k_cache, v_cache = caches(g, batch, cap, dtype)
    kp, vp, table = paginate(k_cache, v_cache, page, g)
    q = torch.randn(batch, nq, H, D, generator=g).to(dtype)
    k = torch.randn(batch, nq, HK, D, generator=g).to(dtype)
    v = torch.randn(batch, nq, HK, D, generator=g).to(dtype)
    kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), causal=True,
              cache_leftpad=torch.tensor(leftpad, dtype=torch.int32))
    out_p = flash_attn_with_kvcache(q, kp, vp, k, v, block_table=table, **kw)
    out_c = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    assert torch.equal(out_p, out_c)
    ends = [s + nq for s in seqlens]
    ref = reference(q, k_cache, v_cache, leftpad, ends, causal=True)
    assert_close(out_p.float().numpy(), ref, np.float32, "out", "nq %d" % nq, t=tol(dtype))


@pytest.fixture(params=orchard_ops.devices()[0]["kernel_isas"])
def isa(request):
    before = orchard_ops.devices()[0]["kernel_isa"]
    orchard_ops.set_native_isa(request.param)
    yield request.param
    orchard_ops.set_native_isa(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("d", [128, 37])
def test_every_kernel_set(isa, dtype, d):
    """Every kernel set's decode (its lane count decides the sums' shuffles and the 16-bit
    widening), paged and not, whole vectors and a ragged head dim, with and without GQA."""
    g = torch.Generator().manual_seed(d)
    for hk in (HK, H):
        seqlens, page = [1000, 3], 32
        k_cache = torch.randn(2, 1024, hk, d, generator=g).to(dtype)
        v_cache = torch.randn(2, 1024, hk, d, generator=g).to(dtype)
        kp, vp, table = paginate(k_cache, v_cache, page, g)
        q = torch.randn(2, 1, H, d, generator=g).to(dtype)
        kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32))
        out_p = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
        out_c = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        assert torch.equal(out_p, out_c)
        ref = reference(q, k_cache, v_cache, [0, 0], seqlens, causal=False)
        t = 1e-5 if dtype == torch.float32 else 8e-3 if dtype == torch.bfloat16 else 1e-3
        assert_close(out_p.float().numpy(), ref, np.float32, "out", "%s hk %d" % (isa, hk), t=t)


def test_no_copy_of_the_pages(device):
    """The pages reach the kernel as they are, on every device: torch allocates nothing the
    size of the keys (gathering them would: a copy of them is made to show the check sees it),
    and orchard_ops stages nothing."""
    g = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(300, 16, HK, D, generator=g), torch.randn(300, 16, HK, D, generator=g)
    table = torch.randperm(300, generator=g)[:200].reshape(2, 100).to(torch.int32)
    q = torch.randn(2, 1, H, D, generator=g)
    kw = dict(block_table=table, cache_seqlens=torch.tensor([1500, 1000], dtype=torch.int32))
    key_bytes = 2500 * HK * D * 4
    orchard_ops.reset_stats()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        flash_attn_with_kvcache(q, kp, vp, device=device, **kw)
        kp[table.flatten().long()]
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocated) >= key_bytes / 2      # the copy made on purpose
    assert sum(allocated) - max(allocated) < key_bytes / 100, allocated
    stats = orchard_ops.stats()["per_device"][device]
    assert stats["bytes_staged"] == 0 and stats["decode_calls"] == 1


PAGED_RUN = """
    import json, sys, torch, numpy as np, orchard_ops
    from orchard.flash_attn import flash_attn_with_kvcache
    from test_paged_kv import caches, paginate, reference, tol, H, D
    checked = 0
    for nq, page in ((1, 1), (1, 1000), (5, 13), (40, 13)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = torch.Generator().manual_seed(nq + page)
            seqlens, leftpad = [100, 37, 250, 0], [5, 0, 70, 0]
            k_cache, v_cache = caches(g, 4, 300, dtype, share_prefix_rows=26)
            kp, vp, table = paginate(k_cache, v_cache, page, g, share_prefix=26 // page)
            q = torch.randn(4, nq, H, D, generator=g).to(dtype)
            kw = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32), causal=True,
                      cache_leftpad=torch.tensor(leftpad, dtype=torch.int32),
                      return_softmax_lse=True, device="%s")
            out_p, lse_p = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
            out_c, lse_c = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
            assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c), (nq, page, dtype)
            ref = reference(q, k_cache, v_cache, leftpad, seqlens, causal=True)
            err = np.abs(out_p.float().numpy() - ref).max()
            assert err <= 2 * tol(dtype), (nq, page, dtype, err)
            checked += 1
    # resident pages (DeviceArrays) give the host arrays' result
    q, kp, vp, table = (x.numpy() for x in (q, kp, vp, table))
    cu_q, cu_k = np.arange(5) * 40, np.array([0, 300, 600, 900, 1200])
    args = dict(causal=True, block_table=table, seqused_k=np.array(seqlens),
                leftpad_k=np.array(leftpad), device="%s")
    host = orchard_ops.flash_attn_varlen_fwd(q.reshape(-1, H, D), kp, vp, cu_q, cu_k, **args)
    dev = [orchard_ops.to_device(x, "%s") for x in (q.reshape(-1, H, D), kp, vp)]
    resident = orchard_ops.flash_attn_varlen_fwd(*dev, cu_q, cu_k, **args)
    same = all(np.array_equal(h, r.numpy()) for h, r in zip(host, resident))
    print(json.dumps([checked, same]))
"""


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device")
@pytest.mark.parametrize("family", ["rows", "tiled", "wg"])
def test_opencl_reads_the_pages_in_place(family):
    """Every OpenCL kernel family reads pages through the meta table's page lists: decode
    steps (page sizes 1 and past the cache), speculative rows and a prefill over scrambled
    pages shared between sequences, with left padding, GQA and an empty sequence, in every
    16-bit and float32 storage: the result of the contiguous cache on the same device bit for
    bit, lse included, and of the float64 reference; resident pages (to_device) too."""
    r = run_python(PAGED_RUN % ((OPENCL_IDS[0],) * 3), timeout=600, ORCHARD_CL_FAMILY=family)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [12, True]


COPY_RUN = """
    import json, numpy as np, orchard_ops as o
    rng = np.random.default_rng(0)
    kp, vp = (rng.standard_normal((4096, 16, 2, 64)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    args = (q, kp, vp, np.array([0, 1, 2]), np.array([0, 20, 37]))
    kw = dict(block_table=np.array([[4000, 9], [9, 17]]), leftpad_k=np.array([0, 16]))
    want = o.flash_attn_varlen_fwd(*args, device="cpu", **kw)
    o.reset_stats()
    got = o.flash_attn_varlen_fwd(*args, device="%s", **kw)
    st = o.stats()["per_device"]["%s"]
    print(json.dumps([all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)),
                      st["host_to_device_bytes"], st["bytes_staged"]]))
"""


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device")
@needs_test_hooks
def test_a_device_without_shared_memory_gets_the_pages_read():
    """Where buffers are copies (a discrete GPU; ORCHARD_CL_TRANSFERS=1 here), a paged call
    sends the pages it reads, not the pool: 3 pages of 4,096 (one shared, one skipped by the
    left padding), the result the native path's."""
    r = run_python(COPY_RUN % ((OPENCL_IDS[0],) * 2), ORCHARD_CL_TRANSFERS=1)
    assert r.returncode == 0, r.stderr[-3000:]
    same, to_device, staged = json.loads(r.stdout.strip().splitlines()[-1])
    page = 16 * 2 * 64 * 4
    assert same and staged == 2 * 3 * page
    assert to_device == 2 * 3 * page + 2 * 8 * 64 * 4       # the pages and q


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device")
def test_a_pool_larger_than_a_buffer_may_be(tmp_path):
    """Pages past the device's largest buffer (max_alloc_bytes; a sparse file mapped, so
    nothing is written) are read as a copy of the pages the call reads."""
    device = next(d for d in orchard_ops.devices() if d["id"] == OPENCL_IDS[0])
    page_bytes = 16 * 2 * 64 * 4
    n = device["max_alloc_bytes"] // page_bytes + 1
    if n * page_bytes > 64 << 30:
        pytest.skip("the device takes buffers of %d bytes" % device["max_alloc_bytes"])
    path = tmp_path / "pool.bin"
    with open(path, "wb") as f:
        f.truncate(2 * n * page_bytes)
    pool = np.memmap(path, np.float32, "r", shape=(2, n, 16, 2, 64))
    q = np.ones((1, 8, 64), np.float32)
    args = (q, pool[0], pool[1], np.array([0, 1]), np.array([0, 20]))
    kw = dict(block_table=np.array([[n - 1, 7]]))
    orchard_ops.reset_stats()
    out, lse = orchard_ops.flash_attn_varlen_fwd(*args, device=OPENCL_IDS[0], **kw)
    assert not out.any() and np.allclose(lse, np.log(20))   # zero keys: all weights equal
    assert orchard_ops.stats()["per_device"][OPENCL_IDS[0]]["bytes_staged"] == 2 * 2 * page_bytes


def test_varlen_func_reads_pages_in_place_without_grad():
    """flash_attn_varlen_func with a block_table: in place when nothing needs a gradient,
    gathered (so gradients reach the pages) when something does; the same result."""
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = caches(g, 2, 90, torch.float32)
    kp, vp, table = paginate(k_cache, v_cache, 8, g)
    lens = [90, 41]
    q = torch.randn(sum(lens), H, D, generator=g)
    cu = torch.tensor([0, 90, 131], dtype=torch.int32)
    orchard_ops.reset_stats()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = flash_attn_varlen_func(q, kp, vp, cu, cu, 90, 90, causal=True, block_table=table)
    assert "aten::index" not in {e.name for e in prof.events()}
    kg, vg = kp.clone().requires_grad_(), vp.clone().requires_grad_()
    out_g = flash_attn_varlen_func(q, kg, vg, cu, cu, 90, 90, causal=True, block_table=table)
    assert torch.equal(out, out_g.detach())
    out_g.sum().backward()
    assert kg.grad is not None and kg.grad[table[0, 0]].abs().sum() > 0
    for b, n in enumerate(lens):
        qb = q[cu[b]:cu[b + 1]].double().transpose(0, 1).numpy()[None]
        kb = k_cache[b, :n].double().transpose(0, 1).numpy()[None]
        vb = v_cache[b, :n].double().transpose(0, 1).numpy()[None]
        ref, _ = ref_fwd(qb, kb, vb, causal=True)
        assert_close(out[cu[b]:cu[b + 1]].numpy(), ref[0].transpose(1, 0, 2), np.float32,
                     "out", "varlen paged %d" % b, t=1e-5)


def ops_call(**kw):
    """flash_attn_varlen_fwd over two sequences of pages (5 pages of 4 rows), with kw."""
    q = torch.randn(2, H, D)
    kp = torch.randn(5, 4, HK, D)
    args = dict(q=q, k=kp, v=kp, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 6, 9], dtype=torch.int32),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    args.update(kw)
    return orchard_ops.flash_attn_varlen_fwd(**args)


@pytest.mark.parametrize("kw,msg", [
    (dict(block_table=torch.tensor([[0, 5], [2, 3]], dtype=torch.int32)),
     r"'block_table'\[0, 1\] = 5 is not a page"),
    (dict(block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
     r"'block_table'\[0, 1\] = -1"),
    (dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), "'block_table' must be"),
    (dict(block_table=torch.tensor([[0], [2]], dtype=torch.int32)), "sequence 0 has 6 keys"),
    (dict(block_table=torch.tensor([[0.0, 1], [2, 3]])), "'block_table' must be an integer"),
    (dict(k=torch.randn(20, HK, D)), "'k' and 'v' must be pages"),
    (dict(v=torch.randn(5, 3, HK, D)), "'k' and 'v' must be pages"),
    (dict(k=torch.randn(0, 4, HK, D), v=torch.randn(0, 4, HK, D)), "num_pages >= 1"),
    (dict(leftpad_k=torch.tensor([7, 0])), r"'leftpad_k'\[0\] = 7"),
    (dict(leftpad_k=torch.tensor([0])), "'leftpad_k' must be"),
    (dict(block_table=None, k=torch.randn(9, HK, D), v=torch.randn(9, HK, D),
          leftpad_k=torch.tensor([0, 4])), r"'leftpad_k'\[1\] = 4 must lie in \[0, 3\]"),
])
def test_bad_pages_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ops_call(**kw)


def test_leftpad_k_on_contiguous_keys(device):
    """Without a block_table, leftpad_k starts each sequence's keys within its slot (with
    seqused_k, a KV cache's left-padded rows): the result of the keys sliced out, on every
    device, for a decode step and a prefill."""
    g = torch.Generator().manual_seed(5)
    slot, lens, pads = 40, [33, 40, 7], [5, 0, 7]
    k, v = torch.randn(3 * slot, HK, D, generator=g), torch.randn(3 * slot, HK, D, generator=g)
    for nq in (1, 20):
        q = torch.randn(3 * nq, H, D, generator=g)
        cu_q = torch.arange(4, dtype=torch.int32) * nq
        out, lse = orchard_ops.flash_attn_varlen_fwd(
            q, k, v, cu_q, torch.arange(4, dtype=torch.int32) * slot, causal=True,
            seqused_k=torch.tensor(lens), leftpad_k=torch.tensor(pads), device=device)
        for b, (n, p) in enumerate(zip(lens, pads)):
            rows = slice(b * slot + p, b * slot + n)
            one, one_lse = orchard_ops.flash_attn_varlen_fwd(
                q[b * nq:(b + 1) * nq], k[rows], v[rows], cu_q[:2], torch.tensor([0, n - p]),
                causal=True, device=device)
            assert torch.equal(out[b * nq:(b + 1) * nq], one)
            assert torch.equal(lse[:, b * nq:(b + 1) * nq], one_lse)


@pytest.mark.parametrize("side_by_side", [False, True])
def test_seqused_and_leftpad_k_of_a_dense_call(device, side_by_side):
    """A dense forward over a KV cache: sequence b uses keys leftpad_k[b] to seqused_k[b] of
    its rows, on every device, GQA, decode step and prefill, caches (B, Hkv, N, D) and
    FlashAttention's (B, N, Hkv, D) seen through a transpose (heads side by side): the
    result of the keys sliced out, bit for bit, and of the float64 reference; lse included."""
    g = torch.Generator().manual_seed(6)
    cap, used, pads = 40, [33, 40, 7, 0], [5, 0, 7, 0]
    shape = (4, cap, HK, D) if side_by_side else (4, HK, cap, D)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if side_by_side:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    for nq in (1, 20):
        q = torch.randn(4, H, nq, D, generator=g)
        out, lse = orchard_ops.flash_attn_fwd(q, k, v, None, 0.0, True, device=device,
                                              seqused_k=torch.tensor(used),
                                              leftpad_k=torch.tensor(pads, dtype=torch.int32))
        for b, (n, p) in enumerate(zip(used, pads)):
            keys, values = k[b:b + 1, :, p:n], v[b:b + 1, :, p:n]
            one, one_lse = orchard_ops.flash_attn_fwd(q[b:b + 1], keys, values, None, 0.0, True,
                                                      device=device)
            assert torch.equal(out[b:b + 1], one) and torch.equal(lse[b:b + 1], one_lse)
            ref, ref_lse = ref_fwd(q[b:b + 1].numpy(), keys.numpy(), values.numpy(), causal=True)
            assert_close(out[b:b + 1], ref, "float32", what="out of sequence %d" % b)
            assert_close(lse[b:b + 1], ref_lse, "float32", kind="lse",
                         what="lse of sequence %d" % b)


def test_seqused_and_leftpad_k_of_a_dense_call_refused():
    """Counts outside a sequence's rows, the wrong number of them, and the backward (which
    has no such options) are refused, naming the argument."""
    q, k = torch.randn(2, H, 1, D), torch.randn(2, HK, 10, D)
    for kw, words in ((dict(seqused_k=torch.tensor([11, 1])), "'seqused_k'[0] = 11 must lie in "
                       "[0, 10]"),
                      (dict(seqused_k=torch.tensor([4, 4]), leftpad_k=torch.tensor([0, 5])),
                       "'leftpad_k'[1] = 5 must lie in [0, 4]"),
                      (dict(leftpad_k=torch.tensor([-1, 0])), "'leftpad_k'[0] = -1"),
                      (dict(seqused_k=torch.tensor([1, 1, 1])), "'seqused_k' must be a 1-D "
                       "integer array of 2 key counts"),
                      (dict(leftpad_k=torch.tensor([0.5, 0.5])), "'leftpad_k' must be an "
                       "integer array (batch_size,)")):
        with pytest.raises(ValueError, match=re.escape(words)):
            orchard_ops.flash_attn_fwd(q, k, k, **kw)
    out, lse = orchard_ops.flash_attn_fwd(q, k, k)
    with pytest.raises(TypeError, match="seqused_k"):
        orchard_ops.flash_attn_bwd(out, q, k, k, out, lse, seqused_k=torch.tensor([1, 1]))


def test_unused_table_entries_are_not_read():
    """Entries past a sequence's pages (or before its left padding) may hold anything."""
    table = torch.tensor([[-7, 1, 99], [2, 3, 1000]], dtype=torch.int32)
    out, _ = ops_call(block_table=table, leftpad_k=torch.tensor([4, 0]))
    assert torch.isfinite(out).all()
