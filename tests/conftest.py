"""Shared fixtures and helpers for the orchard_ops test suite.

* `ops`     : the imported orchard_ops module (tests skip when it is not built).
* `device`  : parametrised over [d["id"] for d in orchard_ops.devices()]; every numerical
              test takes it, so OpenCL devices are covered as soon as they are listed.
* `rng`     : a numpy Generator seeded from the test's node id (reproducible per test).
* helpers   : randn(), assert_close() with dtype-dependent tolerances, subprocess helpers.
"""

import os
import signal
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# The tests send Ctrl-C (SIGINT) to runs in this process and in children, and orchard's
# scripts keep a Ctrl-C the process started ignoring ignored: a suite started so (a script's
# background job, nohup) would see none of them stop. Python's own handler, as under a
# terminal (a child then starts with the signal's default action).
signal.signal(signal.SIGINT, signal.default_int_handler)

# tests/ for `from conftest import ...` in child processes; the repo root and python/
# for an in-place build (`python setup.py build_ext --inplace` writes orchard_ops*.so into
# python/, the package dir).  Without an in-place build the import falls through to
# site-packages.
for _p in (REPO_ROOT, os.path.join(REPO_ROOT, "python"), TESTS_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

try:
    import orchard_ops as _ops  # noqa: E402
    _IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the build state
    _ops = None
    _IMPORT_ERROR = repr(exc)


def _device_ids():
    if _ops is None:
        return [pytest.param("cpu", marks=pytest.mark.skip(
            reason="orchard_ops not importable: %s" % _IMPORT_ERROR))]
    try:
        return [d["id"] for d in _ops.devices()]
    except Exception as exc:  # pragma: no cover
        return [pytest.param("cpu", marks=pytest.mark.skip(reason="devices() failed: %r" % exc))]


DEVICE_IDS = _device_ids()
OPENCL_IDS = [d for d in DEVICE_IDS if isinstance(d, str) and d.startswith("opencl:")]
# OpenCL devices on the CPU (PoCL): where a work-group's private memory is a thread's stack
CPU_OPENCL_IDS = [d["id"] for d in (_ops.devices() if OPENCL_IDS else ())
                  if d["id"] in OPENCL_IDS and d["kind"] == "cpu"]

# Backwards whose few kv units (fewer than orchard.h OR_BWD_ITEMS, 16) split their keys in parts
# of at least OR_BWD_PART_KEYS (1024), rounded up to whole blocks (test_isa.py on the native
# path, test_opencl.py on the tiled family): (b, h, hkv, nq, nk, d), features
BACKWARD_PARTS = {
    "one unit": ((1, 1, 1, 300, 2100, 64), {}),                         # 2 parts
    "causal mqa": ((1, 4, 1, 700, 3100, 64), dict(causal=True)),        # 3 parts
    "window": ((1, 2, 2, 500, 3100, 64), dict(window=(300, 10))),       # part 0 seen by no row
    "more queries": ((1, 1, 1, 2600, 2100, 64), dict(causal=True)),     # rows that see no key
    "chunks in parts": ((1, 1, 1, 200, 2100, 256), dict(causal=True)),  # native: 768-key chunks
    "dropout softcap alibi": ((2, 2, 1, 150, 2100, 48),
                              dict(dropout_p=0.2, seed=3, softcap=4.0,
                                   alibi_slopes=np.array([0.5, 0.25]))),
}

# ORCHARD_FAULT, ORCHARD_AUTO_ANY_OPENCL and ORCHARD_CL_TRANSFERS take effect only in a build
# made with ORCHARD_TEST_HOOKS=1 (setup.py); the tests that set them skip elsewhere.
TEST_HOOKS = _ops is not None and _ops.build_info()["test_hooks"]
needs_test_hooks = pytest.mark.skipif(
    not TEST_HOOKS, reason="orchard_ops was built without ORCHARD_TEST_HOOKS=1 (setup.py), "
                           "so its test switches (ORCHARD_FAULT, ...) are compiled out")


@pytest.fixture(scope="session")
def ops():
    if _ops is None:
        pytest.skip("orchard_ops not importable: %s" % _IMPORT_ERROR)
    return _ops


@pytest.fixture(params=DEVICE_IDS)
def device(request):
    if _ops is None:
        pytest.skip("orchard_ops not importable")
    return request.param


@pytest.fixture
def rng(request):
    """A Generator seeded from the test id, so every test is reproducible on its own."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def make_rng(seed):
    return np.random.default_rng(seed)


def aligned_empty(shape, dtype, align=4096):
    """An uninitialised array whose memory starts on an `align`-byte boundary. Devices that
    share host memory use a buffer in place only when it is aligned as they require
    (CL_DEVICE_MEM_BASE_ADDR_ALIGN, e.g. 128 bytes on PoCL); NumPy only promises 16."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def randn(rng, shape, dtype=np.float64, amp=1.0):
    """Standard normal data (times amp) drawn in float64, then cast to dtype; page-aligned, so
    zero-copy expectations hold on every device."""
    out = aligned_empty(shape, dtype)
    out[...] = (amp * rng.standard_normal(shape)).astype(dtype)
    return out


def rounded(x):
    """float64 copy of an array as it is stored (so float16 inputs are compared with the
    reference evaluated on the float16-rounded values)."""
    return np.asarray(x).astype(np.float64)


# ----------------------------------------------------------------------------- tolerances
#
# The reference is float64.  Comparisons use |got - ref| <= t * (mag + |ref|), i.e.
# numpy's assert_allclose with rtol = t and atol = t * mag, where mag = max|ref| of the
# compared array (the output magnitude).
#
# float64: the kernels do the same arithmetic as the reference in another order (online
#   softmax, blocked sums); the differences are a few ulps times the length of the sums,
#   ~1e-14 relative.  t = 1e-10 leaves a large margin and still catches any real bug.
#
# float32: unit roundoff 2**-24 ~ 6e-8.  Dot products over D <= 256 and sums over
#   N <= a few hundred keys accumulate ~sqrt(D + N) * 6e-8 relative to the magnitude of the
#   terms, exp() of scores of size ~10 amplifies an absolute score error by ~|s|.  A
#   float32 emulation of the FlashAttention algorithm over random shapes (D up to 256,
#   N < 80, inputs up to 3 sigma) gave at most 1.8e-6 in this metric for out, dq, dk, dv
#   and 1.4e-7 for lse, so t = 1e-5 ("1e-5 scaled by the output magnitude") has a >5x margin.
#
# float16 (computed and accumulated in float32): the reference is evaluated on the
#   float16-rounded inputs, so input rounding is not an error.  Rounding the *output* to
#   float16 gives a relative error up to 2**-11 ~ 4.9e-4, plus the float32 accumulation
#   error above (negligible): t = 2e-3 for out.  The backward receives the float16-rounded
#   `out`, and D_i = rowsum(dO_i * O_i) computed from it carries an error of
#   2**-11 * |dO||O| that does not cancel in dS = P (dP - D), while dq/dk themselves may be
#   small through cancellation; the float32 emulation measured up to 1.1e-3 for dq/dk, so
#   gradients use t = 4e-3.  lse is float32 output even for float16 input: t = 2e-5.
TOLERANCES = {
    # dtype: {kind: t}
    np.dtype(np.float64): {"out": 1e-10, "lse": 1e-10, "grad": 1e-10},
    np.dtype(np.float32): {"out": 1e-5, "lse": 1e-5, "grad": 1e-5},
    np.dtype(np.float16): {"out": 2e-3, "lse": 2e-5, "grad": 4e-3},
}


def native(dtype):
    """The native-byte-order version of a dtype ('>f4' -> float32)."""
    return np.dtype(dtype).newbyteorder("=")


def tolerance(dtype, kind="out"):
    return TOLERANCES[native(dtype)][kind]


def grad_floor(dout, out, q, k, scale=None, ratio=1.0):
    """Magnitude floor for comparing dq/dk/dv.

    The backward gets `out` rounded to the working dtype and forms D_i = sum_c dO_ic O_ic
    from it; its error (relative 2**-11 for float16, 2**-24 for float32, of
    sum_c |dO_ic O_ic|) does not cancel in dS = P (dP - D), while the exact gradient can
    cancel to 0 (e.g. a row with a single visible key: dq = 0 exactly in the reference).
    dq_i = scale sum_j dS_ij k_j, so its error is bounded by scale * max|D-terms| * max|k|;
    dk_j sums over up to Nq/Nk rows per key (`ratio`).  The comparison then uses
    atol = t * max(max|ref|, floor).  A float16 `out` below 2**-14 is subnormal: its rounding
    error is absolute, up to 2**-25 = 2**-11 * 2**-14, so it counts as 2**-14 there (an out of
    3e-8 rounds to 0, and the D it gives is off by dO * 3e-8).
    """
    dout = np.asarray(dout, dtype=np.float64)
    subnormal = native(np.asarray(out).dtype) == np.float16
    out = np.asarray(out, dtype=np.float64)
    if subnormal:
        out = np.maximum(np.abs(out), 2.0 ** -14)
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if dout.size == 0 or q.size == 0 or k.size == 0:
        return 0.0
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    dabs = float(np.max(np.sum(np.abs(dout * out), axis=-1)))
    return float(scale) * dabs * max(float(np.max(np.abs(q))), float(np.max(np.abs(k)))) * max(
        1.0, float(ratio))


def score_cond(q, k, scale=None, alibi_slopes=None):
    """Magnitude of the score computation: an upper bound of scale * sum_d |q_id k_jd|
    (Cauchy-Schwarz: max ||q_i|| * max ||k_j||) plus the largest ALiBi bias.

    A score computed in working precision u carries an absolute error ~ u * cond, and
    exp() turns it into a relative error of P (hence of out, lse and the gradients) of the
    same size.  With the default scale and unit-variance data cond is ~ sqrt(D) <= 16 and
    the fixed tolerances above apply; with scale = 1, D = 256 and 3-sigma data it is ~1500
    and float32 legitimately loses ~1e-4.  assert_close uses t = max(t, 8 * u * cond).
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.size == 0 or k.size == 0:
        return 0.0
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    c = abs(float(scale)) * float(np.sqrt(np.max(np.sum(q * q, -1)))) * float(
        np.sqrt(np.max(np.sum(k * k, -1))))
    if alibi_slopes is not None:
        c += float(np.max(np.abs(np.asarray(alibi_slopes, np.float64)))) * (
            q.shape[-2] + k.shape[-2])
    return c


def unit_roundoff(dtype):
    """Working precision: float16 is computed in float32."""
    return 2.0 ** -53 if native(dtype) == np.float64 else 2.0 ** -24


def assert_close(got, ref, dtype, kind="out", what="", t=None, floor=0.0, cond=0.0):
    """Compare an orchard result with the float64 reference, tolerance chosen by dtype/kind.

    atol = t * max(max|ref|, floor) (see grad_floor for gradients), and
    t = max(t, 8 * u * cond) for badly scaled scores (see score_cond).
    -inf entries (lse of rows without visible keys) must match exactly; NaN is never allowed.
    """
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, "%s: shape %s, expected %s" % (what, got.shape, ref.shape)
    g = got.astype(np.float64)
    assert not np.isnan(g).any(), "%s: NaN in result" % what
    ginf, rinf = np.isinf(g), np.isinf(ref)
    if ginf.any() or rinf.any():
        bad = (ginf != rinf) | (ginf & rinf & (np.sign(g) != np.sign(ref)))
        assert not bad.any(), "%s: inf pattern differs at %s (got %s, expected %s)" % (
            what, np.argwhere(bad)[:5].tolist(), g[bad][:5], ref[bad][:5])
        g = np.where(rinf, 0.0, g)
        ref = np.where(rinf, 0.0, ref)
    if t is None:
        t = tolerance(dtype, kind)
    t = max(t, 8.0 * unit_roundoff(dtype) * cond)
    mag = max(float(np.max(np.abs(ref))) if ref.size else 0.0, floor)
    # float16 outputs below 2**-14 are subnormal with a fixed spacing of 2**-24: allow one.
    tiny = 2.0 ** -24 if native(got.dtype) == np.float16 else 1e-300
    np.testing.assert_allclose(g, ref, rtol=t, atol=t * mag + tiny, err_msg=what)


def lse_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# ----------------------------------------------------------------------------- subprocesses


def subprocess_env(**extra):
    """Environment for a child python that can import orchard_ops, orchard and reference."""
    env = dict(os.environ)
    paths = [TESTS_DIR, os.path.join(REPO_ROOT, "python"), REPO_ROOT]
    if _ops is not None and getattr(_ops, "__file__", None):
        paths.insert(0, os.path.dirname(os.path.abspath(_ops.__file__)))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for key, val in extra.items():
        if val is None:
            env.pop(key, None)
        else:
            env[key] = str(val)
    return env


def run_python(code, timeout=120, **env):
    """Run `code` in a fresh interpreter; returns the CompletedProcess (text mode)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(**env), cwd=TESTS_DIR)


