"""Bad inputs: each case runs in a fresh interpreter, so a segfault or abort is a test failure
and not a crash of pytest.  Checks the exception type and that the message names the
argument in quotes (API_CONTRACT: "The message always contains the argument's name in
quotes, e.g. 'k'")."""

import json

import numpy as np
import pytest

from conftest import OPENCL_IDS, run_python

PRELUDE = r"""
import json, sys
import numpy as np
import orchard_ops as ops
rng = np.random.default_rng(0)
def a(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)
q, k, v, do = a(1, 2, 5, 8), a(1, 2, 6, 8), a(1, 2, 6, 8), a(1, 2, 5, 8)
out, lse = ops.flash_attn_fwd(q, k, v)
qp, kp, vp, dop = a(5, 2, 8), a(6, 2, 8), a(6, 2, 8), a(5, 2, 8)
cq, ck = np.array([0, 3, 5], np.int32), np.array([0, 2, 6], np.int32)
vout, vlse = ops.flash_attn_varlen_fwd(qp, kp, vp, cq, ck)
fwd, bwd = ops.flash_attn_fwd, ops.flash_attn_bwd
vfwd, vbwd = ops.flash_attn_varlen_fwd, ops.flash_attn_varlen_bwd
"""

EPILOGUE = r"""
res = {"raised": None}
try:
    CALL()
except BaseException as exc:
    res = {"raised": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
           "msg": str(exc)}
print("RESULT " + json.dumps(res))
"""

TE, VE, ME, OE = "TypeError", "ValueError", "MemoryError", "OverflowError"

# an object whose every conversion (to an array, a float, an int, a sequence) is interrupted
KI = """
class KI:
    def __interrupt(self, *args, **kwargs):
        raise KeyboardInterrupt
    __array__ = __float__ = __index__ = __len__ = __getitem__ = __iter__ = __interrupt
"""

