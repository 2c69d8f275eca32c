"""Device-resident calls against host-array calls on one OpenCL device (issue 17's GPU goal:
resident calls at least 10x faster at N 1024), forward and forward+backward, float32.

    python3 benchmarks/device_resident.py [--device opencl] [--shapes 4,8,1024,64 2,16,1024,128]
                                          [--causal] [--rounds 5] [--json PATH]

The shapes are the B, H, D of the CPU tables (benchmarks/kernel_targets.py) at N 1024. A
host-array call gives the device NumPy arrays and gets NumPy arrays back; a resident call
gives it DeviceArrays (orchard_ops.to_device, made once) and gets DeviceArrays back, as a
training step that keeps its tensors on the device would. The step is a forward and the
backward of its result. Calls alternate in rounds (benchmark.round_robin, one warm-up round);
a ratio is the median of its ratios in each round. Prints a Markdown table and writes the
figures, with the bytes each host-array call copied (stats()), as JSON.

On a device that shares host memory (PoCL on a CPU, integrated GPUs) host arrays are used in
place, nothing crosses a bus, and the ratio is near 1 (a resident call saves only the per-call
buffer set-up): there the figure says only that the resident path costs nothing. The 10x goal is for a discrete GPU, where every host-array call
copies its operands in and its results out.
"""
import argparse
import json

import numpy as np

import orchard_ops
from orchard import benchmark


def copies_per_call(device, fwd, step):
    """Bytes a host-array forward and step copy between host and device (stats())."""
    out = {}
    for name, fn in (("fwd", fwd), ("step", step)):
        orchard_ops.reset_stats()
        fn()
        st = orchard_ops.stats()["per_device"][device]
        out[name] = st["host_to_device_bytes"] + st["device_to_host_bytes"]
    return out


def figures(shape, device, causal, rounds, rng):
    arrays, _ = benchmark.operands(shape, "float32", rng)
    resident = [orchard_ops.to_device(a, device) for a in arrays]

    def step(q, k, v, dout):
        out, lse = orchard_ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
        return orchard_ops.flash_attn_bwd(dout, q, k, v, out, lse, causal=causal, device=device)

    calls = {"host_fwd": benchmark.orchard_calls(*arrays, causal, device)[0],
             "resident_fwd": benchmark.orchard_calls(*resident, causal, device)[0],
             "host_step": lambda: step(*arrays),
             "resident_step": lambda: step(*resident)}
    copied = copies_per_call(device, calls["host_fwd"], calls["host_step"])
    t = benchmark.round_robin(calls, rounds)
    row = {"shape": list(shape), "causal": causal, "bytes_copied_per_host_call": copied}
    for what in ("fwd", "step"):
        row[what] = {"host_ms": float(np.median(t["host_" + what])) * 1e3,
                     "resident_ms": float(np.median(t["resident_" + what])) * 1e3,
                     "ratio": float(np.median(t["host_" + what] / t["resident_" + what]))}
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="opencl", help="an OpenCL device (default: the best)")
    parser.add_argument("--shapes", nargs="+", default=["4,8,1024,64", "2,16,1024,128"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/device_resident.json")
    args = parser.parse_args(argv)
    device = orchard_ops.resolve_device(args.device)
    if not device.startswith("opencl:"):
        parser.error("--device must name an OpenCL device, not %r" % device)
    info = next(d for d in orchard_ops.devices() if d["id"] == device)
    rng = np.random.default_rng(0)
    rows = [figures(tuple(int(x) for x in text.split(",")), device, args.causal, args.rounds,
                    rng) for text in args.shapes]
    print("%s (%s, %s), unified memory: %s; %d rounds%s"
          % (device, info["name"], info["platform"], info["unified_memory"], args.rounds,
             ", causal" if args.causal else ""))
    print("\n| B,H,N,D | call | host arrays ms | DeviceArrays ms | ratio (goal >= 10) |"
          "\n| --- | --- | --- | --- | --- |")
    for row in rows:
        for what, name in (("fwd", "forward"), ("step", "forward+backward")):
            r = row[what]
            print("| %s | %s | %.2f | %.2f | %.2f |" % (",".join(map(str, row["shape"])), name,
                                                       r["host_ms"], r["resident_ms"], r["ratio"]))
    with open(args.json, "w") as f:
        json.dump({"device": device, "device_info": info, "rounds": args.rounds,
                   "results": rows}, f, indent=1)
    print("\nwritten to", args.json)


if __name__ == "__main__":
    main()
