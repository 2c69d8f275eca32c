"""The OpenCL kernels under Oclgrind, a simulator that reports out-of-bounds accesses, data
races and uninitialised reads (Debian package oclgrind; skipped when it is not installed).

`oclgrind python script.py` preloads Oclgrind's OpenCL runtime, which orchard_ops finds before
any ICD loader, so "opencl:0" is the simulated device. Small blocks (8-row work-groups, 4-row
tiles) make every kernel cross tile and work-group boundaries. Two runs: buffers over host
memory (the unified-memory path) with race and API checks, and explicit transfers (the
discrete-GPU path, ORCHARD_CL_TRANSFERS=1: builds with ORCHARD_TEST_HOOKS=1) with the
uninitialised-read checker too, which needs unoptimised kernels:
Debian's Oclgrind 21.10 cannot simulate the LLVM `freeze` instruction that optimisation emits.
Each with every kernel family: row per work-item, register-tiled (CPUs, at both vector
widths they run: 8 lanes, and 16 where the device prefers them; Oclgrind's device, of every
kind, would get 4) and the work-group tiles of the wg family (GPUs), whose reductions take the
local-memory path here (Oclgrind has no subgroups). The tiled
kernels skip the uninitialised-read checker: on them it reports values that are initialised
(the results are checked in the same run, and the reports move or vanish with unrelated edits
such as a printf), as in Oclgrind's open issue #126 about its shadow tracking of vector types,
which these kernels load and store throughout. Bounds, race and API checks still apply, and
Valgrind's Memcheck runs the same tiled kernels, compiled by PoCL, without a report
(tools/valgrind.sh, test_sanitizers.py).
"""
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import TESTS_DIR, needs_test_hooks, subprocess_env

pytestmark = pytest.mark.skipif(shutil.which("oclgrind") is None, reason="oclgrind not installed")

SCRIPT = r"""
import sys
import numpy as np, orchard_ops as o
from orchard.reference import ref_fwd, ref_bwd, ref_varlen_fwd, ref_varlen_bwd

assert o.devices()[1]["platform"] == "Oclgrind", o.devices()
rng = np.random.default_rng(0)
def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)

def check(got, want, tol):
    for g, w in zip(got, want):
        g = np.asarray(g, np.float64)
        assert not np.isnan(g).any()
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)

cases = [
    # dtype, (B, H, Hkv, Nq, Nk, D, Dv), options
    (np.float32, (1, 2, 1, 10, 13, 8, 4),
     dict(causal=True, window=(6, 1), softcap=4.0, alibi_slopes=np.array([0.3, 0.1]),
          dropout_p=0.25, seed=11)),
    (np.float16, (2, 1, 1, 9, 6, 3, 5), dict()),
    (np.float64, (1, 1, 1, 7, 3, 4, 4), dict(causal=True)),     # rows that see no key
    (np.float32, (1, 1, 1, 5, 0, 4, 4), dict()),                # no keys at all
    (np.float32, (1, 2, 2, 70, 100, 8, 20), dict(window=(9, 3))),  # several blocks both ways
    # one kv unit's 2100 keys: two parts of the tiled family's backward (orchard.h
    # or_bwd_parts), the first partly outside every row's window
    (np.float32, (1, 2, 1, 6, 2100, 8, 4), dict(causal=True, window=(1500, 0))),
    # split-KV decode (nq <= 16; the cases above with few rows take it too): two key splits
    # each (the simulator has 1 compute unit), GQA groups in one row block or a unit's rows
    # over several
    (np.float32, (1, 4, 2, 3, 150, 8, 12),
     dict(causal=True, window=(90, 0), softcap=4.0, alibi_slopes=np.array([0.3, 0.1, 0.2, 0.4]),
          dropout_p=0.25, seed=11)),
    (np.float64, (1, 1, 1, 16, 120, 5, 3), dict(causal=True)),
    (np.float16, (2, 3, 1, 1, 200, 16, 8), dict()),
]
# past the cases: varlen, a dense forward over a KV cache, then paged keys
chosen = [int(a) for a in sys.argv[1:]] or range(len(cases) + 3)
assert all(c <= len(cases) + 2 for c in chosen), chosen
for dtype, (b, h, hkv, nq, nk, d, dv), kw in (cases[c] for c in chosen if c < len(cases)):
    q, do = randn(b, h, nq, d, dtype=dtype), randn(b, h, nq, dv, dtype=dtype)
    k, v = randn(b, hkv, nk, d, dtype=dtype), randn(b, hkv, nk, dv, dtype=dtype)
    q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # strided rows
    out, lse = o.flash_attn_fwd(q, k, v, device="opencl:0", **kw)
    grads = o.flash_attn_bwd(do, q, k, v, out, lse, device="opencl:0", **kw)
    tol = 2e-2 if dtype == np.float16 else 1e-4
    check((out, lse), ref_fwd(q.astype(np.float64), k, v, **kw), tol)
    check(grads, ref_bwd(do.astype(np.float64), q.astype(np.float64), k, v, **kw), tol)

if len(cases) in chosen:
    cu_q, cu_k = np.array([0, 6, 6, 11]), np.array([0, 4, 9, 16])
    q, do = randn(11, 2, 8), randn(11, 2, 8)
    k, v = randn(16, 1, 8), randn(16, 1, 8)
    kw = dict(causal=True, dropout_p=0.2, seed=3)
    out, lse = o.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, device="opencl:0", **kw)
    grads = o.flash_attn_varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, device="opencl:0", **kw)
    check((out, lse), ref_varlen_fwd(q, k, v, cu_q, cu_k, **kw), 1e-4)
    check(grads, ref_varlen_bwd(do, q, k, v, cu_q, cu_k, **kw), 1e-4)

if len(cases) + 1 in chosen:
    # row b's keys leftpad_k[b] to seqused_k[b] (none in row 1)
    q, k, v = randn(2, 2, 1, 8), randn(2, 1, 30, 8), randn(2, 1, 30, 8)
    used, pads = np.array([30, 12]), np.array([4, 12])
    out, lse = o.flash_attn_fwd(q, k, v, causal=True, seqused_k=used, leftpad_k=pads,
                                device="opencl:0")
    for b in range(2):
        row, keys = slice(b, b + 1), slice(pads[b], used[b])
        check((out[row], lse[row]), ref_fwd(q[row].astype(np.float64), k[row, :, keys],
                                            v[row, :, keys], causal=True), 1e-4)

if len(cases) + 2 in chosen:
    # pages of 3 keys in scrambled order, sequences 0 and 1 sharing a row of block_table,
    # left padding; a decode step (3 query rows each) and a prefill (20)
    kp, vp = randn(12, 3, 1, 8), randn(12, 3, 1, 6)
    table = np.array([[7, 2, 9, 4, 0], [7, 2, 9, 4, 0], [11, 5, 3, 1, 8]])
    used, pads = np.array([14, 9, 13]), np.array([0, 2, 5])
    keys = lambda x, b: x[table[b]].reshape(15, 1, -1)[pads[b]:used[b]]
    cu_k = np.concatenate([[0], np.cumsum(used - pads)])
    for nq in (3, 20):
        q = randn(3 * nq, 2, 8)
        cu_q = np.arange(4) * nq
        out, lse = o.flash_attn_varlen_fwd(q, kp, vp, cu_q, np.arange(4) * 15, causal=True,
                                           seqused_k=used, leftpad_k=pads, block_table=table,
                                           device="opencl:0")
        want = ref_varlen_fwd(q.astype(np.float64), np.concatenate([keys(kp, b) for b in range(3)]),
                              np.concatenate([keys(vp, b) for b in range(3)]), cu_q, cu_k,
                              causal=True)
        check((out, lse), want, 1e-4)
print("kernels ok")
"""