# (id, setup statements, call expression, accepted exception types, names: any one must be
#  quoted in the message)
CASES = [
    ("q_int32", "q = q.astype(np.int32)", "fwd(q, k, v)", [TE], ["q"]),
    ("all_int32", "q, k, v = (x.astype(np.int32) for x in (q, k, v))", "fwd(q, k, v)", [TE], ["q"]),
    ("q_complex", "q = q.astype(np.complex64)", "fwd(q, k, v)", [TE], ["q"]),
    ("k_dtype_mismatch", "k = k.astype(np.float64)", "fwd(q, k, v)", [TE], ["k"]),
    ("v_dtype_mismatch", "v = v.astype(np.float16)", "fwd(q, k, v)", [TE], ["v"]),
    ("dout_dtype_mismatch", "do = do.astype(np.float64)", "bwd(do, q, k, v, out, lse)", [TE],
     ["dout"]),
    ("out_dtype_mismatch", "out = out.astype(np.float64)", "bwd(do, q, k, v, out, lse)", [TE],
     ["out"]),
    ("q_object", "q = object()", "fwd(q, k, v)", [TE], ["q"]),
    ("q_none", "q = None", "fwd(q, k, v)", [TE], ["q"]),
    ("q_string", "q = 'hello'", "fwd(q, k, v)", [TE], ["q"]),
    ("v_dict", "v = {'a': 1}", "fwd(q, k, v)", [TE], ["v"]),
    ("q_1d", "q, k, v = a(8), a(8), a(8)", "fwd(q, k, v)", [VE], ["q"]),
    ("q_0d", "q = np.float32(1.0)", "fwd(q, k, v)", [VE, TE], ["q"]),
    # a 0-d array (no dims, unlike a NumPy scalar) named in the message of shapes
    ("k_0d_array", "k = np.array(1.0, np.float32)", "fwd(q, k, v)", [VE], ["k", "()"]),
    ("D_0", "q, k = a(1, 2, 5, 0), a(1, 2, 6, 0)", "fwd(q, k, v)", [VE], ["q"]),
    ("D_257", "q, k = a(1, 2, 5, 257), a(1, 2, 6, 257)", "fwd(q, k, v)", [VE], ["q"]),
    ("Dv_0", "v = a(1, 2, 6, 0)", "fwd(q, k, v)", [VE], ["v"]),
    ("Dv_257", "v = a(1, 2, 6, 257)", "fwd(q, k, v)", [VE], ["v"]),
    ("D_mismatch", "k = a(1, 2, 6, 7)", "fwd(q, k, v)", [VE], ["k"]),
    ("Nk_mismatch", "v = a(1, 2, 7, 8)", "fwd(q, k, v)", [VE], ["v", "k"]),
    ("batch_mismatch", "k, v = a(2, 2, 6, 8), a(2, 2, 6, 8)", "fwd(q, k, v)", [VE], ["k"]),
    ("batch_mismatch_v", "v = a(2, 2, 6, 8)", "fwd(q, k, v)", [VE], ["v"]),
    ("heads_3d_mismatch", "q, k, v = a(4, 5, 8), a(2, 6, 8), a(2, 6, 8)", "fwd(q, k, v)", [VE],
     ["k"]),
    ("gqa_5d_not_allowed", "q, k, v = a(1, 1, 4, 5, 8), a(1, 1, 2, 6, 8), a(1, 1, 2, 6, 8)",
     "fwd(q, k, v)", [VE], ["k"]),
    ("H_not_multiple_Hkv", "q, k, v = a(1, 3, 5, 8), a(1, 2, 6, 8), a(1, 2, 6, 8)",
     "fwd(q, k, v)", [VE], ["k"]),
    ("kv_heads_differ", "k, v = a(1, 1, 6, 8), a(1, 2, 6, 8)", "fwd(q, k, v)", [VE], ["v", "k"]),
    ("ndim_mismatch", "k, v = a(2, 6, 8), a(2, 6, 8)", "fwd(q, k, v)", [VE], ["k"]),
    ("dropout_neg", "", "fwd(q, k, v, dropout_p=-0.1)", [VE], ["dropout_p"]),
    ("dropout_one", "", "fwd(q, k, v, dropout_p=1.0)", [VE], ["dropout_p"]),
    ("dropout_nan", "", "fwd(q, k, v, dropout_p=float('nan'))", [VE], ["dropout_p"]),
    ("dropout_bwd", "", "bwd(do, q, k, v, out, lse, dropout_p=1.0)", [VE], ["dropout_p"]),
    ("softcap_neg", "", "fwd(q, k, v, softcap=-1.0)", [VE], ["softcap"]),
    ("softcap_str", "", "fwd(q, k, v, softcap='a')", [TE], ["softcap", "'a'"]),
    ("dropout_str", "", "fwd(q, k, v, dropout_p='0.1')", [TE], ["dropout_p", "'0.1'"]),
    ("dropout_bool_varlen", "", "vfwd(qp, kp, vp, cq, ck, dropout_p=True)", [TE], ["dropout_p"]),
    ("mask_dropout_str", "", "ops.dropout_mask((2, 5, 8), (2, 6, 8), 'x')", [TE],
     ["dropout_p"]),
    ("alibi_nan", "", "fwd(q, k, v, alibi_slopes=np.array([1.0, np.nan]))", [VE],
     ["alibi_slopes", "finite", "nan"]),
    ("softcap_nan", "", "fwd(q, k, v, softcap=float('nan'))", [VE], ["softcap"]),
    ("causal_str", "", "fwd(q, k, v, causal='False')", [TE], ["causal", "'False'"]),
    ("causal_2", "", "fwd(q, k, v, causal=2)", [TE], ["causal"]),
    ("causal_none_bwd", "", "bwd(do, q, k, v, out, lse, causal=None)", [TE], ["causal"]),
    ("causal_varlen_list", "", "vfwd(qp, kp, vp, cq, ck, causal=[1])", [TE], ["causal"]),
    ("window_neg2", "", "fwd(q, k, v, window=(-2, 0))", [VE], ["window"]),
    ("window_right_neg2", "", "fwd(q, k, v, window=(0, -5))", [VE], ["window"]),
    ("window_int", "", "fwd(q, k, v, window=5)", [TE, VE], ["window"]),
    ("window_3", "", "fwd(q, k, v, window=(1, 2, 3))", [TE, VE], ["window"]),
    ("window_str", "", "fwd(q, k, v, window='ab')", [TE, VE], ["window"]),
    ("window_float", "", "fwd(q, k, v, window=(1.5, 2))", [TE, VE], ["window"]),
    ("window_bool", "", "fwd(q, k, v, window=(True, False))", [TE], ["window"]),
    ("scale_numpy_bool", "", "fwd(q, k, v, scale=np.True_)", [TE], ["scale"]),
    ("softcap_numpy_bool", "", "fwd(q, k, v, softcap=np.True_)", [TE], ["softcap"]),
    ("alibi_wrong_H", "", "fwd(q, k, v, alibi_slopes=np.ones(3))", [VE], ["alibi_slopes"]),
    ("alibi_wrong_BH", "", "fwd(q, k, v, alibi_slopes=np.ones((2, 2)))", [VE], ["alibi_slopes"]),
    ("alibi_3d", "", "fwd(q, k, v, alibi_slopes=np.ones((1, 2, 1)))", [VE], ["alibi_slopes"]),
    # a broadcast view too large to copy: its shape is refused before any copy
    ("alibi_huge_view", "", "fwd(q, k, v, alibi_slopes=np.broadcast_to(1.0, (2**40, 2)))", [VE],
     ["alibi_slopes", "(1099511627776, 2)"]),
    ("alibi_int_dtype_or_str", "", "fwd(q, k, v, alibi_slopes='x')", [TE, VE], ["alibi_slopes"]),
    ("alibi_bool", "", "fwd(q, k, v, alibi_slopes=np.array([True, False]))", [TE],
     ["alibi_slopes", "integers or floats"]),
    ("alibi_complex", "", "fwd(q, k, v, alibi_slopes=np.array([1j, 2]))", [TE],
     ["alibi_slopes", "integers or floats"]),
    ("alibi_varlen_wrong", "", "vfwd(qp, kp, vp, cq, ck, alibi_slopes=np.ones((3, 2)))", [VE],
     ["alibi_slopes"]),
    ("seed_neg", "", "fwd(q, k, v, dropout_p=0.1, seed=-1)", [VE], ["seed"]),
    ("seed_2_64", "", "fwd(q, k, v, dropout_p=0.1, seed=2**64)", [VE, OE], ["seed"]),
    ("seed_float", "", "fwd(q, k, v, dropout_p=0.1, seed=1.5)", [TE, VE], ["seed"]),
    ("seed_bool", "", "fwd(q, k, v, dropout_p=0.1, seed=True)", [TE], ["seed"]),
    ("scale_bool", "", "fwd(q, k, v, scale=True)", [TE], ["scale"]),
    ("scale_bool_bwd", "", "bwd(do, q, k, v, out, lse, scale=False)", [TE], ["scale"]),
    ("device_tpu", "", "fwd(q, k, v, device='tpu:0')", [VE], ["device"]),
    ("device_bwd_tpu", "", "bwd(do, q, k, v, out, lse, device='tpu:0')", [VE], ["device"]),
    ("device_opencl_missing", "", "fwd(q, k, v, device='opencl:999')", [VE], ["device"]),
    ("unknown_keyword", "", "fwd(q, k, v, bogus=1)", [TE], ["bogus"]),
    ("cu_decreasing", "cq = np.array([0, 4, 3, 5], np.int32); ck = np.array([0, 2, 4, 6], np.int32)",
     "vfwd(qp, kp, vp, cq, ck)", [VE], ["cu_seqlens_q"]),
    ("cu_wrong_last", "cq = np.array([0, 3, 4], np.int32)", "vfwd(qp, kp, vp, cq, ck)", [VE],
     ["cu_seqlens_q"]),
    ("cu_k_wrong_last", "ck = np.array([0, 2, 7], np.int32)", "vfwd(qp, kp, vp, cq, ck)", [VE],
     ["cu_seqlens_k"]),
    ("cu_not_zero_start", "cq = np.array([1, 3, 5], np.int32)", "vfwd(qp, kp, vp, cq, ck)", [VE],
     ["cu_seqlens_q"]),
    ("cu_not_1d", "cq = cq.reshape(1, 3)", "vfwd(qp, kp, vp, cq, ck)", [VE], ["cu_seqlens_q"]),
    ("cu_float", "cq = cq.astype(np.float64)", "vfwd(qp, kp, vp, cq, ck)", [TE, VE],
     ["cu_seqlens_q"]),
    ("cu_empty", "cq = np.zeros(0, np.int32)", "vfwd(qp, kp, vp, cq, ck)", [VE], ["cu_seqlens_q"]),
    ("cu_length_mismatch", "ck = np.array([0, 2, 4, 6], np.int32)", "vfwd(qp, kp, vp, cq, ck)",
     [VE], ["cu_seqlens_k", "cu_seqlens_q"]),
    ("cu_bwd_decreasing", "cq2 = np.array([0, 4, 3, 5], np.int32); ck2 = np.array([0, 2, 4, 6], np.int32)",
     "vbwd(dop, qp, kp, vp, vout, vlse, cq2, ck2)", [VE], ["cu_seqlens_q"]),
    ("max_seqlen_q_small", "", "vfwd(qp, kp, vp, cq, ck, max_seqlen_q=2)", [VE], ["max_seqlen_q"]),
    ("max_seqlen_k_small", "", "vfwd(qp, kp, vp, cq, ck, None, 3)", [VE], ["max_seqlen_k"]),
    ("max_seqlen_q_float", "", "vfwd(qp, kp, vp, cq, ck, max_seqlen_q=5.0)", [TE],
     ["max_seqlen_q"]),
    ("max_seqlen_k_bool", "", "vfwd(qp, kp, vp, cq, ck, None, True)", [TE], ["max_seqlen_k"]),
    ("max_seqlen_q_below_int64", "", "vfwd(qp, kp, vp, cq, ck, -2**64)", [VE],
     ["max_seqlen_q"]),
    ("window_below_int64", "", "fwd(q, k, v, window=(-2**63 - 1, 0))", [VE], ["window"]),
    ("threads_past_int64", "", "ops.set_num_threads(2**64)", [VE], ["n"]),
    ("mask_shape_past_int64", "", "ops.dropout_mask((2**64, 8), (4, 8), 0.5)", [VE],
     ["q_shape"]),
    ("varlen_q_4d", "qp = a(5, 2, 1, 8)", "vfwd(qp, kp, vp, cq, ck)", [VE], ["q"]),
    ("varlen_H_not_multiple", "qp = a(5, 3, 8)", "vfwd(qp, kp, vp, cq, ck)", [VE], ["k"]),
    ("lse_wrong_shape", "lse = lse[..., :-1]", "bwd(do, q, k, v, out, lse)", [VE], ["lse"]),
    ("lse_wrong_rank", "lse = lse[..., None]", "bwd(do, q, k, v, out, lse)", [VE], ["lse"]),
    ("out_wrong_shape", "out = out[..., :-1]", "bwd(do, q, k, v, out, lse)", [VE], ["out"]),
    ("dout_wrong_shape", "do = a(1, 2, 4, 8)", "bwd(do, q, k, v, out, lse)", [VE], ["dout"]),
    ("varlen_lse_transposed", "vlse = np.ascontiguousarray(vlse.T)",
     "vbwd(dop, qp, kp, vp, vout, vlse, cq, ck)", [VE], ["lse"]),
    ("mask_bad_p", "", "ops.dropout_mask((2, 5, 8), (2, 6, 8), 1.5)", [VE], ["dropout_p"]),
    ("mask_bad_seed", "", "ops.dropout_mask((2, 5, 8), (2, 6, 8), 0.5, -3)", [VE], ["seed"]),
    ("mask_q_shape_1d", "", "ops.dropout_mask((5,), (6, 8), 0.5)", [VE], ["q_shape"]),
    ("mask_k_shape_bool", "", "ops.dropout_mask((2, 5, 8), (2, True, 8), 0.5)", [VE],
     ["k_shape", "True"]),
    # shapes no attention call takes (a mask of them was returned)
    ("mask_k_heads", "", "ops.dropout_mask((1, 3, 8, 4), (1, 2, 10, 4), 0.5)", [VE],
     ["k_shape", "(1, 2, 10, 4)", "q_shape", "heads dividing"]),
    ("mask_k_batch", "", "ops.dropout_mask((1, 2, 8, 4), (2, 2, 8, 4), 0.5)", [VE],
     ["k_shape", "dimensions before the rows"]),
    ("mask_k_head_dim", "", "ops.dropout_mask((1, 2, 8, 4), (1, 2, 8, 5), 0.5)", [VE],
     ["k_shape", "head dim"]),
    ("mask_k_rank", "", "ops.dropout_mask((2, 5, 8), (6, 8), 0.5)", [VE], ["k_shape"]),
    ("mask_head_dim_0", "", "ops.dropout_mask((1, 2, 5, 0), (1, 2, 6, 0), 0.5)", [VE],
     ["q_shape", "head dim", "1..256"]),
    ("mask_head_dim_300", "", "ops.dropout_mask((2, 5, 300), (2, 6, 300), 0.5)", [VE],
     ["q_shape", "head dim", "1..256"]),
    # finite as doubles, inf in the float32 the kernels compute these operands in
    ("scale_past_float32", "", "fwd(q, k, v, scale=1e39)", [VE], ["scale"]),
    ("softcap_past_float32", "", "fwd(q, k, v, softcap=1e39)", [VE], ["softcap"]),
    ("softcap_zero_in_float32", "", "fwd(q, k, v, softcap=1e-300)", [VE],
     ["softcap", "too small for float32"]),
    # 1 / softcap overflows float32 (it multiplied a score of 0 into NaN)
    ("softcap_tiny_in_float32", "", "fwd(q, k, v, softcap=2.9e-39)", [VE],
     ["softcap", "too small for float32", "2.94e-39"]),
    # above 1 / FLT_MAX as a double, under it once rounded to the kernels' float
    ("softcap_tiny_once_float32", "", "fwd(q, k, v, softcap=2.9387361e-39)", [VE],
     ["softcap", "too small for float32"]),
    ("softcap_tiny_in_float64", "q, k, v = (x.astype(np.float64) for x in (q, k, v))",
     "fwd(q, k, v, softcap=5e-309)", [VE], ["softcap", "too small for float64"]),
    ("alibi_past_float32", "", "fwd(q, k, v, alibi_slopes=np.array([1.0, -1e39]))", [VE],
     ["alibi_slopes"]),
    ("scale_int_past_double", "", "fwd(q, k, v, scale=10**400)", [VE], ["scale"]),
    ("softcap_int_past_double", "", "fwd(q, k, v, softcap=10**400)", [VE], ["softcap"]),
    ("device_nul", "", "fwd(q, k, v, device='cpu\\0x')", [VE], ["device"]),
    ("seqlen_first_not_bool", "", "fwd(q, k, v, seqlen_first='no')", [TE], ["seqlen_first"]),
    ("seqlen_first_2d", "", "fwd(q[0, 0], k[0, 0], v[0, 0], seqlen_first=True)", [VE], ["q"]),
    ("seqlen_first_bwd_2d_dout", "",
     "bwd(do[0, 0], q, k, v, out, lse, seqlen_first=True)", [VE], ["dout"]),
    # an interrupt inside a conversion passes through, not as the argument's TypeError
    ("interrupt_in_array", KI, "fwd(KI(), k, v)", ["KeyboardInterrupt"], []),
    ("interrupt_in_scale", KI, "fwd(q, k, v, scale=KI())", ["KeyboardInterrupt"], []),
    ("interrupt_in_seed", KI, "fwd(q, k, v, seed=KI())", ["KeyboardInterrupt"], []),
    ("interrupt_in_alibi", KI, "fwd(q, k, v, alibi_slopes=KI())", ["KeyboardInterrupt"], []),
    ("interrupt_in_window", KI, "fwd(q, k, v, window=KI())", ["KeyboardInterrupt"], []),
    ("interrupt_in_mask_shape", KI, "ops.dropout_mask(KI(), (2, 6, 8), 0.5)",
     ["KeyboardInterrupt"], []),
    ("interrupt_in_dlpack_lookup",
     "class Q:\n    __dlpack__ = property(lambda self: (_ for _ in ()).throw(KeyboardInterrupt))",
     "fwd(Q(), k, v)", ["KeyboardInterrupt"], []),
    ("huge_broadcast_zero_copy",
     "q, k, v = (np.broadcast_to(np.zeros((1, 1, 1, 64), np.float32), (2**16, 2**10, 1024, 64))"
     " for _ in range(3))", "fwd(q, k, v)", [ME], []),
    ("huge_broadcast_staged",
     "q, k, v = (np.broadcast_to(np.zeros((1,), np.float32), (2**16, 2**10, 1024, 64))"
     " for _ in range(3))", "fwd(q, k, v)", [ME], []),
    ("huge_staged_k_small_out",
     "k = np.broadcast_to(np.zeros((1,), np.float32), (1, 2, 2**31, 8)); v = k",
     "fwd(q, k, v)", [ME], []),
    # the size limits are shapes: checked before anything is copied
    ("huge_staged_k_too_many_keys",
     "k = np.broadcast_to(np.zeros((1,), np.float32), (1, 2, 2**36, 8)); v = k",
     "fwd(q, k, v)", [VE], ["k"]),
    ("huge_dropout_mask", "", "ops.dropout_mask((2**20, 2**20, 8), (2**20, 2**20, 8), 0.5)", [ME],
     []),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(ops, case):
    name, setup, call, types, names = case
    code = PRELUDE + setup + "\nCALL = lambda: " + call + "\n" + EPILOGUE
    try:
        r = run_python(code, timeout=90)
    except Exception as exc:  # subprocess.TimeoutExpired
        pytest.fail("%s: child did not finish: %r" % (name, exc))
    assert r.returncode == 0, "%s: child crashed with return code %s\nstderr: %s" % (
        name, r.returncode, r.stderr[-2000:])
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, "%s: no result; stdout=%r stderr=%r" % (name, r.stdout, r.stderr[-2000:])
    res = json.loads(line[-1][len("RESULT "):])
    assert res["raised"] is not None, "%s: `%s` raised nothing, expected %s" % (name, call, types)
    assert any(t in res["mro"] for t in types), "%s: `%s` raised %s(%r), expected %s" % (
        name, call, res["raised"], res["msg"], types)
    if names:
        quoted = ["'%s'" % n for n in names] + ['"%s"' % n for n in names]
        assert any(qn in res["msg"] for qn in quoted), (
            "%s: message %r does not name %s in quotes" % (name, res["msg"], " or ".join(names)))


def test_error_classes(ops):
    assert issubclass(ops.OrchardError, RuntimeError)
    assert issubclass(ops.OrchardOutOfMemory, ops.OrchardError)
    assert issubclass(ops.OrchardOutOfMemory, MemoryError)
    assert isinstance(ops.__version__, str) and ops.__version__


def test_index_and_slope_messages_say_what_was_given(ops):
    """An index array or slopes of the wrong type say the dtype and shape given (not only a
    shape, which may be right), or the object where it is not an array; paged keys and values
    of different head counts are shown as passed."""
    torch = pytest.importorskip("torch")
    q = np.ones((1, 2, 5, 8), np.float32)
    qp, cq, ck = np.ones((6, 1, 16), np.float32), np.array([0, 3, 6]), np.array([0, 5, 13])
    pages = np.ones((4, 8, 1, 16), np.float32)
    cases = [
        (ValueError, r"'seqused_k' must be a 1-D integer array of 1 key counts \(one per "
                     r"sequence\), got an array of dtype float64 and shape \(1,\)",
         lambda: ops.flash_attn_fwd(q, q, q, seqused_k=np.array([3.0]))),
        (ValueError, r"'block_table' must be an integer array .*; got an array of dtype "
                     r"float64 and shape \(2, 2\)",
         lambda: ops.flash_attn_varlen_fwd(qp, pages, pages, cq, ck, block_table=np.zeros((2, 2)),
                                           device="cpu")),
        # an integer table of the wrong row count: the count it needed is named
        (ValueError, r"'block_table' must be an integer array .*: batch_size 2 here, the "
                     r"sequences of the call; got an array of dtype int32 and shape \(1, 1\)",
         lambda: ops.flash_attn_varlen_fwd(qp, pages, pages, cq, ck,
                                           block_table=np.zeros((1, 1), np.int32), device="cpu")),
        (ValueError, r"'cu_seqlens_q' must be a 1-D integer array of B \+ 1 offsets, got an "
                     r"array of dtype float32 and shape \(3,\)",
         lambda: ops.flash_attn_varlen_fwd(qp, qp, qp, cq.astype(np.float32), cq)),
        (TypeError, r"'alibi_slopes' must be an array of integers or floats, got an array of dtype "
                    r"bool",
         lambda: ops.flash_attn_fwd(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.bool))),
        (TypeError, r"'alibi_slopes' must be an array of integers or floats \(a bfloat16 tensor: "
                    r"convert it first\)",
         lambda: ops.flash_attn_fwd(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.bfloat16))),
        (ValueError, r"'k' and 'v' must be pages .* got \(4, 8, 1, 16\) and \(4, 8, 2, 16\)",
         lambda: ops.flash_attn_varlen_fwd(qp, pages, np.ones((4, 8, 2, 16), np.float32), cq, ck,
                                           block_table=np.zeros((2, 2), np.int32), device="cpu")),
        (ValueError, r"'seqused_k' must be .*, got <object object at",
         lambda: ops.flash_attn_fwd(q, q, q, seqused_k=object())),
    ]
    for error, words, call in cases:
        with pytest.raises(error, match=words):
            call()


