"""Fault injection: ORCHARD_FAULT="CALL:N[+][:CL_ERROR]" makes the Nth use of an OpenCL call
fail (csrc/cl_fault.c, in builds with ORCHARD_TEST_HOOKS=1). Each case runs in a fresh interpreter, since the variable is read once
per process. A failure must raise the documented exception (OrchardError naming the call and
the CL error; OrchardOutOfMemory, also a MemoryError, for the out-of-memory codes), leak
nothing (reference counts; resident memory over a loop of failing calls), and leave the device
working: the next calls give the results of the native path. Under the automatic device choice
a failing device falls back to the native path with one warning."""
import json
import os

import pytest

from conftest import DEVICE_IDS, needs_test_hooks, run_python

pytestmark = [pytest.mark.skipif("opencl:0" not in DEVICE_IDS, reason="no OpenCL device"),
              needs_test_hooks]

PRELUDE = r"""
import gc, json, os, sys
import numpy as np
import orchard_ops as ops
from conftest import randn
rng = np.random.default_rng(0)
# DECODE=1: 4 query rows over 1,500 keys, the split-KV decode (4 key splits on 2 compute units)
nq, nk = (4, 1500) if os.environ.get("DECODE") == "1" else (70, 50)
q, k, v = randn(rng, (2, 3, nq, 16), np.float32), randn(rng, (2, 1, nk, 16), np.float32), randn(rng, (2, 1, nk, 8), np.float32)
do = randn(rng, (2, 3, nq, 8), np.float32)
KW = dict(causal=True, alibi_slopes=np.array([0.1, 0.2, 0.3]), dropout_p=0.1, seed=5)

def attention(device):
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **KW)
    return (out, lse) + ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **KW)

def same(a, b):
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-5) for x, y in zip(a, b))

def report(**fields):
    print("RESULT " + json.dumps(fields))
"""

# The first attention() on opencl:0 fails, then two more succeed.
FAIL_THEN_RECOVER = PRELUDE + r"""
expected = attention("cpu")
refs = [sys.getrefcount(x) for x in (q, k, v, do)]
gc.collect()
objects = len(gc.get_objects())
try:
    attention("opencl:0")
    raised = None
except BaseException as exc:
    raised = exc
gc.collect()
report(raised=type(raised).__name__ if raised else None,
       mro=[c.__name__ for c in type(raised).__mro__] if raised else [],
       msg=str(raised) if raised else "",
       refs_stable=refs == [sys.getrefcount(x) for x in (q, k, v, do)],
       objects_grew=len(gc.get_objects()) - objects,
       recovered=[same(attention("opencl:0"), expected) for _ in range(2)])
"""

OOM, DEVICE = "OrchardOutOfMemory", "OrchardError"

