"""k_new and v_new of orchard_ops' forwards (csrc/kv_append.c): the new rows written into a KV
cache as each sequence's last keys and values by the call that reads it, on every device, for
every layout of the cache (dense rows in either axis order, packed varlen slots, pages), left
padding and GQA; the same result as writing them first and calling without; and every
refusal leaving the cache as it was."""

import numpy as np
import pytest

from conftest import randn

B, H, HK, D, DV, CAP, N_NEW = 3, 4, 2, 16, 8, 12, 2
USED = [5, 12, 2]           # each sequence's keys after the write
LEFTPAD = [0, 3, 1]         # sequence 2's first key lies among its new rows: one is unread


def check(q, k, v, k_new, v_new, writes, call):
    """call(q, k, v, k_new=, v_new=) writes the new rows into k and v (in place) and gives
    what writing them first (writes: (index of k and v, key row, value row) for each new row)
    and calling without them gives."""
    want_k, want_v = k.copy(), v.copy()
    for at, key, value in writes:
        want_k[at], want_v[at] = key, value
    want = call(q, want_k, want_v)
    out, lse = call(q, k, v, k_new=k_new, v_new=v_new)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(lse, want[1])


@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_dense_cache_sequence_axis_first(ops, device, rng, leftpad):
    """(B, Nk, Hkv, D) caches (FlashAttention-2's), seqlen_first: new rows (B, n, Hkv, D)."""
    q = randn(rng, (B, 1, H, D), np.float32)
    k, v = randn(rng, (B, CAP, HK, D), np.float32), randn(rng, (B, CAP, HK, DV), np.float32)
    k_new = randn(rng, (B, N_NEW, HK, D), np.float32)
    v_new = randn(rng, (B, N_NEW, HK, DV), np.float32)
    kw = dict(seqused_k=np.array(USED, np.int32), seqlen_first=True, causal=True, device=device)
    if leftpad:
        kw["leftpad_k"] = np.array(LEFTPAD, np.int32)
    writes = [((b, USED[b] - N_NEW + i), k_new[b, i], v_new[b, i])
              for b in range(B) for i in range(N_NEW)]
    check(q, k, v, k_new, v_new, writes, lambda *a, **x: ops.flash_attn_fwd(*a, **kw, **x))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_dense_cache_heads_first(ops, device, rng, dtype):
    """(B, Hkv, Nk, D) caches, as transformers' are in memory: new rows (B, Hkv, n, D)."""
    q = randn(rng, (B, H, 1, D), dtype)
    k, v = randn(rng, (B, HK, CAP, D), dtype), randn(rng, (B, HK, CAP, D), dtype)
    k_new, v_new = randn(rng, (B, HK, N_NEW, D), dtype), randn(rng, (B, HK, N_NEW, D), dtype)
    kw = dict(seqused_k=np.array(USED, np.int32), device=device)
    writes = [((b, slice(None), USED[b] - N_NEW + i), k_new[b, :, i], v_new[b, :, i])
              for b in range(B) for i in range(N_NEW)]
    check(q, k, v, k_new, v_new, writes, lambda *a, **x: ops.flash_attn_fwd(*a, **kw, **x))


