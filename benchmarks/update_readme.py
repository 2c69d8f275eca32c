"""Regenerates the README's Performance figures and plot with orchard-bench, in one run.

    python benchmarks/update_readme.py

The grid is float32 and float16, causal and not, N from 256 to 2048 at B=4 (B=1 at 2048),
H=8, D=64, on every device; plus training tokens/s of the demo model and the target figures
(call overhead, staging cost, peak memory). Takes a few minutes on 2 cores.
"""
import os
import sys

from orchard import bench

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    sys.exit(bench.main(["--train", "--targets", "--repeats", "5",
                         "--json", os.path.join(HERE, "results.json"),
                         "--plot", os.path.join(HERE, "attention_gflops.png"),
                         "--readme", os.path.join(HERE, "..", "README.md")]))