# (ORCHARD_FAULT, extra environment, expected exception, the CL error named in the message).
# Call counts are per process, with a program cache already holding the binaries. With the
# row-per-work-item kernels (ORCHARD_CL_FAMILY=rows): the first forward makes a context and queue,
# loads the program (clCreateProgramWithBinary + clBuildProgram), creates 5 kernels to query
# their work-group limits, then the flash_fwd kernel, 8 buffers (dummy, q, k, v, out, lse,
# meta, slopes), sets arguments, enqueues one kernel and maps out and lse; backward makes 13
# buffers (the D buffer last) and enqueues 3 kernels.
ROWS = {"ORCHARD_CL_FAMILY": "rows"}
CASES = [
    ("clCreateContext:1", {}, OOM, "CL_OUT_OF_HOST_MEMORY"),
    ("clCreateCommandQueue:1", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateProgramWithSource:1", {"ORCHARD_NO_CACHE": 1}, OOM, "CL_OUT_OF_HOST_MEMORY"),
    ("clBuildProgram:1", {"ORCHARD_NO_CACHE": 1}, DEVICE, "CL_BUILD_PROGRAM_FAILURE"),
    ("clGetKernelWorkGroupInfo:2", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateKernel:6", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateKernel:8", {}, OOM, "CL_OUT_OF_RESOURCES"),             # in backward
    ("clCreateBuffer:1", {}, OOM, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),
    ("clCreateBuffer:5", {}, OOM, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),  # after 4 were made
    ("clCreateBuffer:12", {}, OOM, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),  # in backward
    ("clCreateBuffer:3:CL_INVALID_VALUE", {}, DEVICE, "CL_INVALID_VALUE"),
    ("clSetKernelArg:9", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clEnqueueNDRangeKernel:1", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clEnqueueNDRangeKernel:3", {}, OOM, "CL_OUT_OF_RESOURCES"),      # 2nd kernel of backward
    ("clEnqueueMapBuffer:2", {}, DEVICE, "CL_MAP_FAILURE"),
    ("clEnqueueMapBuffer:2:CL_OUT_OF_HOST_MEMORY", {}, OOM, "CL_OUT_OF_HOST_MEMORY"),
    ("clEnqueueUnmapMemObject:1", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clFinish:1", {}, OOM, "CL_OUT_OF_RESOURCES"),
    ("clEnqueueReadBuffer:2", {"ORCHARD_CL_TRANSFERS": 1}, OOM, "CL_OUT_OF_RESOURCES"),
]
CASES = [(fault, dict(ROWS, **env), exc, code) for fault, env, exc, code in CASES]
# The register-tiled kernels (ORCHARD_CL_FAMILY=tiled): the work-group limit of flash_bwd_prep only,
# then the forward kernel (the 2nd kernel made); backward makes prep, flash_bwd_tiled (the
# 4th) and flash_bwd_tiled_dq (5th), its dQ accumulator as the 14th buffer of the call (22nd in
# all), and enqueues 3 kernels.
TILED = {"ORCHARD_CL_FAMILY": "tiled"}
CASES += [
    ("clGetKernelWorkGroupInfo:1", TILED, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateKernel:2", TILED, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateKernel:4", TILED, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateKernel:5", TILED, OOM, "CL_OUT_OF_RESOURCES"),
    ("clCreateBuffer:22", TILED, OOM, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),
    ("clEnqueueNDRangeKernel:3", TILED, OOM, "CL_OUT_OF_RESOURCES"),
    ("clEnqueueNDRangeKernel:4", TILED, OOM, "CL_OUT_OF_RESOURCES"),
]
# The split-KV decode (DECODE=1), in both families: after the 8 buffers of every forward, the
# partial outputs (9th) and their max and sum (10th); flash_decode_split then
# flash_decode_combine (the 6th and 7th kernels with the rows family's 5 probes, the 2nd and
# 3rd with the tiled family's 1), the combine's arguments after the split kernel's 10; the
# combine is the 2nd kernel enqueued.
DECODE = {"DECODE": 1}
CASES += [(fault, dict(DECODE, **family), exc, code) for family in (ROWS, TILED)
          for fault, exc, code in [
              ("clCreateBuffer:9", OOM, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),
              ("clCreateBuffer:10", OOM, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),
              ("clSetKernelArg:12", OOM, "CL_OUT_OF_RESOURCES"),
              ("clEnqueueNDRangeKernel:1", OOM, "CL_OUT_OF_RESOURCES"),
              ("clEnqueueNDRangeKernel:2", OOM, "CL_OUT_OF_RESOURCES")]]
CASES += [("clCreateKernel:7", dict(DECODE, **ROWS), OOM, "CL_OUT_OF_RESOURCES"),
          ("clCreateKernel:3", dict(DECODE, **TILED), OOM, "CL_OUT_OF_RESOURCES")]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A program cache holding the binaries of the test problem, so that most cases count
    their calls from a cache hit (and run without a multi-second build)."""
    folder = tmp_path_factory.mktemp("cache")
    for family in (ROWS, TILED):
        for decode in ("0", "1"):
            r = run_python(PRELUDE + "attention('opencl:0')", ORCHARD_CACHE_DIR=folder,
                           DECODE=decode, **family)
            assert r.returncode == 0, r.stderr
    return folder


def result_of(r):
    assert r.returncode == 0, "child crashed (%s):\n%s" % (r.returncode, r.stderr[-3000:])
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, r.stdout + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("fault,env,exc,code", CASES,
                         ids=[c[0] + ("-decode" if "DECODE" in c[1] else "")
                              + ("-tiled" if c[1]["ORCHARD_CL_FAMILY"] == "tiled" else "")
                              for c in CASES])
def test_fault_raises_and_device_recovers(cache_dir, fault, env, exc, code):
    r = run_python(FAIL_THEN_RECOVER, ORCHARD_FAULT=fault, ORCHARD_CACHE_DIR=cache_dir, **env)
    res = result_of(r)
    call = fault.split(":")[0]
    assert res["raised"] == exc, res
    assert "%s failed: %s" % (call, code) in res["msg"] and "on opencl:0" in res["msg"], res
    assert ("MemoryError" in res["mro"]) == (exc == OOM), res
    assert "RuntimeError" in res["mro"], res
    assert res["refs_stable"], res
    assert res["objects_grew"] < 50, res      # the exception and its traceback, not the arrays
    assert res["recovered"] == [True, True], res


def test_rejected_program_binary_is_rebuilt_from_source(cache_dir):
    """A cached binary the driver refuses to load is rebuilt from source: no error at all."""
    code = PRELUDE + r"""
expected = attention("cpu")
ops.reset_stats()
ok = same(attention("opencl:0"), expected)
report(ok=ok, stats=ops.stats()["per_device"]["opencl:0"])
"""
    for fault in ("clCreateProgramWithBinary:1", "clBuildProgram:1"):
        res = result_of(run_python(code, ORCHARD_FAULT=fault, ORCHARD_CACHE_DIR=cache_dir))
        assert res["ok"] and res["stats"]["kernel_builds"] == 1, (fault, res)


LOOP = PRELUDE + r"""
def rss_kb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

def failing_calls(n):
    for _ in range(n):
        try:
            attention("opencl:0")
        except ops.OrchardError:
            pass
        else:
            raise AssertionError("the call did not fail")

failing_calls(100)      # warm up allocator pools and the driver's own caches
gc.collect()
before, objects = rss_kb(), len(gc.get_objects())
failing_calls(400)
gc.collect()
report(grew_kb=rss_kb() - before, objects_grew=len(gc.get_objects()) - objects,
       refs=[sys.getrefcount(x) for x in (q, k, v, do)])
"""


# clEnqueueMapBuffer fails after the kernel was enqueued: release() must wait for it before
# the outputs it writes are freed.
# The decode (DECODE=1): every call fails at the map, after its scratch buffers, both kernels
# and both enqueues were made; or first at the combine's enqueue, then at the split kernel's.
@pytest.mark.parametrize("fault,decode", [
    ("clEnqueueNDRangeKernel:1+", "0"), ("clEnqueueMapBuffer:1+", "0"), ("clCreateBuffer:4+", "0"),
    ("clSetKernelArg:1+", "0"), ("clEnqueueMapBuffer:1+", "1"), ("clEnqueueNDRangeKernel:2+", "1")])
def test_repeated_failures_leak_nothing(cache_dir, fault, decode):
    """400 failing calls (every buffer, kernel and array made before the failure released
    each time) leave resident memory and the object count where they were."""
    res = result_of(run_python(LOOP, timeout=300, ORCHARD_FAULT=fault, DECODE=decode,
                               ORCHARD_CACHE_DIR=cache_dir))
    # 400 leaked calls would hold 400 x (out, lse and 3 gradients, ~40 kB) = 16 MB. Under
    # AddressSanitizer (tools/sanitize.sh) freed memory sits in its quarantine: no measure.
    assert res["grew_kb"] < 2048 or "libasan" in os.environ.get("LD_PRELOAD", ""), res
    assert res["objects_grew"] < 50, res
    assert res["refs"] == [res["refs"][0]] * 4, res


AUTO = PRELUDE + r"""
expected = attention("cpu")
chosen = ops.default_device()
results = [same(attention(None), expected) for _ in range(3)]
try:
    attention("opencl:0")
    explicit = None
except ops.OrchardError as exc:
    explicit = str(exc)
report(chosen=chosen, results=results, explicit=explicit,
       stats=ops.stats()["per_device"]["opencl:0"])
"""


def test_auto_choice_falls_back_to_native_with_one_warning(cache_dir):
    """ORCHARD_AUTO_ANY_OPENCL=1 lets the automatic choice pick the PoCL device, as it would
    pick a GPU; every call on it fails (clEnqueueNDRangeKernel:1+), so every call falls back
    to the native path, with the same results, and says so once. An explicit request for the
    device raises instead."""
    r = run_python(AUTO, ORCHARD_AUTO_ANY_OPENCL=1, ORCHARD_FAULT="clEnqueueNDRangeKernel:1+",
                   ORCHARD_CACHE_DIR=cache_dir, ORCHARD_DEVICE=None, ORCHARD_LOG=None)
    res = result_of(r)
    assert res["chosen"] == "opencl:0", res
    assert res["results"] == [True, True, True], res
    assert "clEnqueueNDRangeKernel failed: CL_OUT_OF_RESOURCES" in res["explicit"], res
    assert res["stats"]["fwd_calls"] == 0 and res["stats"]["bwd_calls"] == 0, res
    warnings = [x for x in r.stderr.splitlines() if "automatically chosen OpenCL device" in x]
    assert len(warnings) == 1, r.stderr
    assert "clEnqueueNDRangeKernel failed" in warnings[0]


PAGED_AUTO = PRELUDE + r"""
kp = randn(rng, (5, 4, 1, 16), np.float32)     # 5 pages of 4 rows
vp = randn(rng, (5, 4, 1, 8), np.float32)
qv = randn(rng, (6, 3, 16), np.float32)
paged = dict(cu_seqlens_q=np.array([0, 2, 6], np.int32), cu_seqlens_k=np.array([0, 7, 16], np.int32),
             block_table=np.array([[3, 0, 4], [1, 2, 0]], np.int32))
chosen = ops.default_device()
auto = ops.flash_attn_varlen_fwd(qv, kp, vp, device=None, **paged)
report(chosen=chosen, same=same(auto, ops.flash_attn_varlen_fwd(qv, kp, vp, device="cpu", **paged)),
       cpu_calls=ops.stats()["per_device"]["cpu"]["fwd_calls"],
       cl_calls=ops.stats()["per_device"]["opencl:0"]["fwd_calls"])
"""


def test_auto_choice_runs_paged_calls_itself():
    """Paged k and v (block_table) are read by OpenCL devices too: an automatically chosen one
    runs such a call itself, with the native path's result."""
    r = run_python(PAGED_AUTO, ORCHARD_AUTO_ANY_OPENCL=1, ORCHARD_DEVICE=None, ORCHARD_LOG=None)
    res = result_of(r)
    assert res == dict(chosen="opencl:0", same=True, cpu_calls=1, cl_calls=1), res


def test_auto_choice_ignores_cpu_devices_without_the_test_setting():
    r = run_python("import orchard_ops as o; print(o.default_device())",
                   ORCHARD_AUTO_ANY_OPENCL=None, ORCHARD_DEVICE=None)
    assert r.stdout.split() == ["cpu"], r.stdout + r.stderr


def test_orchard_device_is_explicit_no_fallback(cache_dir):
    r = run_python(PRELUDE + "attention(None)", ORCHARD_DEVICE="opencl:0",
                   ORCHARD_FAULT="clEnqueueNDRangeKernel:1", ORCHARD_CACHE_DIR=cache_dir)
    assert r.returncode != 0 and "OrchardOutOfMemory" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("spec", ["clNoSuchCall:1", "clFinish:0", "clFinish", "clFinish:x",
                                  "clFinish:1:CL_NO_SUCH_ERROR", "clFinish:1:CL_SUCCESS"])
def test_malformed_fault_spec_disables_opencl_loudly(spec):
    r = run_python("import orchard_ops as o; print([d['id'] for d in o.devices()])",
                   ORCHARD_FAULT=spec)
    assert r.returncode == 0 and r.stdout.strip() == "['cpu']", r.stdout + r.stderr
    assert "ORCHARD_FAULT entry '%s'" % spec in r.stderr and "OpenCL is disabled" in r.stderr