@pytest.mark.parametrize("page", [None, 1, 4, 64], ids=["packed", "page 1", "page 4", "page 64"])
def test_varlen_slots_and_pages(ops, device, rng, page):
    """Packed slots (cu_seqlens_k, seqused_k) and pages in scrambled order (block_table), left
    padded: new rows (B, n, Hkv, D) at each sequence's last positions."""
    q = randn(rng, (B * 2, H, D), np.float32)
    cu_q = np.arange(0, 2 * B + 1, 2, dtype=np.int32)
    k_new = randn(rng, (B, N_NEW, HK, D), np.float32)
    v_new = randn(rng, (B, N_NEW, HK, DV), np.float32)
    if page is None:
        cu_k = np.arange(0, (B + 1) * CAP, CAP, dtype=np.int32)    # slots with room to grow
        k, v = randn(rng, (B * CAP, HK, D), np.float32), randn(rng, (B * CAP, HK, DV), np.float32)
        kw = dict(seqused_k=np.array(USED, np.int32))
        at = lambda b, pos: (CAP * b + pos,)
    else:
        width = -(-CAP // page)
        table = rng.permutation(B * width + 1).astype(np.int32)[:B * width].reshape(B, width)
        k = randn(rng, (B * width + 1, page, HK, D), np.float32)
        v = randn(rng, (B * width + 1, page, HK, DV), np.float32)
        cu_k = np.concatenate([[0], np.cumsum(USED)]).astype(np.int32)
        kw = dict(block_table=table)
        at = lambda b, pos: (table[b, pos // page], pos % page)
    writes = [(at(b, USED[b] - N_NEW + i), k_new[b, i], v_new[b, i])
              for b in range(B) for i in range(N_NEW)]
    check(q, k, v, k_new, v_new, writes,
          lambda *a, **x: ops.flash_attn_varlen_fwd(*a, cu_q, cu_k, causal=True,
                                                    leftpad_k=np.array(LEFTPAD, np.int32),
                                                    device=device, **kw, **x))


def test_torch_tensors_and_bfloat16(ops, device):
    """torch tensors through DLPack, bfloat16 included, are written in place."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        k, v = (torch.randn(B, CAP, HK, D, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(B, 1, H, D, generator=g).to(dtype)
        k_new, v_new = (torch.randn(B, 1, HK, D, generator=g).to(dtype) for _ in range(2))
        used = torch.tensor(USED, dtype=torch.int32)
        k2, v2 = k.clone(), v.clone()
        for b in range(B):
            k2[b, USED[b] - 1], v2[b, USED[b] - 1] = k_new[b, 0], v_new[b, 0]
        want = ops.flash_attn_fwd(q, k2, v2, seqused_k=used, seqlen_first=True, device=device)
        got = ops.flash_attn_fwd(q, k, v, seqused_k=used, seqlen_first=True, device=device,
                                 k_new=k_new, v_new=v_new)
        assert torch.equal(k, k2) and torch.equal(v, v2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_torch_caches_as_torch_writes_them(ops, device):
    """A torch cache written has its version counter bumped (a backward that saved it, or a
    tensor sharing its memory, refuses to run: it computed a wrong gradient silently); one that
    requires grad in grad mode, or an inference tensor outside inference mode, is refused and
    left as it was; in inference mode an inference tensor is written, under no_grad one that
    requires grad, as torch writes them."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 1, 8, generator=g)
    k_new, v_new = (torch.randn(1, 1, 1, 8, generator=g) for _ in range(2))
    kw = dict(k_new=k_new, v_new=v_new, device=device)
    k = torch.ones(1, 1, 4, 8, requires_grad=True)
    v = torch.ones(1, 1, 4, 8)
    loss = (k * k).sum()                # saves k
    ops.flash_attn_fwd(q, k.detach(), v, **kw)
    assert torch.equal(k[0, 0, 3], k_new[0, 0, 0]) and k._version > 0 and v._version > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():
        frozen = torch.ones(1, 1, 4, 8)
    for cache, why in [(k, "requires grad"), (frozen, "is an inference tensor")]:
        before = cache.detach().clone()
        with pytest.raises(ValueError, match="'k' %s.*it cannot take 'k_new'" % why):
            ops.flash_attn_fwd(q, cache, v, **kw)
        assert torch.equal(cache, before)
    with torch.inference_mode():
        ops.flash_attn_fwd(q, frozen, v, **kw)
    assert torch.equal(frozen[0, 0, 3], k_new[0, 0, 0])
    wanting = k_new.clone().requires_grad_()
    with pytest.raises(ValueError, match="'k_new' requires grad, in grad mode"):
        ops.flash_attn_fwd(q, k.detach(), v, **dict(kw, k_new=wanting))
    none = wanting[:, :, :0]            # no rows: nothing written, nothing to record
    ops.flash_attn_fwd(q, k.detach(), v, **dict(kw, k_new=none, v_new=v_new[:, :, :0]))
    with torch.no_grad():       # as torch writes a tensor that requires grad there
        ops.flash_attn_fwd(q, k, v, **dict(kw, k_new=2 * k_new))
    assert torch.equal(k[0, 0, 3], 2 * k_new[0, 0, 0])


def test_new_rows_are_not_counted_as_operands(ops, rng):
    """stats() counts q, k and v of a call with new rows, none staged, even where the new
    rows are strided (they are copied whatever their layout)."""
    q = randn(rng, (1, 1, 2, D), np.float32)
    k, v = randn(rng, (1, 8, 2, D), np.float32), randn(rng, (1, 8, 2, D), np.float32)
    strided = randn(rng, (1, 1, 2, 2 * D), np.float32)[..., ::2]
    ops.reset_stats()
    ops.flash_attn_fwd(q, k, v, seqlen_first=True, device="cpu", k_new=strided, v_new=strided)
    st = ops.stats()["per_device"]["cpu"]
    assert (st["zero_copy_buffers"], st["staged_buffers"]) == (3, 0), st
    np.testing.assert_array_equal(k[0, 7], strided[0, 0])


def test_new_rows_over_the_cache_are_read_before_the_write(ops, rng):
    """New rows that are a view of the cache's own slots, shifted: written as they were."""
    k, v = randn(rng, (1, 8, 1, D), np.float32), randn(rng, (1, 8, 1, D), np.float32)
    q = randn(rng, (1, 1, 1, D), np.float32)
    kw = dict(seqused_k=np.array([6], np.int32), seqlen_first=True)
    want_k, want_v = k.copy(), v.copy()
    want_k[0, 3:6], want_v[0, 3:6] = k[0, 2:5], v[0, 2:5]
    ops.flash_attn_fwd(q, k, v, k_new=k[:, 2:5], v_new=v[:, 2:5], **kw)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


def test_refusals_leave_the_cache_as_it_was(ops, device, rng):
    q = randn(rng, (2, 1, H, D), np.float32)
    k, v = randn(rng, (2, 8, HK, D), np.float32), randn(rng, (2, 8, HK, D), np.float32)
    new = randn(rng, (2, 1, HK, D), np.float32)
    used = np.array([3, 8], np.int32)
    readonly = k.copy()
    readonly.flags.writeable = False
    kw = dict(seqlen_first=True, seqused_k=used, device=device)
    bad = [
        (ValueError, "'v_new' must be given with 'k_new'", dict(k_new=new)),
        (ValueError, r"'v_new' must be \(\.\.\., n, Hkv, D\).*got shape \(2, 2, 2, 16\)",
         dict(k_new=new, v_new=randn(rng, (2, 2, HK, D), np.float32))),
        (ValueError, r"'k_new' must be .*got shape \(2, 1, 3, 16\)",
         dict(k_new=randn(rng, (2, 1, 3, D), np.float32), v_new=new)),
        (TypeError, "'k_new' has dtype float64 but 'k' has float32",
         dict(k_new=new.astype(np.float64), v_new=new)),
        (ValueError, "sequence 0 ends at position 3, so it cannot end with the 4 new rows",
         dict(k_new=np.concatenate([new] * 4, 1), v_new=np.concatenate([new] * 4, 1))),
    ]
    for error, match, extra in bad:
        before = k.copy(), v.copy()
        with pytest.raises(error, match=match):
            ops.flash_attn_fwd(q, k, v, **kw, **extra)
        np.testing.assert_array_equal(k, before[0])
        np.testing.assert_array_equal(v, before[1])
    for cache, why in [(readonly, "'k' is read-only"),
                       (np.lib.stride_tricks.as_strided(k[:1], k.shape, (0,) + k.strides[1:]),
                        "'k' is an expanded view"),
                       (np.ascontiguousarray(np.repeat(k, 2, -1))[..., ::2],
                        "'k' is read through a copy")]:
        with pytest.raises(ValueError, match=why + ".*it cannot take 'k_new'"):
            ops.flash_attn_fwd(q, cache, v, k_new=new, v_new=new, **kw)
    np.testing.assert_array_equal(readonly, k)
    # a list is read as a new array of NumPy's: its own memory, which a write would not reach
    wide = [x.astype(np.float64) for x in (q, k, v, new)]
    with pytest.raises(ValueError, match="'k' is not a NumPy array or a DLPack tensor.*it "
                                         "cannot take 'k_new'"):
        ops.flash_attn_fwd(wide[0], wide[1].tolist(), wide[2], k_new=wide[3], v_new=wide[3],
                           **kw)

    class ArrayLike:    # __array__ hands a view of a temporary (it owns no data): was written
        def __init__(self, rows):
            self.rows = rows

        def __array__(self, dtype=None, copy=None):
            return np.array(self.rows, np.float32).reshape(k.shape)

    held = ArrayLike(k.ravel().tolist())
    with pytest.raises(ValueError, match="'k' is not a NumPy array or a DLPack tensor: the array "
                                         "NumPy makes of it may be memory of its own.*it cannot "
                                         "take 'k_new'"):
        ops.flash_attn_fwd(q, held, v, k_new=new, v_new=new, **kw)
    np.testing.assert_array_equal(v, before[1])


def test_dlpack_producers_caches_are_written_where_they_say_so(ops, rng):
    """A DLPack 1.x tensor not marked read-only takes the new rows; an unversioned one (an
    older producer's, which may be immutable: JAX's arrays) is refused as read-only."""
    class Producer:
        def __init__(self, array, versioned):
            self.array, self.versioned = array, versioned

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**(kwargs if self.versioned else {}))

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    q = randn(rng, (1, 1, 1, 8), np.float32)
    k, v, new = (np.zeros((1, 1, 4, 8), np.float32) for _ in range(3))
    new[...] = 1
    ops.flash_attn_fwd(q, Producer(k, True), Producer(v, True), k_new=new[:, :, :1],
                       v_new=new[:, :, :1])
    assert (k[0, 0, 3] == 1).all() and (v[0, 0, 3] == 1).all() and not k[0, 0, :3].any()
    k[...] = 0
    with pytest.raises(ValueError, match="'k' is read-only .*DLPack producer's tensor"):
        ops.flash_attn_fwd(q, Producer(k, False), Producer(v, True), k_new=new[:, :, :1],
                           v_new=new[:, :, :1])
    assert not k.any()


def test_device_arrays_are_refused(ops, rng):
    from conftest import OPENCL_IDS
    if not OPENCL_IDS:
        pytest.skip("no OpenCL device")
    k = randn(rng, (1, 2, 8, D), np.float32)
    dk, dq = ops.to_device(k, OPENCL_IDS[0]), ops.to_device(k[:, :, :1], OPENCL_IDS[0])
    with pytest.raises(ValueError, match="'k' is a DeviceArray"):
        ops.flash_attn_fwd(dq, dk, dk, k_new=k[:, :, :1], v_new=k[:, :, :1])
    # new rows on the device for a host cache: was "must be a float16, float32 or float64
    # array ..., not object"
    for name in ("k_new", "v_new"):
        new = {"k_new": k[:, :, :1], "v_new": k[:, :, :1], name: dq}
        with pytest.raises(TypeError, match="argument '%s' is a DeviceArray: new rows go into "
                           "a host cache" % name):
            ops.flash_attn_fwd(k[:, :, :1], k.copy(), k.copy(), **new)
    # all on the device: the same words (were "..., got orchard_ops.DeviceArray, read as an
    # array of object")
    with pytest.raises(TypeError, match="argument 'k_new' is a DeviceArray: new rows go into "
                       "a host cache"):
        ops.flash_attn_fwd(dq, dk, dk, k_new=dk, v_new=dk)


def test_backward_and_varlen_backward_take_no_new_rows(ops):
    q = np.zeros((1, 1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="k_new"):
        ops.flash_attn_bwd(q, q, q, q, q, np.zeros((1, 1, 2), np.float32), k_new=q)
    cu = np.array([0, 2], np.int32)
    with pytest.raises(TypeError, match="k_new"):
        ops.flash_attn_varlen_bwd(q[0, 0], q[0, 0], q[0, 0], q[0, 0], q[0, 0],
                                  np.zeros((1, 2), np.float32), cu, cu, k_new=q[0, 0])


def test_pages_of_new_rows_before_the_left_padding_are_checked(ops, device):
    """A sequence whose left padding lies past its cached keys puts new rows in pages it does
    not read: those pages are checked too, before anything is written."""
    k = np.zeros((3, 4, 1, 8), np.float32)
    v, q = k.copy(), np.ones((1, 1, 8), np.float32)
    new = np.full((1, 3, 1, 8), 7, np.float32)       # positions 6, 7, 8: pages 1 and 2
    cu_q, cu_k = np.array([0, 1], np.int32), np.array([0, 9], np.int32)
    for bad in (-1, 10**6):
        table = np.array([[bad, bad, 0]], np.int32)
        with pytest.raises(ValueError, match=r"'block_table'\[0, 1\] = %d is not a page" % bad):
            ops.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, block_table=table, device=device,
                                      leftpad_k=np.array([8], np.int32), k_new=new, v_new=new)
        assert not k.any() and not v.any()
    table = np.array([[2, 1, 0]], np.int32)
    ops.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, block_table=table, device=device,
                              leftpad_k=np.array([8], np.int32), k_new=new, v_new=new)
    assert (k[1, 2:] == 7).all() and (k[0, :1] == 7).all() and k.sum() == 7 * 3 * 8


def test_no_new_rows_take_any_cache(ops):
    """n = 0, or no sequences or heads: nothing to write, so an empty cache, or one read
    through a copy, is fine."""
    q = np.ones((1, 1, 1, 8), np.float32)
    empty = np.zeros((1, 0, 1, 8), np.float32)
    none = np.zeros((1, 0, 1, 8), np.float32)
    out, _ = ops.flash_attn_fwd(q, empty, empty, seqlen_first=True, k_new=none, v_new=none)
    assert not out.any()
    strided = np.zeros((1, 4, 1, 16), np.float32)[..., ::2]
    ops.flash_attn_fwd(q, strided, strided, seqlen_first=True, k_new=none, v_new=none)
    for shape in ((0, 2), (1, 0)):      # (batch, kv heads)
        z = lambda n: np.zeros(shape[:1] + (n,) + shape[1:] + (8,), np.float32)
        out, _ = ops.flash_attn_fwd(z(1), z(5), z(5), seqlen_first=True, k_new=z(1), v_new=z(1))
        assert out.shape == z(1).shape
    z = np.zeros((0, 1, 8), np.float32)
    new = np.zeros((0, 1, 1, 8), np.float32)     # (no sequences, a row each, Hkv, D)
    out, _ = ops.flash_attn_varlen_fwd(z, z, z, np.array([0]), np.array([0]), k_new=new,
                                       v_new=new)
    assert out.shape == (0, 1, 8)
