"""FlashAttention-2's Python API (flash_attn 2.7/2.8) on orchard: same functions, arguments,
defaults, (batch, seqlen, nheads, headdim) layout and results, on torch CPU tensors of
float16, bfloat16, float32 and float64, plus a device= keyword (an orchard device id).

    from orchard.flash_attn import flash_attn_func   # instead of: from flash_attn import ...

orchard is always deterministic (deterministic= is accepted) and splits the keys itself
(num_splits= is accepted). Every call goes through orchard.torch._attention.
"""
import functools
import itertools
import math
import numbers
import operator

import numpy as np
import torch

import orchard_ops
from orchard.attention_op import _Options
from orchard.torch import (_MAX_HEAD_DIM, _attention, _check_device, _check_tensors,
                           _dropout_keep, _fail, _flag, _forward, _largest_option, _number,
                           _recording, _refuse_transforms, _seed, _tracing)

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]

_INT32 = torch.int32
_MAX_SEQLEN = 2**32 - 1     # orchard's dropout stream numbers rows and keys with 32 bits


def _get_block_size_n(device=None, head_dim=None, is_dropout=False, is_causal=False):
    """Key columns per block of S_dmask's scaling (orchard's native key block), the hook
    FlashAttention-2's tests call to normalise S_dmask."""
    return 96


# ----------------------------------------------------------------------------- checks


def _check_shape(fn, name, t, shape, layout):
    """shape: the expected sizes, None where any size goes (the others follow from the
    arguments checked before: the error says which dimension differs)."""
    if t.dim() != len(shape):
        _fail(fn, name, "must be %s, got shape %s" % (layout, tuple(t.shape)))
    for i, (s, n) in enumerate(zip(shape, t.shape)):
        if s is not None and s != n:
            _fail(fn, name, "must be %s, got shape %s: dimension %d is %d, the other arguments "
                  "make it %d" % (layout, tuple(t.shape), i, n, s))


def _check_heads(fn, q, k, head_axis, names=("q", "k")):
    """q's heads and headdim, and k's heads, which must divide q's: checked before v's shape,
    which follows k's, so that a k of the wrong heads is named as such (FlashAttention-2's
    order). names: the arguments q and k came in (a packed one, a cache)."""
    h, hk = q.shape[head_axis], k.shape[head_axis]
    if h == 0:
        _fail(fn, names[0], "has 0 heads (orchard needs at least one)")
    if hk == 0 or h % hk:
        _fail(fn, names[1], "has %d heads, which must divide the %d heads of %s"
              % (hk, h, names[0]))
    _check_head_dim(fn, names[0], q.shape[-1])


def _check_head_dim(fn, name, d):
    if not 1 <= d <= _MAX_HEAD_DIM:
        _fail(fn, name, "has headdim %d; orchard takes 1 to %d" % (d, _MAX_HEAD_DIM))


def _check_seqlens(fn, **tensors):
    """Each (batch, seqlen, ...) tensor's seqlen within orchard's limit."""
    for name, t in tensors.items():
        if t.shape[1] > _MAX_SEQLEN:
            _fail(fn, name, "has seqlen %d; orchard takes at most %d" % (t.shape[1], _MAX_SEQLEN))


def _check_int32(fn, name, t, shape, layout):
    """TypeError / ValueError naming it unless t is an int32 CPU tensor of this shape."""
    if not isinstance(t, torch.Tensor) or t.dtype != _INT32:
        _fail(fn, name, "must be a torch.int32 tensor, got %s"
              % (t.dtype if isinstance(t, torch.Tensor) else type(t).__name__), TypeError)
    if t.device.type != "cpu":
        _fail(fn, name, "is on %s: pass CPU tensors" % t.device)
    _check_shape(fn, name, t, shape, layout)


def _int32(fn, name, t, shape, layout):
    """t, an int32 CPU tensor of this shape, as a list (nested for 2-D)."""
    _check_int32(fn, name, t, shape, layout)
    return t.tolist()


def _cu_seqlens(fn, name, t, total):
    """cu_seqlens as a list; it may start after the first of `total` tokens and end before
    the last (rows outside are padding, as FlashAttention-2 allows: static-shape buffers)."""
    cu = _int32(fn, name, t, (None,), "(batch_size + 1,)")
    if not cu:
        _fail(fn, name, "must have batch_size + 1 entries, got none")
    if (cu[0] < 0 or total is not None and cu[-1] > total
            or any(a > b for a, b in zip(cu, cu[1:]))):
        _fail(fn, name, "must start at 0 or after, never decrease and end at most at %s (the "
              "number of tokens), got %s" % (total, cu))
    return cu


def _window_bound(w):
    """A window bound as an int; TypeError for what is none, a bool included (orchard_ops
    refuses it too: True had read as 1)."""
    if isinstance(w, bool):
        raise TypeError("a bool is no window bound")
    return operator.index(w)


def _options(fn, q, seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
             alibi_slopes, batch, device, seqlen_first=False, **varlen):
    """Every option checked, under the names the caller used, before anything is computed or
    written (flash_attn_with_kvcache writes its cache only after this). seqlen_first: q, k, v
    are (batch, seqlen, nheads, headdim), read so by orchard_ops."""
    if (type(dropout_p) is float and dropout_p == 0.0 and alibi_slopes is None and not varlen
            and not torch.compiler.is_compiling()):
        # What a model's layers and steps repeat (no seed to draw, no tensor to read) is checked
        # once: 2.3 us of a decode step's 40 (benchmarks/flash_attn_overhead.py), more between
        # a model's other operations. A window's bounds depend on seqlen_k, nothing else does.
        try:
            left, right = window_size
            window = _window_bound(left), _window_bound(right)      # typed keys: ints alone
            return _plain_options(fn, seqlen_k if window != (-1, -1) else 0, softmax_scale,
                                  causal, window, softcap, device, seqlen_first, q.dtype)
        except (TypeError, ValueError):     # unhashable, or refused: said below
            pass
    return _checked_options(fn, q, seqlen_k, dropout_p, softmax_scale, causal, window_size,
                            softcap, alibi_slopes, batch, device, seqlen_first, **varlen)


