"""orchard-bench: attention throughput of every device and backend, measured in one run.

    orchard-bench [--shapes B,H,N,D ...] [--devices cpu,opencl:0] [--dtypes float32,float16,bfloat16]
                  [--causal both] [--repeats 5] [--quick] [--json FILE] [--plot FILE.png]
                  [--train] [--decode]

A table of forward and backward ms and GFLOP/s of orchard on every device, beside NumPy's
matrix product (the roofline), the NumPy reference and torch SDPA (orchard.benchmark says
how); --train adds the tokens/s of the demo model trained with orchard's attention against
the same model on torch SDPA; --decode adds the decode-step table (one query token over a KV
cache, orchard against torch SDPA and the machine's read bandwidth: orchard.decode_bench).
"""
import argparse
import importlib.util
import json
import os
import sys


import orchard_ops

from .. import benchmark


def parse_shape(text):
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4:
        raise argparse.ArgumentTypeError("a shape is B,H,N,D, got %r" % text)
    return shape


def main(argv=None):
    parser = argparse.ArgumentParser(prog="orchard-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", help="B,H,N,D ...")
    parser.add_argument("--devices", help="comma-separated orchard devices (default: all)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16",
                        help="comma-separated, of %s" % ", ".join(benchmark.DTYPES))
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of GFLOP/s against N here")
    parser.add_argument("--train", action="store_true",
                        help="also time training steps of the demo model (needs torch)")
    parser.add_argument("--decode", action="store_true",
                        help="also time decode steps over a KV cache (needs torch)")
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("ORCHARD_BENCH_QUICK") == "1"
    shapes = args.shapes or (benchmark.QUICK_SHAPES if quick else benchmark.DEFAULT_SHAPES)
    repeats = 1 if quick else args.repeats
    devices = args.devices.split(",") if args.devices else [d["id"] for d in orchard_ops.devices()]
    causal_flags = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(benchmark.DTYPES):
        parser.error("argument --dtypes: not a list of %s: %r"
                     % (", ".join(benchmark.DTYPES), args.dtypes))
    if "bfloat16" in dtypes and importlib.util.find_spec("torch") is None:
        parser.error("argument --dtypes: bfloat16 needs torch (pip install '.[torch]')")

    report = benchmark.run(shapes, devices, dtypes, causal_flags, repeats,
                           train_steps=(2 if quick else 12) if args.train else 0)
    print("machine: %(cpu)s, %(logical_cores)d logical cores, %(threads)d threads"
          % report["machine"])
    print("NumPy float32 matrix product (roofline): %.1f GFLOP/s" % report["sgemm_gflops"])
    print(benchmark.table(report["results"], report["sgemm_gflops"]))
    print("\n".join(report["comparisons"]))
    if "training_tokens_per_s" in report:
        t = report["training_tokens_per_s"]
        print("training, demo model: orchard %.0f tokens/s, torch SDPA %.0f tokens/s (%.2fx)"
              % (t["orchard"], t["torch-sdpa"], t["orchard"] / t["torch-sdpa"]))
    if args.decode:
        from .. import decode_bench
        cases = [(8, 2, 64, 1024)] if quick else decode_bench.CASES
        report["decode"] = {}
        for device in devices:
            bandwidth, rows = decode_bench.measure(cases, rounds=1 if quick else 5, device=device)
            report["decode"][device] = dict(read_bandwidth_gbs=bandwidth, results=rows)
            print(decode_bench.table(bandwidth, rows, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        benchmark.plot(report["results"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