# ----------------------------------------------------------------------------- checks


def check_forward(ops, device, q, k, v, what="", **kw):
    """Run orchard's forward, check dtype/shape/no-NaN and compare with ref_fwd (float64 on
    the values as stored).  Returns (out, lse) of orchard."""
    from orchard.reference import ref_fwd
    qa, ka, va = np.asarray(q), np.asarray(k), np.asarray(v)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    out, lse = np.asarray(out), np.asarray(lse)
    dt = native(qa.dtype)
    assert out.dtype == dt, "%s: out dtype %s, expected %s" % (what, out.dtype, dt)
    assert lse.dtype == lse_dtype(dt), "%s: lse dtype %s" % (what, lse.dtype)
    assert out.shape == qa.shape[:-1] + (va.shape[-1],), "%s: out shape %s" % (what, out.shape)
    assert lse.shape == qa.shape[:-1], "%s: lse shape %s" % (what, lse.shape)
    ro, rl = ref_fwd(rounded(qa), rounded(ka), rounded(va), **kw)
    cond = score_cond(qa, ka, kw.get("scale"), kw.get("alibi_slopes"))
    assert_close(out, ro, dt, "out", what + " out", cond=cond)
    assert_close(lse, rl, dt, "lse", what + " lse", cond=cond)
    return out, lse


