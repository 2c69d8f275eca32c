"""Block sizes of an OpenCL device, picked by timing a few and stored beside the device's
program binaries, where every later process finds them.

Each candidate runs in a fresh process (a process builds its programs once) with
ORCHARD_CL_BLOCK_Q / ORCHARD_CL_BLOCK_K set, and is timed on a float32 causal forward plus
backward: the best of `repeats`, after a warm-up call that also builds and caches the program.
A candidate that has not finished after `timeout` seconds (a driver that hangs, a block size
that runs for ever) is killed and reported as timed out, like one that cannot run.
The fastest is stored with orchard_ops.save_tuned_blocks(); the environment variables still
override it. A candidate the device cannot run (too much local memory, a build failure) is
reported and skipped. The candidates are those of the kernel family the device runs, as
devices() lists them from orchard_ops' family table: for the tiled family a block is (query
rows, keys); for the rows family (work-group rows, keys per local tile); for the wg family
(block rows, tile rows). In the wg and tiled families the stored blocks are the backward's
(and the wg decode's): their forwards, and the tiled decode, fit blocks of their own from the
family's defaults (or ORCHARD_CL_BLOCK_Q/K), the wg forward to its smaller tiles, the tiled
one to twice the rows where they fit; without a record the tiled backward takes twice the
keys where they fit (96 x 192, a candidate). A candidate's forward runs on its own blocks (the
variables set them), so its time is that of a step whose forward is not quite the later
runs' one.
"""
import json
import os
import signal
import subprocess
import sys

import orchard_ops

TIMING_SCRIPT = """
import json, sys, time, numpy as np, orchard_ops
device, (b, h, n, d), repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
def step():
    out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=True, device=device)
    orchard_ops.flash_attn_bwd(do, q, k, v, out, lse, causal=True, device=device)
step()
best = float("inf")
for _ in range(repeats):
    start = time.perf_counter()
    step()
    best = min(best, time.perf_counter() - start)
print(json.dumps([best] + list(orchard_ops.program_blocks(device, d)[1:])))
"""


# The device's program built once, as a call would (its first error line, if any)
BUILD_SCRIPT = """
import sys, orchard_ops
try:
    orchard_ops.program_blocks(sys.argv[1], int(sys.argv[2]))
except orchard_ops.OrchardError as exc:
    sys.exit(str(exc).splitlines()[0])
"""


def run_child(script, args, timeout, **env):
    """(the last line a fresh Python running `script` with these arguments and environment
    variables printed, None), or (None, why) where it failed or ran past timeout seconds (None:
    no limit). A child of its own: a process builds its programs once, and this one keeps no
    device context (a GPU in exclusive-process mode would refuse the children one)."""
    try:
        r = subprocess.run([sys.executable, "-c", script] + args, env=dict(os.environ, **env),
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:   # (the child is killed)
        return None, "timed out after %g s" % timeout
    if r.returncode < 0:    # killed: its last line (a compiler warning) would not say so
        return None, "crashed: %s" % signal.Signals(-r.returncode).name
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return None, lines[-1] if lines else "exit status %d" % r.returncode
    lines = r.stdout.splitlines()
    return (lines[-1] if lines else ""), None


def time_candidate(device, shape, block_q, block_k, repeats, timeout=None):
    """(seconds of a forward plus backward with these blocks, (bq, bk) they ran as: rounded
    and fitted by the family's rules), or (None, why) if they do not run (within timeout
    seconds, None: no limit)."""
    line, why = run_child(TIMING_SCRIPT, [device, json.dumps(shape), str(repeats)], timeout,
                          ORCHARD_CL_BLOCK_Q=str(block_q), ORCHARD_CL_BLOCK_K=str(block_k))
    if line is None:
        return None, why
    seconds, bq, bk = json.loads(line)
    return seconds, (bq, bk)


def default_candidates(device):
    """The block sizes of the kernel family `device` runs; ValueError unless it is an OpenCL
    device id (its message says what the device must be, for the caller to name it)."""
    info = next((d for d in orchard_ops.devices() if d["id"] == device), None)
    if info is None or info["backend"] != "opencl":
        raise ValueError("must be an OpenCL device id, such as opencl:0 (got %r)" % (device,))
    return info["block_candidates"]


def tune(device, shape=(1, 8, 1024, 64), candidates=None, repeats=3, report=print,
         progress=None, timeout=None):
    """Times every candidate on `device`, stores the fastest; returns ({(bq, bk): seconds},
    stored), the times keyed by the blocks that ran (a candidate the family's rules round or
    fit runs as other blocks, which are what is stored), stored whether the store succeeded
    (an older record of the same blocks does not count). A candidate gets at most `timeout`
    seconds in all (None: no limit). Each candidate's time (or failure) is passed to `report` as a line of
    text, and progress (an orchard.progress.Progress of len(candidates)) is updated after
    each."""
    try:
        default = default_candidates(device)
    except ValueError as exc:
        raise ValueError("tune(): 'device' %s" % exc) from None
    candidates = default if candidates is None else candidates
    options = os.environ.get("ORCHARD_CL_OPTIONS")
    if options:     # OpenCL checks them only in a build: here once, not in every candidate
        built, why = run_child(BUILD_SCRIPT, [device, str(shape[3])], timeout)
        if built is None:
            raise RuntimeError("tune(): %s cannot build its programs with ORCHARD_CL_OPTIONS=%r "
                               "(%s)" % (device, options, why))
    times, why = {}, None
    for n, (bq, bk) in enumerate(candidates, 1):
        seconds, ran = time_candidate(device, list(shape), bq, bk, repeats, timeout)
        if seconds is None:
            why = ran
            report("  %d x %d: failed (%s)" % (bq, bk, why))
        else:
            times[ran] = min(seconds, times.get(ran, seconds))
            report("  %d x %d: %.2f ms%s" % (bq, bk, seconds * 1e3, "" if ran == (bq, bk)
                                              else " (runs as %d x %d)" % ran))
        if progress is not None:
            progress.update(n, "%dx%d" % (bq, bk))
    if not times:
        raise RuntimeError("tune(): no candidate block size ran on %s, the last: %s%s"
                           % (device, why, " (ORCHARD_CL_OPTIONS=%r is set)" % options
                              if options else ""))
    stored = orchard_ops.save_tuned_blocks(device, *min(times, key=times.get))
    if not stored:
        report("the OpenCL cache is off (ORCHARD_NO_CACHE), or its folder cannot be made or "
               "written or is not the user's own (another user's, or writable by others): "
               "nothing stored")
    return times, stored
