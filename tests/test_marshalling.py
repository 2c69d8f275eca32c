"""Marshalling of inputs: strides, byte order, alignment, read-only, lists, torch tensors,
and the zero-copy / staged counters of stats()."""

import numpy as np
import pytest

from conftest import (aligned_empty, assert_close, check_backward, check_forward, randn,
                      run_python)
from orchard.reference import ref_fwd

COUNTERS = ["fwd_calls", "decode_calls", "bwd_calls", "zero_copy_buffers", "staged_buffers", "bytes_staged",
            "kernel_builds", "cache_hits"]


def delta(ops, fn, device):
    """Run fn() between reset_stats() and stats(); return (result, totals, per-device)."""
    ops.reset_stats()
    res = fn()
    st = ops.stats()
    return res, st, st["per_device"].get(device, {})


def misaligned(x):
    """A copy of x whose data pointer is offset by 1 byte from an aligned buffer."""
    buf = np.zeros(x.nbytes + 1, dtype=np.uint8)
    y = np.frombuffer(buf.data[1:1 + x.nbytes], dtype=x.dtype).reshape(x.shape)
    y[...] = x
    assert not y.flags.aligned
    return y


# ------------------------------------------------------------------------------- stats


def test_stats_keys_and_reset(ops, device, rng):
    q, k, v, do = (randn(rng, (1, 2, 5, 8), np.float32) for _ in range(4))
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    st = ops.stats()
    for c in COUNTERS:
        assert c in st, "stats() lacks %r" % c
        assert isinstance(st[c], int)
    assert isinstance(st["per_device"], dict) and device in st["per_device"]
    for c in COUNTERS:
        assert c in st["per_device"][device]
    assert st["fwd_calls"] >= 1 and st["bwd_calls"] >= 1
    ops.reset_stats()
    st = ops.stats()
    for c in COUNTERS:
        assert st[c] == 0, "%s not reset: %s" % (c, st[c])
        for dev, counters in st["per_device"].items():
            assert counters.get(c, 0) == 0, "per_device[%s][%s] not reset" % (dev, c)


def test_stats_counts_calls(ops, device, rng):
    q, k, v, do = (randn(rng, (1, 2, 5, 8), np.float32) for _ in range(4))

    def run():
        for _ in range(3):
            out, lse = ops.flash_attn_fwd(q, k, v, device=device)
        for _ in range(2):
            ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)

    _, st, dev = delta(ops, run, device)
    assert st["fwd_calls"] == 3 and st["bwd_calls"] == 2, st
    assert dev["fwd_calls"] == 3 and dev["bwd_calls"] == 2, dev


def test_stats_returns_snapshot(ops, device, rng):
    ops.reset_stats()
    st = ops.stats()
    st["fwd_calls"] = 12345
    st["per_device"].clear()
    st2 = ops.stats()
    assert st2["fwd_calls"] == 0 and st2["per_device"] != {}


