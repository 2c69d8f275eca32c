"""orchard's OpenCL kernels on a GPU, against the device's own float32 FMA peak (issue 17).

    python3 benchmarks/gpu_opencl.py [--device opencl:0] [--out gpu_opencl.json] [--quick]

Prints the device, its driver and platform; measures the device's float32 FMA peak with an
FMA-chain kernel of its own (below); then, for the wg kernel family (the GPUs' family), checks
one small problem against the native path (the largest difference is printed: a wrong result
shows before any timing) and times orchard's forward and backward at the shapes of the CPU
tables (benchmarks/kernel_targets.py: B,H = 4,8 at N 1024 and 2,16 at N 4096), D 64 and 128,
causal and not, float32 and float16: GFLOP/s with FlashAttention-2's accounting
(orchard.benchmark: forward 4*B*H*N*N*D, halved when causal; backward 2.5x) and the fraction
of the measured peak. The operands are DeviceArrays (orchard_ops.to_device), so the times are
the kernels' and not the host bus's; each is the median of --repeats calls after a warm-up call
that also builds the program. Then, at N 1024, float32: the forward and forward+backward on
DeviceArrays against host arrays, the issue's 10x goal for resident calls. Then a sweep of
block sizes: the wg family's float32 forward and backward (not causal) at the longest shapes
with each of the device's block_candidates (devices(); the wg family's on a GPU) set through
ORCHARD_CL_BLOCK_Q/K. Last the rows family, for comparison, as the wg family was measured. Each family runs in a child process of
its own (ORCHARD_CL_FAMILY is read when a process builds its programs) that prints each row as
it is measured; the JSON file is rewritten after each, so a run cut short keeps what it got.

--quick runs small shapes and a short peak kernel, so that the script can be checked on any
OpenCL device (PoCL's CPU device too: slowly, and its figures mean nothing for a GPU).

Peak method: PEAK_SOURCE runs CHAINS independent chains a = a * b + c (fma, 2 flops) of
`iters` steps per work-item, in work-groups of 256, compute units x 2048 work-items in all;
its time is the device's own (event profiling: end - start), the best of 5 launches after a
warm-up; peak = 2 * CHAINS * iters * work-items / time. Independent chains hide the FMA latency,
so the figure is the throughput of the device's float32 FMA units as OpenCL C reaches them.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

import numpy as np

import orchard_ops
from orchard import benchmark

SHAPES = [(4, 8, 1024, 64), (4, 8, 1024, 128), (2, 16, 4096, 64), (2, 16, 4096, 128)]
QUICK_SHAPES = [(1, 2, 128, 64), (1, 2, 256, 128)]
DTYPES = ("float32", "float16")

CHAINS = 16
PEAK_SOURCE = """
__kernel void fma_chains(__global float *out, float b, float c, int iters)
{
    float a[%(chains)d];
    for (int i = 0; i < %(chains)d; i++)
        a[i] = get_global_id(0) + i;
    for (int n = 0; n < iters; n++)
        for (int i = 0; i < %(chains)d; i++)
            a[i] = fma(a[i], b, c);
    float s = 0;
    for (int i = 0; i < %(chains)d; i++)
        s += a[i];
    out[get_global_id(0)] = s;      /* every chain is used: none is optimised away */
}
""" % {"chains": CHAINS}


class OpenCL:
    """The few OpenCL calls the peak kernel needs, through ctypes and the ICD loader (the
    library orchard_ops opens too), so the script needs no OpenCL package."""
    CL_DEVICE_TYPE_ALL = 0xFFFFFFFF
    CL_DEVICE_NAME, CL_PLATFORM_NAME = 0x102B, 0x0902
    CL_QUEUE_PROFILING_ENABLE, CL_MEM_WRITE_ONLY = 1 << 1, 1 << 1
    CL_PROFILING_COMMAND_START, CL_PROFILING_COMMAND_END = 0x1282, 0x1283

    def __init__(self):
        self.lib = ctypes.CDLL(os.environ.get("ORCHARD_OPENCL_LIBRARY") or "libOpenCL.so.1")
        for name, restype in (("clCreateContext", ctypes.c_void_p),
                              ("clCreateCommandQueue", ctypes.c_void_p),
                              ("clCreateProgramWithSource", ctypes.c_void_p),
                              ("clCreateKernel", ctypes.c_void_p),
                              ("clCreateBuffer", ctypes.c_void_p)):
            getattr(self.lib, name).restype = restype

    def check(self, rc, call):
        if rc != 0:
            raise RuntimeError("%s failed: OpenCL error %d" % (call, rc))

    def ids(self, get, *args):
        n = ctypes.c_uint()
        self.check(get(*args, 0, None, ctypes.byref(n)), get.__name__)
        out = (ctypes.c_void_p * n.value)()
        self.check(get(*args, n.value, out, None), get.__name__)
        return list(out)

    def text(self, get, obj, what):
        buf = ctypes.create_string_buffer(1024)
        self.check(get(ctypes.c_void_p(obj), what, ctypes.c_size_t(1024), buf, None),
                   get.__name__)
        return buf.value.decode(errors="replace")

    def find(self, name, platform, nth=0):
        """The nth device of this name on this platform (several identical GPUs), in the
        order the platform lists them, as orchard_ops does."""
        for p in self.ids(self.lib.clGetPlatformIDs):
            if self.text(self.lib.clGetPlatformInfo, p, self.CL_PLATFORM_NAME) != platform:
                continue
            for d in self.ids(self.lib.clGetDeviceIDs, ctypes.c_void_p(p),
                              ctypes.c_ulong(self.CL_DEVICE_TYPE_ALL)):
                if self.text(self.lib.clGetDeviceInfo, d, self.CL_DEVICE_NAME) == name:
                    if nth == 0:
                        return d
                    nth -= 1
        raise RuntimeError("OpenCL device %r of platform %r not found" % (name, platform))

    def fma_peak(self, device, compute_units, iters):
        """GFLOP/s of the FMA-chain kernel (the method in the module's docstring)."""
        lib, rc = self.lib, ctypes.c_int()
        dev = ctypes.c_void_p(device)
        ctx = lib.clCreateContext(None, 1, ctypes.byref(dev), None, None, ctypes.byref(rc))
        self.check(rc.value, "clCreateContext")
        queue = lib.clCreateCommandQueue(ctypes.c_void_p(ctx), dev,
                                         ctypes.c_ulong(self.CL_QUEUE_PROFILING_ENABLE),
                                         ctypes.byref(rc))
        self.check(rc.value, "clCreateCommandQueue")
        src = ctypes.c_char_p(PEAK_SOURCE.encode())
        prog = lib.clCreateProgramWithSource(ctypes.c_void_p(ctx), 1, ctypes.byref(src), None,
                                             ctypes.byref(rc))
        self.check(rc.value, "clCreateProgramWithSource")
        self.check(lib.clBuildProgram(ctypes.c_void_p(prog), 1, ctypes.byref(dev), None, None,
                                      None), "clBuildProgram")
        kernel = lib.clCreateKernel(ctypes.c_void_p(prog), b"fma_chains", ctypes.byref(rc))
        self.check(rc.value, "clCreateKernel")
        local = 256
        items = max(1, compute_units) * 2048
        buf = lib.clCreateBuffer(ctypes.c_void_p(ctx), ctypes.c_ulong(self.CL_MEM_WRITE_ONLY),
                                 ctypes.c_size_t(4 * items), None, ctypes.byref(rc))
        self.check(rc.value, "clCreateBuffer")
        mem = ctypes.c_void_p(buf)
        for i, (arg, size) in enumerate(((mem, 8), (ctypes.c_float(1.0000001), 4),
                                         (ctypes.c_float(1e-7), 4), (ctypes.c_int(iters), 4))):
            self.check(lib.clSetKernelArg(ctypes.c_void_p(kernel), i, ctypes.c_size_t(size),
                                          ctypes.byref(arg)), "clSetKernelArg")
        best = float("inf")
        for run in range(6):            # the first is a warm-up
            event = ctypes.c_void_p()
            self.check(lib.clEnqueueNDRangeKernel(
                ctypes.c_void_p(queue), ctypes.c_void_p(kernel), 1, None,
                ctypes.byref(ctypes.c_size_t(items)), ctypes.byref(ctypes.c_size_t(local)), 0,
                None, ctypes.byref(event)), "clEnqueueNDRangeKernel")
            self.check(lib.clWaitForEvents(1, ctypes.byref(event)), "clWaitForEvents")
            start, end = ctypes.c_ulong(), ctypes.c_ulong()
            for what, out in ((self.CL_PROFILING_COMMAND_START, start),
                              (self.CL_PROFILING_COMMAND_END, end)):
                self.check(lib.clGetEventProfilingInfo(event, what, ctypes.c_size_t(8),
                                                      ctypes.byref(out), None),
                           "clGetEventProfilingInfo")
            lib.clReleaseEvent(event)
            if run > 0:
                best = min(best, (end.value - start.value) * 1e-9)
        for release, obj in ((lib.clReleaseMemObject, buf), (lib.clReleaseKernel, kernel),
                             (lib.clReleaseProgram, prog), (lib.clReleaseCommandQueue, queue),
                             (lib.clReleaseContext, ctx)):
            release(ctypes.c_void_p(obj))
        return 2.0 * CHAINS * iters * items / best / 1e9


def check_against_native(device, shape):
    """Largest |difference| from the native path's float32 forward and backward on one small
    problem, causal and not: a wrong result on this device shows before any timing."""
    rng = np.random.default_rng(1)
    _, (q, k, v, dout) = benchmark.operands(shape, "float32", rng)
    worst = {}
    for causal in (False, True):
        results = []
        for dev in ("cpu", device):
            out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=dev)
            grads = orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal,
                                               device=dev)
            results.append([np.asarray(out), *(np.asarray(g) for g in grads)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            key = name + (" causal" if causal else "")
            worst[key] = float(np.max(np.abs(a - b)))
    return worst


def measure_family(device, shapes, repeats, dtypes, causal_flags, check):
    """The child process: with `check` the result of check_against_native, then one forward
    and backward row per problem of the family ORCHARD_CL_FAMILY names, each printed as a JSON
    line as soon as it is measured (a run cut short keeps what it measured). The operands are
    DeviceArrays, so the times are the kernels' and not the host bus's."""
    if check:
        info = next(d for d in orchard_ops.devices() if d["id"] == device)
        print(json.dumps({"family": info["kernel_family"],
                          "max_abs_diff_vs_native": check_against_native(device,
                                                                         (1, 2, 128, 64))}),
              flush=True)
    rng = np.random.default_rng(0)
    for shape in shapes:
        for dtype in dtypes:
            _, ops = benchmark.operands(shape, dtype, rng)
            resident = [orchard_ops.to_device(a, device) for a in ops]
            for causal in causal_flags:
                fwd, bwd = benchmark.orchard_calls(*resident, causal, device)
                flops = benchmark.attention_flops(*shape, causal)
                fwd_s, bwd_s = (benchmark.median_time(fn, repeats) for fn in (fwd, bwd))
                print(json.dumps({"B,H,N,D": list(shape), "dtype": dtype, "causal": causal,
                                  "fwd_ms": fwd_s * 1e3, "fwd_gflops": flops / fwd_s / 1e9,
                                  "bwd_ms": bwd_s * 1e3,
                                  "bwd_gflops": 2.5 * flops / bwd_s / 1e9}), flush=True)


def device_resident_vs_host(device, shapes, repeats):
    """Issue 17's goal, device-resident calls at least 10x faster than host-array calls at N
    1024: float32, not causal, the shapes of this run at N 1024 (all of them with --quick)."""
    at_1024 = [s for s in shapes if s[2] == 1024] or shapes
    rng = np.random.default_rng(0)
    return [benchmark.resident_vs_host(s, device, False, repeats, rng) for s in at_1024]


def child_rows(env, device, shapes, repeats, peak, dtypes=DTYPES, sweep=False):
    """measure_family in a child process with these environment variables (the family, the
    blocks: read when the child builds its programs): its JSON lines as they come, the rows
    with their fractions of the peak."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--device",
                              device, "--repeats", str(repeats), "--dtypes", *dtypes, "--shapes",
                              *(",".join(map(str, s)) for s in shapes)]
                             + (["--sweep"] if sweep else []),
                             env=dict(os.environ, **env), stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        r = json.loads(line)
        if "fwd_gflops" in r:
            r["fwd_of_peak"], r["bwd_of_peak"] = r["fwd_gflops"] / peak, r["bwd_gflops"] / peak
        yield r
    if child.wait() != 0:
        raise RuntimeError("a child run (%s) failed: its error is above" % env)


def run_family(family, device, shapes, repeats, peak, result, out):
    """The family's rows, printed as a table and written to `out` as they come."""
    got = result["families"][family] = {"rows": []}
    for r in child_rows({"ORCHARD_CL_FAMILY": family}, device, shapes, repeats, peak):
        if "max_abs_diff_vs_native" in r:
            got.update(r)
            print("%s family: largest |difference| from the native path (float32, 1,2,128,64): "
                  "%s" % (got["family"], ", ".join("%s %.1e" % kv for kv in
                                            r["max_abs_diff_vs_native"].items())), flush=True)
            print(TABLE_HEAD, flush=True)
            continue
        got["rows"].append(r)
        print("| %s | %s | %s | %s | %.2f | %.0f | %.1f %% | %.2f | %.0f | %.1f %% |"
              % (got["family"], ",".join(map(str, r["B,H,N,D"])), r["dtype"],
                 "yes" if r["causal"] else "no", r["fwd_ms"], r["fwd_gflops"],
                 100 * r["fwd_of_peak"], r["bwd_ms"], r["bwd_gflops"], 100 * r["bwd_of_peak"]),
              flush=True)
        write(result, out)


def sweep_blocks(candidates, device, shapes, repeats, peak, result, out):
    """The wg family's float32 forward and backward (not causal) at the run's longest shapes
    with each of the device's block candidates set through ORCHARD_CL_BLOCK_Q/K (blocks that do
    not fit shrink as the family's rules say: the row names what was asked for)."""
    longest = [s for s in shapes if s[2] == max(t[2] for t in shapes)]
    rows = result["block_sweep"] = []
    print("\n| wg blocks asked | B,H,N,D | fwd GFLOP/s | of peak | bwd GFLOP/s | of peak |"
          "\n| --- | --- | --- | --- | --- | --- |", flush=True)
    for bq, bk in candidates:
        env = {"ORCHARD_CL_FAMILY": "wg", "ORCHARD_CL_BLOCK_Q": str(bq),
               "ORCHARD_CL_BLOCK_K": str(bk)}
        for r in child_rows(env, device, longest, repeats, peak, ("float32",), sweep=True):
            r["blocks"] = [bq, bk]
            rows.append(r)
            print("| %d x %d | %s | %.0f | %.1f %% | %.0f | %.1f %% |"
                  % (bq, bk, ",".join(map(str, r["B,H,N,D"])), r["fwd_gflops"],
                     100 * r["fwd_of_peak"], r["bwd_gflops"], 100 * r["bwd_of_peak"]), flush=True)
            write(result, out)


TABLE_HEAD = ("\n| family | B,H,N,D | dtype | causal | fwd ms | fwd GFLOP/s | of peak | bwd ms "
              "| bwd GFLOP/s | of peak |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- "
              "| --- |")


def write(result, out):
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="an OpenCL device (default: the first GPU, else the "
                        "first OpenCL device)")
    parser.add_argument("--out", default="gpu_opencl.json", help="the JSON file to write")
    parser.add_argument("--quick", action="store_true", help="small shapes, a short peak run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, help=argparse.SUPPRESS)
    parser.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    opencl = [d for d in orchard_ops.devices() if d["backend"] == "opencl"]
    if not opencl:
        parser.exit(2, "gpu_opencl: error: no OpenCL device is listed by orchard_ops.devices()\n")
    if args.device is None:
        args.device = next((d for d in opencl if d["kind"] == "gpu"), opencl[0])["id"]
    info = next((d for d in opencl if d["id"] == args.device), None)
    if info is None:
        parser.exit(2, "gpu_opencl: error: --device %r is not an OpenCL device (%s)\n"
                    % (args.device, ", ".join(d["id"] for d in opencl)))
    if args.repeats < benchmark.MIN_REPEATS:
        parser.exit(2, "gpu_opencl: error: --repeats must be >= %d, got %d\n"
                    % (benchmark.MIN_REPEATS, args.repeats))
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes
              else QUICK_SHAPES if args.quick else SHAPES)
    if args.child:
        measure_family(args.device, shapes, args.repeats, args.dtypes,
                       (False,) if args.sweep else (False, True), check=not args.sweep)
        return 0

    print("device: %s (%s, %d compute units, %.1f GiB, %d KiB local memory)"
          % (info["name"], info["kind"], info["compute_units"], info["global_mem_bytes"] / 2**30,
             info["local_mem_bytes"] // 1024))
    print("driver: %s; platform: %s" % (info["driver_version"], info["platform"]), flush=True)
    cl = OpenCL()
    twins = [d["id"] for d in opencl if (d["name"], d["platform"]) == (info["name"],
                                                                       info["platform"])]
    peak = cl.fma_peak(cl.find(info["name"], info["platform"], twins.index(info["id"])),
                       info["compute_units"], 1024 if args.quick else 4096)
    print("float32 FMA peak (measured): %.0f GFLOP/s" % peak, flush=True)
    result = {"device": {k: info[k] for k in ("id", "name", "vendor", "kind", "platform",
                                              "driver_version", "compute_units",
                                              "local_mem_bytes", "fp16", "fp64", "subgroups")},
              "fma_peak_gflops": peak, "peak_method": __doc__.split("Peak method: ")[1].strip(),
              "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "families": {}}
    write(result, args.out)
    # the wg family first, the goals' family; the rows family, for comparison, last
    run_family("wg", args.device, shapes, args.repeats, peak, result, args.out)
    result["device_resident"] = device_resident_vs_host(args.device, shapes, args.repeats)
    print("\n| B,H,N,D | call | host arrays ms | DeviceArrays ms | host / resident (goal >= 10) |"
          "\n| --- | --- | --- | --- | --- |")
    for r in result["device_resident"]:
        for what, name in (("fwd", "forward"), ("step", "forward+backward")):
            print("| %s | %s | %.2f | %.2f | %.2f |" % (",".join(map(str, r["shape"])), name,
                                                       r[what]["host_ms"], r[what]["resident_ms"],
                                                       r[what]["ratio"]), flush=True)
    write(result, args.out)
    sweep_blocks(info["block_candidates"], args.device, shapes, args.repeats, peak, result,
                 args.out)
    run_family("rows", args.device, shapes, args.repeats, peak, result, args.out)
    print("\nwrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
