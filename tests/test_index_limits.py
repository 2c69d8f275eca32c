"""Index arithmetic past 2**31: sizes are either computed correctly (64-bit offsets) or refused
with a ValueError naming the argument before anything is allocated or run; a buffer that
cannot be allocated is a MemoryError. Stride-0 (broadcast) views reach the huge sizes without
the memory: an (N, D) view of one row costs one row.

The limits (csrc/orchard.h, checked in csrc/args.c): a sequence has fewer than 2**32 rows or keys (the dropout stream
numbers rows and columns with 32 bits), q fewer than 2**31 heads (the OpenCL kernels count a
GQA group in an int)."""
import numpy as np
import pytest

from conftest import aligned_empty
from orchard.reference import ref_fwd


def broadcast(shape, dtype=np.float32):
    """A zero-copy view of `shape` over one page-aligned row: readable in place everywhere."""
    row = aligned_empty((1,) * (len(shape) - 1) + shape[-1:], dtype)
    row[...] = 1.0
    return np.broadcast_to(row, shape)


def small(*shape):
    # filled, not computed from the empty memory: an inf or NaN there made a RuntimeWarning
    x = aligned_empty(shape, np.float32)
    x[...] = 1.0
    return x


@pytest.mark.parametrize("case,argument", [
    (lambda: (small(4, 8), broadcast((2**32, 8)), broadcast((2**32, 8))), "k"),
    (lambda: (broadcast((2**32, 8)), small(4, 8), small(4, 8)), "q"),
    (lambda: (broadcast((2, 2**32 + 5, 8)), broadcast((2, 3, 8)), broadcast((2, 3, 8))), "q"),
    (lambda: (broadcast((1, 2**31, 0, 8)), broadcast((1, 1, 0, 8)), broadcast((1, 1, 0, 8))),
     "q"),
])
def test_oversized_dimensions_are_refused(ops, device, case, argument):
    q, k, v = case()
    with pytest.raises(ValueError, match="'%s'" % argument):
        ops.flash_attn_fwd(q, k, v, device=device)


def test_oversized_varlen_sequence_is_refused(ops, device):
    q = broadcast((2**32 + 1, 1, 8))
    cu = np.array([0, 1, 2**32 + 1], np.int64)
    with pytest.raises(ValueError, match="'cu_seqlens_q'"):
        ops.flash_attn_varlen_fwd(q, q, q, cu, cu, device=device)


def test_oversized_dropout_mask_is_refused(ops):
    with pytest.raises(ValueError, match="'k_shape'"):
        ops.dropout_mask((1, 8), (2**32, 8), 0.5)


def test_unit_count_past_every_table_is_memory_error(ops, device):
    """2**58 batch entries of empty sequences: nothing to compute, but the per-unit tables
    cannot be allocated (their byte size overflows)."""
    q = broadcast((2**58, 1, 0, 8), np.float16)
    with pytest.raises(MemoryError, match="cannot allocate the tables of 288230376151711744 "
                                          "batch-heads"):
        ops.flash_attn_fwd(q, q, q, device=device)


def test_unstageable_view_is_memory_error(ops, device):
    """A byte-swapped broadcast view must be copied, and the copy cannot be allocated."""
    k = np.broadcast_to(np.ones((1, 1, 8), ">f4"), (2**20, 2**14, 8))
    with pytest.raises(MemoryError, match="argument 'k' must be copied .* the copy fails "
                                          "\\(cannot allocate an array of 5.498e\\+11 bytes"):
        ops.flash_attn_fwd(small(2**20, 1, 8), k, k, device=device)


def unstageable(*shape):
    """A byte-swapped broadcast view: the kernels read it through a copy, which is too large to
    make (over 0.5 TB here)."""
    return np.broadcast_to(np.ones((1,) * (len(shape) - 1) + shape[-1:], ">f4"), shape)


def paged_call(ops, device, q, table, pages=None):
    pages = small(4, 16, 1, 8) if pages is None else pages
    return ops.flash_attn_varlen_fwd(q, pages, pages, np.array([0, len(q)]), np.array([0, 32]),
                                     max_seqlen_q=len(q), max_seqlen_k=32, block_table=table,
                                     device=device)


BIG = (2**20, 2**14)    # rows and heads that no copy can hold at head dim 8


