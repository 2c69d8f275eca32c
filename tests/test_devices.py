"""devices(), default_device(), resolve_device(), ORCHARD_DEVICE, cache_dir() and
build_info()."""
import os
import re
import stat
import sys

import numpy as np
import pytest

from conftest import OPENCL_IDS, TEST_HOOKS, assert_close, randn, run_python
from orchard.reference import ref_fwd

FIELDS = {
    "id": str, "name": str, "vendor": str, "kind": str, "backend": str, "platform": str,
    "driver_version": str, "compute_units": int, "global_mem_bytes": int, "local_mem_bytes": int,
    "max_work_group_size": int, "fp16": bool, "fp64": bool, "unified_memory": bool,
}


def test_devices_entries(ops):
    devs = ops.devices()
    assert isinstance(devs, list) and devs
    ids = [d["id"] for d in devs]
    assert len(set(ids)) == len(ids), "duplicate device ids %s" % ids
    assert "cpu" in ids
    for d in devs:
        for key, typ in FIELDS.items():
            assert key in d, "device %s lacks %r" % (d.get("id"), key)
            assert isinstance(d[key], typ), "device %s: %r is %r" % (d["id"], key, d[key])
        assert d["kind"] in ("cpu", "gpu", "accelerator"), d
        assert d["backend"] in ("native", "opencl"), d
        assert d["compute_units"] >= 1 and d["global_mem_bytes"] > 0, d
        if d["backend"] == "opencl":
            assert d["id"].startswith("opencl:"), d
            assert isinstance(d["subgroups"], bool), d
    cpu = devs[ids.index("cpu")]
    assert cpu["backend"] == "native" and cpu["kind"] == "cpu"
    assert "simd" in cpu and isinstance(cpu["simd"], str)
    assert cpu["fp64"] and cpu["fp16"]


def test_devices_returns_fresh_list(ops):
    a = ops.devices()
    a[0]["id"] = "mutated"
    a.append({})
    b = ops.devices()
    assert b[0]["id"] != "mutated" and {} not in b


def test_default_device_is_listed(ops):
    dev = ops.default_device()
    assert dev in [d["id"] for d in ops.devices()]


