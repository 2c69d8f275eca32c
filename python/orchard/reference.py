"""Float64 NumPy reference of the orchard_ops attention contract, every feature included.

The definition of correctness for the test suite, and a way for users to check orchard's
results: ref_fwd / ref_bwd take the same arguments as flash_attn_fwd / flash_attn_bwd (and
ref_varlen_fwd / ref_varlen_bwd those of the varlen calls) and return float64 arrays. It is
written to be plain rather than fast: everything is computed in float64 on the full (Nq, Nk)
score matrix, and the backward pass is derived by hand with the chain rule (no autograd).

Semantics, per (batch-head, row i, column j), off = Nk - Nq:
    s = scale * q_i . k_j                       (scale defaults to 1/sqrt(D))
    if softcap > 0:  s = softcap * tanh(s / softcap)
    if alibi:        s += -slope * |i + off - j|
    visible iff (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                and (not causal or j <= i + off)
    P = softmax over visible j,  lse_i = log sum_{visible j} exp(s_ij)
    out_i = sum_j P_ij * keep_ij / (1 - p) * v_j
    A row with no visible key: out 0, lse -inf, gradients 0.

Dropout keep decisions come from Philox4x32-10 (Random123), see `ref_dropout_keep`.
"""

import math

import numpy as np

# --------------------------------------------------------------------------------------
# Philox4x32-10 (Random123)
# --------------------------------------------------------------------------------------

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _u32(x):
    return np.asarray(x, dtype=np.uint64) & np.uint64(_MASK32)


def philox4x32(counter4, key2, rounds=10):
    """Philox4x32-R.  counter4: 4 uint32 values/arrays, key2: 2 uint32 values/arrays.

    Vectorised: all words are broadcast against each other.  Arithmetic is done on
    uint64 arrays (products of two 32-bit values fit in 64 bits) and masked to 32 bits.
    Returns a uint32 array of shape broadcast_shape + (4,).
    """
    c = [_u32(x) for x in counter4]
    k = [_u32(x) for x in key2]
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(c[0], c[1], c[2], c[3], k[0], k[1])
    m0 = np.uint64(PHILOX_M0)
    m1 = np.uint64(PHILOX_M1)
    mask = np.uint64(_MASK32)
    shift = np.uint64(32)
    for r in range(rounds):
        if r > 0:  # key bump between rounds
            k0 = (k0 + np.uint64(PHILOX_W0)) & mask
            k1 = (k1 + np.uint64(PHILOX_W1)) & mask
        p0 = m0 * c0  # < 2**64, no overflow
        p1 = m1 * c2
        hi0, lo0 = p0 >> shift, p0 & mask
        hi1, lo1 = p1 >> shift, p1 & mask
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def dropout_threshold(p):
    """uint32(floor(p * 2**32)); a draw `word` is kept iff word >= threshold."""
    return int(math.floor(p * 2.0 ** 32))


def ref_dropout_keep(bh, nq, nk, p, seed):
    """Keep mask (bool) of shape (len(bh), nq, nk) for the given flat batch-head indices.

    counter = (j // 4, i, bh & 0xffffffff, bh >> 32), key = (seed & 0xffffffff, seed >> 32),
    word = philox(counter, key)[j % 4], keep iff word >= uint32(floor(p * 2**32)).
    """
    bh = np.asarray(bh, dtype=np.uint64).reshape(-1)
    seed = int(seed)
    key = (seed & _MASK32, seed >> 32)
    nblk = (nk + 3) // 4
    if bh.size == 0 or nq == 0 or nk == 0:
        return np.zeros((bh.size, nq, nk), dtype=bool)
    blk = np.arange(nblk, dtype=np.uint64)[None, None, :]
    row = np.arange(nq, dtype=np.uint64)[None, :, None]
    bhv = bh[:, None, None]
    words = philox4x32((blk, row, bhv & np.uint64(_MASK32), bhv >> np.uint64(32)), key)
    # words: (nbh, nq, nblk, 4) -> column j = 4 * block + lane
    words = words.reshape(bh.size, nq, nblk * 4)[:, :, :nk]
    return words >= np.uint32(dropout_threshold(p))


def ref_dropout_mask(q_shape, k_shape, p, seed):
    """Dense keep mask, shape q_shape[:-2] + (Nq, Nk); bh = row-major index over q_shape[:-2]."""
    q_shape = tuple(q_shape)
    k_shape = tuple(k_shape)
    batch = q_shape[:-2]
    nq, nk = q_shape[-2], k_shape[-2]
    nbh = int(np.prod(batch, dtype=np.int64))
    keep = ref_dropout_keep(np.arange(nbh), nq, nk, p, seed)
    return keep.reshape(batch + (nq, nk))


# --------------------------------------------------------------------------------------
# Dense attention
# --------------------------------------------------------------------------------------


