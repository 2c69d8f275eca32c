"""The native kernel sets (csrc/isa_*.c): every set this CPU runs, forced in turn, against the
float64 reference; how a set is chosen (widest at import, ORCHARD_ISA, set_native_isa)."""

import numpy as np
import pytest

from conftest import (BACKWARD_PARTS, assert_close, check_backward, check_forward,
                      check_varlen_backward_in_parts, grad_floor, randn, run_python, score_cond)
from orchard.reference import ref_bwd, ref_fwd

try:
    import orchard_ops
    ISAS = orchard_ops.devices()[0]["kernel_isas"]
except ImportError:     # conftest's ops fixture skips every test then
    ISAS = ()


@pytest.fixture(params=ISAS)
def isa(ops, request):
    before = ops.devices()[0]["kernel_isa"]
    ops.set_native_isa(request.param)
    yield request.param
    ops.set_native_isa(before)


def qkv(rng, dtype, h=4, hkv=None, nq=130, nk=200, d=64, dv=None):
    return (randn(rng, (2, h, nq, d), dtype), randn(rng, (2, hkv or h, nk, d), dtype),
            randn(rng, (2, hkv or h, nk, dv or d), dtype))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("d,dv", [(64, 64), (80, 48), (128, 128), (7, 200)])
def test_forward(ops, isa, rng, dtype, d, dv):
    assert ops.devices()[0]["kernel_isa"] == isa
    check_forward(ops, "cpu", *qkv(rng, dtype, d=d, dv=dv), what=isa)


FEATURES = {
    "causal": dict(causal=True),
    "window": dict(window=(40, 3)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625])),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_score_features(ops, isa, rng, feature):
    q, k, v = qkv(rng, np.float32, hkv=2)
    check_forward(ops, "cpu", q, k, v, what="%s %s" % (isa, feature), **FEATURES[feature])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_backward(ops, isa, rng, dtype, causal):
    q, k, v = qkv(rng, dtype, hkv=2, nq=150, nk=130, d=72)
    check_backward(ops, "cpu", q, k, v, randn(rng, q.shape, dtype), what=isa, causal=causal)


