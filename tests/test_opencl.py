"""The OpenCL backend's own behaviour: discovery without a runtime, device names, the program
cache across processes, tuned block sizes, explicit transfers, both kernel families,
cross-device equality, logs.

The numerical suite (test_forward.py, test_backward.py, ...) already runs on every OpenCL
device that devices() lists, with the kernel family chosen for it (register-tiled on CPUs,
row per work-item on GPUs); test_kernel_families runs each family on every feature. These
tests need a device, and skip when there is none.
"""
import ast
import json
import os
import re
import shutil
import stat
import subprocess
import time

import numpy as np
import orchard_ops
import pytest

from conftest import (BACKWARD_PARTS, CPU_OPENCL_IDS, OPENCL_IDS, REPO_ROOT, check_backward,
                      check_varlen_backward_in_parts, needs_test_hooks, randn, run_python)

needs_opencl = pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device listed")


def skip_unless_local_memory(dev, size):
    """Skips a test that fits blocks to `size` bytes of local memory (ORCHARD_CL_LOCAL_MEM,
    which never grows a device's) where the device has less: its kernels there get others."""
    has = next(x["local_mem_bytes"] for x in orchard_ops.devices() if x["id"] == dev)
    if has < size:
        pytest.skip("%s has %d KiB of local memory, less than the %d KiB the test fits to"
                    % (dev, has >> 10, size >> 10))