@functools.lru_cache(maxsize=256, typed=True)    # typed: causal=1.0 is refused, True is not
def _plain_options(fn, seqlen_k, softmax_scale, causal, window_size, softcap, device,
                   seqlen_first, dtype):
    return _checked_options(fn, None, seqlen_k, 0.0, softmax_scale, causal, window_size, softcap,
                            None, None, device, seqlen_first, dtype)


def _slopes_in_bound(slopes, dtype):
    """Whether ALiBi slopes are finite in the kernels' type for operands of dtype (a bool
    tensor): compared in float64, where the bound of a narrower type would be inf and let inf
    through."""
    return (slopes.double().abs() <= _largest_option(dtype)).all()


def _checked_options(fn, q, seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                     alibi_slopes, batch, device, seqlen_first=False, dtype=None, **varlen):
    """dtype: the operands' (None: q's), whose kernels' type bounds the numbers."""
    dtype = q.dtype if dtype is None else dtype
    bound = _largest_option(dtype)
    kind = "float64" if dtype == torch.float64 else "float32, the kernels' type for these inputs"
    in_type = "" if dtype == torch.float64 else " in " + kind
    dropout_p = _number(fn, "dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        _fail(fn, "dropout_p", "must be in [0, 1), got %r" % (dropout_p,))
    if softmax_scale is not None:
        softmax_scale = _number(fn, "softmax_scale", softmax_scale)
        if not -bound <= softmax_scale <= bound:     # NaN too; in words dynamic=True traces
            _fail(fn, "softmax_scale", "must be finite%s, got %r" % (in_type, softmax_scale))
    softcap = _number(fn, "softcap", softcap)
    if not softcap <= bound:     # NaN too
        _fail(fn, "softcap", "must be finite%s (<= 0: no softcap), got %r" % (in_type, softcap))
    # the native kernels multiply by 1 / softcap, in float32 but for float64 inputs
    cap = softcap if dtype == torch.float64 else float(np.float32(softcap))
    if 0 < softcap and (cap == 0 or 1.0 / cap > bound):
        _fail(fn, "softcap", "is too small for %s (1 / softcap overflows): pass 0 or at least "
              "%s, got %r" % (kind, "5.57e-309" if dtype == torch.float64 else "2.94e-39",
                              softcap))
    softcap = max(softcap, 0.0)     # as FlashAttention-2: only a positive softcap caps
    try:
        left, right = (_window_bound(w) for w in window_size)
    except (TypeError, ValueError):
        _fail(fn, "window_size", "must be a pair of ints, got %r" % (window_size,), TypeError)
    # As FlashAttention-2: a negative bound (-1 by convention) or one reaching past every key
    # is none; then, with the other bound set, an unbounded side reaches seqlen_k (which
    # leaves the rows of Nq > Nk whose window ends before the first key empty).
    left, right = (-1 if left < 0 or left >= seqlen_k else left,
                   -1 if right < 0 or right >= seqlen_k else right)
    window = (seqlen_k if left < 0 <= right else left, seqlen_k if right < 0 <= left else right)
    if alibi_slopes is not None:
        if (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype == torch.bool
                or alibi_slopes.is_complex()):
            _fail(fn, "alibi_slopes", "must be a tensor of a real dtype, got %r"
                  % (alibi_slopes,), TypeError)
        if alibi_slopes.device.type != "cpu":
            _fail(fn, "alibi_slopes", "is on %s: pass CPU tensors" % alibi_slopes.device)
        h = q.shape[-2]
        shape = alibi_slopes.shape      # compared a size at a time: traced, h may be a symbol
        if not (len(shape) == 1 and shape[0] == h
                or len(shape) == 2 and shape[0] == batch and shape[1] == h):
            _fail(fn, "alibi_slopes", "must be (nheads,) = (%d,) or (batch_size, nheads) = "
                  "(%d, %d), got shape %s" % (h, batch, h, tuple(alibi_slopes.shape)))
        # no gradient reaches the slopes (as FlashAttention-2); orchard_ops reads float32/64
        alibi_slopes = alibi_slopes.detach()
        # traced, orchard_ops checks them when the graph runs (a value read would break it)
        if not _tracing() and not _slopes_in_bound(alibi_slopes, dtype):
            _fail(fn, "alibi_slopes", "must be finite%s, got %s"
                  % (in_type, alibi_slopes.tolist()))
        if alibi_slopes.dtype not in (torch.float32, torch.float64):
            alibi_slopes = alibi_slopes.to(torch.float32)
    _check_device(fn, device)
    return _Options(scale=softmax_scale, dropout_p=dropout_p, causal=_flag(fn, "causal", causal),
                    window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                    seed=_seed(dropout_p), device=device, seqlen_first=seqlen_first, **varlen)


# ----------------------------------------------------------------------------- S_dmask


def _attn_probs(q, k, opts, keep):
    """S_dmask of one batch of heads, q (B, H, Nq, D), k (B, Hkv, Nk, D), keep (B, H, Nq, Nk)
    the dropout mask, as FlashAttention-2 encodes it: per block of _get_block_size_n key columns,
    exp(score - m) with m the row maximum over that block and every block after it, and
    negative where dropout dropped the entry. A plain torch computation: it is for tests."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.detach().to(ct), k.detach().to(ct)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    nq, nk = q.shape[2], k.shape[2]
    scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = scale * q @ k.transpose(-1, -2)
    if opts.softcap > 0:
        s = opts.softcap * torch.tanh(s / opts.softcap)
    diag = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    if opts.alibi_slopes is not None:
        s = s - opts.alibi_slopes.to(ct)[..., None, None] * (diag - j).abs()
    left, right = opts.window
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    if opts.causal:
        visible &= j <= diag
    s = s.masked_fill(~visible, -math.inf)
    if nk == 0:
        return s
    blocks = s.split(_get_block_size_n(), dim=-1)
    m = torch.stack([b.amax(-1) for b in blocks], -1).flip(-1).cummax(-1).values.flip(-1)
    a = torch.cat([torch.exp(b - m[..., c, None]) for c, b in enumerate(blocks)], -1)
    a = torch.where(visible, a, 0.0)
    return torch.where(keep, a, -a)


def _no_probs(q):
    """S_dmask without dropout: empty, as FlashAttention-2 returns it (return_attn_probs is then
    the way to softmax_lse, and costs nothing more)."""
    return q.new_empty(0)


def _dense_probs(q, k, opts, dtype):
    keep = _dropout_keep(q.shape, k.shape, opts.dropout_p, opts.seed)
    return _attn_probs(q, k, opts, keep).to(dtype)


def _varlen_probs(q, k, opts, cu_q, cu_k, max_q, max_k):
    batch, h = len(cu_q) - 1, q.shape[1]
    keep = _dropout_keep((batch, h, max_q, 1), (batch, h, max_k, 1), opts.dropout_p, opts.seed)
    probs = q.new_zeros(batch, h, max_q, max_k)
    for b in range(batch):
        sq, eq, sk, ek = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        slopes = opts.alibi_slopes
        o = opts._replace(alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2
                          else slopes)
        kb = keep[b:b + 1, :, :eq - sq, :ek - sk]
        probs[b, :, :eq - sq, :ek - sk] = _attn_probs(
            q[sq:eq].transpose(0, 1)[None], k[sk:ek].transpose(0, 1)[None], o, kb)[0]
    return probs


# ----------------------------------------------------------------------------- dense


def _dense(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           return_attn_probs, device):
    _check_tensors(fn, q=q, k=k, v=v)
    return_attn_probs = _flag(fn, "return_attn_probs", return_attn_probs)
    qs, ks, vs = q.shape, k.shape, v.shape
    # Valid shapes in few comparisons (this runs on every call); the checks that name the
    # argument only when they fail.
    if not (len(qs) == len(ks) == len(vs) == 4 and ks[0] == qs[0] and ks[3] == qs[3]
            and vs[:3] == ks[:3] and 0 < ks[2] <= qs[2] and qs[2] % ks[2] == 0
            and 0 < qs[3] <= _MAX_HEAD_DIM and 0 < vs[3] <= _MAX_HEAD_DIM
            and qs[1] <= _MAX_SEQLEN and ks[1] <= _MAX_SEQLEN):
        layout = "(batch_size, seqlen, nheads, headdim)"
        _check_shape(fn, "q", q, (None,) * 4, layout)
        _check_shape(fn, "k", k, (qs[0], None, None, qs[3]), layout)
        _check_heads(fn, q, k, 2)
        _check_shape(fn, "v", v, tuple(ks[:3]) + (None,), layout)
        _check_head_dim(fn, "v", vs[3])
        _check_seqlens(fn, q=q, k=k)
    # orchard_ops reads the (batch, seqlen, nheads, headdim) operands as they lie: no transposes
    # (1.4 us each)
    opts = _options(fn, q, k.shape[1], dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, q.shape[0], device, seqlen_first=True)
    out, lse = _attention(q, k, v, opts)
    out = out.contiguous()      # in q's memory order: contiguous unless q's axes were permuted
    if not return_attn_probs:
        return out
    if opts.dropout_p == 0:
        return out, lse, _no_probs(q)
    return out, lse, _dense_probs(q.transpose(1, 2), k.transpose(1, 2), opts, q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, device=None):
    """Attention of q (batch, seqlen_q, nheads, headdim) over k, v (batch, seqlen_k, nheads_k,
    headdim); nheads_k divides nheads (GQA/MQA). causal and window_size are bottom-right
    aligned. Returns out (batch, seqlen_q, nheads, headdim), or with return_attn_probs
    (out, softmax_lse (batch, nheads, seqlen_q), S_dmask (batch, nheads, seqlen_q, seqlen_k)
    with dropout, else empty)."""
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, return_attn_probs, device)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, device=None):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim)."""
    fn = "flash_attn_qkvpacked_func"
    _check_tensors(fn, qkv=qkv)
    _check_shape(fn, "qkv", qkv, (None, None, 3, None, None),
                 "(batch_size, seqlen, 3, nheads, headdim)")
    _check_heads(fn, qkv, qkv, -2, ("qkv",) * 2)
    return _dense(fn, *qkv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, return_attn_probs, device)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, device=None):
    """flash_attn_func on q and kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    fn = "flash_attn_kvpacked_func"
    _check_tensors(fn, q=q, kv=kv)
    _check_shape(fn, "q", q, (None,) * 4, "(batch_size, seqlen, nheads, headdim)")
    _check_shape(fn, "kv", kv, (q.shape[0], None, 2, None, q.shape[3]),
                 "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    _check_heads(fn, q, kv, -2, ("q", "kv"))
    return _dense(fn, q, *kv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, return_attn_probs, device)


# ----------------------------------------------------------------------------- varlen


def _check_pages(fn, name, t, layout):
    """ValueError naming it unless pages t have num_blocks and page_block_size >= 1."""
    if t.shape[0] < 1 or t.shape[1] < 1:
        _fail(fn, name, "must be %s, num_blocks and page_block_size >= 1, got %s"
              % (layout, tuple(t.shape)))


def _check_block_table(fn, table, keys, page, nblocks, first=None):
    """ValueError naming block_table unless each row b lists pages in [0, nblocks) in the
    entries that hold sequence b's keys first[b] (default 0) to keys[b], the ones orchard_ops
    reads (entries first[b] // page to keys[b] / page, rounded up; the rest may hold anything,
    as in FlashAttention-2). table (batch, max_num_blocks_per_seq) int32, keys and first lists
    of ints."""
    need = [-(-s // page) for s in keys]
    start = [0] * len(need) if first is None else [f // page for f in first]
    if table.numel() <= 1024:
        # a few requests' pages: Python's min and max over each row's cost less than the
        # NumPy calls below, which took 15-20 us in a decode step
        bad = [b for b, (row, a, m) in enumerate(zip(table.tolist(), start, need))
               if a < m and (min(row[a:m]) < 0 or max(row[a:m]) >= nblocks)]
    else:
        # thousands: whole-array operations (a row at a time took 0.2 ms at 32 x 256 entries)
        rows, at = table.numpy(), np.arange(table.shape[1])
        used = ((at >= np.array(start, dtype=np.int64)[:, None])
                & (at < np.array(need, dtype=np.int64)[:, None]))
        bad = (((rows < 0) | (rows >= nblocks)) & used).any(1).nonzero()[0]
    if len(bad):
        b = int(bad[0])
        _fail(fn, "block_table", "row %d lists pages %s%s, outside [0, %d) (num_blocks)"
              % (b, table[b, start[b]:need[b]].tolist(),
                 " from entry %d" % start[b] if start[b] else "", nblocks))


def _paged_gather(fn, q, k, v, cu_k, block_table, gather):
    """The keys and values of every sequence, packed (total_k, nheads_k, headdim), from the
    pages (num_blocks, page_block_size, nheads_k, headdim) that block_table lists; a copy
    through torch indexing, so gradients reach the pages. Without gather, only the checks."""
    layout = "(num_blocks, page_block_size, nheads_k, headdim) with a block_table"
    _check_shape(fn, "k", k, (None, None, None, q.shape[2]), layout)
    _check_heads(fn, q, k, -2)
    _check_shape(fn, "v", v, tuple(k.shape[:3]) + (None,), layout)
    batch = len(cu_k) - 1
    _check_int32(fn, "block_table", block_table, (batch, None),
                 "(batch_size, max_num_blocks_per_seq) = (%d, ...)" % batch)
    _check_pages(fn, "k", k, layout)
    page, room = k.shape[1], block_table.shape[1] * k.shape[1]
    lengths = [b - a for a, b in zip(cu_k, cu_k[1:])]
    for s, n in enumerate(lengths):
        if n > room:
            _fail(fn, "cu_seqlens_k", "gives sequence %d %d keys, more than its %d pages of %d "
                  "in block_table hold" % (s, n, block_table.shape[1], page))
    _check_block_table(fn, block_table, lengths, page, k.shape[0])
    if not gather:
        return k, v
    lengths = torch.tensor(lengths, dtype=torch.long)
    # key i of sequence s: row i % page of page block_table[s, i // page]
    sequence = torch.repeat_interleave(torch.arange(batch), lengths)
    starts = torch.tensor(cu_k[:-1], dtype=torch.long) - cu_k[0]
    at = torch.arange(len(sequence)) - starts[sequence]
    index = block_table[sequence, at // page].long() * page + at % page
    return k.flatten(0, 1)[index], v.flatten(0, 1)[index]


def _check_max_seqlen(fn, name, x, longest):
    """x as an int (None stays None); TypeError / ValueError naming it unless it is an integer
    at least `longest`. Anything with __index__ is one, as for FlashAttention-2's int
    parameters: transformers 4.44-4.47 passed one-element integer tensors."""
    if x is None:
        return None
    n = None
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        n = x       # as given: operator.index would specialise a traced int to its value
    elif not isinstance(x, bool):
        try:
            n = operator.index(x)
        except (TypeError, RuntimeError):   # RuntimeError: a tensor of several elements
            pass
    if n is None:
        _fail(fn, name, "must be an int, got %r" % (x,), TypeError)
    if n < longest:
        _fail(fn, name, "must be at least %d, the longest sequence, got %d" % (longest, n))
    return n


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
            block_table, device, suffixes=("_q", "_k")):
    cu_names = ["cu_seqlens" + x for x in suffixes]
    _check_tensors(fn, q=q, k=k, v=v)
    return_attn_probs = _flag(fn, "return_attn_probs", return_attn_probs)
    _check_shape(fn, "q", q, (None,) * 3, "(total_q, nheads, headdim)")
    layout = "(total_k, nheads_k, headdim)"
    if (_tracing() and block_table is None
            and max_seqlen_q is not None and max_seqlen_k is not None):
        # traced (torch.compile, make_fx, fake tensors), the offsets stay unread (a value read
        # would break the graph); orchard_ops checks them, and the max_seqlen against them,
        # when the graph runs
        for name, t in zip(cu_names, (cu_seqlens_q, cu_seqlens_k)):
            _check_int32(fn, name, t, (None,), "(batch_size + 1,)")
            if t.shape[0] == 0:
                _fail(fn, name, "must have batch_size + 1 entries, got none")
        _check_shape(fn, "k", k, (None, None, q.shape[2]), layout)
        _check_heads(fn, q, k, -2)
        _check_shape(fn, "v", v, tuple(k.shape[:2]) + (None,), layout)
        _check_entries(fn, cu_names, cu_seqlens_q.shape[0], cu_seqlens_k.shape[0])
        max_seqlen_q, max_seqlen_k = (_check_max_seqlen(fn, "max_seqlen" + suffix, x, 0)
                                      for x, suffix in zip((max_seqlen_q, max_seqlen_k), suffixes))
        cu_q = cu_k = None      # read only for S_dmask with dropout, below
        batch = cu_seqlens_q.shape[0] - 1
    else:
        if torch.compiler.is_exporting():
            # the offsets' values are read below, which torch.export cannot trace (compiled,
            # the graph breaks there and they are read eagerly)
            if block_table is not None:
                _fail(fn, "block_table", "cannot be given to a call torch.export traces: its "
                      "pages are found from cu_seqlens' values while tracing")
            missing = "max_seqlen" + suffixes[max_seqlen_q is not None]
            _fail(fn, missing, "must be given to a call torch.export traces: without it the "
                  "sequences' lengths are read from cu_seqlens' values while tracing")
        cu_q = _cu_seqlens(fn, cu_names[0], cu_seqlens_q, q.shape[0])
        if block_table is None:
            _check_shape(fn, "k", k, (None, None, q.shape[2]), layout)
            _check_heads(fn, q, k, -2)
            _check_shape(fn, "v", v, tuple(k.shape[:2]) + (None,), layout)
            cu_k = _cu_seqlens(fn, cu_names[1], cu_seqlens_k, k.shape[0])
        else:
            cu_k = _cu_seqlens(fn, cu_names[1], cu_seqlens_k, None)
            if cu_k[0]:     # pages: only the offsets' differences count
                cu_seqlens_k = cu_seqlens_k - cu_k[0]
                cu_k = [x - cu_k[0] for x in cu_k]
            # read in place, unless gradients must reach the pages
            in_place = not (torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad))
            k, v = _paged_gather(fn, q, k, v, cu_k, block_table, not in_place)
            if not in_place:
                block_table = None
        _check_entries(fn, cu_names, len(cu_q), len(cu_k))
        longest = [max((b - a for a, b in zip(cu, cu[1:])), default=0) for cu in (cu_q, cu_k)]
        max_seqlen_q, max_seqlen_k = (
            n if x is None else _check_max_seqlen(fn, "max_seqlen" + suffix, x, n)
            for x, suffix, n in zip((max_seqlen_q, max_seqlen_k), suffixes, longest))
        batch = len(cu_q) - 1
    _check_head_dim(fn, "v", v.shape[-1])
    opts = _options(fn, q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, batch, device, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, block_table=block_table)
    # tokens outside the sequences are padding: out 0 and lse -inf (attention_op.ops_call)
    if block_table is not None:     # pages read in place: nothing to differentiate
        # (negated views resolved as _attention resolves them: the pages are only read)
        out, lse = _forward(q.resolve_neg(), k.resolve_neg(), v.resolve_neg(), opts)
    else:
        out, lse = _attention(q, k, v, opts)
    out = out.contiguous()      # a transposed q gives an output in its layout
    if not return_attn_probs:
        return out
    if opts.dropout_p == 0:
        return out, lse, _no_probs(q)
    if cu_q is None:
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if block_table is not None:
        k, _ = _paged_gather(fn, q, k, v, cu_k, block_table, True)
    probs = _varlen_probs(q, k, opts, cu_q, cu_k, max_seqlen_q, max_seqlen_k).to(q.dtype)
    return out, lse, probs


def _check_entries(fn, cu_names, n_q, n_k):
    if n_k != n_q:
        _fail(fn, cu_names[1], "has %d entries, %s has %d: one per sequence plus one"
              % (n_k, cu_names[0], n_q))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, device=None):
    """Attention over packed sequences: q (total_q, nheads, headdim), k, v (total_k, nheads_k,
    headdim), sequence b at rows cu_seqlens[b]:cu_seqlens[b + 1] (int32). With block_table
    (batch, max_num_blocks_per_seq), k and v are pages (num_blocks, page_block_size, nheads_k,
    headdim) of any page size, read in place (gathered into a copy per call when gradients
    must reach them). softmax_lse is (nheads, total_q);
    S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k) with dropout, else empty. cu_seqlens may
    start after the first row and end before the last: rows outside are padding (out 0, lse
    -inf)."""
    return _varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs, block_table, device)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, device=None):
    """flash_attn_varlen_func on qkv (total, 3, nheads, headdim)."""
    fn = "flash_attn_varlen_qkvpacked_func"
    _check_tensors(fn, qkv=qkv)
    _check_shape(fn, "qkv", qkv, (None, 3, None, None), "(total, 3, nheads, headdim)")
    _check_heads(fn, qkv, qkv, -2, ("qkv",) * 2)
    return _varlen(fn, *qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, None, device, suffixes=("", ""))


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, device=None):
    """flash_attn_varlen_func on q and kv (total_k, 2, nheads_k, headdim)."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_tensors(fn, q=q, kv=kv)
    _check_shape(fn, "q", q, (None,) * 3, "(total_q, nheads, headdim)")
    _check_shape(fn, "kv", kv, (None, 2, None, q.shape[2]), "(total_k, 2, nheads_k, headdim)")
    _check_heads(fn, q, kv, -2, ("q", "kv"))
    return _varlen(fn, q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, None, device)


