"""Threading: set/get_num_threads, ORCHARD_NUM_THREADS, bit-identical results for any thread
count, concurrent calls from Python threads, the GIL released during kernels."""

import threading
import time

import numpy as np
import pytest

from conftest import randn, run_python


@pytest.fixture
def restore_threads(ops):
    n = ops.get_num_threads()
    yield
    ops.set_num_threads(n)


def test_set_get_num_threads(ops, restore_threads):
    for n in (1, 2, 3, 7):
        ops.set_num_threads(n)
        assert ops.get_num_threads() == n
    assert isinstance(ops.get_num_threads(), int)


@pytest.mark.parametrize("bad", [0, -1])
def test_set_num_threads_rejects_bad(ops, restore_threads, bad):
    ops.set_num_threads(2)
    with pytest.raises(ValueError):
        ops.set_num_threads(bad)
    assert ops.get_num_threads() == 2


def test_set_num_threads_rejects_non_int(ops, restore_threads):
    # a wrong type is a TypeError (the Semantics table), a wrong value a ValueError
    with pytest.raises(TypeError, match="'n' must be an int"):
        ops.set_num_threads("2")
    with pytest.raises(TypeError, match="'n' must be an int"):
        ops.set_num_threads(2.5)
    with pytest.raises(TypeError, match="'n' must be an int"):
        ops.set_num_threads(True)   # an int to Python, but not a count
    with pytest.raises(ValueError, match="'n' must be an int in 1..4096, got 5000"):
        ops.set_num_threads(5000)


def test_set_num_threads_passes_on_other_failures(ops, restore_threads):
    # an __index__ that fails for another reason than its value: that error, not a ValueError
    class Interrupted:
        def __index__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ops.set_num_threads(Interrupted())


def test_env_num_threads():
    for n in (1, 3, 5):
        r = run_python("import orchard_ops; print(orchard_ops.get_num_threads())",
                       ORCHARD_NUM_THREADS=n)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(n), (n, r.stdout, r.stderr)
    r = run_python("import orchard_ops; print(orchard_ops.get_num_threads())",
                   ORCHARD_NUM_THREADS=None)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) >= 1


@pytest.mark.parametrize("bad", ["abc", "0", "-3", "1.5", "4097", "99999999", "2x", " 3", "3 ",
                                 "+3"])
def test_env_num_threads_rejects_bad(bad):
    # as a bad ORCHARD_ISA: import works, devices(), calls and get_num_threads() (which has
    # no count to tell) name the variable until set_num_threads() sets a count; the console
    # scripts print it in their one error line
    code = """if True:
        import numpy as np, orchard_ops
        q = np.ones((1, 1, 4, 8), np.float32)
        for call in (orchard_ops.devices, lambda: orchard_ops.flash_attn_fwd(q, q, q),
                     orchard_ops.get_num_threads):
            try:
                call()
                print("no error")
            except ValueError as exc:
                print(exc)
        orchard_ops.set_num_threads(2)
        orchard_ops.flash_attn_fwd(q, q, q)
        print(len(orchard_ops.devices()) >= 1)
    """
    r = run_python(code, ORCHARD_NUM_THREADS=bad)
    assert r.returncode == 0, r.stderr
    message = "ORCHARD_NUM_THREADS='%s': not a thread count; expected an integer in 1..4096" % bad
    assert r.stdout.splitlines() == [message] * 3 + ["True"], r.stdout
    r = run_python("import sys; from orchard.cli.devices import main; sys.exit(main([]))",
                   ORCHARD_NUM_THREADS=bad)
    assert r.returncode == 2 and r.stderr == "orchard-devices: error: environment variable %s\n" \
        % message, r.stderr


def _workload(rng, dtype=np.float32, nk=90):
    b, h, hkv, nq = 2, 4, 2, 70
    q = randn(rng, (b, h, nq, 40), dtype)
    k = randn(rng, (b, hkv, nk, 40), dtype)
    v = randn(rng, (b, hkv, nk, 24), dtype)
    do = randn(rng, (b, h, nq, 24), dtype)
    return q, k, v, do