def test_messages_show_the_value_given(ops):
    """The value in a message is the one passed: not wrapped by a cast to int64, not stripped of
    its sign, not a UnicodeEncodeError for text no device or set is named by."""
    q = np.zeros((5, 2, 8), np.float32)
    cu = np.array([0, 5], np.int32)
    with pytest.raises(ValueError, match=r"'cu_seqlens_k' must hold values below 2\*\*63, got "
                                         r"18446744073709551615 at flat index 1"):
        ops.flash_attn_varlen_fwd(q, q, q, cu, np.array([0, 2**64 - 1], np.uint64))
    dense = np.zeros((1, 2, 5, 8), np.float32)
    for name in ("seqused_k", "leftpad_k"):
        with pytest.raises(ValueError, match="'%s' must hold values below 2" % name):
            ops.flash_attn_fwd(dense, dense, dense, **{name: np.array([2**64 - 1], np.uint64)})
    from fractions import Fraction
    for huge in (-10**400, Fraction(-10**400)):
        with pytest.raises(ValueError, match=r"'dropout_p' must be in \[0, 1\), got -inf"):
            ops.flash_attn_fwd(dense, dense, dense, dropout_p=huge)
    with pytest.raises(ValueError, match="'device' must be valid UTF-8 text"):
        ops.flash_attn_fwd(dense, dense, dense, device="\ud800")
    with pytest.raises(ValueError, match="name must be valid UTF-8 text"):
        ops.set_native_isa("\ud800")