# ----------------------------------------------------------------------------- KV cache


def _rotary(x, cos, sin, pos, interleaved):
    """x (..., N, H, D) with its first 2 * cos.shape[1] features rotated by the angles of rows
    pos (..., N) of cos/sin: pairs (0, 1), (2, 3), ... when interleaved, else (i, i +
    rotary_dim / 2)."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    rd = 2 * cos.shape[1]
    c, s = cos[pos].to(ct)[..., None, :], sin[pos].to(ct)[..., None, :]
    xr = x[..., :rd].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        xr = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, -1)
        xr = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1)
    return torch.cat((xr.to(x.dtype), x[..., rd:]), -1)


def _memory(t):
    """The bytes [start, end) of t's storage."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlaps(span, spans):
    """Whether the bytes [start, end) of span overlap any of spans'."""
    return any(span[0] < end and start < span[1] for start, end in spans)


def _check_lengths(fn, seqlens, n, capacity):
    """ValueError unless every cache_seqlens entry (a list, or one int) leaves room for the n
    new tokens in a cache of capacity keys."""
    listed = seqlens if isinstance(seqlens, list) else [seqlens]
    if any(not 0 <= s <= capacity - n for s in listed):
        _fail(fn, "cache_seqlens", "%s plus the %d new tokens must lie in [0, %d], the "
              "cache's length" % (seqlens, n, capacity))