REPORT = re.compile(r"Invalid (read|write)|data race|[Uu]ninitiali[sz]ed|FATAL|"
                    r"Oclgrind - |errors generated|out of bounds", re.I)


@pytest.mark.parametrize("family,vector", [("rows", None), ("tiled", 8), ("tiled", 16),
                                           ("wg", None)])
@pytest.mark.parametrize("mode", ["in-place", pytest.param("transfers", marks=needs_test_hooks)])
def test_kernels_clean_under_oclgrind(tmp_path, mode, family, vector):
    script = tmp_path / "kernels.py"
    script.write_text(textwrap.dedent(SCRIPT))
    checks = ["--data-races", "--check-api"]
    # tiled: the smallest blocks, one register-tile step (params.h's or_tiled_step: 48 rows
    # and keys at 8 lanes, 32 at 16), whose tiles need more than the simulator's 32 KiB of
    # local memory: it gets PoCL's 2 MiB; wg: 8-row blocks of 32 work-items, 16-key tiles (a
    # key block of whole lanes)
    if family == "tiled":
        checks += ["--local-mem-size", str(2 << 20)]
    log = tmp_path / "programs.log"
    env = dict(ORCHARD_CL_BLOCK_Q=8, ORCHARD_CL_BLOCK_K=4, ORCHARD_CL_FAMILY=family,
               ORCHARD_NO_CACHE=1, ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=str(log))
    if vector:
        env.update(ORCHARD_CL_VECTOR=vector)
    runs = [[]]         # one process, every case
    if mode == "transfers":
        if family != "tiled":
            checks.append("--uninitialized")
            # a process per case: Oclgrind 21.10 never frees the shadow of a released buffer
            # (plugins/Uninitialized.cpp allocates one only where none is), so a later buffer at
            # the same address reads as uninitialised past the old one's size, as the split-KV
            # decode's scratch does in a process's second decode call
            runs = [[str(c)] for c in range(len(re.findall(r"^    \(np\.", SCRIPT, re.M)) + 3)]
        env.update(ORCHARD_CL_TRANSFERS=1, ORCHARD_CL_OPTIONS="-cl-opt-disable")
    for cases in runs:
        r = subprocess.run(["oclgrind", *checks, sys.executable, str(script), *cases],
                           capture_output=True, text=True, timeout=900,
                           env=subprocess_env(ORCHARD_OPENCL_LIBRARY=None, **env),
                           cwd=TESTS_DIR)  # Oclgrind stands in for the OpenCL library
        reports = [line for line in r.stderr.splitlines() if REPORT.search(line)]
        assert r.returncode == 0, (cases, r.stderr[-4000:])
        assert "kernels ok" in r.stdout, cases
        assert not reports, "\n".join([str(cases)] + reports[:20]) + "\n" + r.stderr[-4000:]
    # every program of the family asked for, at the lanes asked for (4: the simulator is a GPU
    # too); none fell back to rows
    built = re.findall(r"OpenCL program for .*: (\w+) kernels, .*, (\d+) lanes", log.read_text())
    assert built and set(built) == {(family, str(vector or 4))}, set(built)