def check_backward(ops, device, q, k, v, dout, what="", **kw):
    """Run orchard's forward + backward and compare the gradients with ref_bwd."""
    from orchard.reference import ref_bwd
    qa, ka, va = np.asarray(q), np.asarray(k), np.asarray(v)
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    dq, dk, dv = (np.asarray(g) for g in ops.flash_attn_bwd(dout, q, k, v, out, lse,
                                                            device=device, **kw))
    rq, rk, rv = ref_bwd(rounded(dout), rounded(qa), rounded(ka), rounded(va), **kw)
    floor = grad_floor(dout, out, qa, ka, kw.get("scale"), qa.shape[-2] / max(ka.shape[-2], 1))
    cond = score_cond(qa, ka, kw.get("scale"), kw.get("alibi_slopes"))
    for name, g, r, x in (("dq", dq, rq, qa), ("dk", dk, rk, ka), ("dv", dv, rv, va)):
        assert g.dtype == native(x.dtype), "%s: %s dtype %s, expected %s" % (
            what, name, g.dtype, x.dtype)
        assert g.shape == x.shape, "%s: %s shape %s, expected %s" % (what, name, g.shape, x.shape)
        assert_close(g, r, x.dtype, "grad", "%s %s" % (what, name), floor=floor, cond=cond)
    return dq, dk, dv