def visible_mask(nq, nk, causal=False, window=(-1, -1)):
    """Boolean (nq, nk) visibility matrix, bottom-right aligned (off = nk - nq)."""
    left, right = window
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    diag = i + (nk - nq)
    vis = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    if causal:
        vis &= j <= diag
    return vis


def _expand_kv(q, k, v):
    """Broadcast GQA/MQA kv heads (4-D only) to the query heads.  Returns k, v, group."""
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        h, hkv = q.shape[1], k.shape[1]
        assert hkv > 0 and h % hkv == 0, "H % Hkv != 0"
        g = h // hkv
        return np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), g
    return k, v, 1


def _slopes_for(batch, alibi_slopes):
    """alibi slopes (H,) == batch[-1:] or full batch shape -> float64 array of shape batch."""
    s = np.asarray(alibi_slopes, dtype=np.float64)
    assert s.shape in (tuple(batch[-1:]), tuple(batch)), (s.shape, batch)
    return np.broadcast_to(s, tuple(batch))


def _prepare(q, k, v, scale, dropout_p, alibi_slopes, seed, keep):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    assert q.ndim >= 2
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    kx, vx, group = _expand_kv(q, k, v)
    batch = q.shape[:-2]
    nq, nk = q.shape[-2], kx.shape[-2]
    nbh = int(np.prod(batch, dtype=np.int64))
    q3 = q.reshape(nbh, nq, d)
    k3 = kx.reshape(nbh, nk, d)
    v3 = vx.reshape(nbh, nk, v.shape[-1])
    slopes = None
    if alibi_slopes is not None:
        slopes = _slopes_for(batch, alibi_slopes).reshape(nbh)
    mult = None
    if keep is not None:
        keep = np.asarray(keep, dtype=bool).reshape(nbh, nq, nk)
        mult = keep / (1.0 - dropout_p)
    elif dropout_p > 0:
        keep = ref_dropout_keep(np.arange(nbh), nq, nk, dropout_p, seed)
        mult = keep / (1.0 - dropout_p)
    return q, k, v, q3, k3, v3, float(scale), slopes, mult, group


def _scores(q3, k3, scale, causal, window, slopes, softcap):
    """Returns (s, s_raw, vis): final scores (masked entries -inf), raw scaled scores."""
    nq, nk = q3.shape[1], k3.shape[1]
    s_raw = scale * np.einsum("bid,bjd->bij", q3, k3)
    if softcap > 0:
        s = softcap * np.tanh(s_raw / softcap)
    else:
        s = s_raw.copy()
    if slopes is not None:
        dist = np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :])
        s = s - slopes[:, None, None] * dist[None, :, :]
    vis = np.broadcast_to(visible_mask(nq, nk, causal, window), s.shape)
    s = np.where(vis, s, -np.inf)
    return s, s_raw, vis