def child(code, **env):
    """Runs code in a fresh interpreter and returns the JSON it printed last."""
    r = run_python(code, timeout=300, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_no_opencl_library_still_imports():
    """With the ICD loader unfindable, the module imports, lists only the CPU, and works."""
    out = child("""
        import json, numpy as np, orchard_ops as o
        q = np.ones((1, 4, 8), np.float32)
        out, lse = o.flash_attn_fwd(q, q, q)
        try:
            o.flash_attn_fwd(q, q, q, device="opencl")
            err = None
        except ValueError as e:
            err = str(e)
        print(json.dumps({"ids": [d["id"] for d in o.devices()], "default": o.default_device(),
                          "out": float(out.sum()), "err": err, "why": o.opencl_unavailable()}))
    """, ORCHARD_OPENCL_LIBRARY="/nonexistent/libOpenCL.so.1")
    assert out["ids"] == ["cpu"] and out["default"] == "cpu"
    assert out["out"] == pytest.approx(32.0)
    # the reason is named, not only the devices there are
    why = "ORCHARD_OPENCL_LIBRARY='/nonexistent/libOpenCL.so.1' cannot be opened"
    assert out["why"].startswith(why) and "'device' 'opencl'" in out["err"]
    assert "no OpenCL device: " + why in out["err"]
    lacking = child("""
        import json, orchard_ops as o
        print(json.dumps(o.opencl_unavailable()))
    """, ORCHARD_OPENCL_LIBRARY="libc.so.6")
    assert lacking == "ORCHARD_OPENCL_LIBRARY='libc.so.6' lacks OpenCL 1.2 entry points"


def test_no_platform_still_imports(tmp_path):
    """An ICD loader with no vendor files (no platform) gives just the CPU. The loader is this
    run's (ORCHARD_OPENCL_LIBRARY's when set): another one on the library path, as an image
    with a GPU driver can hold, may not read OCL_ICD_VENDORS as ocl-icd does."""
    out = child("""
        import json, orchard_ops as o
        print(json.dumps([[d["id"] for d in o.devices()], o.opencl_unavailable()]))
    """, OCL_ICD_VENDORS=str(tmp_path))
    assert out == [["cpu"], "no OpenCL platform is installed (no ICD found)"]


@pytest.mark.skipif(not (os.path.exists("/etc/OpenCL/vendors/pocl.icd")
                         and os.path.exists("/usr/lib/oclgrind/liboclgrind-rt-icd.so")),
                    reason="needs PoCL registered and Oclgrind's ICD library (the README's packages)")
def test_a_simulator_is_never_the_best_device(tmp_path):
    """Oclgrind, registered beside PoCL, calls itself a GPU: the automatic choice skips it (it
    had picked it, every call thousands of times slower) and "opencl" takes the real device;
    named, it is still there."""
    (tmp_path / "pocl.icd").write_text(open("/etc/OpenCL/vendors/pocl.icd").read())
    (tmp_path / "oclgrind.icd").write_text("/usr/lib/oclgrind/liboclgrind-rt-icd.so\n")
    out = child("""
        import json, orchard_ops as o
        info = {d["id"]: d["platform"] for d in o.devices()}
        print(json.dumps([info, o.default_device(), o.resolve_device("opencl"),
                          o.resolve_device("opencl:oclgrind")]))
    """, OCL_ICD_VENDORS=str(tmp_path), ORCHARD_DEVICE=None, ORCHARD_AUTO_ANY_OPENCL=None)
    info, auto, best, named = out
    assert sorted(info.values()) == ["Oclgrind", "Portable Computing Language", "orchard native"]
    assert auto == "cpu"
    assert info[best] == "Portable Computing Language" and info[named] == "Oclgrind"


@needs_opencl
def test_device_names(ops):
    info = [d for d in ops.devices() if d["backend"] == "opencl"]
    first = info[0]
    for key in ("name", "vendor", "kind", "platform", "driver_version", "compute_units",
                "global_mem_bytes", "local_mem_bytes", "max_alloc_bytes", "max_work_group_size",
                "fp16", "fp64",
                "unified_memory"):
        assert key in first, key
    assert first["kind"] in ("cpu", "gpu", "accelerator")
    assert ops.opencl_unavailable() is None
    q = randn(np.random.default_rng(0), (1, 2, 5, 8), np.float32)
    ref, _ = ops.flash_attn_fwd(q, q, q, device=first["id"])
    word = first["platform"].split()[0].lower()     # a substring, any case
    for name in ("opencl", first["id"], "opencl:" + word):
        out, _ = ops.flash_attn_fwd(q, q, q, device=name)
        np.testing.assert_array_equal(out, ref)
    with pytest.raises(ValueError, match="device"):
        ops.flash_attn_fwd(q, q, q, device="opencl:%d" % len(info))
    with pytest.raises(ValueError, match="device"):
        ops.flash_attn_fwd(q, q, q, device="opencl:no-such-device-name")


@needs_opencl
def test_orchard_device_env_selects_opencl():
    out = child("""
        import json, numpy as np, orchard_ops as o
        q = np.ones((1, 4, 8), np.float32)
        o.reset_stats()
        o.flash_attn_fwd(q, q, q)
        print(json.dumps({"default": o.default_device(),
                          "calls": o.stats()["per_device"]["%s"]["fwd_calls"]}))
    """ % OPENCL_IDS[0], ORCHARD_DEVICE=OPENCL_IDS[0])
    assert out == {"default": OPENCL_IDS[0], "calls": 1}


CACHE_RUN = """
    import json, numpy as np, orchard_ops as o
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 20, 12)).astype(np.float32) for _ in range(3))
    out, lse = o.flash_attn_fwd(q, k, v, causal=True, device="%s")
    ref, _ = o.flash_attn_fwd(q, k, v, causal=True, device="cpu")
    st = o.stats()["per_device"]["%s"]
    print(json.dumps({"builds": st["kernel_builds"], "hits": st["cache_hits"],
                      "err": float(np.abs(out - ref).max())}))
"""


@needs_opencl
def test_program_cache_across_processes(tmp_path):
    dev = OPENCL_IDS[0]
    cache = tmp_path / "cache"
    first = child(CACHE_RUN % (dev, dev), ORCHARD_CACHE_DIR=cache, ORCHARD_NO_CACHE=None)
    assert first["builds"] == 1 and first["hits"] == 0 and first["err"] < 1e-5
    files = list(cache.iterdir())
    assert len(files) == 1
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    second = child(CACHE_RUN % (dev, dev), ORCHARD_CACHE_DIR=cache, ORCHARD_NO_CACHE=None)
    assert second["builds"] == 0 and second["hits"] == 1 and second["err"] < 1e-5

    data = files[0].read_bytes()
    for broken in (data[: len(data) // 2], data[:40] + bytes(len(data) - 40), b"garbage"):
        files[0].write_bytes(broken)
        again = child(CACHE_RUN % (dev, dev), ORCHARD_CACHE_DIR=cache, ORCHARD_NO_CACHE=None)
        assert again["builds"] == 1 and again["hits"] == 0 and again["err"] < 1e-5
        assert files[0].read_bytes() == data or len(files[0].read_bytes()) > 40


@needs_opencl
def test_program_cache_refuses_another_programs_entry_and_a_fifo(tmp_path):
    """An entry copied over another's name checks out on its own (magic, size, checksum):
    the key inside it tells them apart, else the wrong kernels would run on this call's
    buffers. A FIFO in an entry's place must not hang the process."""
    dev = OPENCL_IDS[0]
    cache = tmp_path / "cache"
    env = dict(ORCHARD_CACHE_DIR=cache, ORCHARD_NO_CACHE=None)
    child(CACHE_RUN % (dev, dev), **env)
    [mine] = list(cache.iterdir())
    wide = CACHE_RUN.replace("(1, 2, 20, 12)", "(1, 2, 20, 64)")
    assert child(wide % (dev, dev), **env)["builds"] == 1
    [other] = [f for f in cache.iterdir() if f != mine]
    mine.write_bytes(other.read_bytes())
    again = child(CACHE_RUN % (dev, dev), **env)
    assert again["builds"] == 1 and again["hits"] == 0 and again["err"] < 1e-5
    mine.unlink()
    os.mkfifo(mine)
    again = child(CACHE_RUN % (dev, dev), **env)
    assert again["builds"] == 1 and again["hits"] == 0 and again["err"] < 1e-5


@needs_opencl
def test_program_cache_removes_the_least_recently_used_past_its_bound(tmp_path):
    """Past 256 MiB of entries a store removes the least recently used (a load marks an entry
    used) down to 192 MiB, and temporary files an hour old; tuned block sizes (entries of a few
    bytes) and files that are no entries stay. Sparse files of 100 MiB stand in for old
    programs."""
    dev = OPENCL_IDS[0]
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    old = ["%032x.clbin" % i for i in range(4)]
    for age, name in enumerate(old):
        with open(cache / name, "wb") as f:
            f.truncate(100 << 20)
        os.utime(cache / name, (1000 + age, 1000 + age))   # old[0] the least recently used
    (cache / ("%032x.clbin" % 99)).write_bytes(b"48 96")      # a tuned record's size
    with open(cache / "notes.txt", "wb") as f:
        f.truncate(300 << 20)
    # temporary files of stores: one a killed process left two hours ago, one under way
    stale, fresh = "%032x.clbin.Ab3dE9" % 7, "%032x.clbin.xY7zQ1" % 8
    for name in (stale, fresh):
        (cache / name).write_bytes(b"part of a binary")
    for name in ("notes.txt", "%032x.clbin" % 99, stale):
        os.utime(cache / name, (time.time() - 7200,) * 2)
    first = child(CACHE_RUN % (dev, dev), ORCHARD_CACHE_DIR=cache, ORCHARD_NO_CACHE=None)
    assert first["builds"] == 1
    left = sorted(f.name for f in cache.iterdir())
    # 400 MiB and the new entry: the three oldest go, which leaves 100 MiB and the new one
    assert [n for n in old if n in left] == old[3:]
    assert stale not in left and fresh in left
    assert "notes.txt" in left and "%032x.clbin" % 99 in left and len(left) == 5
    [new] = [n for n in left if n not in old and n not in ("notes.txt", fresh)
             and not n.startswith("0" * 30)]
    before = os.stat(cache / new).st_mtime
    os.utime(cache / new, (before - 100, before - 100))
    again = child(CACHE_RUN % (dev, dev), ORCHARD_CACHE_DIR=cache, ORCHARD_NO_CACHE=None)
    assert again["hits"] == 1 and os.stat(cache / new).st_mtime > before - 50    # used now


@needs_opencl
def test_no_cache_env(tmp_path):
    dev = OPENCL_IDS[0]
    for _ in range(2):
        out = child(CACHE_RUN % (dev, dev), ORCHARD_CACHE_DIR=tmp_path, ORCHARD_NO_CACHE=1)
        assert out["builds"] == 1 and out["hits"] == 0
    assert list(tmp_path.iterdir()) == []


FAMILY_RUN = """
    import json, numpy as np, orchard_ops as o
    from orchard.reference import ref_fwd, ref_bwd, ref_varlen_fwd, ref_varlen_bwd
    rng = np.random.default_rng(5)
    cases = [   # dtype, (B, H, Hkv, Nq, Nk, D, Dv), options
        (np.float32, (2, 4, 2, 130, 200, 64, 64), dict()),
        (np.float32, (1, 2, 1, 97, 150, 40, 24),
         dict(causal=True, window=(60, 7), softcap=3.0, alibi_slopes=np.array([0.3, 0.05]),
              dropout_p=0.2, seed=9)),
        (np.float16, (1, 3, 3, 50, 31, 80, 8), dict(causal=True)),
        (np.float64, (1, 1, 1, 120, 40, 16, 16), dict(causal=True)),   # rows that see no key
        (np.float32, (1, 2, 1, 40, 70, 256, 200), dict(softcap=2.0)),  # the largest head dims
    ]
    checked = 0
    for dtype, (b, h, hkv, nq, nk, d, dv), kw in cases:
        q, do = (rng.standard_normal((b, h, nq, x)).astype(dtype) for x in (d, dv))
        k, v = (rng.standard_normal((b, hkv, nk, x)).astype(dtype) for x in (d, dv))
        out, lse = o.flash_attn_fwd(q, k, v, device="%s", **kw)
        got = (out, lse) + o.flash_attn_bwd(do, q, k, v, out, lse, device="%s", **kw)
        want = ref_fwd(q.astype(float), k, v, **kw) + ref_bwd(do.astype(float), q.astype(float), k, v, **kw)
        tol = 2e-2 if dtype == np.float16 else 1e-4
        for g, w in zip(got, want):
            g = np.asarray(g, float)      # lse is -inf where a row sees no key: equal, not nan
            err = np.where(g == w, 0, np.abs(g - w)).max(initial=0) / (1 + np.abs(w[np.isfinite(w)]).max(initial=0))
            assert err < tol, (dtype, kw, err)
            checked += 1
    cu_q, cu_k = np.array([0, 70, 70, 181]), np.array([0, 40, 140, 250])
    q, do = rng.standard_normal((2, 181, 2, 32)).astype(np.float32)
    k, v = rng.standard_normal((2, 250, 1, 32)).astype(np.float32)
    kw = dict(causal=True, dropout_p=0.1, seed=4)
    out, lse = o.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, device="%s", **kw)
    got = (out, lse) + o.flash_attn_varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, device="%s", **kw)
    want = ref_varlen_fwd(q, k, v, cu_q, cu_k, **kw) + ref_varlen_bwd(do, q, k, v, cu_q, cu_k, **kw)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, float), w, rtol=1e-4, atol=1e-4)
        checked += 1
    # float16 rows 34 bytes apart: views of padded rows, two heads (PoCL's vload_half8 faulted)
    q, k, v, do = (rng.standard_normal((1, 2, n, 17)).astype(np.float16)[..., :16]
                   for n in (1, 2, 2, 1))
    out, lse = o.flash_attn_fwd(q, k, v, device="%s")
    got = (out, lse) + o.flash_attn_bwd(do, q, k, v, out, lse, device="%s")
    for g, w in zip(got, ref_fwd(q.astype(float), k, v) + ref_bwd(do.astype(float), q.astype(float), k, v)):
        np.testing.assert_allclose(np.asarray(g, float), w, rtol=2e-2, atol=2e-2)
        checked += 1
    # keys that no window reaches (the first 175) may hold NaN and inf: nothing changes, with a
    # softcap too (its derivative at a masked score is 0, not that of a NaN score)
    q, do = rng.standard_normal((2, 1, 2, 100, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 2, 300, 16)).astype(np.float32)
    kp, vp = k.copy(), v.copy()
    kp[..., :175, :], vp[..., :175, :] = np.nan, np.inf
    for softcap in (0.0, 5.0):
        kw = dict(causal=True, window=(25, 0), softcap=softcap, device="%s")
        runs = []
        for kk, vv in ((k, v), (kp, vp)):
            out, lse = o.flash_attn_fwd(q, kk, vv, **kw)
            runs.append((out, lse) + o.flash_attn_bwd(do, q, kk, vv, out, lse, **kw))
        for n, (clean, poisoned) in enumerate(zip(*runs)):
            if n >= 3:      # dK, dV: zero for the keys nobody sees
                assert not poisoned[..., :175, :].any(), softcap
                clean, poisoned = clean[..., 175:, :], poisoned[..., 175:, :]
            np.testing.assert_array_equal(poisoned, clean)
            checked += 1
    print(json.dumps(checked))
"""


@needs_opencl
@pytest.mark.parametrize("family,vector", [("rows", ""), ("tiled", ""), ("tiled", "8"),
                                           ("wg", "")])
def test_kernel_families(family, vector):
    """Every OpenCL kernel family (ORCHARD_CL_FAMILY) on every feature, several blocks each
    way, against the float64 reference; small blocks so that every edge is crossed (the wg
    family rounds them to whole micro-tiles: 32 x 32; the tiled one to register-tile steps,
    32 or 48). The tiled family also at 8 lanes, where the device would take 16 (PoCL on
    AVX-512)."""
    dev = OPENCL_IDS[0]
    checked = child(FAMILY_RUN % ((dev,) * 7), ORCHARD_CL_FAMILY=family, ORCHARD_CL_BLOCK_Q=30,
                    ORCHARD_CL_BLOCK_K=20, ORCHARD_CL_VECTOR=vector or None)
    assert checked == 5 * 5 + 5 + 5 + 2 * 5     # out, lse, dq, dk, dv of every case


@pytest.mark.skipif(not CPU_OPENCL_IDS, reason="no OpenCL CPU device listed")
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("case", sorted(BACKWARD_PARTS))
def test_tiled_backward_in_parts_of_keys(ops, rng, dtype, case):
    """The tiled family's backward of few kv units gives each part of a unit's keys a
    work-group (orchard.h or_bwd_parts, as the native path), their dQ added by
    flash_bwd_tiled_dq: keys split across parts, parts some rows or every row cannot see."""
    (b, h, hkv, nq, nk, d), kw = BACKWARD_PARTS[case]
    q, k, v = (randn(rng, (b, h, nq, d), dtype), randn(rng, (b, hkv, nk, d), dtype),
               randn(rng, (b, hkv, nk, d), dtype))
    check_backward(ops, CPU_OPENCL_IDS[0], q, k, v, randn(rng, q.shape, dtype), what=case, **kw)


@pytest.mark.skipif(not CPU_OPENCL_IDS, reason="no OpenCL CPU device listed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_varlen_backward_in_parts_of_keys(ops, rng, dtype):
    """Sequences shorter than the parts of the longest: their later parts have no keys."""
    check_varlen_backward_in_parts(ops, CPU_OPENCL_IDS[0], rng, dtype, CPU_OPENCL_IDS[0])


DECODE_RUN = """
    import json, numpy as np, orchard_ops as o
    from orchard.reference import ref_fwd, ref_varlen_fwd
    rng = np.random.default_rng(8)
    dev = "%s"
    def err(got, want):     # lse is -inf where a row sees no key: equal, not nan
        got = np.asarray(got, float)
        return np.where(got == want, 0, np.abs(got - want)).max(initial=0) / (1 + np.abs(want[np.isfinite(want)]).max(initial=0))
    tol = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}
    cases = [   # dtype, (B, H, Hkv, Nq, Nk, D, Dv), options
        (np.float32, (1, 8, 2, 1, 3000, 64, 64), dict()),
        (np.float32, (2, 4, 1, 4, 1500, 40, 24),
         dict(causal=True, window=(900, 3), softcap=3.0, alibi_slopes=np.array([0.3, 0.05, 0.1, 0.2]),
              dropout_p=0.2, seed=9, scale=0.4)),
        (np.float16, (1, 2, 2, 16, 2000, 256, 8), dict(causal=True)),
        (np.float64, (1, 3, 1, 16, 700, 1, 5), dict(window=(-1, 2))),
        (np.float32, (1, 2, 1, 16, 5, 16, 16), dict(causal=True)),     # rows that see no key
        (np.float32, (1, 2, 2, 3, 0, 8, 8), dict()),                    # no keys at all
    ]
    checked = calls = 0
    for dtype, (b, h, hkv, nq, nk, d, dv), kw in cases:
        q = rng.standard_normal((b, nq, h, d)).astype(dtype).transpose(0, 2, 1, 3)   # strided rows
        k, v = (rng.standard_normal((b, hkv, nk, x)).astype(dtype) for x in (d, dv))
        got = o.flash_attn_fwd(q, k, v, device=dev, **kw)
        calls += 1
        for g, w in zip(got, ref_fwd(q.astype(float), k, v, **kw)):
            assert err(g, w) < tol[dtype], (dtype, kw, err(g, w))
            checked += 1
    cu_q, cu_k = np.array([0, 1, 17, 17, 21]), np.array([0, 900, 1200, 1205, 1205])
    q = rng.standard_normal((21, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1205, 2, 32)).astype(np.float32) for _ in range(2))
    kw = dict(causal=True, dropout_p=0.1, seed=4, softcap=5.0)
    got = o.flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, device=dev, **kw)
    calls += 1
    for g, w in zip(got, ref_varlen_fwd(q, k, v, cu_q, cu_k, **kw)):
        assert err(g, w) < 1e-4, err(g, w)
        checked += 1
    # as close to the reference as the unsplit forward: the same rows after 17 more (no
    # mask that the row count moves) take that one
    for dtype in (np.float16, np.float32, np.float64):
        for nq in (1, 4, 16):
            q = rng.standard_normal((1, 8, nq + 17, 64)).astype(dtype)
            k, v = (rng.standard_normal((1, 2, 3000, 64)).astype(dtype) for _ in range(2))
            kw = dict(softcap=3.0, dropout_p=0.2, seed=9)
            decode = o.flash_attn_fwd(np.ascontiguousarray(q[:, :, :nq]), k, v, device=dev, **kw)
            unsplit = o.flash_attn_fwd(q, k, v, device=dev, **kw)
            calls += 2
            want = ref_fwd(q[:, :, :nq].astype(float), k, v, **kw)
            for dg, ug, w in zip(decode, unsplit, want):
                slack = 4 * np.finfo(dtype).eps * np.abs(w).max()
                assert err(dg, w) <= 1.5 * err(ug[..., :nq, :] if ug.ndim == 4 else ug[..., :nq], w) + slack, (dtype, nq)
                checked += 1
    st = o.stats()["per_device"][dev]
    print(json.dumps([checked, st["fwd_calls"] == calls, st["decode_calls"]]))
"""


@needs_opencl
@pytest.mark.parametrize("family", ["rows", "tiled", "wg"])
def test_decode_families(family):
    """The split-KV decode (<= 16 query rows per head, flash_decode.cl) of every family (wg
    programs run the rows family's split kernel with their own blocks) with their default
    blocks, so long caches take several key splits: every feature, GQA, head dims 1 to 256,
    dv != d, strided queries, varlen, rows that see no key, against the float64 reference; at
    least as close to it as the unsplit forward of the same rows; every such call counted in
    decode_calls."""
    checked, counted, decode_calls = child(DECODE_RUN % OPENCL_IDS[0], ORCHARD_CL_FAMILY=family)
    assert checked == 6 * 2 + 2 + 9 * 2 and counted
    assert decode_calls == 7 + 9      # the unsplit calls have 17 rows or more


WG_RUN = """
    import json, numpy as np, orchard_ops as o
    from orchard.reference import ref_fwd, ref_bwd
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((1, 4, 75, 48)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 90, 48)).astype(np.float32) for _ in range(2))
    kw = dict(causal=True, softcap=4.0, dropout_p=0.1, seed=5)
    out, lse = o.flash_attn_fwd(q, k, v, device="%s", **kw)
    runs = [o.flash_attn_bwd(do, q, k, v, out, lse, device="%s", **kw) for _ in range(2)]
    want = ref_fwd(q.astype(float), k, v, **kw) + ref_bwd(do.astype(float), q.astype(float), k, v, **kw)
    err = max(float(np.abs(g - w).max()) for g, w in zip((out, lse) + runs[0], want))
    print(json.dumps({"err": err, "same": all(np.array_equal(a, b) for a, b in zip(*runs)),
                      "out": out.ravel()[::97].tolist()}))
"""


@needs_opencl
def test_wg_reductions_and_determinism(tmp_path):
    """The wg family's softmax row reductions, through subgroups where the device has them
    and through local memory (forced by -DOR_WG_NO_SUBGROUPS): both match the float64
    reference and each other; two backward runs give identical bits (no atomics). The debug
    log names the blocks, rounded to whole micro-tiles (bq of 4 rows, bk of 16 keys)."""
    dev, log = OPENCL_IDS[0], tmp_path / "orchard.log"
    env = dict(ORCHARD_CL_FAMILY="wg", ORCHARD_CL_BLOCK_Q=10, ORCHARD_CL_BLOCK_K=20,
               ORCHARD_NO_CACHE=1)
    default = child(WG_RUN % (dev, dev), ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=log, **env)
    local = child(WG_RUN % (dev, dev), ORCHARD_CL_OPTIONS="-DOR_WG_NO_SUBGROUPS", **env)
    for run in (default, local):
        assert run["err"] < 1e-4 and run["same"]
    np.testing.assert_allclose(default["out"], local["out"], rtol=1e-5, atol=1e-6)
    assert "wg kernels, blocks 12 x 32" in log.read_text()


FIT_RUN = """
    import json, numpy as np, orchard_ops as o
    from orchard.reference import ref_fwd, ref_bwd
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 2, 50, %d)).astype(np.%s) for _ in range(4))
    out, lse = o.flash_attn_fwd(q, k, v, causal=True, device="%s")
    got = (out, lse) + o.flash_attn_bwd(do, q, k, v, out, lse, causal=True, device="%s")
    want = ref_fwd(q, k, v, causal=True) + ref_bwd(do, q, k, v, causal=True)
    print(json.dumps(max(float(np.abs(g - w).max()) for g, w in zip(got, want))))
"""


@needs_opencl
@needs_test_hooks
@pytest.mark.parametrize("dtype, d, logged", [
    ("float32", 128, "wg kernels, blocks 16 x 16 (forward 32 x 32, backward 16 x 16)"),
    ("float64", 256, "rows kernels")])
def test_wg_blocks_fit_local_memory(tmp_path, dtype, d, logged):
    """With 48 KiB of local memory, as GPUs commonly offer (ORCHARD_CL_LOCAL_MEM, a test
    hook): float32 D 128 runs the wg family on blocks halved until the tiles of its backward
    and decode kernels fit (16 x 16, from 64 x 64), and its forward on its own (32 x 32);
    float64 D 256, whose smallest wg tiles (4 x 16) need 83 KiB, runs the rows family. Results
    stay those of the reference."""
    dev, log = OPENCL_IDS[0], tmp_path / "orchard.log"
    skip_unless_local_memory(dev, 48 * 1024)
    err = child(FIT_RUN % (d, dtype, dev, dev), ORCHARD_CL_FAMILY="wg", ORCHARD_NO_CACHE=1,
                ORCHARD_CL_LOCAL_MEM=48 * 1024, ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=log)
    assert err < (1e-4 if dtype == "float32" else 1e-10)
    assert logged in log.read_text()


@needs_opencl
@needs_test_hooks
def test_wg_forward_blocks_not_taken_from_a_tuned_record(tmp_path):
    """A tuned record holds the blocks the backward ran as (orchard-tune), smaller than what
    the forward fits to its own tiles: the wg forward fits from the defaults instead (48 KiB
    at D 64: backward 16 x 16 as tuned, forward 64 x 32), results those of the reference."""
    dev, log = OPENCL_IDS[0], tmp_path / "orchard.log"
    skip_unless_local_memory(dev, 48 * 1024)
    err = child("""
    import orchard_ops
    assert orchard_ops.save_tuned_blocks("%s", 16, 16)
""" % dev + FIT_RUN % (64, "float32", dev, dev), ORCHARD_CL_FAMILY="wg",
                ORCHARD_CACHE_DIR=tmp_path, ORCHARD_CL_LOCAL_MEM=48 * 1024,
                ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=log)
    assert err < 1e-4
    assert ("wg kernels, blocks 16 x 16 (forward 64 x 32, backward 16 x 16, tuned)"
            in log.read_text())


TILED_BLOCKS_RUN = """
    import json, numpy as np, orchard_ops as o
    from orchard.reference import ref_fwd, ref_bwd
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 2, 400, %d)).astype(np.float32) for _ in range(4))
    err = 0.0
    for causal in (False, True):
        out, lse = o.flash_attn_fwd(q, k, v, causal=causal, window=(150, -1), device="%s")
        got = (out, lse) + o.flash_attn_bwd(do, q, k, v, out, lse, causal=causal,
                                            window=(150, -1), device="%s")
        want = (ref_fwd(q, k, v, causal=causal, window=(150, -1))
                + ref_bwd(do, q, k, v, causal=causal, window=(150, -1)))
        err = max([err] + [float(np.abs(g - w).max()) for g, w in zip(got, want)])
    print(json.dumps(err))
"""


@needs_opencl
@needs_test_hooks
@pytest.mark.parametrize("d, env, logged", [
    (64, {}, "blocks 96 x 96 (forward 192 x 96, backward 96 x 192), 16 lanes"),
    (128, {}, "blocks 96 x 96 (forward 192 x 96, backward 96 x 192), 16 lanes"),
    (256, {}, "blocks 96 x 96 (forward 96 x 96, backward 96 x 96), 16 lanes"),
    (64, {"ORCHARD_CL_VECTOR": 8},
     "blocks 96 x 96 (forward 96 x 96, backward 96 x 192), 8 lanes"),
    (64, {"ORCHARD_CL_BLOCK_Q": 96},
     "blocks 96 x 96 (forward 96 x 96, backward 96 x 192), 16 lanes"),
    (64, {"ORCHARD_CL_BLOCK_K": 96},
     "blocks 96 x 96 (forward 192 x 96, backward 96 x 96), 16 lanes"),
    (64, {"ORCHARD_CL_BLOCK_Q": "", "ORCHARD_CL_BLOCK_K": ""},
     "blocks 96 x 96 (forward 192 x 96, backward 96 x 192), 16 lanes"),
    (64, {"ORCHARD_CL_BLOCK_Q": 320},
     "blocks 320 x 96 (forward 320 x 96, backward 320 x 96), 16 lanes"),
    (128, {"ORCHARD_CL_LOCAL_MEM": 1 << 20},
     "blocks 96 x 96 (forward 96 x 96, backward 96 x 96), 16 lanes"),
    (64, {"ORCHARD_CL_LOCAL_MEM": 512 << 10},
     "blocks 96 x 96 (forward 96 x 96, backward 96 x 96), 16 lanes"),
    (64, {"tuned": (64, 64)},
     "blocks 96 x 96 (forward 192 x 96, backward 64 x 64, tuned), 16 lanes"),
    (64, {"tuned": (96, 192)},
     "blocks 96 x 96 (forward 192 x 96, backward 96 x 192, tuned), 16 lanes")])
def test_tiled_forward_and_backward_blocks(tmp_path, d, env, logged):
    """The tiled forward copies each key and value block into local tiles once per block of
    query rows, the backward each block of query rows once per block of keys: at 16 lanes the
    forward takes twice the family's rows (192, not from a tuned record) where its tiles then
    take at most a quarter of local memory, the backward, at any width, twice its keys (not
    where a tuned record sets them) where its tiles take at most half (2 MiB here, as PoCL's on
    an Emerald Rapids Xeon: D 64 and 128 yes, D 256 no; 1 MiB at D 128 and 512 KiB at D 64:
    no; a case skips on a device with less local memory than it fits to). ORCHARD_CL_BLOCK_Q sets
    the rows and ORCHARD_CL_BLOCK_K the keys of both (empty, a variable is unset); decoding
    keeps the family's blocks (the log's first pair), with a tuned record too. 400 query rows
    (blocks of 192, 192 and 16), causal and not with a window, forward and backward against
    the reference."""
    dev, log = OPENCL_IDS[0], tmp_path / "orchard.log"
    env = dict(env)
    tuned = env.pop("tuned", None)
    setup = ("""
    import orchard_ops
    assert orchard_ops.save_tuned_blocks("%s", %d, %d)
""" % ((dev,) + tuned)) if tuned else ""
    env = {"ORCHARD_CL_VECTOR": 16, "ORCHARD_CL_LOCAL_MEM": 2 << 20, **env}
    skip_unless_local_memory(dev, env["ORCHARD_CL_LOCAL_MEM"])
    err = child(setup + TILED_BLOCKS_RUN % (d, dev, dev), ORCHARD_CL_FAMILY="tiled",
                ORCHARD_CACHE_DIR=tmp_path, ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=log, **env)
    assert err < 1e-4
    assert "tiled kernels, " + logged in log.read_text()


POCL_WORKERS_RUN = """
    import ctypes, json, os, numpy as np
    if %r:
        os.sched_setaffinity(0, %r)
    def threads():
        return set(os.listdir("/proc/self/task"))
    before = threads()
    import orchard_ops as o
    o.devices()     # discovery starts PoCL's worker threads
    workers = threads() - before
    q = np.ones((1, 2, 64, 16), np.float32)
    assert float(o.flash_attn_fwd(q, q, q, device="%s")[0].sum()) == 2 * 64 * 16
    def allowed(t):
        with open("/proc/self/task/%%s/status" %% t) as f:
            line = next(l for l in f if l.startswith("Cpus_allowed_list"))
        return line.split()[1]
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    print(json.dumps([sorted(allowed(t) for t in workers),
                      (libc.getenv(b"POCL_AFFINITY") or b"").decode()]))
"""

def pocl_id():
    """The first CPU device of PoCL's platform, or None."""
    import orchard_ops
    return next((d["id"] for d in orchard_ops.devices() if d["id"] in CPU_OPENCL_IDS
                 and d["platform"] == "Portable Computing Language"), None)


POCL_ID = pocl_id() if CPU_OPENCL_IDS else None


@pytest.mark.skipif(POCL_ID is None or len(os.sched_getaffinity(0)) < 2
                    or os.sched_getaffinity(0) != set(range(os.cpu_count())),
                    reason="needs PoCL and a process that may run on every CPU (2 or more)")
@pytest.mark.parametrize("env, mask", [({}, None), ({"POCL_AFFINITY": "0"}, None),
                                       ({}, "last")])
def test_pocl_workers_pinned(env, mask):
    """PoCL's worker threads, woken for every command, often woke on one core between other
    work and shared it: orchard sets POCL_AFFINITY=1 while it discovers the platforms (PoCL
    pins worker i to CPU i as it starts them), for that time alone. Not where the user set it
    (0: the workers may run anywhere), nor where the process may run on fewer CPUs (here only
    the last: PoCL would pin a worker outside that set)."""
    cpus = os.cpu_count()
    only = {cpus - 1} if mask else None
    unset = dict.fromkeys(["POCL_AFFINITY", "POCL_MAX_PTHREAD_COUNT", "POCL_CPU_MAX_CU_COUNT",
                           "POCL_MAX_COMPUTE_UNITS"])
    workers, left = child(POCL_WORKERS_RUN % (only, only, POCL_ID), **{**unset, **env})
    assert left == env.get("POCL_AFFINITY", "")     # not left in the environment
    assert workers
    if mask:
        assert set(workers) == {str(cpus - 1)}
    elif env:
        assert set(workers) == {"0-%d" % (cpus - 1)}
    else:
        assert sorted(workers, key=int) == [str(c) for c in range(len(workers))]


@pytest.mark.skipif(not CPU_OPENCL_IDS, reason="no OpenCL CPU device listed")
@pytest.mark.parametrize("d, dtype, rows", [
    (128, "float32", {682}),
    (12, "float64", {936, 910}),    # 12 or 16 reals a row, as the device's vector width pads
])
def test_rows_blocks_fit_a_cpu_threads_stack(tmp_path, d, dtype, rows):
    """On a CPU device the rows family's work-group keeps its private state on one thread's
    stack: ORCHARD_CL_BLOCK_Q=4096 crashed PoCL's backward at D 128 (float32) and, held to 1
    MiB of rows of D + Dv reals, still at D 12 of float64 (about 3.2 KiB a work-item, its
    rows a tenth of it); the work-group now holds 4 MiB counted as 2 (D + Dv) reals and 4 KiB
    a work-item, results those of the reference."""
    dev, log = CPU_OPENCL_IDS[0], tmp_path / "orchard.log"
    err = child(FIT_RUN % (d, dtype, dev, dev), ORCHARD_CL_FAMILY="rows",
                ORCHARD_CL_BLOCK_Q=4096, ORCHARD_NO_CACHE=1, ORCHARD_DEBUG_FLASH_ATN=1,
                ORCHARD_LOG=log)
    assert err < 1e-4
    assert int(re.search(r"rows kernels, blocks (\d+) x", log.read_text()).group(1)) in rows


def kernel_source():
    """The program source setup.py embeds: the kernels/ files in its order."""
    setup_py = os.path.join(REPO_ROOT, "setup.py")
    tree = ast.parse(open(setup_py).read())
    files = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "KERNELS")
    return "".join(open(os.path.join(REPO_ROOT, f)).read() for f in files)


def clang_15_or_later():
    """A clang whose OpenCL header declares the subgroup built-ins in OpenCL C 1.2 under
    cl_intel_subgroups: 15 or later (clang 14's declares none there, whatever the macros)."""
    for name in ("clang", "clang-19", "clang-18", "clang-17", "clang-16", "clang-15"):
        if shutil.which(name):
            version = subprocess.run([name, "--version"], capture_output=True, text=True).stdout
            major = re.search(r"clang version (\d+)", version)
            if major and int(major.group(1)) >= 15:
                return name
    return None


CLANG = clang_15_or_later()


@pytest.mark.skipif(CLANG is None, reason="no clang 15 or later to compile OpenCL C with")
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
def test_wg_subgroup_path_compiles(tmp_path, dtype):
    """No device here has subgroups (PoCL's CPU device, Oclgrind), so the subgroup reductions
    of the wg family are checked by compiling its kernels for SPIR with clang: where the host
    says the device has subgroups (-DOR_WG_SUBGROUPS) and the compiler declares them, with
    cl_intel_subgroups in OpenCL C 1.2 (what orchard builds), cl_khr_subgroups in 2.0 or the
    __opencl_c_subgroups feature in 3.0, the kernels call sub_group_reduce_max/add; with
    -DOR_WG_NO_SUBGROUPS, or where either is missing, they do not."""
    src = tmp_path / "orchard.cl"
    src.write_text(kernel_source())
    storage, real = {"f16": (16, 4), "bf16": (116, 4), "f32": (32, 4), "f64": (64, 8)}[dtype]
    modes = {   # options: whether subgroups reduce the rows
        "-cl-std=CL1.2 -DOR_WG_SUBGROUPS": True,
        "-cl-std=CL2.0 -DOR_WG_SUBGROUPS -Xclang -cl-ext=-cl_intel_subgroups": True,
        "-cl-std=CL3.0 -DOR_WG_SUBGROUPS -Xclang "
        "-cl-ext=-cl_intel_subgroups,-cl_khr_subgroups,+__opencl_c_subgroups": True,
        "-cl-std=CL1.2 -DOR_WG_SUBGROUPS -DOR_WG_NO_SUBGROUPS": False,
        "-cl-std=CL1.2 -DOR_WG_SUBGROUPS -Xclang -cl-ext=-cl_intel_subgroups": False,
        "-cl-std=CL1.2": False,     # the device lists neither extension
    }
    params_size = 64 if real == 8 else 56      # or_params: 3 longs, 3 reals, 4 ints, aligned
    for options, subgroups in modes.items():
        ir = tmp_path / "orchard.ll"
        # -Dinline=: the helpers get bodies in the module, so their calls show
        r = subprocess.run([CLANG, "-x", "cl", *options.split(), "-target", "spir64", "-Xclang",
                            "-finclude-default-header", "-DOR_FAMILY=2", "-DOR_STORAGE=%d" % storage,
                            "-DHEAD_D=72", "-DHEAD_DV=40", "-DVW=4", "-DBQ=32", "-DBK=32",
                            "-DFQ=32", "-DFK=48", "-DSQ=32", "-DSK=32",
                            "-DOR_PARAMS_SIZE=%d" % params_size, "-Dinline=", "-O0", "-emit-llvm",
                            "-S", "-o", str(ir), str(src)], capture_output=True, text=True)
        assert r.returncode == 0, (options, r.stderr[-3000:])
        calls = set(re.findall(r"@_Z\d+(sub_group_reduce_\w+?)[fd]\b", ir.read_text()))
        assert calls == ({"sub_group_reduce_max", "sub_group_reduce_add"} if subgroups else set()), options


FAMILY_PROBE = """
    import json, numpy as np, orchard_ops as o
    q = np.ones((1, 2, 8, 16), np.float32)
    try:
        o.flash_attn_fwd(q, q, q, device="%s")
        print(json.dumps(None))
    except o.OrchardError as e:
        print(json.dumps(str(e)))
"""


@needs_opencl
def test_params_struct_checked_against_host():
    """The host passes the size of the parameter struct it sends; a program whose struct
    differs (here: a host that claims 7 bytes) fails to build instead of reading shifted
    fields."""
    dev = OPENCL_IDS[0]
    assert child(FAMILY_PROBE % dev, ORCHARD_NO_CACHE=1) is None
    err = child(FAMILY_PROBE % dev, ORCHARD_NO_CACHE=1, ORCHARD_CL_OPTIONS="-DOR_PARAMS_SIZE=7")
    assert "CL_BUILD_PROGRAM_FAILURE" in err and "or_params_size_matches_host" in err


@needs_opencl
def test_kernel_family_listed_and_named():
    """devices() says which family a device runs (the table's choice for its kind, or
    ORCHARD_CL_FAMILY) and what orchard-tune times; an unknown family name is an error."""
    dev = OPENCL_IDS[0]
    listed = child("""
        import json, orchard_ops as o
        print(json.dumps([[d["kind"], d["kernel_family"], d["block_candidates"]]
                          for d in o.devices() if d["backend"] == "opencl"]))
    """)
    for kind, family, blocks in listed:
        assert family == {"cpu": "tiled", "gpu": "wg"}.get(kind, "rows")
        assert len(blocks) == 5 and all(bq >= 1 and bk >= 1 for bq, bk in blocks)
    forced = child("""
        import json, orchard_ops as o
        print(json.dumps(o.devices()[1]["kernel_family"]))
    """, ORCHARD_CL_FAMILY="Rows")
    assert forced == "rows"     # in any case, as the names in error messages are written
    err = child(FAMILY_PROBE % dev, ORCHARD_CL_FAMILY="blocked")
    assert "ORCHARD_CL_FAMILY='blocked' names no kernel family" in err


ENVIRONMENT_PROBE = """
    import json, numpy as np, orchard_ops as o
    listed = [d.get("environment_error") for d in o.devices()]
    q = np.ones((1, 2, 8, 16), np.float32)
    errors = []
    for call in (lambda: o.flash_attn_fwd(q, q, q, device="%s"),
                 lambda: o.tuned_blocks("%s"), lambda: o.save_tuned_blocks("%s", 16, 16)):
        try:
            call()
            errors.append(None)
        except o.OrchardError as e:
            errors.append(str(e))
    print(json.dumps([listed, errors]))
"""


@needs_opencl
@pytest.mark.parametrize("name, value, message", [
    ("ORCHARD_CL_VECTOR", "3", "ORCHARD_CL_VECTOR='3': expected 4, 8 or 16"),
    ("ORCHARD_CL_VECTOR", "8x", "ORCHARD_CL_VECTOR='8x': expected 4, 8 or 16"),
    ("ORCHARD_CL_BLOCK_Q", "abc", "ORCHARD_CL_BLOCK_Q='abc': expected an integer in 1..4096"),
    ("ORCHARD_CL_BLOCK_K", "-4", "ORCHARD_CL_BLOCK_K='-4': expected an integer in 1..4096"),
    ("ORCHARD_CL_BLOCK_Q", "5000", "ORCHARD_CL_BLOCK_Q='5000': expected an integer in 1..4096"),
    ("ORCHARD_CL_BLOCK_Q", " 8", "ORCHARD_CL_BLOCK_Q=' 8': expected an integer in 1..4096"),
    ("ORCHARD_CL_FAMILY", "blocked", "ORCHARD_CL_FAMILY='blocked' names no kernel family"),
    # PoCL's compiler crashed the process on a -D or -I without its argument
    ("ORCHARD_CL_OPTIONS", "-w -D", "ORCHARD_CL_OPTIONS='-w -D': -D needs a macro name"),
    ("ORCHARD_CL_OPTIONS", "-I", "ORCHARD_CL_OPTIONS='-I': -I needs a folder"),
    # a macro the host sets for every program, redefined: a crash (BQ), wrong numbers (HEAD_D)
    ("ORCHARD_CL_OPTIONS", "-w -DBQ=7", "ORCHARD_CL_OPTIONS='-w -DBQ=7': -DBQ: orchard "
     "defines that macro for every program"),
    ("ORCHARD_CL_OPTIONS", "-D HEAD_D=5", "-DHEAD_D: orchard defines that macro"),
    ("ORCHARD_CL_OPTIONS", "-UVW", "-UVW: orchard defines that macro"),
    ("ORCHARD_CL_OPTIONS", "-w -DSK=7", "-DSK: orchard defines that macro"),
    ("ORCHARD_CL_OPTIONS", "-DBQX=1 -DHEAD_DIM", None),
    # a longer value was cut short at its buffer, dropping its last options unseen
    ("ORCHARD_CL_OPTIONS", "-DX=1 " * 100, "ORCHARD_CL_OPTIONS is 600 characters long: at most "
     "512"),
    ("ORCHARD_CL_OPTIONS", "-D X=1 -I .", None),
    ("ORCHARD_CL_VECTOR", "", None),  # empty: unset
])
def test_bad_opencl_environment_refused(name, value, message):
    """An ORCHARD_CL_* value the kernels cannot use (once silently replaced by the default) is
    named by devices() for every OpenCL device, and every OpenCL call refuses it; the native
    device is untouched. The tuned-block records' functions refuse it too (under an unknown
    ORCHARD_CL_FAMILY they had read None and stored nothing without a word)."""
    listed, errors = child(ENVIRONMENT_PROBE % ((OPENCL_IDS[0],) * 3), ORCHARD_NO_CACHE=1,
                           **{name: value})
    assert listed[0] is None    # cpu
    if message is None:
        assert errors == [None] * 3 and all(e is None for e in listed)
    else:
        assert all(message in e for e in listed[1:]) and all(message in e for e in errors)
        assert errors[1].startswith("tuned_blocks() on %s: " % OPENCL_IDS[0])


@needs_opencl
def test_bad_opencl_environment_set_later_stops_built_programs_too():
    """A bad value set after a head dim's program was built stops that head dim's calls too
    (it stopped only programs built after it); unset again, they run."""
    got = child("""
        import json, os, numpy as np, orchard_ops as o
        q = np.ones((1, 2, 8, 16), np.float32)
        o.flash_attn_fwd(q, q, q, device="%s")
        os.environ["ORCHARD_CL_FAMILY"] = "blocked"
        try:
            o.flash_attn_fwd(q, q, q, device="%s")
            err = None
        except o.OrchardError as e:
            err = str(e)
        del os.environ["ORCHARD_CL_FAMILY"]
        out, _ = o.flash_attn_fwd(q, q, q, device="%s")
        print(json.dumps([err, float(out.sum())]))
    """ % ((OPENCL_IDS[0],) * 3))
    assert "ORCHARD_CL_FAMILY='blocked' names no kernel family" in got[0]
    assert got[1] == 2 * 8 * 16


@needs_opencl
def test_tuned_blocks_stored_and_used(tmp_path):
    """orchard-tune times candidates in child processes, stores the fastest beside the program
    binaries, as the blocks it ran with (a candidate the family's rules round runs, and is
    reported and stored, as what it became); a later process builds with it (the debug log
    says so), results unchanged."""
    dev = OPENCL_IDS[0]
    r = run_python("""
        import sys
        from orchard.cli import tune
        sys.exit(tune.main(["--device", "%s", "--shape", "1,2,100,16", "--repeats", "1",
                            "--candidates", "96x96", "192x96", "7x9"]))
    """ % dev, timeout=600, ORCHARD_CACHE_DIR=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "chosen: " in r.stdout
    ran = child("""
        import json, orchard_ops as o
        print(json.dumps(o.program_blocks("%s", head_dim=16)))
    """ % dev, ORCHARD_CACHE_DIR=tmp_path, ORCHARD_CL_BLOCK_Q=7, ORCHARD_CL_BLOCK_K=9)
    assert ran[0] in ("rows", "tiled", "wg") and (ran[1], ran[2]) != (7, 9)
    assert "7 x 9: " in r.stderr and "(runs as %d x %d)" % tuple(ran[1:]) in r.stderr
    assert "chosen: 7 x 9" not in r.stdout      # never stored as asked
    log = tmp_path / "debug.log"
    got = child("""
        import json, numpy as np, orchard_ops as o
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 2, 130, 16)).astype(np.float32) for _ in range(3))
        out, _ = o.flash_attn_fwd(q, k, v, causal=True, device="%s")
        ref, _ = o.flash_attn_fwd(q, k, v, causal=True, device="cpu")
        print(json.dumps([o.tuned_blocks("%s"), float(np.abs(out - ref).max())]))
    """ % (dev, dev), ORCHARD_CACHE_DIR=tmp_path, ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=log)
    blocks, err = got
    # stored as they ran: whole register-tile steps, built as stored
    assert tuple(blocks) in {(96, 96), (192, 96), tuple(ran[1:])} and err < 1e-5
    assert "backward %d x %d, tuned)" % tuple(blocks) in log.read_text()


@needs_opencl
def test_tune_kills_a_candidate_past_its_timeout(tmp_path):
    """A candidate still running after --timeout seconds (a driver that hangs: here its timing
    script, which sleeps) is killed and reported; with none left, orchard-tune says so (status
    2) and stores nothing."""
    start = time.monotonic()
    r = run_python("""
        import sys
        from orchard import tuning
        from orchard.cli import tune
        tuning.TIMING_SCRIPT = "import time; time.sleep(300)"
        sys.exit(tune.main(["--device", "%s", "--candidates", "96x96", "--timeout", "1"]))
    """ % OPENCL_IDS[0], timeout=600, ORCHARD_CACHE_DIR=tmp_path)
    assert time.monotonic() - start < 60
    assert r.returncode == 2, r.stderr
    assert "96 x 96: failed (timed out after 1 s)" in r.stderr
    assert "error: tune(): no candidate block size ran" in r.stderr
    assert "chosen" not in r.stdout


@needs_opencl
def test_tuned_blocks_errors(ops, tmp_path):
    with pytest.raises(ValueError, match="'device' must be an OpenCL device"):
        ops.tuned_blocks("cpu")
    with pytest.raises(ValueError, match="'block_q'"):
        ops.save_tuned_blocks(OPENCL_IDS[0], 0, 64)
    with pytest.raises(ValueError, match="'block_k'"):
        ops.save_tuned_blocks(OPENCL_IDS[0], 64, 5000)
    with pytest.raises(ValueError, match="'block_q' must be an int in 1..4096, got 2\\*\\*64|"
                       "'block_q' must be an int in 1..4096, got 18446744073709551616"):
        ops.save_tuned_blocks(OPENCL_IDS[0], 2**64, 64)     # was OverflowError
    with pytest.raises(TypeError, match="'block_k' must be an int"):
        ops.save_tuned_blocks(OPENCL_IDS[0], 64, True)      # was read as 1
    with pytest.raises(ValueError, match="'device'"):
        ops.save_tuned_blocks("opencl:99", 64, 64)
    with pytest.raises(ValueError, match="'device' must be an OpenCL device"):
        ops.program_blocks("cpu")
    with pytest.raises(ValueError, match="'head_dim' must be an int in 1..256, got 0"):
        ops.program_blocks(OPENCL_IDS[0], head_dim=0)
    assert child("""
        import json, orchard_ops as o
        print(json.dumps([o.save_tuned_blocks("%s", 48, 48), o.tuned_blocks("%s")]))
    """ % (OPENCL_IDS[0], OPENCL_IDS[0]), ORCHARD_CACHE_DIR=tmp_path, ORCHARD_NO_CACHE=1) \
        == [False, None]
    r = run_python("from orchard.cli import tune; raise SystemExit(tune.main(['--device', 'cpu']))")
    assert r.returncode == 2 and r.stderr.startswith(
        "orchard-tune: error: argument --device: must be an OpenCL device id"), r.stderr
    # with the cache off, orchard-tune says that nothing was stored, even with --quiet
    r = run_python("""
        from orchard.cli import tune
        raise SystemExit(tune.main(["--device", "%s", "--shape", "1,2,64,16", "--repeats", "1",
                                    "--candidates", "96x96", "--quiet"]))
    """ % OPENCL_IDS[0], timeout=600, ORCHARD_CACHE_DIR=tmp_path, ORCHARD_NO_CACHE=1)
    assert r.returncode == 0 and "not stored" in r.stdout, (r.stdout, r.stderr)
    assert "cache is off (ORCHARD_NO_CACHE)" in r.stdout
    # a store that fails beside a record of the same blocks (a read-only cache, here its
    # failure made so) is reported as none, not as the record it found
    r = run_python("""
        import json, orchard_ops
        from orchard.cli import tune
        args = ["--device", "%s", "--shape", "1,2,64,16", "--repeats", "1", "--candidates",
                "96x96", "--quiet", "--json"]
        tune.main(args)
        orchard_ops.save_tuned_blocks = lambda *blocks: False
        tune.main(args)
    """ % OPENCL_IDS[0], timeout=600, ORCHARD_CACHE_DIR=tmp_path / "ro")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["stored"] for line in r.stdout.splitlines()] == [True, False]
    # a cache folder that cannot be made: named
    r = run_python("""
        from orchard.cli import tune
        raise SystemExit(tune.main(["--device", "%s", "--shape", "1,2,64,16", "--repeats", "1",
                                    "--candidates", "96x96", "--quiet"]))
    """ % OPENCL_IDS[0], timeout=600, ORCHARD_CACHE_DIR="/proc/orchard-cache")
    assert r.returncode == 0 and "not stored: the cache folder /proc/orchard-cache cannot be " \
        "made or written" in r.stdout, (r.stdout, r.stderr)
    # one that others may write to (the cache is off there): that reason too, not only "cannot
    # be made or written"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    r = run_python("""
        from orchard.cli import tune
        raise SystemExit(tune.main(["--device", "%s", "--shape", "1,2,64,16", "--repeats", "1",
                                    "--candidates", "96x96", "--quiet"]))
    """ % OPENCL_IDS[0], timeout=600, ORCHARD_CACHE_DIR=shared)
    assert r.returncode == 0 and "writable by others" in r.stdout, (r.stdout, r.stderr)
    # build options no program builds with: one error naming them, before any candidate runs
    # (each candidate's failure was a line of its own)
    r = run_python("""
        from orchard.cli import tune
        raise SystemExit(tune.main(["--device", "%s", "--shape", "1,2,64,16", "--repeats", "1",
                                    "--candidates", "96x96", "48x48"]))
    """ % OPENCL_IDS[0], timeout=600, ORCHARD_NO_CACHE=1, ORCHARD_CL_OPTIONS="-cl-nonsense")
    assert r.returncode == 2 and ": failed (" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(
        "orchard-tune: error: tune(): %s cannot build its programs with "
        "ORCHARD_CL_OPTIONS='-cl-nonsense' (program_blocks() on %s: clBuildProgram failed: "
        % (OPENCL_IDS[0], OPENCL_IDS[0])), r.stderr


@needs_opencl
@needs_test_hooks
def test_explicit_transfers_match_in_place():
    """ORCHARD_CL_TRANSFERS=1 takes the discrete-GPU path (copies in and out) on any device."""
    code = """
        import json, numpy as np, orchard_ops as o
        rng = np.random.default_rng(1)
        q = rng.standard_normal((2, 4, 33, 16)).astype(np.float32)
        k, v = (rng.standard_normal((2, 2, 47, 16)).astype(np.float32) for _ in range(2))
        kw = dict(causal=True, dropout_p=0.1, seed=7, softcap=5.0, device="%s")
        out, lse = o.flash_attn_fwd(q[:, :, ::-1], k, v, **kw)
        grads = o.flash_attn_bwd(np.ones_like(out), q[:, :, ::-1], k, v, out, lse, **kw)
        print(json.dumps([x.tolist() for x in (out, lse) + grads]))
    """ % OPENCL_IDS[0]
    copied = child(code, ORCHARD_CL_TRANSFERS=1)
    in_place = child(code, ORCHARD_CL_TRANSFERS=None)
    for a, b in zip(copied, in_place):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@needs_opencl
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
def test_cross_device_dropout_identical_masks(ops, dtype):
    """Every device draws the same Philox mask: with dropout the outputs agree to rounding,
    where a different mask would change them by O(1)."""
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (2, 3, 70, 24), dtype) for _ in range(3))
    do = randn(rng, (2, 3, 70, 24), dtype)
    kw = dict(dropout_p=0.3, seed=2**40 + 17, causal=True)
    results = {}
    for dev in ["cpu"] + OPENCL_IDS:
        if dtype == np.float64 and not next(d for d in ops.devices() if d["id"] == dev)["fp64"]:
            continue
        out, lse = ops.flash_attn_fwd(q, k, v, device=dev, **kw)
        results[dev] = (out, lse) + ops.flash_attn_bwd(do, q, k, v, out, lse, device=dev, **kw)
    tol = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}[dtype]
    for dev, res in results.items():
        for got, want in zip(res, results["cpu"]):
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                       rtol=tol, atol=tol, err_msg=dev)


@needs_opencl
def test_logs(tmp_path):
    log = tmp_path / "orchard.log"
    child("""
        import json, numpy as np, orchard_ops as o
        q = np.ones((1, 2, 8, 4), np.float32)
        out, lse = o.flash_attn_fwd(q, q, q[..., ::-1], device="%s")
        o.flash_attn_bwd(out, q, q, q, out, lse, device="cpu")
        print(json.dumps(0))
    """ % OPENCL_IDS[0], ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_TENSOR_PROFILE=1, ORCHARD_LOG=log)
    text = log.read_text()
    assert "flash_attn_fwd device=%s q=(1, 2, 8, 4)" % OPENCL_IDS[0] in text
    assert "flash_attn_bwd device=cpu" in text
    assert "zero-copy" in text and "staged" in text and "ms" in text
    # a log file that cannot be opened: the lines come to stderr, saying why (they came
    # silently, as if ORCHARD_LOG were unset)
    r = run_python("""
        import numpy as np, orchard_ops as o
        q = np.ones((1, 2, 8, 4), np.float32)
        o.flash_attn_fwd(q, q, q, device="cpu")
    """, ORCHARD_DEBUG_FLASH_ATN=1, ORCHARD_LOG=tmp_path / "no" / "such.log")
    assert r.returncode == 0
    assert ("(ORCHARD_LOG='%s' cannot be opened: No such file or directory) orchard: "
            "flash_attn_fwd device=cpu" % (tmp_path / "no" / "such.log")) in r.stderr


@needs_opencl
def test_build_failure_is_orchard_error_with_log():
    """A program that does not compile (here: a bad macro forced through ORCHARD_CL_OPTIONS)
    raises OrchardError naming clBuildProgram and CL_BUILD_PROGRAM_FAILURE, with the log; an
    explicitly requested device never falls back."""
    out = child("""
        import json, numpy as np, orchard_ops as o
        q = np.ones((1, 4, 8), np.float32)
        try:
            o.flash_attn_fwd(q, q, q, device="%s")
            msg, kind = None, None
        except o.OrchardError as e:
            msg, kind = str(e), type(e).__name__
        print(json.dumps({"msg": msg, "kind": kind, "cpu": float(o.flash_attn_fwd(q, q, q)[0].sum())}))
    """ % OPENCL_IDS[0], ORCHARD_CL_OPTIONS="-Dlong=no_such_size", ORCHARD_NO_CACHE=1)
    assert out["kind"] == "OrchardError"
    assert "clBuildProgram" in out["msg"] and "CL_BUILD_PROGRAM_FAILURE" in out["msg"]
    assert "build log" in out["msg"] and "no_such_size" in out["msg"]
    assert out["cpu"] == pytest.approx(32.0)


@needs_opencl
def test_gpu_benchmark_script_runs(tmp_path):
    """benchmarks/gpu_opencl.py, the measurement written for the first GPU, runs end to end
    on any OpenCL device at a tiny shape: its own FMA-peak kernel, both families in their
    child processes, the JSON file (no figure is asserted: the machine is shared)."""
    out = tmp_path / "gpu.json"
    r = run_python("""
        import runpy, sys
        sys.argv = ["gpu_opencl.py", "--device", "%s", "--out", "%s", "--repeats", "3",
                    "--quick", "--shapes", "1,1,40,16"]
        runpy.run_path("%s", run_name="__main__")
    """ % (OPENCL_IDS[0], out, os.path.join(REPO_ROOT, "benchmarks", "gpu_opencl.py")),
                   timeout=600)
    assert r.returncode == 0, r.stderr
    assert "float32 FMA peak (measured)" in r.stdout and "driver: " in r.stdout
    result = json.loads(out.read_text())
    assert result["fma_peak_gflops"] > 0 and result["device"]["id"] == OPENCL_IDS[0]
    (resident,) = result["device_resident"]
    assert resident["shape"] == [1, 1, 40, 16]
    assert resident["fwd"]["ratio"] > 0 and resident["step"]["resident_ms"] > 0
    for family in ("wg", "rows"):
        rows = result["families"][family]["rows"]
        assert result["families"][family]["family"] == family
        assert {(r["dtype"], r["causal"]) for r in rows} == {
            (d, c) for d in ("float32", "float16") for c in (False, True)}
        assert all(r["fwd_gflops"] > 0 and r["bwd_of_peak"] > 0 for r in rows)
    bad = run_python("""
        import runpy, sys
        sys.argv = ["gpu_opencl.py", "--device", "opencl:99"]
        runpy.run_path("%s", run_name="__main__")
    """ % os.path.join(REPO_ROOT, "benchmarks", "gpu_opencl.py"))
    assert bad.returncode == 2 and "gpu_opencl: error: --device 'opencl:99'" in bad.stderr


@needs_opencl
def test_forked_child_refuses_opencl_instead_of_hanging():
    """The OpenCL driver's threads do not survive fork(): a PoCL call in a child forked after
    the parent loaded OpenCL never returned. The child gets an error naming the way out, its
    native calls work, and dropping a DeviceArray it inherited makes no OpenCL call."""
    out = child("""
        import json, os, numpy as np, orchard_ops as o
        q = np.ones((1, 2, 8, 16), np.float32)
        o.flash_attn_fwd(q, q, q, device="%s")
        kept = o.to_device(q, "%s")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                o.flash_attn_fwd(q, q, q, device="%s")
                err = None
            except o.OrchardError as e:
                err = str(e)
            native = float(o.flash_attn_fwd(q, q, q)[0].sum())
            del kept
            os.write(w, json.dumps([err, native]).encode())
            os._exit(0)
        os.close(w)
        reply = os.read(r, 4096).decode()
        _, status = os.waitpid(pid, 0)
        print(json.dumps([json.loads(reply), status, kept.numpy().shape]))
    """ % ((OPENCL_IDS[0],) * 3))
    (err, native), status, shape = out
    assert status == 0 and native == 256.0 and shape == [1, 2, 8, 16]
    assert "fork()ed after its parent loaded OpenCL" in err and "'spawn'" in err


def test_a_tuning_candidate_that_crashes_is_said_to_have_crashed(monkeypatch):
    """A killed candidate was reported by its last line of stderr (a compiler warning)."""
    from orchard import tuning

    monkeypatch.setattr(tuning, "TIMING_SCRIPT",
                        "import os, signal, sys; print('1 warning generated.', file=sys.stderr); "
                        "os.kill(os.getpid(), signal.SIGSEGV)")
    assert tuning.time_candidate("opencl:0", [1, 1, 8, 8], 8, 8, 1) == (None, "crashed: SIGSEGV")