def _run_all(ops, device, q, k, v, do, kw):
    out, lse = ops.flash_attn_fwd(q, k, v, device=device, **kw)
    grads = ops.flash_attn_bwd(do, q, k, v, out, lse, device=device, **kw)
    # varlen on the same data: 2 sequences of the batch packed
    qp = np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(-1, q.shape[1], q.shape[3]))
    kp = np.ascontiguousarray(k.transpose(0, 2, 1, 3).reshape(-1, k.shape[1], k.shape[3]))
    vp = np.ascontiguousarray(v.transpose(0, 2, 1, 3).reshape(-1, v.shape[1], v.shape[3]))
    dop = np.ascontiguousarray(do.transpose(0, 2, 1, 3).reshape(-1, do.shape[1], do.shape[3]))
    cq = np.array([0, q.shape[2], 2 * q.shape[2]], np.int32)
    ck = np.array([0, k.shape[2], 2 * k.shape[2]], np.int32)
    vo, vl = ops.flash_attn_varlen_fwd(qp, kp, vp, cq, ck, device=device, **kw)
    vg = ops.flash_attn_varlen_bwd(dop, qp, kp, vp, vo, vl, cq, ck, device=device, **kw)
    return [out, lse, *grads, vo, vl, *vg]


KW = [dict(), dict(causal=True, dropout_p=0.2, seed=3, softcap=2.0,
                   alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]))]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