CHUNKED = {    # (h, hkv, nq, nk), features: at D 256 a chunk is 768 keys of float (384 of
    # double: native.h OR_BWD_CHUNK_BYTES), so 1700 keys take 3 (5)
    "causal gqa": ((2, 1, 200, 1700), dict(causal=True)),
    "window": ((1, 1, 400, 1700), dict(window=(500, 20))),     # the first chunk seen by no row
    "more queries": ((1, 1, 1000, 800), dict(causal=True)),    # rows that see no key
    "dropout softcap alibi": ((2, 2, 150, 1700), dict(dropout_p=0.2, seed=3, softcap=4.0,
                                                      alibi_slopes=np.array([0.5, 0.25]))),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("case", sorted(CHUNKED))
def test_backward_in_chunks_of_keys(ops, isa, rng, dtype, case):
    """The backward goes through a unit's keys in chunks (native.h OR_BWD_CHUNK_BYTES), dQ kept
    between them: keys split across chunks, query blocks that a chunk's keys are masked from."""
    (h, hkv, nq, nk), kw = CHUNKED[case]
    q, k, v = qkv(rng, dtype, h=h, hkv=hkv, nq=nq, nk=nk, d=256)
    check_backward(ops, "cpu", q, k, v, randn(rng, q.shape, dtype), what="%s %s" % (isa, case),
                   **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("case", sorted(BACKWARD_PARTS))
def test_backward_in_parts_of_keys(ops, isa, rng, dtype, case):
    """A backward of few kv units gives each part of a unit's keys to a work item, its dQ in a
    buffer of its own, the parts' added after (attn_native.c): keys split across parts, parts
    that some query blocks, or every one, cannot see."""
    (b, h, hkv, nq, nk, d), kw = BACKWARD_PARTS[case]
    q, k, v = (randn(rng, (b, h, nq, d), dtype), randn(rng, (b, hkv, nk, d), dtype),
               randn(rng, (b, hkv, nk, d), dtype))
    check_backward(ops, "cpu", q, k, v, randn(rng, q.shape, dtype), what="%s %s" % (isa, case),
                   **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_varlen_backward_in_parts_of_keys(ops, isa, rng, dtype):
    """Sequences of a varlen batch with fewer parts than the longest (the part count is the
    longest's), one with no keys, one with no queries, against the float64 reference."""
    check_varlen_backward_in_parts(ops, "cpu", rng, dtype, isa)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=str)
def test_decode(ops, isa, rng, dtype):
    calls = lambda: ops.stats()["per_device"].get("cpu", {}).get("decode_calls", 0)  # noqa: E731
    before = calls()
    check_forward(ops, "cpu", *qkv(rng, dtype, h=8, hkv=2, nq=1, nk=3000, d=128), what=isa)
    assert calls() == before + 1


@pytest.mark.parametrize("d,dv", [(128, 128), (80, 48), (7, 200), (96, 33)])
@pytest.mark.parametrize("h,hkv,nq", [(8, 2, 1), (8, 2, 3), (4, 4, 1), (6, 2, 2)])
def test_decode_bfloat16(ops, isa, rng, d, dv, h, hkv, nq):
    """bfloat16 caches are widened a pair of vectors at a time, out of order, or on avx512bf16
    multiplied as pairs by bfloat16 dot products (attn_decode_impl.h, attn_decode_bf16_impl.h):
    head dims inside and across those blocks, 1 to 12 rows per GQA group. The result is the
    float64 one rounded to bfloat16 (on avx512bf16 also P: each element then within 2^-8 of
    sum_j p_j |v_j|, the output of the same attention over |v|), and lse (float32) as close as a
    float32 call's."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16)
               for x in qkv(rng, np.float32, h=h, hkv=hkv, nq=nq, nk=700, d=d, dv=dv))
    before = ops.stats()["per_device"].get("cpu", {}).get("decode_calls", 0)
    out, lse = ops.flash_attn_fwd(q, k, v, causal=True)
    assert ops.stats()["per_device"]["cpu"]["decode_calls"] == before + 1
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))
    ref, ref_lse = ref_fwd(q64, k64, v64, causal=True)
    got = torch.as_tensor(out).float().numpy()
    p_rounding = 2.0 ** -8 * ref_fwd(q64, k64, np.abs(v64), causal=True)[0]
    atol = p_rounding if isa == "avx512bf16" else 1e-5 * np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= 2.0 ** -8 * np.abs(ref) + atol), isa
    assert_close(np.asarray(lse), ref_lse, np.float32, "lse", isa)


@pytest.mark.parametrize("nq", [8, 9, 16])
def test_bfloat16_decode_rows(ops, isa, rng, nq):
    """bfloat16 steps of 9 to 16 query rows a unit go to the forward on the amx set (its tiles
    are faster there: isa_amx.c DECODE_BF16_ROWS), to the split-KV decode on the others, as do
    8 rows everywhere; stats() counts only the split-KV ones, and both agree with the float64
    reference to the rounding of P (2^-8 of max|v|)."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16)
               for x in qkv(rng, np.float32, h=8, hkv=2, nq=nq, nk=1100, d=128))
    before = ops.stats()["per_device"].get("cpu", {}).get("decode_calls", 0)
    out, lse = ops.flash_attn_fwd(q, k, v, causal=True)
    decoded = ops.stats()["per_device"]["cpu"].get("decode_calls", 0) - before
    assert decoded == (0 if isa == "amx" and nq > 8 else 1), isa
    q64, k64, v64 = (x.double().numpy() for x in (q, k, v))
    ref, ref_lse = ref_fwd(q64, k64, v64, causal=True)
    np.testing.assert_allclose(torch.as_tensor(out).double().numpy(), ref, rtol=2.0 ** -8,
                               atol=2.0 ** -8 * np.abs(v64).max(), err_msg=isa)
    assert_close(np.asarray(lse), ref_lse, np.float32, "lse", isa)


BF16_CASES = {     # (h, hkv, nq, nk, d, dv), features
    "plain": ((4, 4, 130, 200, 64, 64), {}),
    "causal gqa": ((4, 2, 130, 200, 64, 64), dict(causal=True)),
    "odd d, wide dv": ((2, 2, 77, 301, 7, 200), {}),
    "odd keys causal": ((2, 1, 300, 301, 80, 48), dict(causal=True)),
    "window from odd keys": ((2, 2, 150, 151, 33, 33), dict(window=(40, 3))),
    "softcap": ((2, 2, 150, 151, 128, 128), dict(softcap=5.0)),
    "alibi": ((2, 2, 100, 100, 64, 64), dict(alibi_slopes=np.array([0.5, 0.25]), causal=True)),
    "dropout": ((2, 2, 100, 129, 64, 64), dict(dropout_p=0.3, seed=5)),
    "three query rows": ((2, 2, 3, 200, 64, 64), dict(causal=True)),   # a pair padded
    "head dim 256": ((2, 1, 100, 260, 256, 256), dict(causal=True)),   # amx: 8 tiles along d
    "keys in chunks": ((1, 1, 200, 1700, 256, 256), dict(window=(900, 0))),  # widened: 3 chunks
}


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bfloat16(ops, isa, rng, case):
    """bfloat16 q, k, v and dO (avx512bf16: the matrix products on bfloat16 dot products, P and
    dS rounded to bfloat16, attn_bf16_impl.h; amx: those of a row-major left operand on AMX
    tiles, attn_amx_impl.h, with rows and words past whole tiles on the dot products). out is the float64 result on the stored inputs to
    the rounding of out and of P (2^-9 of |out| and of max|v| at most), lse as a float32 call's;
    the gradients within 2^-6 of their magnitude (the widening path's, here: up to 3.4e-3; the
    dot products': up to 4.9e-3; a key or a pair lost is an error of order 1)."""
    torch = pytest.importorskip("torch")
    (h, hkv, nq, nk, d, dv), kw = BF16_CASES[case]
    q, k, v, dout = (torch.from_numpy(x).to(torch.bfloat16)
                     for x in qkv(rng, np.float32, h=h, hkv=hkv, nq=nq, nk=nk, d=d, dv=dv)
                     + (randn(rng, (2, h, nq, dv), np.float32),))
    out, lse = ops.flash_attn_fwd(q, k, v, **kw)
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    ref, ref_lse = ref_fwd(q64, k64, v64, **kw)
    got = torch.as_tensor(out).double().numpy()
    np.testing.assert_allclose(got, ref, rtol=2.0 ** -8, atol=2.0 ** -8 * np.abs(v64).max(),
                               err_msg=isa)
    cond = score_cond(q64, k64, None, kw.get("alibi_slopes"))
    assert_close(np.asarray(lse), ref_lse, np.float32, "lse", isa, cond=cond)
    grads = ops.flash_attn_bwd(dout, q, k, v, out, lse, **kw)
    floor = grad_floor(do64, got, q64, k64, None, nq / nk)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_bwd(do64, q64, k64, v64, **kw)):
        assert g.dtype == torch.bfloat16, name
        assert_close(torch.as_tensor(g).double().numpy(), r, np.float32, "grad",
                     "%s %s" % (isa, name), t=2.0 ** -6, floor=floor)


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_float16_forward(ops, isa, rng, case):
    """float16 q, k, v through the same edges (amx: each value split into two bfloat16 for the
    tiles, the four products, P split too: attn_f16_split_impl.h; the others widen),
    against the float64 reference at float16's tolerances, and within a float16 rounding of
    out and 2^-14 of lse of the widening set's result."""
    (h, hkv, nq, nk, d, dv), kw = BF16_CASES[case]
    q, k, v = qkv(rng, np.float16, h=h, hkv=hkv, nq=nq, nk=nk, d=d, dv=dv)
    out, lse = check_forward(ops, "cpu", q, k, v, what=isa, **kw)
    ops.set_native_isa("baseline")
    wide_out, wide_lse = (np.asarray(x) for x in ops.flash_attn_fwd(q, k, v, **kw))
    np.testing.assert_allclose(out.astype(np.float64), wide_out.astype(np.float64),
                               rtol=2.0 ** -10, atol=2.0 ** -14, err_msg=isa)
    np.testing.assert_allclose(lse, wide_lse, rtol=2.0 ** -14, atol=2.0 ** -14, err_msg=isa)