@pytest.mark.parametrize("device", ["cpu"] + OPENCL_IDS[:1])
def test_results_too_large_name_the_call_and_result(ops, device):
    """A result that cannot be allocated (operands read in place from one row of memory; 2^62
    bytes, past what orchard asks the system for on any machine) is a MemoryError naming the
    function and the result (it said only "cannot allocate an array of 4.612e+18 bytes")."""
    q = np.broadcast_to(np.ones((1, 1, 1, 8), np.float32), (2**57, 1, 1, 8))
    with pytest.raises(MemoryError, match=r"flash_attn_fwd\(\): the result 'out' cannot be "
                                          r"allocated \(cannot allocate an array of 4\.612e\+18 "
                                          r"bytes\)"):
        ops.flash_attn_fwd(q, q, q, device=device)
    lse = np.broadcast_to(np.float32(0), (2**57, 1, 1))
    with pytest.raises(MemoryError, match=r"flash_attn_bwd\(\): the result 'dq' cannot be"):
        ops.flash_attn_bwd(q, q, q, q, q, lse, device=device)


@pytest.mark.parametrize("shape, error, name", [
    ((1, 1, 4, 8), TypeError, "'k'"),                   # float16 q beside float32 k
    ((2**40, 2**40, 4, 8), ValueError, "'q'"),          # past NumPy's bounds
    (None, ValueError, "'q' has 4 dimensions and no DLPack shape"),     # a NULL shape
], ids=["dtype-mismatch", "shape-past-numpy", "no-shape"])
def test_operand_release_keeps_the_calls_error(ops, shape, error, name):
    """A DLPack producer's deleter that runs Python code (a ctypes callback) is called while the
    call's error is pending; that error, naming the argument, is what reaches the caller, not a
    SystemError. A tensor without a shape array (a producer's bug) is refused before it is
    taken (it crashed the process): its producer keeps it."""
    import ctypes as C

    class Device(C.Structure):
        _fields_ = [("type", C.c_int32), ("id", C.c_int32)]

    class DataType(C.Structure):
        _fields_ = [("code", C.c_uint8), ("bits", C.c_uint8), ("lanes", C.c_uint16)]

    class Tensor(C.Structure):
        _fields_ = [("data", C.c_void_p), ("device", Device), ("ndim", C.c_int32),
                    ("dtype", DataType), ("shape", C.POINTER(C.c_int64)),
                    ("strides", C.POINTER(C.c_int64)), ("byte_offset", C.c_uint64)]

    class Managed(C.Structure):
        pass

    Deleter = C.CFUNCTYPE(None, C.POINTER(Managed))
    Managed._fields_ = [("dl_tensor", Tensor), ("ctx", C.c_void_p), ("deleter", Deleter)]
    deleted = []
    deleter = Deleter(lambda m: deleted.append(1))
    new_capsule = C.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = C.py_object, [C.c_void_p, C.c_char_p, C.c_void_p]
    half = np.zeros((1, 1, 4, 8), np.float16)
    dims = (C.c_int64 * 4)(*shape) if shape else None
    managed = Managed()
    managed.dl_tensor = Tensor(half.ctypes.data, Device(1, 0), 4, DataType(2, 16, 1), dims, None, 0)
    managed.deleter = deleter

    class Producer:
        def __dlpack__(self, *args, **kwargs):
            return new_capsule(C.addressof(managed), b"dltensor", None)

    k = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(error, match=name):
        ops.flash_attn_fwd(Producer(), k, k)
    assert deleted == ([1] if shape else [])