def _softmax(s, vis):
    """Row softmax over visible entries; rows with none visible give P = 0, lse = -inf."""
    has = vis.any(axis=-1, keepdims=True)
    m = np.where(has, np.max(np.where(vis, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf), 0.0)
    e = np.where(vis, np.exp(np.where(vis, s, 0.0) - m), 0.0)
    l = e.sum(axis=-1, keepdims=True)
    p = np.where(has, e / np.where(has, l, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(has[..., 0], m[..., 0] + np.log(np.where(has, l, 1.0))[..., 0], -np.inf)
    return p, lse


def ref_fwd(q, k, v, scale=None, dropout_p=0.0, causal=False, window=(-1, -1),
            alibi_slopes=None, softcap=0.0, seed=0, keep=None):
    """Reference forward.  Returns (out, lse) in float64.

    out: q.shape[:-1] + (Dv,), lse: q.shape[:-1].  `keep` (bool, q.shape[:-2] + (Nq, Nk))
    overrides the Philox mask (used by the varlen reference).
    """
    q, k, v, q3, k3, v3, scale, slopes, mult, _ = _prepare(
        q, k, v, scale, dropout_p, alibi_slopes, seed, keep)
    s, _, vis = _scores(q3, k3, scale, causal, window, slopes, softcap)
    p, lse = _softmax(s, vis)
    z = p if mult is None else p * mult
    out = np.einsum("bij,bjd->bid", z, v3)
    return out.reshape(q.shape[:-1] + (v.shape[-1],)), lse.reshape(q.shape[:-1])


def ref_bwd(dout, q, k, v, scale=None, dropout_p=0.0, causal=False, window=(-1, -1),
            alibi_slopes=None, softcap=0.0, seed=0, keep=None):
    """Reference backward (analytic).  Returns (dq, dk, dv) in float64, shapes of q, k, v.

    With M = keep / (1 - p) and Z = P * M, out = Z V:
        dV = Z^T dO
        dP = (dO V^T) * M
        dS = P * (dP - rowsum(P * dP))                 softmax Jacobian
        alibi adds a constant: d(s before alibi) = dS
        softcap: d(s_raw) = dS * (1 - tanh(s_raw / softcap)^2)
        dQ = scale * dS_raw K,  dK = scale * dS_raw^T Q
    Masked entries have P = 0, hence dS = 0.  GQA: dK, dV summed over each group's heads.
    """
    q, k, v, q3, k3, v3, scale, slopes, mult, group = _prepare(
        q, k, v, scale, dropout_p, alibi_slopes, seed, keep)
    do3 = np.asarray(dout, dtype=np.float64).reshape(v3.shape[0], q3.shape[1], v3.shape[2])
    s, s_raw, vis = _scores(q3, k3, scale, causal, window, slopes, softcap)
    p, _ = _softmax(s, vis)
    z = p if mult is None else p * mult
    dv3 = np.einsum("bij,bid->bjd", z, do3)
    dz = np.einsum("bid,bjd->bij", do3, v3)
    dp = dz if mult is None else dz * mult
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    if softcap > 0:
        t = np.tanh(s_raw / softcap)
        ds = ds * (1.0 - t * t)
    dq3 = scale * np.einsum("bij,bjd->bid", ds, k3)
    dk3 = scale * np.einsum("bij,bid->bjd", ds, q3)
    dq = dq3.reshape(q.shape)
    if group > 1:
        b, hkv = k.shape[0], k.shape[1]
        dk = dk3.reshape(b, hkv, group, k.shape[2], k.shape[3]).sum(axis=2)
        dv = dv3.reshape(b, hkv, group, v.shape[2], v.shape[3]).sum(axis=2)
    else:
        dk = dk3.reshape(k.shape)
        dv = dv3.reshape(v.shape)
    return dq, dk, dv


# --------------------------------------------------------------------------------------
# Variable length (packed) attention
# --------------------------------------------------------------------------------------


def _varlen_pieces(q, k, v, cu_q, cu_k, alibi_slopes, dropout_p, seed):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    cu_q = [int(x) for x in np.asarray(cu_q).reshape(-1)]
    cu_k = [int(x) for x in np.asarray(cu_k).reshape(-1)]
    assert len(cu_q) == len(cu_k) and cu_q[0] == 0 and cu_k[0] == 0
    assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    h = q.shape[1]
    nb = len(cu_q) - 1
    slopes = None
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)
        assert slopes.shape in ((h,), (nb, h)), slopes.shape
        slopes = np.broadcast_to(slopes, (nb, h))
    for b in range(nb):
        sq, eq, sk, ek = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        qb = q[sq:eq].transpose(1, 0, 2)[None]  # (1, H, nq, D)
        kb = k[sk:ek].transpose(1, 0, 2)[None]
        vb = v[sk:ek].transpose(1, 0, 2)[None]
        keep = None
        if dropout_p > 0:
            keep = ref_dropout_keep(b * h + np.arange(h), eq - sq, ek - sk, dropout_p, seed)[None]
        sl = None if slopes is None else slopes[b]
        yield (sq, eq, sk, ek), qb, kb, vb, keep, sl


def ref_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, dropout_p=0.0, causal=False,
                   window=(-1, -1), alibi_slopes=None, softcap=0.0, seed=0):
    """Packed reference: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv).

    Returns out (total_q, H, Dv) and lse (H, total_q) in float64.  Dropout is keyed by
    bh = b * H + h with local row/column indices.
    """
    q = np.asarray(q, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for (sq, eq, _, _), qb, kb, vb, keep, sl in _varlen_pieces(
            q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_p, seed):
        o, l = ref_fwd(qb, kb, vb, scale, dropout_p, causal, window, sl, softcap, seed, keep=keep)
        out[sq:eq] = o[0].transpose(1, 0, 2)
        lse[:, sq:eq] = l[0]
    return out, lse


def ref_varlen_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, dropout_p=0.0,
                   causal=False, window=(-1, -1), alibi_slopes=None, softcap=0.0, seed=0):
    """Packed reference backward.  Returns (dq, dk, dv) in float64 with the shapes of q, k, v."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    dout = np.asarray(dout, dtype=np.float64)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    for (sq, eq, sk, ek), qb, kb, vb, keep, sl in _varlen_pieces(
            q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_p, seed):
        dob = dout[sq:eq].transpose(1, 0, 2)[None]
        a, b_, c = ref_bwd(dob, qb, kb, vb, scale, dropout_p, causal, window, sl, softcap, seed,
                           keep=keep)
        dq[sq:eq] = a[0].transpose(1, 0, 2)
        dk[sk:ek] = b_[0].transpose(1, 0, 2)
        dv[sk:ek] = c[0].transpose(1, 0, 2)
    return dq, dk, dv