def test_float16_scores_whose_products_cancel(ops, isa):
    """Keys whose products with q cancel, where the split's lo x lo products do not (each
    +-2^-16 of its product): amx had left those out, an error growing with sum |q_d k_d| that put
    out at 3.9x float16's tolerance here; the four products are each exact in float."""
    d, a, c = 256, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8     # in float16; bfloat16 lo +-2^-8
    q = np.full((1, 1, 32, d), a, np.float16)           # 32 rows: the tiles' path
    k = np.empty((1, 1, 56, d), np.float16)
    k[..., :55, 0::2], k[..., :55, 1::2] = a, -c
    k[..., 55:, 0::2], k[..., 55:, 1::2] = -a, c
    v = np.zeros((1, 1, 56, 2), np.float16)
    v[..., :55, 0], v[..., 55:, 0], v[..., 1] = 1, -1, 1
    check_forward(ops, "cpu", q, k, v, what=isa, scale=2.0)


@pytest.mark.parametrize("top", [0.0, 60.0])
def test_probabilities_across_the_exps_range(ops, isa, top):
    """P read straight from the forward (one query of 1, keys of one score each, values the
    identity: out = softmax of the scores) over score gaps from 0 to 90, below a maximum of 0
    and of 60: every set's exp (csrc/native_kernels.h or_exp16 where there is AVX-512,
    kernels/expf.h elsewhere) and the normalisation within 5e-7 (8 ulps; measured at most
    2e-7) of float64 on the gaps as float32 rounds them, where e^-gap is a normal float, and 0
    or below float's normal range past it. Dropping the highest term of or_exp16's polynomial
    fails it."""
    n = 256
    scores = np.concatenate([[top], top - np.linspace(0, 90, n - 1)]).astype(np.float32)
    q = np.ones((1, 1, 1, 1), np.float32)
    k = scores.reshape(1, 1, n, 1)
    v = np.eye(n, dtype=np.float32).reshape(1, 1, n, n)
    got = ops.flash_attn_fwd(q, k, v, scale=1.0)[0].reshape(n).astype(np.float64)
    gaps = -(scores - np.float32(top)).astype(np.float64)    # rounded to float32, as the kernels'
    e = np.exp(-gaps)
    ref = e / e.sum()
    normal = gaps < 87
    np.testing.assert_allclose(got[normal], ref[normal], rtol=5e-7, atol=0, err_msg=isa)
    assert np.all((got[~normal] >= 0) & (got[~normal] < 1.2e-38)), (isa, got[~normal])


