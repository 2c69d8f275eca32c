"""Regenerates the README's Performance figures and plot, in one run.

    python benchmarks/update_readme.py [--quick] [--readme README.md] [--json results.json]
                                       [--plot attention_gflops.png]

Measures what orchard-bench does (orchard.benchmark) on the grid float32, float16 and
bfloat16, causal and not, N from 256 to 2048 at B=4 (B=1 at 2048), H=8, D=64, on every
device, plus training
tokens/s of the demo model and the figures of benchmarks/targets.py; writes them as JSON, the
plot, and Markdown between "<!-- bench:start -->" and "<!-- bench:end -->" in the README.
Takes a few minutes on 2 cores; --quick (or ORCHARD_BENCH_QUICK=1, as orchard-bench reads it)
is a tiny smoke run, which writes only the files named (--readme, --json, --plot): its figures
are no measurement.
"""
import argparse
import json
import os
import re
import sys
import time


import orchard_ops
import targets
from orchard import benchmark
from orchard.cli.args import env_flag
from orchard.progress import Progress

HERE = os.path.dirname(os.path.abspath(__file__))


def markdown(report):
    """The results as Markdown: machine, table, comparisons, targets."""
    m = report["machine"]
    lines = ["Measured %s on %s (%d logical cores, %s SIMD, %.0f GiB), native kernel set %s, "
             "%d threads, Python %s, NumPy %s; devices: %s. NumPy float32 matrix product (the "
             "roofline): %.1f GFLOP/s."
             % (time.strftime("%Y-%m-%d"), m["cpu"], m["logical_cores"], m["simd"],
                m["memory_gib"], m.get("kernel_isa"), m["threads"], m["python"], m["numpy"],
                ", ".join("%s (%s)" % (d["id"], d["name"]) for d in m["devices"]),
                report["sgemm_gflops"]), "",
             "| backend | device | B,H,N,D | dtype | causal | fwd ms | fwd GFLOP/s | bwd ms | "
             "bwd GFLOP/s | fwd / sgemm |", "|" + " --- |" * 10]
    for r in report["results"]:
        lines.append("| %s | %s | %d,%d,%d,%d | %s | %s | %.2f | %.1f | %s | %s | %.2f |" % (
            r["backend"], r["device"], r["B"], r["H"], r["N"], r["D"], r["dtype"],
            "yes" if r["causal"] else "no", r["fwd_ms"], r["fwd_gflops"],
            "%.2f" % r["bwd_ms"] if "bwd_ms" in r else "-",
            "%.1f" % r["bwd_gflops"] if "bwd_gflops" in r else "-",
            r["fwd_gflops"] / report["sgemm_gflops"]))
    lines += [""] + ["- " + c for c in report["comparisons"] if c.split(": ")[1].startswith(
        "orchard") or " than orchard" in c]
    if "training_tokens_per_s" in report:
        t = report["training_tokens_per_s"]
        lines.append("- training the demo model: orchard %.0f tokens/s, torch SDPA %.0f tokens/s"
                     % (t["orchard"], t["torch-sdpa"]))
    t = report["targets"]
    lines += ["", "Targets (float32, B,H,N,D = %s; the calls alternate in one loop and a ratio "
              "is the median of its ratios in each round; the matrix product at %.1f GFLOP/s):"
              % (",".join(map(str, t["shape"])), t["sgemm_gflops"]), "",
              "| target | bound | measured | |", "| --- | --- | --- | --- |"]
    lines += ["| %s | %s | %s | %s |" % row for row in targets.target_rows(t)]
    return "\n".join(lines)


def write_readme(path, text):
    with open(path) as f:
        old = f.read()
    new, count = re.subn(r"(<!-- bench:start -->\n).*?(<!-- bench:end -->)",
                         lambda m: m.group(1) + text + "\n" + m.group(2), old, flags=re.S)
    if count != 1:
        raise SystemExit("%s has no <!-- bench:start --> ... <!-- bench:end --> block" % path)
    with open(path, "w") as f:
        f.write(new)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny float32 non-causal shapes, the fewest repeats, targets "
                             "timed once, no training; writes only the files named")
    parser.add_argument("--readme", help="default: the repository's README.md")
    parser.add_argument("--json", help="default: benchmarks/results.json")
    parser.add_argument("--plot", help="default: benchmarks/attention_gflops.png")
    args = parser.parse_args(argv)
    quick = args.quick or env_flag("ORCHARD_BENCH_QUICK")
    if not quick:   # (a smoke run's figures never replace the measured ones by default)
        args.readme = args.readme or os.path.join(HERE, "..", "README.md")
        args.json = args.json or os.path.join(HERE, "results.json")
        args.plot = args.plot or os.path.join(HERE, "attention_gflops.png")
    devices = [d["id"] for d in orchard_ops.devices()]
    shapes, dtypes, causal_flags = ((benchmark.QUICK_SHAPES, ["float32"], [False]) if quick else
                                    (benchmark.DEFAULT_SHAPES, ["float32", "float16", "bfloat16"],
                                     [False, True]))
    # (a bar on a terminal, a line every 30 s in a log: the full run takes minutes)
    progress = Progress(len(shapes) * len(dtypes) * len(causal_flags), "benchmark",
                        unit="problems")
    if quick:
        report = benchmark.run(shapes, devices, dtypes, causal_flags, benchmark.MIN_REPEATS,
                               progress=progress)
    else:
        report = benchmark.run(shapes, devices, dtypes, causal_flags, 5, train_steps=12,
                               progress=progress)
    progress.close()
    print("timing the targets (benchmarks/targets.py)", file=sys.stderr)
    report["targets"] = (targets.target_figures(1, shapes[-1]) if quick
                         else targets.target_figures(5))
    text = markdown(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        benchmark.plot(report["results"], args.plot)
    if args.readme:
        write_readme(args.readme, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
