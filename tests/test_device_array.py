"""Device-resident tensors: to_device(), DeviceArray, attention calls on DeviceArrays.

A call on DeviceArrays runs the same kernels as the host-array call on the same device, so
its results must equal those bit for bit, whether the host call reads its arrays in place or
copies them as on a discrete GPU (ORCHARD_CL_TRANSFERS=1). stats() counts the copies between
host and device memory; a call on resident operands makes none. Skips without an OpenCL
device.
"""
import gc
import json
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import (OPENCL_IDS, TEST_HOOKS, TESTS_DIR, assert_close, grad_floor,
                      needs_test_hooks, randn, rounded, run_python, subprocess_env)
from orchard.reference import ref_bwd, ref_fwd

pytestmark = pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device listed")
DEV = OPENCL_IDS[0] if OPENCL_IDS else None
DTYPES = ["float16", "float32", "float64", "bfloat16"]


def make(rng, shape, dtype):
    """Random host operand of dtype: a NumPy array, or a torch tensor for bfloat16."""
    x = randn(rng, shape, np.float32)
    if dtype != "bfloat16":
        return x.astype(dtype)
    torch = pytest.importorskip("torch")
    return torch.from_numpy(x).to(torch.bfloat16)


def bits(ops, x):
    """The stored bits of a host array, torch tensor or DeviceArray, C-contiguous."""
    if isinstance(x, ops.DeviceArray):
        x = x.numpy()
    elif not isinstance(x, np.ndarray):      # torch
        import torch
        x = x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
    x = np.ascontiguousarray(x)
    return x.view("u%d" % x.itemsize)


def assert_same_bits(ops, host, resident):
    assert len(host) == len(resident)
    for h, r in zip(host, resident):
        assert isinstance(r, ops.DeviceArray) and r.device == DEV
        assert r.shape == tuple(h.shape)
        np.testing.assert_array_equal(bits(ops, h), bits(ops, r))


@pytest.fixture(params=["in_place", "transfers"])
def transfers(request, monkeypatch):
    """Host calls read arrays in place (unified memory) or copy them (ORCHARD_CL_TRANSFERS=1)."""
    if request.param == "transfers":
        if not TEST_HOOKS:
            pytest.skip("ORCHARD_CL_TRANSFERS needs a build with ORCHARD_TEST_HOOKS=1")
        monkeypatch.setenv("ORCHARD_CL_TRANSFERS", "1")
    else:
        monkeypatch.delenv("ORCHARD_CL_TRANSFERS", raising=False)
    return request.param


# ----------------------------------------------------------------------------- the object

@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bit_exact(ops, rng, dtype):
    for shape in [(2, 3, 17, 8), (5,), (), (0, 4), (3, 0, 2)]:
        x = make(rng, shape, dtype)
        if dtype != "bfloat16":     # NaN, infinities, -0 and subnormals survive too
            x.reshape(-1)[:4] = np.array([np.nan, -np.inf, -0.0, 1e-40])[:x.size].astype(dtype)
        d = ops.to_device(x, DEV)
        assert type(d) is ops.DeviceArray
        assert (d.shape, d.dtype, d.device) == (tuple(x.shape), dtype, DEV)
        assert d.nbytes == int(np.prod(shape)) * (8 if dtype == "float64" else
                                                  4 if dtype == "float32" else 2)
        back = d.numpy()
        assert back.flags.c_contiguous and back.shape == tuple(x.shape)
        assert back.dtype == (np.uint16 if dtype == "bfloat16" else np.dtype(dtype))
        np.testing.assert_array_equal(bits(ops, back), bits(ops, x))
        assert d.numpy() is not back                    # a new array each time
    assert repr(d) == "DeviceArray(shape=(3, 0, 2), dtype=%s, device='%s')" % (dtype, DEV)