def test_contiguous_is_zero_copy(ops, device, rng):
    q, k, v, do = (randn(rng, (2, 3, 6, 8), np.float32) for _ in range(4))
    (out, lse), st, dev = delta(ops, lambda: ops.flash_attn_fwd(q, k, v, device=device), device)
    assert st["zero_copy_buffers"] == 3, st    # q, k, v; outputs are not counted
    assert st["staged_buffers"] == 0 and st["bytes_staged"] == 0, st
    assert dev["zero_copy_buffers"] == 3, dev
    _, st, _ = delta(ops, lambda: ops.flash_attn_bwd(do, q, k, v, out, lse, device=device), device)
    assert st["zero_copy_buffers"] == 6, st    # dout, q, k, v, out, lse
    assert st["staged_buffers"] == 0 and st["bytes_staged"] == 0, st


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
def test_bnhd_transposed_is_zero_copy(ops, device, rng, dtype):
    """A (B, N, H, D) array transposed to (B, H, N, D) has a contiguous last dim: in place."""
    qs, ks, vs, dos = (randn(rng, (2, 7, 3, 16), dtype) for _ in range(4))
    q, k, v, do = (x.transpose(0, 2, 1, 3) for x in (qs, ks, vs, dos))
    assert not q.flags.c_contiguous
    (out, lse), st, dev = delta(ops, lambda: check_forward(ops, device, q, k, v, causal=True),
                                device)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st
    assert st["bytes_staged"] == 0, st
    assert dev["zero_copy_buffers"] == 3 and dev["staged_buffers"] == 0, dev
    _, st, _ = delta(ops, lambda: check_backward(ops, device, q, k, v, do, causal=True), device)
    assert st["staged_buffers"] == 0, st


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
def test_seqlen_first_reads_bnhd_as_it_lies(ops, device, rng, dtype):
    """seqlen_first=True: (B, N, H, D) operands in place, GQA heads, every option; the same
    results bit for bit as their (B, H, N, D) views, out and gradients (B, N, H, D) in the
    operands' memory order, lse (B, H, N)."""
    q, do = randn(rng, (2, 7, 4, 16), dtype), randn(rng, (2, 7, 4, 8), dtype)
    k, v = randn(rng, (2, 9, 2, 16), dtype), randn(rng, (2, 9, 2, 8), dtype)
    kw = dict(causal=True, window=(5, 0), softcap=2.0, dropout_p=0.2, seed=3,
              alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05]), device=device)
    t = lambda x: x.transpose(0, 2, 1, 3)
    (out, lse), st, _ = delta(ops, lambda: ops.flash_attn_fwd(q, k, v, seqlen_first=True, **kw),
                              device)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st
    want_out, want_lse = ops.flash_attn_fwd(t(q), t(k), t(v), **kw)
    assert out.shape == (2, 7, 4, 8) and out.flags.c_contiguous and lse.shape == (2, 4, 7)
    np.testing.assert_array_equal(out, t(want_out))
    np.testing.assert_array_equal(lse, want_lse)
    grads = ops.flash_attn_bwd(do, q, k, v, out, lse, seqlen_first=True, **kw)
    want = ops.flash_attn_bwd(t(do), t(q), t(k), t(v), want_out, want_lse, **kw)
    for g, w, x in zip(grads, want, (q, k, v)):
        assert g.shape == x.shape and g.flags.c_contiguous
        np.testing.assert_array_equal(g, t(w))
    # shapes in messages as passed: out in the other layout is named so
    with pytest.raises(ValueError, match=r"'out' must have shape \(2, 7, 4, 8\), got \(2, 4, 7, 8\)"):
        ops.flash_attn_bwd(do, q, k, v, np.ascontiguousarray(t(out)), lse, seqlen_first=True, **kw)
    with pytest.raises(ValueError, match=r"'k' must have the head dim .* \(q has shape "
                                         r"\(2, 7, 4, 16\), k \(2, 9, 2, 8\)"):
        ops.flash_attn_fwd(q, v, v, seqlen_first=True, **kw)
    # a 3-D operand is (seqlen, nheads, headdim) (GQA heads need 4-D k and v)
    kw.update(alibi_slopes=None, dropout_p=0.0)
    k4, v4 = (np.repeat(x, 2, axis=2) for x in (k, v))
    out3, lse3 = ops.flash_attn_fwd(q[1], k4[1], v4[1], seqlen_first=True, **kw)
    assert out3.shape == (7, 4, 8) and lse3.shape == (4, 7)
    np.testing.assert_array_equal(out3, ops.flash_attn_fwd(q, k, v, seqlen_first=True, **kw)[0][1])


def test_broadcast_batch_strides_zero_copy(ops, device, rng):
    """Stride-0 batch dims (np.broadcast_to) with a contiguous last dim are used in place."""
    q = randn(rng, (2, 3, 5, 8), np.float32)
    k = np.broadcast_to(randn(rng, (1, 1, 6, 8), np.float32), (2, 3, 6, 8))
    v = np.broadcast_to(randn(rng, (2, 1, 6, 4), np.float32), (2, 3, 6, 4))
    _, st, _ = delta(ops, lambda: check_forward(ops, device, q, k, v), device)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st
    do = randn(rng, (2, 3, 5, 4), np.float32)
    check_backward(ops, device, q, k, v, do)