def test_default_device_honours_env():
    r = run_python("import orchard_ops; print(orchard_ops.default_device())", ORCHARD_DEVICE="cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cpu", r.stdout


def test_default_device_env_does_not_change_environment():
    code = ("import os, orchard_ops; orchard_ops.default_device(); orchard_ops.devices(); "
            "print(os.environ.get('ORCHARD_DEVICE'), os.environ.get('PYOPENCL_CTX'))")
    r = run_python(code, ORCHARD_DEVICE="cpu", PYOPENCL_CTX=None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cpu None"


def test_resolve_device(ops):
    devs = ops.devices()
    for d in devs:
        assert ops.resolve_device(d["id"]) == d["id"]
    assert ops.resolve_device(None) == ops.resolve_device("auto") == ops.default_device()
    opencl = [d for d in devs if d["backend"] == "opencl"]
    if opencl:
        best = max(opencl, key=lambda d: (d["kind"] == "gpu", d["compute_units"]))
        assert ops.resolve_device("opencl") == best["id"]
        assert ops.resolve_device("opencl:" + opencl[0]["name"].upper()) == opencl[0]["id"]
    for name in ["tpu:7", "opencl:%d" % len(opencl), "opencl:no such device", "opencl:", "CPU"]:
        with pytest.raises(ValueError, match="resolve_device\\(\\): 'device' '.*' is not an "
                                             "available device \\(available: \\['cpu'"):
            ops.resolve_device(name)
    if not opencl:
        with pytest.raises(ValueError, match="not an available device"):
            ops.resolve_device("opencl")
    with pytest.raises(TypeError, match="'device' must be a str or None, not int"):
        ops.resolve_device(0)


def test_resolve_device_honours_env():
    code = "import orchard_ops as o; print(o.resolve_device(None), o.resolve_device('cpu'))"
    r = run_python(code, ORCHARD_DEVICE="cpu")
    assert r.returncode == 0 and r.stdout.split() == ["cpu", "cpu"], r.stdout + r.stderr
    r = run_python("import orchard_ops as o; o.resolve_device(None)", ORCHARD_DEVICE="tpu:1")
    assert "ValueError: resolve_device(): ORCHARD_DEVICE 'tpu:1' is not an available" in r.stderr


def test_cache_dir(ops, tmp_path, monkeypatch):
    """ORCHARD_CACHE_DIR, else $XDG_CACHE_HOME/orchard, else ~/.cache/orchard, made 0700 with
    its parents; None when the cache is off."""
    for var in ("ORCHARD_CACHE_DIR", "XDG_CACHE_HOME", "ORCHARD_NO_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = str(tmp_path / "home" / ".cache" / "orchard")
    assert ops.cache_dir() == expected
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")   # ignored, as XDG's spec says
    assert ops.cache_dir() == expected
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ops.cache_dir() == str(tmp_path / "xdg" / "orchard")
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path / "a" / "b"))
    assert ops.cache_dir() == str(tmp_path / "a" / "b")
    for made in (expected, str(tmp_path / "xdg" / "orchard"), str(tmp_path / "a" / "b")):
        assert os.path.isdir(made) and stat.S_IMODE(os.stat(made).st_mode) == 0o700, made
    os.chmod(str(tmp_path / "a" / "b"), 0o777)   # binaries others could plant: not loaded
    assert ops.cache_dir() is None
    os.chmod(str(tmp_path / "a" / "b"), 0o700)
    for off in ("1", "yes"):
        monkeypatch.setenv("ORCHARD_NO_CACHE", off)
        assert ops.cache_dir() is None
    for on in ("", "0", "false", "Off", "no"):   # on/off variables read as everywhere
        monkeypatch.setenv("ORCHARD_NO_CACHE", on)
        assert ops.cache_dir() == str(tmp_path / "a" / "b")
    # a file where the folder should be: no cache (it was returned as the cache folder)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path / "file"))
    assert ops.cache_dir() is None



def test_cache_off_says_why_once(tmp_path):
    """A cache that cannot be had is one log line, naming why, however often it is asked for
    (with HOME unset it was off without a word); one turned off by ORCHARD_NO_CACHE says
    nothing."""
    (tmp_path / "file").write_text("x")
    code = "import orchard_ops as o; print(o.cache_dir(), o.cache_dir())"
    cases = [({"HOME": None}, "no folder is named (ORCHARD_CACHE_DIR, an absolute "
                              "XDG_CACHE_HOME or HOME)"),
             ({"ORCHARD_CACHE_DIR": tmp_path / "file"}, "%s is not a folder" % (tmp_path / "file")),
             ({"ORCHARD_CACHE_DIR": tmp_path / "file" / "sub"},
              "%s cannot be made (Not a directory)" % (tmp_path / "file" / "sub")),
             ({"ORCHARD_CACHE_DIR": "/proc/orchard-cache"}, "/proc/orchard-cache cannot be made")]
    for env, why in cases:
        env = dict(dict.fromkeys(("ORCHARD_CACHE_DIR", "XDG_CACHE_HOME", "ORCHARD_NO_CACHE",
                                  "ORCHARD_LOG")), **env)
        r = run_python(code, **env)
        assert r.returncode == 0 and r.stdout.split() == ["None", "None"], r.stdout + r.stderr
        assert r.stderr.splitlines() and r.stderr.splitlines()[0].startswith(
            "orchard: the OpenCL program cache is off: " + why), (env, r.stderr)
        assert r.stderr.count("cache is off") == 1, r.stderr
    r = run_python(code, ORCHARD_NO_CACHE=1, HOME=None, ORCHARD_CACHE_DIR=None,
                   XDG_CACHE_HOME=None, ORCHARD_LOG=None)
    assert r.returncode == 0 and r.stdout.split() == ["None", "None"] and r.stderr == "", r.stderr


def test_default_device_used_for_none(ops, rng):
    """device=None runs on default_device(): its per-device counters move."""
    q, k, v = (randn(rng, (1, 2, 5, 8), np.float32) for _ in range(3))
    ops.reset_stats()
    out, _ = ops.flash_attn_fwd(q, k, v)
    st = ops.stats()
    assert st["per_device"][ops.default_device()]["fwd_calls"] == 1, st
    assert_close(out, ref_fwd(q, k, v)[0], np.float32, "out")


def test_explicit_device_counts_there(ops, device, rng):
    q, k, v = (randn(rng, (1, 2, 5, 8), np.float32) for _ in range(3))
    ops.reset_stats()
    ops.flash_attn_fwd(q, k, v, device=device)
    st = ops.stats()
    assert st["per_device"][device]["fwd_calls"] == 1, st
    assert st["fwd_calls"] == 1


def test_build_info(ops):
    info = ops.build_info()
    assert info["version"] == ops.__version__
    assert isinstance(info["opencl"], bool) and isinstance(info["test_hooks"], bool)
    assert info["max_head_dim"] == 256 and info["max_cl_block"] == 4096
    assert info["dtypes"] == ("float16", "float32", "float64", "bfloat16")
    if not info["opencl"]:
        assert [d["id"] for d in ops.devices()] == ["cpu"]


@pytest.mark.skipif(TEST_HOOKS, reason="built with ORCHARD_TEST_HOOKS=1")
def test_test_switches_are_compiled_out():
    """Without ORCHARD_TEST_HOOKS=1 at build time the test switches do nothing: a malformed
    ORCHARD_FAULT neither disables OpenCL nor says a word, and ORCHARD_AUTO_ANY_OPENCL does
    not change the automatic choice."""
    code = "import orchard_ops as o; print(o.default_device(), len(o.devices()))"
    plain = run_python(code, ORCHARD_DEVICE=None, ORCHARD_FAULT=None, ORCHARD_AUTO_ANY_OPENCL=None)
    hooked = run_python(code, ORCHARD_DEVICE=None, ORCHARD_FAULT="clNoSuchCall:1",
                        ORCHARD_AUTO_ANY_OPENCL=1)
    assert plain.returncode == 0 and hooked.returncode == 0, plain.stderr + hooked.stderr
    assert hooked.stdout == plain.stdout and hooked.stderr == plain.stderr == ""


SIGNAL_HANDLERS = r"""
import ctypes, os, signal, time
import numpy as np
import orchard_ops

libc = ctypes.CDLL(None)


class Action(ctypes.Structure):     # struct sigaction on Linux: the handler first
    _fields_ = [("handler", ctypes.c_void_p), ("rest", ctypes.c_char * 256)]


class Info(ctypes.Structure):       # Dl_info
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


def library(handler):
    info = Info()
    found = handler and libc.dladdr(ctypes.c_void_p(handler), ctypes.byref(info))
    return os.path.basename(info.fname.decode()) if found else str(handler)


def handlers():
    out = {}
    for sig in range(1, signal.NSIG):
        action = Action()
        if libc.sigaction(sig, None, ctypes.byref(action)) == 0:
            out[sig] = action.handler
    return out


ran = []
for sig in (signal.SIGQUIT, signal.SIGUSR1):    # a program's own, as faulthandler's
    signal.signal(sig, lambda signum, frame: ran.append(signum))
before = handlers()
devices = orchard_ops.devices()
listed = handlers()
q = np.ones((1, 1, 8, 24), np.float32)
orchard_ops.flash_attn_fwd(q, q, q, device="opencl:0")     # a build (ORCHARD_NO_CACHE)
for sig in (signal.SIGQUIT, signal.SIGUSR1):
    os.kill(os.getpid(), sig)
time.sleep(0.1)
name = lambda s: signal.Signals(s).name if s in signal.Signals._value2member_map_ else str(s)
print(sum(d["backend"] == "opencl" for d in devices),
      sorted(name(s) + ":" + library(listed[s]) for s in before if listed.get(s) != before[s]),
      sorted(ran) == sorted([signal.SIGQUIT, signal.SIGUSR1]))
"""


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device listed")
def test_opencl_leaves_the_signal_handlers_as_they_were():
    """PoCL's LLVM installs its own handlers for SIGINT, SIGQUIT, SIGUSR1, SIGSEGV and others
    while the platforms are listed (SIGINT's with SA_RESETHAND: a second Ctrl-C during the
    first killed the process; SIGQUIT's and SIGUSR1's swallowed them, the program's handlers
    never ran, not even after a build); orchard gives every one back, and leaves the driver's
    own (PoCL's for SIGFPE, which steps over a kernel's integer division traps). (It gives them
    back after each build too, where LLVM installs them again once one of its handlers has
    run: not provoked here, as none of them is left to run.)"""
    result = run_python(SIGNAL_HANDLERS, ORCHARD_NO_CACHE="1")
    assert result.returncode == 0, result.stderr
    count, changed, ran = result.stdout.split()
    import orchard_ops
    pocl = any("PoCL" in d["platform"] or "Portable" in d["platform"]
               for d in orchard_ops.devices())
    assert (re.fullmatch(r"\['SIGFPE:libpocl\.so[0-9.]*'\]", changed) if pocl
            else changed == "[]"), result.stdout
    assert ran == "True", result.stdout


def test_a_cpu_call_leaves_opencl_unloaded():
    """device="cpu" never enumerates OpenCL: its library and a CPU driver's threads and
    signal handlers stay out of a process that only uses the native path (a fork()ed child of
    it may then use OpenCL)."""
    r = run_python("""
        import numpy as np, orchard_ops
        q = np.ones((1, 2, 5, 8), np.float32)
        orchard_ops.flash_attn_fwd(q, q, q, device="cpu")
        orchard_ops.flash_attn_bwd(q, q, q, q, q, np.zeros((1, 2, 5), np.float32), device="cpu")
        print(any("libOpenCL" in line for line in open("/proc/self/maps")))
        print(orchard_ops.stats()["per_device"]["cpu"]["fwd_calls"])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "1"]