@pytest.mark.parametrize("kw", KW, ids=["plain", "features"])
@pytest.mark.parametrize("nk", [90, 2100], ids=["units", "parts"])
def test_bit_identical_across_thread_counts(ops, device, rng, restore_threads, dtype, kw, nk):
    """nk 2100: the native backward splits each of the 4 kv units' keys in 2 parts, an item each
    (orchard.h OR_BWD_ITEMS), their dQ added in part order whichever threads ran them."""
    q, k, v, do = _workload(rng, dtype, nk)
    results = {}
    for n in (1, 2, 3, 4, 1):
        ops.set_num_threads(n)
        for _ in range(2):  # repeated runs too
            res = _run_all(ops, device, q, k, v, do, kw)
            if not results:
                results["ref"] = res
            for i, (a, b) in enumerate(zip(res, results["ref"])):
                assert a.tobytes() == b.tobytes(), (
                    "result %d differs with %d threads: max |diff| %g" % (
                        i, n, np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_forward_unit_items_match_query_block_items(ops, restore_threads, dtype, paged):
    """The native forward hands out an item per kv unit, which packs that unit's keys and
    values itself, where there are 8 units per thread or more (attn_native.c), else an item
    per query block after a pre-pass that packs every unit: 8 kv units give the first with
    one thread and the second with eight. Both are the same bits, in every kernel set and
    instance (bfloat16 dot products, float16 on tiles, float, double), paged keys too."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    kind = getattr(torch, dtype)
    b, h, hk, n, d, page = 2, 8, 4, 200, 40, 16     # 8 kv units, GQA groups of 2
    q = torch.randn(b * n, h, d, generator=g).to(kind)
    k, v = (torch.randn(b, n, hk, d, generator=g).to(kind) for _ in range(2))
    cu = torch.tensor([0, n, 2 * n], dtype=torch.int32)
    if paged:   # each sequence's pages in reverse order
        per_seq = -(-n // page)
        table = torch.arange(b * per_seq - 1, -1, -1, dtype=torch.int32).reshape(b, per_seq)
        kp, vp = (torch.zeros(b * per_seq, page, hk, d, dtype=kind) for _ in range(2))
        for s in range(b):
            for r in range(n):
                kp[table[s, r // page], r % page] = k[s, r]
                vp[table[s, r // page], r % page] = v[s, r]
        kv = dict(k=kp, v=vp, block_table=table)
    else:
        kv = dict(k=k.reshape(b * n, hk, d), v=v.reshape(b * n, hk, d))
    before = ops.devices()[0]["kernel_isa"]
    try:
        for isa in ops.devices()[0]["kernel_isas"]:
            ops.set_native_isa(isa)
            results = []
            for threads in (1, 8):
                ops.set_num_threads(threads)
                results.append(ops.flash_attn_varlen_fwd(q=q, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                         causal=True, **kv))
            for a, c in zip(*results):
                assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), isa
    finally:
        ops.set_native_isa(before)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("kw", KW, ids=["plain", "features"])
def test_decode_bit_identical_across_thread_counts(ops, device, rng, restore_threads, dtype, kw):
    """A decode step's splits are merged by whichever worker finishes a kv head's last one:
    the same bits whichever it is."""
    q, k, v = (randn(rng, (2, 4, 3, 64), dtype), randn(rng, (2, 2, 2500, 64), dtype),
               randn(rng, (2, 2, 2500, 48), dtype))
    before = ops.stats()["per_device"].get(device, {}).get("decode_calls", 0)
    ref = None
    for n in (1, 2, 3, 4, 2):
        ops.set_num_threads(n)
        for _ in range(3):
            res = ops.flash_attn_fwd(q, k, v, device=device, **kw)
            ref = ref or res
            for a, b in zip(res, ref):
                assert a.tobytes() == b.tobytes(), "differs with %d threads" % n
    assert ops.stats()["per_device"][device]["decode_calls"] == before + 15


def test_concurrent_python_threads(ops, device, restore_threads):
    ops.set_num_threads(2)
    rngs = [np.random.default_rng(100 + i) for i in range(8)]
    inputs = [_workload(r) for r in rngs]
    kw = dict(causal=True, dropout_p=0.1, seed=9)
    serial = [_run_all(ops, device, *inp, kw) for inp in inputs]
    results = [None] * 8
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait()
            for _ in range(3):
                res = _run_all(ops, device, *inputs[i], kw)
                for a, b in zip(res, serial[i]):
                    if a.tobytes() != b.tobytes():
                        raise AssertionError("thread %d got a different result" % i)
            results[i] = True
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "deadlock: a worker thread did not finish"
    assert not errors, errors
    assert all(results)


def test_concurrent_stats_consistent(ops, device, rng):
    q, k, v, _ = _workload(rng)
    ops.reset_stats()
    n_threads, n_calls = 8, 5

    def worker():
        for _ in range(n_calls):
            ops.flash_attn_fwd(q[:, :, :8], k[:, :, :8], v[:, :, :8], device=device)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    st = ops.stats()
    assert st["fwd_calls"] == n_threads * n_calls, st
    assert st["zero_copy_buffers"] == 3 * n_threads * n_calls, st


def test_gil_released_during_kernel(ops, device, restore_threads):
    """While one thread is inside a long forward call, another Python thread keeps running."""
    ops.set_num_threads(1)
    rng = np.random.default_rng(0)
    n = 1024
    q, k, v = (randn(rng, (1, 2, n, 64), np.float32) for _ in range(3))
    t0 = time.perf_counter()
    ops.flash_attn_fwd(q, k, v, device=device)
    call = time.perf_counter() - t0
    if call < 0.05:  # too fast to measure: make it longer
        reps = int(0.05 / max(call, 1e-4)) + 1
        q, k, v = (np.concatenate([x] * reps, axis=0) for x in (q, k, v))
        t0 = time.perf_counter()
        ops.flash_attn_fwd(q, k, v, device=device)
        call = time.perf_counter() - t0
    done = threading.Event()

    def worker():
        ops.flash_attn_fwd(q, k, v, device=device)
        done.set()

    th = threading.Thread(target=worker)
    stamps = []
    th.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
        time.sleep(0.001)
    th.join()
    gaps = np.diff(stamps) if len(stamps) > 1 else np.array([call])
    # with the GIL held for the whole call the main loop would stall for ~`call` seconds
    assert gaps.max() < 0.5 * call, "main thread stalled %.3fs during a %.3fs call" % (
        gaps.max(), call)


def test_set_num_threads_while_running(ops, device, restore_threads):
    """Changing the thread count while other Python threads are inside kernels: no deadlock,
    results unchanged."""
    rngs = [np.random.default_rng(200 + i) for i in range(4)]
    inputs = [_workload(r) for r in rngs]
    serial = [_run_all(ops, device, *inp, {}) for inp in inputs]
    stop = threading.Event()
    errors = []

    def worker(i):
        try:
            while not stop.is_set():
                res = _run_all(ops, device, *inputs[i], {})
                for a, b in zip(res, serial[i]):
                    if a.tobytes() != b.tobytes():
                        raise AssertionError("thread %d got a different result" % i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for n in [1, 3, 2, 4, 1, 2] * 5:
        ops.set_num_threads(n)
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock after set_num_threads"
    assert not errors, errors


FORK_SCRIPT = r"""
import os, sys, numpy as np
if sys.argv[1:] == ["torch"]:
    import torch                              # its OpenMP runtime: the calls run on its threads
import orchard_ops as ops
ops.set_num_threads(2)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 200, 32)).astype(np.float32) for _ in range(3))
ref, _ = ops.flash_attn_fwd(q, k, v)          # thread pool is running now
pid = os.fork()
if pid == 0:
    out, _ = ops.flash_attn_fwd(q, k, v)      # must not hang on the parent's pool
    os._exit(0 if out.tobytes() == ref.tobytes() else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("runtime", ["orchard", "torch"])
def test_fork_after_use(ops, runtime):
    """A forked child (multiprocessing / DataLoader workers) can still call the kernels, also
    where the parent ran them on torch's OpenMP threads (libgomp's team hangs in a child)."""
    import subprocess
    if runtime == "torch":
        pytest.importorskip("torch")
    try:
        r = run_python(FORK_SCRIPT.replace("sys.argv[1:]", repr([runtime])), timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("forked child hung calling flash_attn_fwd after the parent used the pool")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "child 0", (r.stdout, r.stderr[-2000:])


RUNTIME_SCRIPT = r"""
import hashlib, sys, numpy as np
if sys.argv[1:] == ["torch"]:
    import torch
import orchard_ops as ops
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 300, 64)).astype(np.float32) for _ in range(3))
qd = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
kd, vd = (rng.standard_normal((2, 2, 30000, 64)).astype(np.float32) for _ in range(2))
h = hashlib.sha256()
for n in (1, 2, 3):
    ops.set_num_threads(n)
    out, lse = ops.flash_attn_fwd(q, k, v, causal=True, dropout_p=0.1, seed=3)
    grads = ops.flash_attn_bwd(out, q, k, v, out, lse, causal=True, dropout_p=0.1, seed=3)
    for a in (out, lse, *grads, *ops.flash_attn_fwd(qd, kd, vd)):
        h.update(np.ascontiguousarray(a).tobytes())
print(ops.devices()[0]["thread_runtime"] + "|" + h.hexdigest())
"""


def test_openmp_runtime():
    """With torch loaded, multithreaded calls run on its OpenMP threads (unless ORCHARD_OPENMP=0)
    and give the same bits as on orchard's own threads, for forward, backward and decoding."""
    pytest.importorskip("torch")
    seen = {}
    for runtime, env in (("torch", {"ORCHARD_OPENMP": "1"}), ("torch", {"ORCHARD_OPENMP": "0"}),
                         ("numpy", {"ORCHARD_OPENMP": "1"})):
        r = run_python(RUNTIME_SCRIPT.replace("sys.argv[1:]", repr([runtime])), timeout=300,
                       **env)
        assert r.returncode == 0, r.stderr[-2000:]
        seen[(runtime, tuple(env.items()))] = r.stdout.strip().split("|")
    names = [name for name, _ in seen.values()]
    assert names[0].startswith("openmp: "), names
    assert names[1:] == ["orchard", "orchard"], names
    assert len({digest for _, digest in seen.values()}) == 1, seen