def test_size1_last_dim_any_stride_zero_copy(ops, device, rng):
    base = randn(rng, (1, 2, 5, 3), np.float32)
    q = base[..., 1:2]  # D = 1, last stride 4 but also non-contiguous rows
    k = np.lib.stride_tricks.as_strided(base, shape=(1, 2, 5, 1), strides=base.strides[:3] + (40,))
    v = randn(rng, (1, 2, 5, 2), np.float32)
    _, st, _ = delta(ops, lambda: check_forward(ops, device, q, k, v), device)
    # q starts 4 bytes into base: in place all the same (an OpenCL buffer that must start on
    # the device's base alignment starts before it)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st


@pytest.mark.parametrize("offset", [4, 16, 64, 100])
def test_any_element_aligned_array_is_read_in_place(ops, device, rng, offset):
    """Arrays as NumPy and torch allocate them (16 or 64 bytes aligned, or views starting
    anywhere on an element) are read in place on every device, PoCL's 128-byte base alignment
    included, forward and backward."""
    n = 2 * 3 * 7 * 8
    raw = aligned_empty((n + 64,), np.float32)
    q = raw[offset // 4:offset // 4 + n].reshape(2, 3, 7, 8)
    q[...] = randn(rng, q.shape, np.float32)
    k, v, do = (aligned_empty(q.shape, np.float32) for _ in range(3))
    for x in (k, v, do):
        x[...] = randn(rng, q.shape, np.float32)
    _, st, _ = delta(ops, lambda: check_forward(ops, device, q, k, v, causal=True), device)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st
    check_backward(ops, device, q, k, v, do, causal=True)


def _staged_case(ops, device, q, k, v, nbytes):
    _, st, dev = delta(ops, lambda: check_forward(ops, device, q, k, v), device)
    assert st["staged_buffers"] == 1 and st["zero_copy_buffers"] == 2, st
    assert st["bytes_staged"] == nbytes, (st, nbytes)
    assert dev["staged_buffers"] == 1 and dev["bytes_staged"] == nbytes, dev


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
def test_reversed_last_dim_is_staged(ops, device, rng, dtype):
    q0, k, v = (randn(rng, (2, 3, 6, 8), dtype) for _ in range(3))
    q = q0[..., ::-1]
    _staged_case(ops, device, q, k, v, q.size * q.itemsize)


def test_strided_last_dim_is_staged(ops, device, rng):
    big = randn(rng, (2, 3, 6, 16), np.float32)
    q = big[..., ::2]
    k, v = (randn(rng, (2, 3, 6, 8), np.float32) for _ in range(2))
    _staged_case(ops, device, q, k, v, q.size * 4)
    _staged_case(ops, device, k, q, v, q.size * 4)


@pytest.mark.parametrize("dtype", ["f4", "f8", "f2"])
def test_big_endian_is_staged(ops, device, rng, dtype):
    k, v = (randn(rng, (2, 3, 6, 8), np.dtype(dtype)) for _ in range(2))
    q = randn(rng, (2, 3, 6, 8), np.dtype(">" + dtype))
    assert q.dtype.byteorder == ">"
    _staged_case(ops, device, q, k, v, q.nbytes)
    out, _ = ops.flash_attn_fwd(q, k, v, device=device)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_misaligned_is_staged(ops, device, rng, dtype):
    q0, k, v = (randn(rng, (2, 3, 6, 8), dtype) for _ in range(3))
    q = misaligned(q0)
    _staged_case(ops, device, q, k, v, q.nbytes)


def test_staging_memory_reused_never_shared(ops, device, rng):
    """Freed staging and output memory is handed to later arrays (marshal.c, spares): call
    after call, each staged operand holds its own values and no live array shares memory with
    a later one, whatever the sizes."""
    kept = []
    for shape in [(2, 3, 64, 32), (2, 3, 64, 32), (2, 3, 48, 32), (2, 3, 64, 32), (1, 2, 8, 32)]:
        q, k, v = (randn(rng, shape, np.float32) for _ in range(3))
        out, lse = check_forward(ops, device, q[..., ::-1], k[..., ::-1], v)
        for old_out, old_ref in kept:
            assert not np.shares_memory(out, old_out) and not np.shares_memory(lse, old_out)
            np.testing.assert_array_equal(old_out, old_ref)
        kept.append((out, out.copy()))
        del lse                         # its memory may serve the next call


FREED_OUTPUTS = """
import numpy as np, orchard_ops as ops
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((2, 3, 64, 32)).astype(np.float32) for _ in range(4))
out, lse = ops.flash_attn_fwd(q, k, v, device="cpu")
address = lambda arrays: sorted(a.__array_interface__["data"][0] for a in arrays)
grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device="cpu")
freed, want = address(grads), [g.copy() for g in grads]
del grads
grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device="cpu")
print(address(grads) == freed, all(np.array_equal(g, w) for g, w in zip(grads, want)))
"""


def test_freed_outputs_serve_the_next_call():
    """A backward's three outputs, freed, are the next backward's memory (marshal.c keeps up to
    four freed buffers): no fresh pages, which the kernel zeroes, call after call. In a fresh
    process, on the native path, whose inputs here are used in place: what earlier calls left
    among the spares (larger buffers are kept first) and an OpenCL device's staged copies of
    the inputs would take the places."""
    r = run_python(FREED_OUTPUTS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "True"], r.stdout


def test_read_only_inputs(ops, device, rng):
    q, k, v, do = (randn(rng, (2, 3, 6, 8), np.float32) for _ in range(4))
    for x in (q, k, v, do):
        x.setflags(write=False)
    _, st, _ = delta(ops, lambda: check_forward(ops, device, q, k, v, causal=True), device)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st
    out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    out.setflags(write=False)
    lse.setflags(write=False)
    ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    check_backward(ops, device, q, k, v, do, causal=True)


def test_all_odd_layouts_at_once(ops, device, rng):
    """Every operand of fwd and bwd in a different odd layout; results still correct."""
    d = 8
    q = randn(rng, (2, 5, 3, d), np.float32).transpose(0, 2, 1, 3)          # zero-copy view
    k = randn(rng, (2, 3, 6, d), np.float32)[..., ::-1]                      # reversed
    v = misaligned(randn(rng, (2, 3, 6, d), np.float32))                     # misaligned
    do = randn(rng, (2, 3, 5, d), np.dtype(">f4"))                           # big endian
    check_forward(ops, device, q, k, v, causal=True)
    check_backward(ops, device, q, k, v, do, causal=True)


def test_non_contiguous_views(ops, device, rng):
    base = randn(rng, (4, 6, 20, 24), np.float64)
    q = base[::2, 1::2, ::3, :16]
    k = base[1::2, ::2, 1:19:2, 4:20]
    v = np.asfortranarray(base[:2, :3, :9, :5])
    do = base[2:, 3:, :7, 10:15]
    check_forward(ops, device, q, k, v)
    check_backward(ops, device, q, k, v, do, window=(2, 2))


def test_python_lists(ops, device, rng):
    q, k, v = (randn(rng, (2, 4, 3), np.float64) for _ in range(3))
    out, lse = ops.flash_attn_fwd(q.tolist(), k.tolist(), v.tolist(), device=device)
    ro, rl = ref_fwd(q, k, v)
    assert np.asarray(out).dtype == np.float64
    assert_close(out, ro, np.float64, "out")
    assert_close(lse, rl, np.float64, "lse")
    do = randn(rng, (2, 4, 3), np.float64)
    grads = ops.flash_attn_bwd(do.tolist(), q.tolist(), k.tolist(), v.tolist(),
                               np.asarray(out).tolist(), np.asarray(lse).tolist(), device=device)
    ref = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device)
    for g, r in zip(grads, ref):
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_torch_cpu_tensors(ops, device, rng, dtype):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    qn, kn, vn, don = (randn(rng, (2, 3, 6, 8), np.dtype(dtype)) for _ in range(4))
    q, k, v, do = (torch.from_numpy(x) for x in (qn, kn, vn, don))
    assert q.dtype == tdt
    out, lse = check_forward(ops, device, q, k, v, causal=True)
    check_backward(ops, device, q, k, v, do, causal=True)
    # a non-contiguous torch view (B, N, H, D) -> (B, H, N, D)
    qt = torch.from_numpy(randn(rng, (2, 6, 3, 8), np.dtype(dtype))).transpose(1, 2)
    assert not qt.is_contiguous()
    _, st, _ = delta(ops, lambda: check_forward(ops, device, qt, k, v), device)
    assert st["zero_copy_buffers"] == 3 and st["staged_buffers"] == 0, st
    # torch tensors for bwd's out/lse as well
    ops.flash_attn_bwd(do, q, k, v, torch.from_numpy(np.asarray(out)),
                       torch.from_numpy(np.asarray(lse)), causal=True, device=device)