def check_varlen_backward_in_parts(ops, device, rng, dtype, what=""):
    """A causal varlen backward whose longest sequence's keys go in parts (BACKWARD_PARTS), its
    others with fewer keys than the parts cover, one with no keys, one with no queries, against
    the float64 reference; dtype "float32" or "bfloat16" (torch tensors)."""
    torch = pytest.importorskip("torch")
    from orchard.reference import ref_varlen_bwd
    lq, lk, h, d = [300, 5, 0, 40], [2500, 0, 700, 1100], 2, 64
    cq, ck = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32)
              for n in (lq, lk))
    q, do = (torch.from_numpy(randn(rng, (sum(lq), h, d), np.float32)) for _ in range(2))
    k, v = (torch.from_numpy(randn(rng, (sum(lk), 1, d), np.float32)) for _ in range(2))
    q, k, v, do = (x.to(getattr(torch, dtype)) for x in (q, k, v, do))
    out, lse = ops.flash_attn_varlen_fwd(q, k, v, cq, ck, causal=True, device=device)
    grads = ops.flash_attn_varlen_bwd(do, q, k, v, out, lse, cq, ck, causal=True, device=device)
    wide = [x.double().numpy() for x in (do, q, k, v)]
    refs = ref_varlen_bwd(*wide, cq.numpy(), ck.numpy(), causal=True)
    floor = grad_floor(wide[0], torch.as_tensor(out).double().numpy(), wide[1], wide[2], None,
                       300 / 2500)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(torch.as_tensor(g).double().numpy(), r, np.float32, "grad",
                     "%s %s" % (what, name), t=2.0 ** -6 if dtype == "bfloat16" else None,
                     floor=floor)