def _cache_call(q, kc, vc, starts, opts, new=None, **extra):
    """(out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q)) of q (batch,
    seqlen_q, nheads, headdim) over keys kc and values vc (rows, nheads_k, headdim) where
    sequence b's start at row starts[b]: one varlen call for the whole batch; extra: the
    options saying which of them it uses (leftpad_k, block_table); new: (k_new, v_new) (batch,
    seqlen_new, nheads_k, headdim) that the call writes as each sequence's last keys and
    values, or None. The arguments are checked, but for the pages the call reads (orchard_ops
    checks them, before it writes anything): the caller's work."""
    batch, nq = q.shape[:2]
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * nq
    out, lse = _forward(q.flatten(0, 1), kc, vc, opts._replace(
        cu_seqlens_q=cu_q, cu_seqlens_k=torch.as_tensor(starts, dtype=torch.int64), **extra),
        **_new_rows(new))
    return out.unflatten(0, (batch, nq)), lse.unflatten(1, (batch, nq)).transpose(0, 1)


def _new_rows(new):
    return {} if new is None else dict(k_new=new[0], v_new=new[1])


def _writable_in_call(caches, new):
    """Whether orchard_ops' call can write the new keys and values (tensors) into the caches
    itself (it bumps their version counters, as torch's writes do): not while torch records,
    nor where autograd would record the write (in grad mode, a cache or new tensor that
    requires grad), since its graph would not see it; nor into a cache it reads through a copy
    (not contiguous in its last dimension, or elements not aligned)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*caches, *new))
    return not _recording() and not grad and all(
        (c.stride(-1) == 1 or c.shape[-1] == 1) and c.data_ptr() % c.element_size() == 0
        for c in caches)


def _check_not_inference(fn, caches):
    """Refuses a cache (name, tensor) made under torch.inference_mode outside inference mode:
    torch forbids writing one there (its own indexing raises, but only once it has written)."""
    if not torch.is_inference_mode_enabled():
        for name, cache in caches:
            if cache.is_inference():
                _fail(fn, name, "is an inference tensor (made under torch.inference_mode): "
                      "it can be written only in inference mode")


def _read_cache(q, k_cache, v_cache, used, leftpad, opts, new=None):
    """(out (batch, seqlen_q, nheads, headdim_v), lse (batch, nheads, seqlen_q)) of q (batch,
    seqlen_q, nheads, headdim) over sequence b's rows [leftpad[b], used[b]) (leftpad None: 0)
    of caches k_cache, v_cache (batch, seqlen_cache, nheads_k, headdim): one dense call, which
    reads them in place whatever their strides (transformers' caches are (batch, nheads_k,
    seqlen_cache, headdim) in memory); new as _cache_call's. The arguments are checked: the
    caller's work."""
    out, lse = _forward(q, k_cache, v_cache,
                        opts._replace(seqused_k=used, leftpad_k=leftpad, seqlen_first=True),
                        **_new_rows(new))
    return out.contiguous(), lse