def test_torch_flipped_tensor(ops, device, rng):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(randn(rng, (1, 2, 5, 8), np.float32))
    k = torch.from_numpy(randn(rng, (1, 2, 5, 8), np.float32))
    v = torch.from_numpy(randn(rng, (1, 2, 8, 5), np.float32)).transpose(-1, -2)  # (1,2,5,8)
    assert v.stride(-1) != 1
    _, st, _ = delta(ops, lambda: check_forward(ops, device, q, k, v), device)
    assert st["staged_buffers"] == 1 and st["bytes_staged"] == v.numel() * 4, st
    q = torch.from_numpy(randn(rng, (1, 2, 5, 8), np.float32)).flip(-1)  # torch copies on flip
    check_forward(ops, device, q, k, v)


def test_inputs_not_modified(ops, device, rng):
    q, k, v, do = (randn(rng, (2, 3, 6, 8), np.float32) for _ in range(4))
    q2 = q[..., ::-1]
    copies = [x.copy() for x in (q, k, v, do)]
    out, lse = ops.flash_attn_fwd(q2, k, v, causal=True, device=device)
    out_c, lse_c = out.copy(), lse.copy()
    ops.flash_attn_bwd(do, q2, k, v, out, lse, causal=True, device=device)
    for a, b in zip((q, k, v, do), copies):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)


