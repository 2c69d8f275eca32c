"""orchard-bench: attention throughput of every device and backend, measured in one run.

    orchard-bench [--shapes B,H,N,D ...] [--devices cpu,opencl:0] [--dtypes float32,float16,bfloat16]
                  [--causal both] [--repeats 5] [--quick] [--json [FILE]] [--plot FILE.png]
                  [--overwrite] [--train] [--decode] [--quiet]
    orchard-bench --scaling [--max-n N] [--head-dims 64,128,256] [--dtypes ...] [--causal ...]
                  [--devices cpu] [--repeats 5] [--quick] [--json [FILE]] [--plot FILE.png]

A table of forward and backward ms and GFLOP/s of orchard on every device, beside NumPy's
matrix product (the roofline), the NumPy reference and torch SDPA (orchard.benchmark says
how); --train adds the tokens/s of the demo model trained with orchard's attention against
the same model on torch SDPA; --decode adds the decode-step table (one query token over a KV
cache, orchard against torch SDPA and the machine's read bandwidth: orchard.decode_bench).
--scaling prints, instead of the grid, the scaling tables: ms and GFLOP/s against N from 256
to 16384 per dtype, head dim, causal flag and direction, orchard beside torch SDPA and a
naive NumPy attention, against the machine's matrix products (orchard.scaling_bench).
Every figure is the median of --repeats timings (at least 3).
"""
import argparse
import importlib.util
import json
import os
import sys

import orchard_ops

from .. import benchmark, scaling_bench
from ..atomic import is_stdout, write_atomically, written_in_place
from ..progress import Progress
from .args import (Parser, UsageError, choices_list, console_script, devices, env_flag,
                   integer, integer_list, output_file, shape, writing)

EXAMPLES = (
    "orchard-bench --quick",
    "orchard-bench --shapes 4,8,1024,64 1,8,4096,64 --dtypes float32 --causal yes",
    "orchard-bench --devices cpu --json results.json --plot gflops.png",
    "orchard-bench --quick --json | python3 -m json.tool",
    "orchard-bench --scaling --dtypes bfloat16 --head-dims 128 --max-n 4096 --plot scaling.png",
)
INDICATIVE = ("--quick: tiny shapes and %d repeats; the figures and ratios are indicative "
              "only, not measurements to quote")


def print_report(report, out):
    print("machine: %(cpu)s, %(logical_cores)d logical cores, %(threads)d threads, native "
          "kernel set %(kernel_isa)s" % report["machine"], file=out)
    print("every figure is the median of %d timings" % report["repeats"], file=out)
    if "scaling" in report:
        print(scaling_bench.table(report["scaling"]), file=out)
        return
    print("NumPy float32 matrix product (roofline): %.1f GFLOP/s" % report["sgemm_gflops"],
          file=out)
    print(benchmark.table(report["results"], report["sgemm_gflops"]), file=out)
    print("\n".join(report["comparisons"]), file=out)
    if "training_tokens_per_s" in report:
        t = report["training_tokens_per_s"]
        print("training, demo model: orchard %.0f tokens/s, torch SDPA %.0f tokens/s (%.2fx)"
              % (t["orchard"], t["torch-sdpa"], t["orchard"] / t["torch-sdpa"]), file=out)
    if "decode" in report:
        from .. import decode_bench     # it needs torch
        for dev, decode in report["decode"].items():
            print(decode_bench.table(decode["read_bandwidth_gbs"], decode["results"], dev),
                  file=out)


def grid(args, quick, repeats, causal_flags):
    """The report of the grid (and --train, --decode): orchard.benchmark.run's."""
    shapes = args.shapes or (benchmark.QUICK_SHAPES if quick else benchmark.DEFAULT_SHAPES)
    device_ids = args.devices or [d["id"] for d in orchard_ops.devices()]
    progress = Progress(len(shapes) * len(args.dtypes) * len(causal_flags), "benchmark",
                        unit="problems", enabled=not args.quiet)
    report = benchmark.run(shapes, device_ids, args.dtypes, causal_flags, repeats,
                           train_steps=(benchmark.MIN_REPEATS if quick else 12)
                           if args.train else 0, progress=progress)
    report["indicative_only"] = quick
    progress.close()
    if args.decode:
        from .. import decode_bench
        cases = [(8, 2, 64, 1024)] if quick else decode_bench.CASES
        report["decode"] = {}
        for dev in device_ids:
            dtypes = [dt for dt, name in zip(decode_bench.DTYPES, decode_bench.DTYPE_NAMES)
                      if name in args.dtypes]
            bandwidth, rows = decode_bench.measure(cases, dtypes, rounds=repeats, device=dev)
            report["decode"][dev] = dict(read_bandwidth_gbs=bandwidth, results=rows)
    return report