@pytest.mark.parametrize("call, message", [
    (lambda ops, dev: ops.flash_attn_fwd(unstageable(*BIG, 300), small(1, 4, 300),
                                         small(1, 4, 300), device=dev), "'q' must have a head dim"),
    (lambda ops, dev: ops.flash_attn_fwd(small(4, 3, 8), unstageable(*BIG, 8), unstageable(*BIG, 8),
                                         device=dev), "'k' must have the batch dimensions"),
    (lambda ops, dev: ops.flash_attn_fwd(unstageable(*BIG, 8), small(5, 8), small(5, 8),
                                         device=dev, seqlen_first=True), "seqlen_first=True"),
    (lambda ops, dev: ops.flash_attn_bwd(unstageable(*BIG, 8), small(1, 4, 8), small(1, 4, 8),
                                         small(1, 4, 8), small(1, 4, 8), small(1, 4), device=dev),
     "'dout' must have shape"),
    (lambda ops, dev: ops.flash_attn_varlen_fwd(unstageable(*BIG, 8), small(3, 1, 8),
                                                small(3, 1, 8), np.array([0, 2]),
                                                np.array([0, 3]), device=dev), "'cu_seqlens_q'"),
    (lambda ops, dev: paged_call(ops, dev, unstageable(*BIG, 8), np.array([[0, 7]])),
     "'block_table'"),
    (lambda ops, dev: paged_call(ops, dev, small(1, 1, 8), np.array([[0, 2**31]]),
                                 unstageable(2**30, 16, 1, 8)), "'block_table'"),
    (lambda ops, dev: paged_call(ops, dev, small(1, 1, 9), np.array([[0, 1]]),
                                 unstageable(2**30, 16, 1, 8)), "'k' must have the head dim"),
    (lambda ops, dev: ops.flash_attn_fwd(unstageable(1, *BIG, 8), small(1, 16, 4, 8),
                                         small(1, 16, 4, 8), alibi_slopes=np.ones(3), device=dev),
     "'alibi_slopes' must have shape"),
    (lambda ops, dev: ops.flash_attn_fwd(unstageable(1, *BIG, 8), small(1, 16, 4, 8),
                                         small(1, 16, 4, 8), alibi_slopes=np.full(BIG[0], np.inf),
                                         device=dev), "'alibi_slopes' must be finite"),
])
def test_shape_errors_come_before_copies(ops, device, call, message):
    """A call wrong in its shapes, tables or ALiBi slopes fails at their check, having copied nothing, however
    large the operands it would copy: staged first, views like these raised MemoryError (and
    ones of a few GB that could be copied had the process killed)."""
    before = ops.stats()["per_device"][device]["staged_buffers"]
    with pytest.raises(ValueError, match=message):
        call(ops, device)
    assert ops.stats()["per_device"][device]["staged_buffers"] == before


def test_to_device_past_the_largest_buffer_copies_nothing(ops, device):
    """A view larger than the device's largest buffer is refused before its copy is made,
    naming the sizes."""
    if device == "cpu":
        pytest.skip("to_device takes OpenCL devices")
    largest = next(d for d in ops.devices() if d["id"] == device)["max_alloc_bytes"]
    view = unstageable(largest // 4 // 8 + 1, 8)
    with pytest.raises(ops.OrchardOutOfMemory, match="CL_INVALID_BUFFER_SIZE .*'array' takes "
                                                     "%d bytes; .* is %d bytes" % (view.nbytes, largest)):
        ops.to_device(view, device)


def test_offsets_past_2_31_elements_are_computed_correctly(ops, device):
    """Units 2**26 elements apart in one 8.6 GB array that is never touched except for the
    rows used (zero pages are not resident): the last unit starts at element 2**31. The
    native path reads it in place; an OpenCL device either runs it (one buffer over the whole
    extent) or, beyond its CL_DEVICE_MAX_MEM_ALLOC_SIZE, raises OrchardOutOfMemory."""
    units, stride, d = 33, 2**20, 64
    raw = np.zeros(units * stride * d * 4 + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    z = raw[start:start + units * stride * d * 4].view(np.float32).reshape(units, stride, d)
    rng = np.random.default_rng(0)
    q, k, v = z[:, :3], z[:, 5:9], z[:, 10:14]
    for x in (q, k, v):
        x[...] = rng.standard_normal(x.shape)
    assert (units - 1) * stride * d >= 2**31      # past the largest int32 index
    try:
        out, lse = ops.flash_attn_fwd(q, k, v, device=device)
    except ops.OrchardOutOfMemory as exc:
        assert device != "cpu" and "CL_INVALID_BUFFER_SIZE" in str(exc), exc
        return
    ro, rl = ref_fwd(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(out, ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, rl, rtol=1e-5, atol=1e-5)