def test_operands_reshaped_by_a_later_callback_are_read_as_checked(ops, device, rng):
    """Python code that runs after the operands were checked (a scale's __float__, a
    max_seqlen's __index__) may set a caller's array's shape in place: the call reads the
    shapes it checked (it read the new ones, past the buffers: a crash)."""
    q, k = randn(rng, (1, 1, 1, 64), np.float32), randn(rng, (1, 1, 512, 64), np.float32)
    v = randn(rng, (1, 1, 512, 1), np.float32)
    want = ops.flash_attn_fwd(q, k, v, scale=0.125, device=device)

    class Scale:
        def __float__(self):
            k.shape = (1, 1, 512 * 64, 1)   # the same memory as 32768 keys of D 1
            return 0.125

    got = ops.flash_attn_fwd(q, k, v, scale=Scale(), device=device)
    assert k.shape == (1, 1, 512 * 64, 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    x = randn(rng, (512, 1, 8), np.float32)
    cu = np.array([0, 512], np.int32)
    want = ops.flash_attn_varlen_fwd(x, x, x, cu, cu, 512, device=device)

    class MaxLen:
        def __index__(self):
            x.shape = (16, 1, 256)
            return 512

    got = ops.flash_attn_varlen_fwd(x, x, x, cu, cu, MaxLen(), device=device)
    assert x.shape == (16, 1, 256)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