def test_to_device_takes_views_buffers_and_torch(ops, rng):
    x = randn(rng, (4, 6, 10), np.float32)
    for view in [x[:, ::2], x[..., ::-1], x.transpose(1, 0, 2), x.astype(">f4")]:
        np.testing.assert_array_equal(ops.to_device(view, DEV).numpy(), view)
    buf = memoryview(x)
    np.testing.assert_array_equal(ops.to_device(buf, DEV).numpy(), x)
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x).permute(2, 0, 1)
    np.testing.assert_array_equal(ops.to_device(t, DEV).numpy(), t.numpy())


def test_bad_input(ops, rng):
    x = randn(rng, (2, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"to_device\(\): 'device' must name an OpenCL device"):
        ops.to_device(x, "cpu")
    with pytest.raises(ValueError, match=r"to_device\(\): 'device' 'opencl:99' is not an "
                                         r"available device"):
        ops.to_device(x, "opencl:99")
    with pytest.raises(TypeError, match=r"to_device\(\): 'device' must be a str"):
        ops.to_device(x, 0)
    with pytest.raises(TypeError, match=r"to_device\(\): argument 'array' must be a float16, "
                                        r"float32 or float64 array \(bfloat16: a tensor "
                                        r"through DLPack\), not int32"):
        ops.to_device(x.astype(np.int32), DEV)
    # what was given named, not only NumPy's reading of it ("not object" for None)
    with pytest.raises(TypeError, match=r"argument 'array' must be .* got str, read as an "
                                        r"array of <U3"):
        ops.to_device("abc", DEV)
    with pytest.raises(TypeError, match=r"argument 'array' must be .* got NoneType, read as "
                                        r"an array of object"):
        ops.to_device(None, DEV)
    d = ops.to_device(x, DEV)
    with pytest.raises(TypeError, match=r"'array' is already a DeviceArray"):
        ops.to_device(d, DEV)
    with pytest.raises(TypeError, match="cannot create 'orchard_ops.DeviceArray' instances"):
        ops.DeviceArray()
    with pytest.raises(AttributeError):
        d.shape = (1,)


# ----------------------------------------------------------------------------- attention

CASES = {
    # q, k, v shapes; options
    "causal_gqa_dropout": ((2, 4, 40, 16), (2, 2, 57, 16), (2, 2, 57, 24),
                           dict(causal=True, dropout_p=0.2, seed=9, softcap=4.0)),
    "window_alibi": ((1, 3, 33, 32), (1, 3, 33, 32), (1, 3, 33, 32),
                     dict(window=(5, 2), alibi_slopes=np.array([0.1, 0.3, 0.7]), scale=0.4)),
    "decode": ((2, 4, 3, 32), (2, 1, 300, 32), (2, 1, 300, 32), dict(causal=True)),
    "three_dims": ((3, 20, 8), (3, 20, 8), (3, 20, 8), {}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_dense_equals_host_call(ops, rng, transfers, dtype, case):
    qs, ks, vs, kw = CASES[case]
    if dtype == "float64" and not next(d for d in ops.devices() if d["id"] == DEV)["fp64"]:
        pytest.skip("no cl_khr_fp64")
    q, k, v = make(rng, qs, dtype), make(rng, ks, dtype), make(rng, vs, dtype)
    host_o, host_l = ops.flash_attn_fwd(q, k, v, device=DEV, **kw)
    dout = make(rng, tuple(host_o.shape), dtype)
    host_g = ops.flash_attn_bwd(dout, q, k, v, host_o, host_l, device=DEV, **kw)

    dq, dk, dv, ddo = (ops.to_device(x, DEV) for x in (q, k, v, dout))
    out, lse = ops.flash_attn_fwd(dq, dk, dv, **kw)
    assert lse.dtype == ("float64" if dtype == "float64" else "float32")
    assert_same_bits(ops, (host_o, host_l), (out, lse))
    grads = ops.flash_attn_bwd(ddo, dq, dk, dv, out, lse, device=DEV, **kw)
    assert_same_bits(ops, host_g, grads)
    assert [g.dtype for g in grads] == [dtype] * 3


def test_resident_matches_reference(ops, rng):
    """The resident results against the float64 reference, not only against the host call."""
    q, k, v, do = (randn(rng, (2, 3, 45, 16), np.float32) for _ in range(4))
    kw = dict(causal=True, softcap=3.0)
    out, lse = ops.flash_attn_fwd(*(ops.to_device(x, DEV) for x in (q, k, v)), **kw)
    ref_o, ref_l = ref_fwd(rounded(q), rounded(k), rounded(v), **kw)
    assert_close(out.numpy(), ref_o, np.float32, "out", "out")
    assert_close(lse.numpy(), ref_l, np.float32, "lse", "lse")
    grads = ops.flash_attn_bwd(ops.to_device(do, DEV), *(ops.to_device(x, DEV) for x in (q, k, v)),
                               out, lse, **kw)
    ref_g = ref_bwd(rounded(do), rounded(q), rounded(k), rounded(v), **kw)
    floor = grad_floor(do, out.numpy(), q, k)
    for g, r, name in zip(grads, ref_g, ("dq", "dk", "dv")):
        assert_close(g.numpy(), r, np.float32, "grad", name, floor=floor)


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_varlen_equals_host_call(ops, rng, transfers, dtype):
    cu_q = np.array([0, 7, 7, 40], np.int32)
    cu_k = np.array([0, 20, 25, 80], np.int64)
    used = np.array([18, 5, 30], np.int32)
    q, do = make(rng, (40, 4, 16), dtype), make(rng, (40, 4, 16), dtype)
    k, v = make(rng, (80, 2, 16), dtype), make(rng, (80, 2, 16), dtype)
    kw = dict(causal=True, dropout_p=0.1, seed=3)
    host_o, host_l = ops.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, device=DEV, seqused_k=used,
                                               **kw)
    dq, dk, dv, ddo = (ops.to_device(x, DEV) for x in (q, k, v, do))
    out, lse = ops.flash_attn_varlen_fwd(dq, dk, dv, cu_q, cu_k, seqused_k=used, **kw)
    assert lse.shape == (4, 40)
    assert_same_bits(ops, (host_o, host_l), (out, lse))
    host_g = ops.flash_attn_varlen_bwd(do, q, k, v, host_o, host_l, cu_q, cu_k, device=DEV, **kw)
    grads = ops.flash_attn_varlen_bwd(ddo, dq, dk, dv, out, lse, cu_q, cu_k, **kw)
    assert_same_bits(ops, host_g, grads)


def test_mixed_and_misplaced_operands(ops, rng):
    q = randn(rng, (1, 2, 8, 16), np.float32)
    d = ops.to_device(q, DEV)
    with pytest.raises(ValueError, match=r"flash_attn_fwd\(\): argument 'k' is a host array but "
                                         r"'q' is a DeviceArray"):
        ops.flash_attn_fwd(d, q, d)
    with pytest.raises(ValueError, match=r"argument 'q' is a host array but 'k' is a DeviceArray"):
        ops.flash_attn_fwd(q, d, q)
    out, lse = ops.flash_attn_fwd(d, d, d)
    with pytest.raises(ValueError, match=r"flash_attn_bwd\(\): argument 'lse' is a host array"):
        ops.flash_attn_bwd(d, d, d, d, out, lse.numpy())
    with pytest.raises(ValueError, match=r"flash_attn_fwd\(\): 'device' is 'cpu' but the "
                                         r"operands are DeviceArrays on %s" % DEV):
        ops.flash_attn_fwd(d, d, d, device="cpu")
    for device in ("auto", DEV):    # "auto", as None, leaves the choice to the operands
        assert np.array_equal(ops.flash_attn_fwd(d, d, d, device=device)[0].numpy(),
                              out.numpy())
    with pytest.raises(TypeError, match=r"flash_attn_bwd\(\): argument 'lse' has dtype float16; "
                                        r"it must be float32"):
        ops.flash_attn_bwd(d, d, d, d, out, ops.to_device(lse.numpy().astype(np.float16), DEV))
    with pytest.raises(TypeError, match=r"argument 'k' has dtype float64 but 'q' has float32"):
        ops.flash_attn_fwd(d, ops.to_device(q.astype(np.float64), DEV), d)
    with pytest.raises(ValueError, match=r"argument 'k' must have the head dim"):
        ops.flash_attn_fwd(d, ops.to_device(q[..., :8], DEV), d)
    with pytest.raises(ValueError, match=r"'cu_seqlens_q' must be a 1-D integer array"):
        ops.flash_attn_varlen_fwd(*(ops.to_device(q[0], DEV),) * 3, d, d)
    with pytest.raises(TypeError, match=r"flash_attn_bwd\(\): seqlen_first=True takes host "
                                        r"arrays or tensors, not DeviceArrays"):
        ops.flash_attn_bwd(d, d, d, d, out, lse, seqlen_first=True)


@pytest.mark.skipif(len(OPENCL_IDS) < 2, reason="one OpenCL device listed")
def test_operands_on_two_devices(ops, rng):
    q = randn(rng, (1, 2, 8, 16), np.float32)
    a, b = ops.to_device(q, OPENCL_IDS[0]), ops.to_device(q, OPENCL_IDS[1])
    with pytest.raises(ValueError, match=r"argument 'k' is on %s but 'q' is on %s"
                                         % (OPENCL_IDS[1], OPENCL_IDS[0])):
        ops.flash_attn_fwd(a, b, a)


FAULT_SCRIPT = r"""
import json, numpy as np, orchard_ops as ops
q = np.random.default_rng(0).standard_normal((1, 2, 20, 8)).astype(np.float32)
def run():
    d = ops.to_device(q, %(dev)r)
    out, lse = ops.flash_attn_fwd(d, d, d)
    return out.numpy()
try:
    run()
    raised = None
except Exception as e:
    raised = [type(e).__name__, isinstance(e, MemoryError), str(e)]
host = ops.flash_attn_fwd(q, q, q, device=%(dev)r)[0]
print(json.dumps({"raised": raised, "recovered": bool((run() == host).all())}))
"""


@needs_test_hooks
@pytest.mark.parametrize("fault, func, call, what", [
    ("clCreateBuffer:1", "to_device", "clCreateBuffer", ": 'array' takes 1280 bytes; "),
    ("clCreateBuffer:3", "flash_attn_fwd", "clCreateBuffer", ": 'lse' takes 160 bytes; "),
    ("clEnqueueReadBuffer:1", "numpy", "clEnqueueReadBuffer", "")])
def test_device_failures(fault, func, call, what):
    """A failing OpenCL call raises OrchardOutOfMemory naming the function, the device and the
    call (ORCHARD_FAULT, csrc/cl_fault.c), and a buffer's the array and its size; the next calls
    work."""
    r = run_python(FAULT_SCRIPT % {"dev": DEV}, timeout=300, ORCHARD_FAULT=fault)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["raised"][:2] == ["OrchardOutOfMemory", True]
    assert got["raised"][2].startswith("%s() on %s: %s failed: CL_" % (func, DEV, call))
    assert what in got["raised"][2]
    assert got["recovered"]


OCLGRIND_SCRIPT = r"""
import numpy as np, orchard_ops as o
from orchard.reference import ref_fwd, ref_bwd
assert o.devices()[1]["platform"] == "Oclgrind", o.devices()
rng = np.random.default_rng(0)
q, do = (rng.standard_normal((1, 4, 10, 8)).astype(np.float32) for _ in range(2))
k, v = (rng.standard_normal((1, 2, 13, 8)).astype(np.float32) for _ in range(2))
kw = dict(causal=True, window=(6, 1), softcap=4.0, alibi_slopes=np.array([0.3, 0.1, 0.2, 0.4]),
          dropout_p=0.25, seed=11)
dq, dk, dv, ddo = (o.to_device(x, "opencl:0") for x in (q, k, v, do))
res = o.flash_attn_fwd(dq, dk, dv, **kw)
res += o.flash_attn_bwd(ddo, dq, dk, dv, *res, **kw)
want = ref_fwd(q, k, v, **kw) + ref_bwd(do, q, k, v, **kw)
for r, w in zip(res, want):
    np.testing.assert_allclose(r.numpy(), w, rtol=1e-4, atol=1e-4)
print("resident ok")
"""


@pytest.mark.skipif(shutil.which("oclgrind") is None, reason="oclgrind not installed")
def test_resident_calls_clean_under_oclgrind(tmp_path):
    """Resident operands and results under Oclgrind's bounds, race, API and uninitialised-read
    checks (the rows family, small blocks, unoptimised kernels, as in test_oclgrind.py), checked
    against the reference. Resident calls only: host-array calls in the same process make
    Oclgrind 21.10 report reads of reused addresses (test_oclgrind.py says why)."""
    script = tmp_path / "resident.py"
    script.write_text(OCLGRIND_SCRIPT)
    # Oclgrind stands in for the OpenCL library: a loader named by the environment must not
    env = subprocess_env(ORCHARD_CL_BLOCK_Q=8, ORCHARD_CL_BLOCK_K=4, ORCHARD_CL_FAMILY="rows",
                         ORCHARD_NO_CACHE=1, ORCHARD_CL_OPTIONS="-cl-opt-disable",
                         ORCHARD_OPENCL_LIBRARY=None)
    r = subprocess.run(["oclgrind", "--data-races", "--check-api", "--uninitialized",
                        sys.executable, str(script)], capture_output=True, text=True,
                       timeout=900, env=env, cwd=TESTS_DIR)
    assert r.returncode == 0 and "resident ok" in r.stdout, r.stderr[-4000:]
    reports = [line for line in r.stderr.splitlines()
               if re.search(r"Invalid (read|write)|data race|uninitiali[sz]ed|out of bounds",
                            line, re.I)]
    assert not reports, "\n".join(reports[:20])


# ----------------------------------------------------------------------------- stats

COUNTERS = ("host_to_device", "host_to_device_bytes", "device_to_host", "device_to_host_bytes")


def transfers_of(ops):
    st = ops.stats()["per_device"][DEV]
    return {name: st[name] for name in COUNTERS}


def test_stats_count_transfers(ops, rng, transfers):
    q, k, v, do = (randn(rng, (2, 2, 24, 16), np.float32) for _ in range(4))
    n = q.nbytes
    ops.reset_stats()
    dq, dk, dv, ddo = (ops.to_device(x, DEV) for x in (q, k, v, do))
    assert transfers_of(ops) == dict(host_to_device=4, host_to_device_bytes=4 * n,
                                     device_to_host=0, device_to_host_bytes=0)
    out, lse = ops.flash_attn_fwd(dq, dk, dv, causal=True)
    ops.flash_attn_bwd(ddo, dq, dk, dv, out, lse, causal=True)
    st = ops.stats()["per_device"][DEV]
    assert (st["fwd_calls"], st["bwd_calls"], st["zero_copy_buffers"], st["staged_buffers"]) \
        == (1, 1, 4, 0)                     # the four to_device reads; the calls add none
    assert transfers_of(ops)["host_to_device"] == 4 and transfers_of(ops)["device_to_host"] == 0
    out.numpy()
    assert transfers_of(ops)["device_to_host"] == 1
    assert transfers_of(ops)["device_to_host_bytes"] == out.nbytes

    # a host-array call: copies in and out only where the device does not read host memory
    ops.reset_stats()
    host_o, host_l = ops.flash_attn_fwd(q, k, v, causal=True, device=DEV)
    copied = transfers == "transfers" or not next(
        d for d in ops.devices() if d["id"] == DEV)["unified_memory"]
    expect = dict(host_to_device=3, host_to_device_bytes=3 * n, device_to_host=2,
                  device_to_host_bytes=host_o.nbytes + host_l.nbytes)
    assert transfers_of(ops) == (expect if copied else dict.fromkeys(COUNTERS, 0))
    st = ops.stats()
    assert all(st[name] == st["per_device"][DEV][name] for name in COUNTERS)
    assert st["per_device"]["cpu"]["host_to_device"] == 0

    # an empty array crosses nothing either way (to_device counted a copy, .numpy() none)
    ops.reset_stats()
    ops.to_device(np.zeros((0, 16), np.float32), DEV).numpy()
    assert transfers_of(ops) == dict.fromkeys(COUNTERS, 0)


# ----------------------------------------------------------------------------- lifetime

def test_refcounts(ops, rng):
    q, k, v = (ops.to_device(randn(rng, (1, 2, 16, 8), np.float32), DEV) for _ in range(3))
    before = [sys.getrefcount(x) for x in (q, k, v)]
    for _ in range(200):
        out, lse = ops.flash_attn_fwd(q, k, v, causal=True)
        grads = ops.flash_attn_bwd(out, q, k, v, out, lse, causal=True)
        with pytest.raises(ValueError):
            ops.flash_attn_fwd(q, k, out.numpy())
    assert [sys.getrefcount(x) for x in (q, k, v)] == before
    assert sys.getrefcount(out) == 2 and sys.getrefcount(lse) == 2
    assert [sys.getrefcount(g) for g in grads] == [3, 3, 3]   # tuple, `g`, getrefcount
    x = np.ones((4, 4), np.float32)
    r = sys.getrefcount(x)
    d = ops.to_device(x, DEV)
    assert sys.getrefcount(x) == r      # nothing keeps the host array
    del d
    gc.collect()


LEAK_SCRIPT = r"""
import json, numpy as np, orchard_ops as ops

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

x = np.ones((16, 2**20), np.float32)      # 64 MiB
q = np.ones((1, 2, 256, 64), np.float32)
def one():
    d = ops.to_device(x, %(dev)r)
    dq = ops.to_device(q, %(dev)r)
    out, lse = ops.flash_attn_fwd(dq, dq, dq)
    ops.flash_attn_bwd(out, dq, dq, dq, out, lse)
    return d.nbytes

for _ in range(3):
    one()
r0 = rss()
for _ in range(40):
    one()
print(json.dumps({"growth": rss() - r0}))
"""


def test_buffers_released():
    """Dropping a DeviceArray releases its buffer: 40 rounds of a 64 MiB array (and of the
    results of two calls) leave the RSS where it was (a leak would add 2.5 GiB; PoCL's
    buffers are host memory)."""
    r = run_python(LEAK_SCRIPT % {"dev": DEV}, timeout=300)
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout.strip().splitlines()[-1])["growth"]
    assert growth < 128 * 2**20, "RSS grew by %.0f MiB" % (growth / 2**20)


def test_threads_share_resident_operands(ops, rng):
    q, k, v = (randn(rng, (2, 2, 64, 16), np.float32) for _ in range(3))
    dq, dk, dv = (ops.to_device(x, DEV) for x in (q, k, v))
    want = bits(ops, ops.flash_attn_fwd(q, k, v, causal=True, device=DEV)[0])
    got, errors = [], []

    def work():
        try:
            for _ in range(5):
                got.append(bits(ops, ops.flash_attn_fwd(dq, dk, dv, causal=True)[0]))
        except Exception as e:      # reported below: an assert in a thread would be lost
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 20
    for g in got:
        np.testing.assert_array_equal(g, want)