def scaling(args, quick, repeats, causal_flags):
    """The report of --scaling: the machine and orchard.scaling_bench.measure's tables."""
    if quick:
        ns, head_dims, tokens = (scaling_bench.QUICK_NS, scaling_bench.QUICK_HEAD_DIMS,
                                 scaling_bench.QUICK_TOKENS)
    else:
        ns, head_dims, tokens = scaling_bench.NS, scaling_bench.HEAD_DIMS, scaling_bench.TOKENS
    ns = [n for n in ns if args.max_n is None or n <= args.max_n]
    head_dims = args.head_dims or head_dims
    progress = Progress(len(scaling_bench.problems(ns, head_dims, args.dtypes, causal_flags)),
                        "scaling", unit="problems", enabled=not args.quiet)
    report = {"machine": benchmark.machine_facts(), "repeats": repeats,
              "indicative_only": quick, "complete": False}

    def after(done, label, scaling):
        progress.update(done, label)
        if args.json not in (None, "-"):    # a run stopped midway keeps what it measured
            report["scaling"] = scaling
            save_json(args.json, report)

    report["scaling"] = scaling_bench.measure(ns, head_dims, args.dtypes, causal_flags,
                                              args.devices or ["cpu"], repeats, tokens, after)
    report["complete"] = True
    progress.close()
    return report


def save_json(path, report):
    """The report in path, replaced atomically: never half written, whenever the run stops."""
    with writing("--json", path):
        write_atomically(path, lambda f: f.write(json.dumps(report, indent=1).encode() + b"\n"))


