"""Device-resident calls against host-array calls on one OpenCL device (issue 17's GPU goal:
resident calls at least 10x faster at N 1024), forward and forward+backward, float32.

    python3 benchmarks/device_resident.py [--device opencl] [--shapes 4,8,1024,64 2,16,1024,128]
                                          [--causal] [--rounds 5] [--json PATH]

The shapes are the B, H, D of the CPU tables (benchmarks/kernel_targets.py) at N 1024. A
host-array call gives the device NumPy arrays and gets NumPy arrays back; a resident call
gives it DeviceArrays (orchard_ops.to_device, made once) and gets DeviceArrays back, as a
training step that keeps its tensors on the device would. The step is a forward and the
backward of its result. Calls alternate in rounds (orchard.benchmark.resident_vs_host, one
warm-up round); a ratio is the median of its ratios in each round. Prints a Markdown table and
writes the figures, with the bytes each host-array call copied (stats()), as JSON.

On a device that shares host memory (PoCL on a CPU, integrated GPUs) host arrays are used in
place, nothing crosses a bus, and the ratio is near 1 (a resident call saves only the per-call
buffer set-up): there the figure says only that the resident path costs nothing. The 10x
goal is for a discrete GPU, where every host-array call copies its operands in and its results
out.
"""
import argparse
import json

import numpy as np

import orchard_ops
from orchard import benchmark


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
    rows = [benchmark.resident_vs_host(tuple(int(x) for x in text.split(",")), device,
                                       args.causal, args.rounds, rng) for text in args.shapes]
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