@torch.no_grad()
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, device=None):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a KV cache, after writing k, v
    (batch, seqlen_new, nheads_k, headdim) into it in place at cache_seqlens (rotated first
    when rotary_cos/rotary_sin are given). Sequence b uses cache row cache_batch_idx[b] from
    cache_leftpad[b] to cache_seqlens[b] + seqlen_new. The cache is (batch_cache, seqlen_cache,
    nheads_k, headdim), or with block_table pages (num_blocks, page_block_size, nheads_k,
    headdim) of any page size, both read in place, on every device. One call for the whole
    batch; a decode step (seqlen_q <= 16) takes the split-KV path. Not differentiable.
    Returns out, or (out, softmax_lse) with return_softmax_lse."""
    fn = "flash_attn_with_kvcache"
    return_softmax_lse = _flag(fn, "return_softmax_lse", return_softmax_lse)
    try:
        operator.index(num_splits)
    except TypeError:
        _fail(fn, "num_splits", "must be an int (orchard chooses the splits itself), got %r"
              % (num_splits,), TypeError)
    if (k is None) != (v is None):
        _fail(fn, "v" if v is None else "k", "must be given with '%s'" % ("k" if v is None else "v"))
    new = {} if k is None else dict(k=k, v=v)
    _check_tensors(fn, q=q, k_cache=k_cache, v_cache=v_cache, **new)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not torch.compiler.is_compiling() and cache.is_neg():    # (Dynamo cannot ask)
            _fail(fn, name, "is a lazily negated view (negative bit set, as x.conj().imag): a "
                  "cache is written in place, pass one that is not")
    # the rest, read only, resolved as torch's kernels resolve them (DLPack drops the bit)
    q = q.resolve_neg()
    new = {name: t.resolve_neg() for name, t in new.items()}
    k, v = new.get("k"), new.get("v")
    if not torch.compiler.is_compiling():   # (Dynamo handles torch.func itself)
        # before any write: new keys with tangents, written here, made the cache a dual tensor
        _refuse_transforms(q, k_cache, v_cache, *new.values())
    layout = "(batch_size, seqlen, nheads, headdim)"
    _check_shape(fn, "q", q, (None,) * 4, layout)
    batch, nq, _, d = q.shape
    paged = block_table is not None
    cache_layout = ("(num_blocks, page_block_size, nheads_k, headdim) with a block_table" if paged
                    else "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _check_shape(fn, "k_cache", k_cache, (None, None, None, d), cache_layout)
    _check_heads(fn, q, k_cache, 2, ("q", "k_cache"))
    _check_shape(fn, "v_cache", v_cache, tuple(k_cache.shape[:3]) + (None,), cache_layout)
    _check_head_dim(fn, "v_cache", v_cache.shape[3])
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    n = 0
    if k is not None:
        _check_shape(fn, "k", k, (batch, None, hk, d), layout)
        _check_shape(fn, "v", v, tuple(k.shape[:3]) + (dv,), layout)
        n = k.shape[1]

    # Traced (torch.compile, make_fx, fake tensors), a contiguous cache reads no value (that
    # would break the graph): its lengths, left padding and rows are checked when the graph
    # runs, before the cache is written (RuntimeError naming the argument), the rest by
    # orchard_ops.
    traced = _tracing() and not paged
    in_place = cache_batch_idx is None     # the cache's first rows, read as they are
    if paged:
        if cache_batch_idx is not None:
            _fail(fn, "cache_batch_idx", "cannot be used with a block_table")
        _check_int32(fn, "block_table", block_table, (batch, None),
                     "(batch_size, max_num_blocks_per_seq) = (%d, ...)" % batch)
        _check_pages(fn, "k_cache", k_cache, cache_layout)
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            _fail(fn, "k_cache", "has batch_size_cache %d, fewer than the %d sequences of q "
                  "(pass cache_batch_idx to choose rows)" % (k_cache.shape[0], batch))
    # traced, the batch may be a symbol, which a message cannot hold
    per_sequence = "(batch_size,)" if traced else "(batch_size,) = (%d,)" % batch
    rows = None     # the sequences' cache rows (cache_batch_idx); None: the first batch rows
    if cache_batch_idx is not None:
        name = "cache_batch_idx"
        if traced:
            _check_int32(fn, name, cache_batch_idx, (batch,), per_sequence)
            torch._assert_async(((cache_batch_idx >= 0) & (cache_batch_idx < k_cache.shape[0]))
                                .all(), "%s: '%s' has entries outside [0, batch_size_cache)"
                                % (fn, name))
        else:
            listed = _int32(fn, name, cache_batch_idx, (batch,), per_sequence)
            if any(not 0 <= r < k_cache.shape[0] for r in listed):
                _fail(fn, name, "has entries outside [0, %d) (batch_size_cache): %s"
                      % (k_cache.shape[0], listed))
            in_place = listed == list(range(batch))
        rows = cache_batch_idx.long()
    if capacity > _MAX_SEQLEN:
        _fail(fn, "block_table" if paged else "k_cache", "%s %d keys; orchard takes at most %d"
              % ("gives a sequence room for" if paged else "has seqlen_cache", capacity,
                 _MAX_SEQLEN))
    _check_seqlens(fn, q=q)
    if cache_seqlens is None:
        if k is not None:
            _fail(fn, "cache_seqlens", "must be given with new keys 'k' and values 'v'")
        lengths = torch.full((batch,), capacity)
    elif isinstance(cache_seqlens, bool):   # an int to Python, never a length
        _fail(fn, "cache_seqlens", "must be an int or a torch.int32 tensor, got %r"
              % cache_seqlens, TypeError)
    elif isinstance(cache_seqlens, numbers.Integral):
        _check_lengths(fn, cache_seqlens, n, capacity)     # (before torch.full: any int)
        lengths = torch.full((batch,), int(cache_seqlens))
    else:
        _check_int32(fn, "cache_seqlens", cache_seqlens, (batch,), per_sequence)
        lengths = cache_seqlens.long()
    if traced:
        # (the messages name no size: with dynamic=True the sizes are symbols)
        torch._assert_async(((lengths >= 0) & (lengths <= capacity - n)).all(),
                            "%s: 'cache_seqlens' plus the new tokens must lie in [0, "
                            "seqlen_cache]" % fn)
        if cache_leftpad is not None:
            _check_int32(fn, "cache_leftpad", cache_leftpad, (batch,), per_sequence)
            torch._assert_async(((cache_leftpad >= 0) & (cache_leftpad <= lengths + n)).all(),
                                "%s: 'cache_leftpad' must lie in [0, cache_seqlens + "
                                "seqlen_new]" % fn)
    else:
        seqlens = lengths.tolist()
        _check_lengths(fn, seqlens, n, capacity)
        leftpad = [0] * batch if cache_leftpad is None else _int32(
            fn, "cache_leftpad", cache_leftpad, (batch,), per_sequence)
        if any(not 0 <= p <= s + n for p, s in zip(leftpad, seqlens)):
            _fail(fn, "cache_leftpad", "%s must lie in [0, cache_seqlens + seqlen_new]"
                  % leftpad)
    # The new keys and values go into the cache in the call that reads it: orchard_ops writes
    # them once it has checked every argument, every page included (csrc/kv_append.c). A
    # cache read through a gathered copy (cache_batch_idx), or one orchard_ops cannot write,
    # takes them here; the pages are checked first then.
    in_call = (k is not None and (paged or in_place)
               and _writable_in_call((k_cache, v_cache), (k, v)))
    if paged:
        # the pages of sequence b's keys from its left padding on, and of its new keys: the
        # ones orchard_ops reads and writes
        page_keys = dict(keys=[s + n for s in seqlens], page=page, nblocks=k_cache.shape[0],
                         first=[min(p, s) for p, s in zip(leftpad, seqlens)])
        # checked first where this function writes new keys, or where torch records (the
        # call then runs with the graph, past the refusal's message below)
        if not in_call and (k is not None or _recording()):
            _check_block_table(fn, block_table, **page_keys)
    opts = _options(fn, q, capacity, 0.0, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, batch, device)
    if _tracing() and opts.alibi_slopes is not None:   # (before the write: orchard_ops checks
        # them when the graph runs, after it)
        torch._assert_async(_slopes_in_bound(opts.alibi_slopes, q.dtype),
                            "%s: 'alibi_slopes' must be finite" % fn)
    if (rotary_cos is None) != (rotary_sin is None):
        _fail(fn, "rotary_sin" if rotary_sin is None else "rotary_cos", "must be given with "
              "'%s'" % ("rotary_cos" if rotary_sin is None else "rotary_sin"))
    if rotary_cos is not None:
        if k is None:
            _fail(fn, "rotary_cos", "needs new keys 'k' and values 'v' to rotate")
        _check_tensors(fn, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
        rotary_interleaved = _flag(fn, "rotary_interleaved", rotary_interleaved)
        _check_shape(fn, "rotary_cos", rotary_cos, (None, None), "(seqlen_ro, rotary_dim / 2)")
        _check_shape(fn, "rotary_sin", rotary_sin, rotary_cos.shape, "rotary_cos's shape")
        if not 1 <= 2 * rotary_cos.shape[1] <= d:
            _fail(fn, "rotary_cos", "gives rotary_dim %d; it must be in [2, headdim = %d]"
                  % (2 * rotary_cos.shape[1], d))
        # the new keys' positions, and the queries': theirs where masks place them, else
        # all at cache_seqlens (below)
        local = opts.causal or opts.window != (-1, -1)
        reach = max(n, nq if local else min(nq, 1))
        if traced:
            torch._assert_async((lengths + reach <= rotary_cos.shape[0]).all(),
                                "%s: 'rotary_cos' has fewer positions than these tokens need"
                                % fn)
        else:
            need = max([0] + [s + reach for s in seqlens])
            if rotary_cos.shape[0] < need:
                _fail(fn, "rotary_cos", "has %d positions; these tokens need %d"
                      % (rotary_cos.shape[0], need))
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)) if k is not None else ():
        # (Dynamo cannot ask: a cache made under inference_mode is then written as any other
        # by Inductor, refused by torch (RuntimeError) under aot_eager)
        if not torch.compiler.is_compiling():
            _check_not_inference(fn, [(name, cache)])
        # (an empty cache has no rows to share: NumPy gives any empty array strides of 0)
        if 0 in cache.stride() and cache.numel() > 0 and any(
                st == 0 and size > 1 for st, size in zip(cache.stride(), cache.shape)):
            _fail(fn, name, "is an expanded view (stride 0): its rows share memory and "
                  "cannot take new keys and values")
    # Checked, but for the pages a call that writes in orchard_ops reads (it checks them
    # before it writes): from here on nothing fails on the caller's input, so the cache is
    # written only for a call that completes.

    if k is not None:
        # new keys, values or queries in the cache's own memory are read as they were before
        # the write (index_put_ copies element by element, so overlapping slots would read
        # keys already moved). Memory, not storage objects: views made elsewhere
        # (torch.from_numpy of a NumPy view of the cache's array) have their own. orchard_ops
        # copies the new rows it writes first, but reads q after the write.
        if not traced:
            caches = [_memory(t) for t in (k_cache, v_cache)]
            q = q.clone() if _overlaps(_memory(q), caches) else q
            if not in_call:
                k, v = (t.clone() if _overlaps(_memory(t), caches) else t for t in (k, v))
        elif not torch.compiler.is_compiling():     # (torch.compile functionalizes: it reads
            # them so itself) make_fx and fake tensors, whose memory cannot be compared: all
            # copied (a step's few rows)
            q, k, v = q.clone(), k.clone(), v.clone()
        if rotary_cos is not None or not in_call:
            pos = lengths[:, None] + torch.arange(n)      # (batch, n): the new tokens'
        if rotary_cos is not None:
            k = _rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
        if not in_call:
            at = ((block_table.long().gather(1, pos // page), pos % page) if paged
                  else ((torch.arange(batch) if rows is None else rows)[:, None], pos))
            k_cache[at] = k
            v_cache[at] = v
    if rotary_cos is not None:
        # As FlashAttention-2: queries sit at the new tokens' positions when masks place
        # them, else all at cache_seqlens.
        steps = torch.arange(nq) if local else torch.zeros(nq, dtype=torch.long)
        q = _rotary(q, rotary_cos, rotary_sin, lengths[:, None] + steps, rotary_interleaved)
    new = (k, v) if in_call else None
    if batch == 0:          # no sequence to attend with (its new keys, none, are written)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = q.new_zeros(0, nq, q.shape[2], dv), q.new_zeros(0, q.shape[2], nq,
                                                                   dtype=lse_dtype)
        return (out, lse) if return_softmax_lse else out

    # One call over the whole batch: sequence b's keys are cache rows [leftpad, seqlen + n),
    # read in place: from its pages (a varlen call: orchard_ops reads block_table itself), or
    # from its row of the cache (a dense call). A reordered cache is gathered first (a copy).
    if paged:
        starts = [0] + list(itertools.accumulate(s + n for s in seqlens))
        try:
            out, lse = _cache_call(q, k_cache, v_cache, starts, opts, new,
                                   block_table=block_table, leftpad_k=cache_leftpad)
        except ValueError:
            # orchard_ops checks the pages it reads, in its own function's name: a call it
            # refused is checked here too, for this function's message (no cost to the others)
            _check_block_table(fn, block_table, **page_keys)
            raise
    else:
        if not in_place or k_cache.shape[0] != batch:
            slots = slice(0, batch) if in_place else rows
            k_cache, v_cache = k_cache[slots], v_cache[slots]
        out, lse = _read_cache(q, k_cache, v_cache, lengths + n, cache_leftpad, opts, new)
    return (out, lse.contiguous()) if return_softmax_lse else out