@pytest.mark.parametrize("first", [180, 179], ids=["even", "odd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_keys_no_row_sees_are_never_read(ops, isa, rng, dtype, first):
    """Keys before the first that a window lets any row see may hold NaN and inf, in every set
    and dtype: forward and backward give what they give with ordinary numbers there, and those
    keys get zero gradients. The sets that multiply pairs of keys (bfloat16 dot products and
    tiles, float16 split for tiles) start a pair at an even key, so an odd first key shares
    its pair with a key no row sees (its P of 0 times a NaN was NaN in every row)."""
    torch = pytest.importorskip("torch")
    q, k, v, do = (torch.from_numpy(x).to(getattr(torch, dtype))
                   for x in qkv(rng, np.float32, h=2, nq=100, nk=300, d=64)
                   + (randn(rng, (2, 2, 100, 64), np.float32),))
    kw = dict(window=(300 - 100 - first, 0), causal=True)
    results = []
    for poison in (False, True):
        kp, vp = k.clone(), v.clone()
        if poison:
            kp[..., :first, :], vp[..., :first, :] = float("nan"), float("inf")
        out, lse = ops.flash_attn_fwd(q, kp, vp, **kw)
        results.append((out, lse) + tuple(ops.flash_attn_bwd(do, q, kp, vp, out, lse, **kw)))
    for name, clean, poisoned in zip(("out", "lse", "dq", "dk", "dv"), *results):
        clean, poisoned = (torch.as_tensor(x) for x in (clean, poisoned))
        if name in ("dk", "dv"):
            assert not poisoned[..., :first, :].any(), (isa, name)
            clean, poisoned = clean[..., first:, :], poisoned[..., first:, :]
        assert torch.equal(clean, poisoned), (isa, name)


def test_sets_agree(ops, rng):
    """The sets sum in different orders, so they agree to rounding, not bit for bit."""
    q, k, v = qkv(rng, np.float32)
    before = ops.devices()[0]["kernel_isa"]
    outs = {}
    try:
        for name in ISAS:
            ops.set_native_isa(name)
            outs[name] = ops.flash_attn_fwd(q, k, v, causal=True)[0]
    finally:
        ops.set_native_isa(before)
    for name, out in outs.items():
        np.testing.assert_allclose(out, outs[ISAS[0]], rtol=0, atol=2e-6, err_msg=name)


def test_widest_set_is_chosen_at_import(ops):
    """bfloat16 dot products only where they are as fast as float FMAs (AMD's CPUs) or where
    AMX tiles take the products (native_isa.c): the widest set otherwise."""
    info = run_python("import orchard_ops; print(orchard_ops.devices()[0]['kernel_isa'])",
                      ORCHARD_ISA=None)
    amd = ops.devices()[0]["vendor"] == "AuthenticAMD"
    widest = ISAS[-2] if ISAS[-1] == "avx512bf16" and not amd else ISAS[-1]
    assert info.stdout.strip() == widest, info.stderr
    assert ISAS[0] == "baseline"


@pytest.mark.parametrize("name", ISAS)
def test_orchard_isa_environment_variable(ops, name):
    info = run_python("import orchard_ops; print(orchard_ops.devices()[0]['kernel_isa'])",
                      ORCHARD_ISA=name)
    assert info.stdout.strip() == name, info.stderr


def test_bad_isa_names(ops):
    # import succeeds; devices() and every call that takes a device name the variable, until
    # set_native_isa() chooses a set
    info = run_python("""
import numpy as np, orchard_ops
q = np.ones((1, 2, 3, 8), np.float32)
for call in (orchard_ops.devices, lambda: orchard_ops.flash_attn_fwd(q, q, q),
             lambda: orchard_ops.flash_attn_fwd(q, q, q, device="cpu")):
    try:
        call()
        print("no error")
    except ValueError as exc:
        print(exc)
orchard_ops.set_native_isa("baseline")
print(orchard_ops.devices()[0]["kernel_isa"], orchard_ops.flash_attn_fwd(q, q, q)[0].shape)
""", ORCHARD_ISA="avx9000")
    lines = info.stdout.splitlines()
    assert info.returncode == 0, info.stderr
    assert len(lines) == 4, info.stdout
    for line in lines[:3]:
        assert line.startswith("ORCHARD_ISA='avx9000': not a kernel set this CPU runs"), line
    assert lines[3] == "baseline (1, 2, 3, 8)"
    with pytest.raises(ValueError, match="name='sse9'.*expected one of"):
        ops.set_native_isa("sse9")
    with pytest.raises(TypeError, match="must be a str, not int"):
        ops.set_native_isa(3)


@pytest.mark.parametrize("script", ["devices", "train", "bench"])
def test_bad_isa_in_console_scripts(ops, script):
    # the scripts import orchard before their main runs: the variable still ends in one line
    info = run_python("import sys; from orchard.cli.%s import main; sys.exit(main([]))" % script,
                      ORCHARD_ISA="sse9")
    assert info.returncode == 2, info.stderr
    assert "Traceback" not in info.stderr
    assert info.stderr.strip() == ("orchard-%s: error: environment variable ORCHARD_ISA='sse9': "
                                   "not a kernel set this CPU runs; expected one of %r"
                                   % (script, tuple(ISAS)))


@pytest.mark.skipif("amx" not in ISAS, reason="no AMX on this CPU (or Linux did not grant it)")
def test_amx_between_torch_calls_on_the_same_threads(ops):
    """Tiles are configured per work item and released after it, on threads that torch's
    oneDNN kernels (bfloat16 SDPA, matmul) also configure for AMX: calls interleaved on torch's
    OpenMP threads (orchard's default once torch is loaded) give each library its own results,
    bit for bit, and no illegal instruction (a fresh process: a crash is a failure, not the
    suite's end)."""
    pytest.importorskip("torch")
    info = run_python("""
import numpy as np, torch, torch.nn.functional as F, orchard_ops
assert orchard_ops.devices()[0]["kernel_isa"] == "amx"
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(2, 4, 300, 64, generator=g).to(torch.bfloat16) for _ in range(4))
a = torch.randn(512, 512, generator=g).to(torch.bfloat16)
def torch_calls():
    tq = q.clone().requires_grad_(True)
    out = F.scaled_dot_product_attention(tq, k, v, is_causal=True)
    return [out, torch.autograd.grad(out, tq, do)[0], a @ a]
def orchard_calls():
    out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=True)
    return [out, lse] + list(orchard_ops.flash_attn_bwd(do, q, k, v, out, lse, causal=True))
first = (torch_calls(), orchard_calls())
for _ in range(3):
    again = (torch_calls(), orchard_calls())
    for mine, ref in zip(again, first):
        assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(mine, ref))
print("ok", torch.get_num_threads())
""", ORCHARD_ISA=None)
    assert info.returncode == 0, info.stderr
    assert info.stdout.startswith("ok"), info.stdout