def check_plot_file(path):
    """UsageError unless matplotlib is there and can write the format path's suffix names
    (checked before the benchmark, not after it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("argument --plot: needs matplotlib (pip install '.[bench]') (got %r)"
                         % path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    suffix = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise UsageError("argument --plot: a file name ending in one of .%s (got %r)"
                         % (", .".join(sorted(formats)), path))


@console_script("orchard-bench")
def main(argv=None):
    parser = Parser("orchard-bench", __doc__.splitlines()[0], EXAMPLES)
    parser.add_argument("--shapes", type=shape, nargs="+", metavar="B,H,N,D",
                        help="The problem shapes to time. Default: four shapes from N=256 to "
                             "N=2048 (two tiny ones with --quick).")
    parser.add_argument("--devices", type=devices, metavar="ID,...",
                        help="Comma-separated orchard devices. Default: every device listed "
                             "(the native cpu alone with --scaling).")
    parser.add_argument("--dtypes", type=choices_list(benchmark.DTYPES),
                        default="float32,float16,bfloat16", metavar="NAME,...",
                        help="Comma-separated dtypes, of %s." % ", ".join(benchmark.DTYPES))
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both",
                        help="Time causal attention, non-causal, or both.")
    parser.add_argument("--repeats", type=integer(benchmark.MIN_REPEATS), metavar="N",
                        help="Timed calls per figure, which is their median. Default: 5 "
                             "(%d with --quick)." % benchmark.MIN_REPEATS)
    parser.add_argument("--quick", action="store_true",
                        help="Tiny shapes and, unless --repeats says otherwise, %d repeats, to "
                             "check that everything runs; its figures are indicative only."
                             % benchmark.MIN_REPEATS)
    parser.add_argument("--json", type=output_file, nargs="?", const="-", metavar="FILE",
                        help="Write the report as JSON to FILE, or without FILE print it to "
                             "stdout instead of the table. With --scaling FILE is rewritten "
                             "after each problem, with \"complete\": false until the last.")
    parser.add_argument("--plot", type=output_file, metavar="FILE",
                        help="Write a plot of forward GFLOP/s against N to FILE, in the "
                             "format its suffix names (.png added to a name without one, "
                             "PNG into a device or FIFO named so; with "
                             "--scaling: forward and backward, a panel per dtype, causal "
                             "flag and head dim).")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace an existing --json or --plot file.")
    parser.add_argument("--train", action="store_true",
                        help="Also time training steps of the demo model (needs torch).")
    parser.add_argument("--decode", action="store_true",
                        help="Also time decode steps over a KV cache against torch SDPA "
                             "(needs torch).")
    parser.add_argument("--scaling", action="store_true",
                        help="Instead of the grid, the scaling tables: N from %d to %d, "
                             "on the native device unless --devices says otherwise."
                             % (scaling_bench.NS[0], scaling_bench.NS[-1]))
    parser.add_argument("--max-n", type=integer(scaling_bench.NS[0]), metavar="N",
                        help="With --scaling: the largest N of the tables, a bound on "
                             "their Ns (which stop at %d, at %d with --quick). Default: no "
                             "bound."
                             % (scaling_bench.NS[-1], scaling_bench.QUICK_NS[-1]))
    parser.add_argument("--head-dims", metavar="D,...",
                        type=integer_list(1, orchard_ops.build_info()["max_head_dim"]),
                        help="With --scaling: comma-separated head dims. Default: %s (%s "
                             "with --quick)." % (
                                 ",".join(map(str, scaling_bench.HEAD_DIMS)),
                                 ",".join(map(str, scaling_bench.QUICK_HEAD_DIMS))))
    args = parser.parse_args(argv)
    quick = args.quick or env_flag("ORCHARD_BENCH_QUICK")
    grid_only = [flag for flag, given in (("--shapes", args.shapes), ("--train", args.train),
                                          ("--decode", args.decode)) if given]
    scaling_only = [flag for flag, given in (("--max-n", args.max_n is not None),
                                             ("--head-dims", args.head_dims)) if given]
    if args.scaling and grid_only:
        raise UsageError("argument %s: not allowed with argument --scaling" % grid_only[0])
    if scaling_only and not args.scaling:
        raise UsageError("argument %s: only with argument --scaling" % scaling_only[0])
    needs_torch = [flag for flag, wanted in (("--dtypes bfloat16", "bfloat16" in args.dtypes),
                                             ("--train", args.train),
                                             ("--decode", args.decode)) if wanted]
    if needs_torch and importlib.util.find_spec("torch") is None:
        raise UsageError("%s needs torch (pip install '.[torch]')" % " and ".join(needs_torch))
    if args.decode:
        from .. import decode_bench
        if not set(decode_bench.DTYPE_NAMES) & set(args.dtypes):   # (an empty table)
            raise UsageError("argument --decode: decode steps are timed in %s, none of "
                             "--dtypes %s" % (" and ".join(decode_bench.DTYPE_NAMES),
                                              ",".join(args.dtypes)))
    # what matplotlib writes for a name without a suffix; a device or FIFO (/dev/null), or
    # standard output, is written itself, in PNG
    if (args.plot and not os.path.splitext(args.plot)[1] and not is_stdout(args.plot)
            and not written_in_place(args.plot)):
        args.plot += ".png"
        try:    # the file written, checked as the name given was
            output_file(args.plot)
        except argparse.ArgumentTypeError as exc:
            raise UsageError("argument --plot: %s" % exc)
    if args.plot and args.json not in (None, "-") and os.path.realpath(args.json) == \
            os.path.realpath(args.plot):
        raise UsageError("argument --plot: the same file as --json (got %r)" % args.plot)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path not in (None, "-") and os.path.exists(path) and not args.overwrite:
            raise UsageError("argument %s: %s exists; pass --overwrite to replace it (got %r)"
                             % (flag, path, path))
    if args.plot:
        check_plot_file(args.plot)

    repeats = args.repeats or (benchmark.MIN_REPEATS if quick else 5)
    causal_flags = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    report = (scaling if args.scaling else grid)(args, quick, repeats, causal_flags)
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        if quick:
            print(INDICATIVE % repeats)
        print_report(report, sys.stdout)
        if args.json:
            save_json(args.json, report)
    if args.plot:
        with writing("--plot", args.plot):
            if args.scaling:
                scaling_bench.plot(report["scaling"], args.plot)
            else:
                benchmark.plot(report["results"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
