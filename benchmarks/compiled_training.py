"""The demo model's training step under torch.compile: tokens/s of torch SDPA and orchard
attention (patch_model), each eager and compiled by Inductor, the four steps interleaved in
rounds (orchard.benchmark.training_tokens_per_s; the first round compiles).

    python3 benchmarks/compiled_training.py [--steps 8] [--batch 8] [--seq 256]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from orchard import benchmark  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="at least 3 (medians of them)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    for name, least in (("steps", benchmark.MIN_REPEATS), ("batch", 1), ("seq", 1)):
        if getattr(args, name) < least:
            parser.error("argument --%s: must be >= %d (got %d)" % (name, least,
                                                                    getattr(args, name)))
    rate = benchmark.training_tokens_per_s(args.steps, args.batch, args.seq, compiled=True)
    print("batch %d, seq %d, %d steps (medians)\n" % (args.batch, args.seq, args.steps))
    print("| attention | eager tokens/s | compiled tokens/s | compiled / eager |")
    print("| --- | --- | --- | --- |")
    for backend in ("torch-sdpa", "orchard"):
        eager, compiled = rate[backend], rate[backend + " compiled"]
        print("| %s | %.0f | %.0f | %.2f |" % (backend, eager, compiled, compiled / eager))
    print("\norchard / torch-sdpa: eager %.2f, compiled %.2f"
          % (rate["orchard"] / rate["torch-sdpa"],
             rate["orchard compiled"] / rate["torch-sdpa compiled"]))


if __name__ == "__main__":
    main()
