"""A/B timing of two builds of orchard_ops, for changes that must not move speed (or should).

    python3 benchmarks/ab_builds.py BEFORE_DIR AFTER_DIR [--pairs 20]
                                    [--calls d64|d128|d128-long|d256|short|half|few-units|decode]
                                    [--devices cpu,opencl:0]
                                    [--threads N]

Each DIR holds an orchard_ops extension (e.g. a checkout's python/ after
`python3 setup.py build_ext --inplace`, or a copy of the .so). Both are loaded into one process
(each from its own file, so each keeps its own state), and every call is timed on both builds
back to back, in alternating order, `--pairs` times; the table gives the best time of each and
the median over pairs of after / before. A shared VM's speed drifts by 10-20 % within seconds
(the twenty-fourth session's: consecutive calls 15 % apart); a ratio of two calls made next to
each other drifts far less than one of two processes seconds apart (this script's earlier
method: a call whose code had not changed read 0.84 and 0.97 in two runs, 0.96-1.00 this way).
--calls picks the shapes: d64 (B4 H8 N1024), d128 (B2 H8 N2048, float32 and bfloat16; the
backward B1), d128-long (float32 B1 H16 N4096, a backward of several key chunks), d256
(float32, N 2048 and 256), short (N 256 and 100, many heads), half
(bfloat16 and float16 forwards, D 64 and 128, float16 at N 256), few-units (backwards of
fewer kv units than orchard.h's OR_BWD_ITEMS, whose keys go in parts), decode
(benchmarks/decode.py's decode steps, one query row against a cache).
"""
import argparse
import glob
import importlib.machinery
import importlib.util
import os
import statistics
import time

import numpy as np
# torch before the first call: orchard moves its threads onto OpenMP's once torch's runtime is
# loaded (threadpool.c), and every call here must run on the same threads
import torch

CALLS = {  # (name, B or query heads, H or kv heads, N or cache length, D, causal, dtype)
    "d64": [("fwd", 4, 8, 1024, 64, False, "float32"),
            ("fwd causal", 4, 8, 1024, 64, True, "float32"),
            ("bwd", 4, 8, 1024, 64, False, "float32"),
            ("fwd f16", 4, 8, 1024, 64, True, "float16")],
    "d128": [("fwd", 2, 8, 2048, 128, False, "float32"),
             ("fwd causal", 2, 8, 2048, 128, True, "float32"),
             ("fwd bf16", 2, 8, 2048, 128, False, "bfloat16"),
             ("bwd", 1, 8, 2048, 128, False, "float32")],
    "d128-long": [("fwd N4096", 1, 16, 4096, 128, False, "float32"),
                  ("bwd N4096", 1, 16, 4096, 128, False, "float32")],
    "d256": [("fwd", 1, 8, 2048, 256, False, "float32"),
             ("fwd causal", 1, 8, 2048, 256, True, "float32"),
             ("fwd N256", 1, 64, 256, 256, False, "float32"),
             ("bwd", 1, 4, 2048, 256, False, "float32")],
    # short sequences: a unit's last key block is partly past its keys (N 256: 96 + 96 + 64)
    "short": [("fwd N256", 1, 128, 256, 64, False, "float32"),
              ("bwd N256", 1, 128, 256, 64, False, "float32"),
              ("fwd N256 d128", 1, 128, 256, 128, False, "float32"),
              ("fwd N100", 1, 256, 100, 64, False, "float32"),
              ("bwd N100", 1, 256, 100, 64, False, "float32"),
              ("fwd N100 causal", 1, 256, 100, 64, True, "float32")],
    # fewer kv units than items (orchard.h OR_BWD_ITEMS): the backward splits units' keys in parts
    "few-units": [("bwd N4096", 1, 1, 4096, 64, False, "float32"),
                  ("bwd N4096 causal", 1, 1, 4096, 64, True, "float32"),
                  ("bwd N4096 d128", 1, 2, 4096, 128, False, "float32"),
                  ("bwd N4096 d128 bf16", 1, 2, 4096, 128, True, "bfloat16"),
                  ("bwd N2048 d128", 1, 8, 2048, 128, False, "float32"),
                  ("bwd N1024 f16", 2, 4, 1024, 64, True, "float16")],
    "half": [("fwd bf16", 4, 8, 1024, 64, False, "bfloat16"),
             ("fwd f16", 4, 8, 1024, 64, False, "float16"),
             ("fwd bf16 d128", 2, 8, 2048, 128, False, "bfloat16"),
             ("fwd f16 d128", 2, 8, 2048, 128, False, "float16"),
             ("fwd f16 N256", 1, 128, 256, 64, False, "float16")],
    "decode": [("decode gqa 4k", 32, 8, 4096, 128, True, "float32"),
               ("decode gqa 4k bf16", 32, 8, 4096, 128, True, "bfloat16"),
               ("decode mha 4k", 32, 32, 4096, 128, True, "float32"),
               ("decode mha 4k bf16", 32, 32, 4096, 128, True, "bfloat16")],
}


def load_build(folder):
    """The orchard_ops extension in folder, loaded apart from any other copy."""
    found = [f for f in glob.glob(os.path.join(folder, "orchard_ops*"))
             if f.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
    if not found:
        raise SystemExit("ab_builds.py: error: no orchard_ops*.so in %r" % folder)
    spec = importlib.util.spec_from_file_location("orchard_ops", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def operands(name, b, h, n, d, dtype, rng):
    """q, k, v, dO of a call; bfloat16 (which NumPy lacks) as torch tensors."""
    if name.startswith("decode"):   # b query heads, h kv heads, one query row
        shapes = [(1, b, 1, d), (1, h, n, d), (1, h, n, d), (1, b, 1, d)]
    else:
        shapes = [(b, h, n, d)] * 4
    arrays = [rng.standard_normal(s).astype("float32" if dtype == "bfloat16" else dtype)
              for s in shapes]
    if dtype == "bfloat16":
        arrays = [torch.from_numpy(a).bfloat16() for a in arrays]
    return arrays


def call(ops, name, q, k, v, do, causal, device):
    """A function running the call on build ops."""
    if name.startswith("bwd"):
        out, lse = ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
        return lambda: ops.flash_attn_bwd(do, q, k, v, out, lse, causal=causal, device=device)
    return lambda: ops.flash_attn_fwd(q, k, v, causal=causal, device=device)


def at_least_one(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("must be a whole number of 1 or more (got %r)" % text)
    return int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--pairs", type=at_least_one, default=20, metavar="N")
    parser.add_argument("--calls", choices=sorted(CALLS), default="d64")
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--threads", type=int, help="native threads (default: orchard's)")
    args = parser.parse_args()
    builds = [load_build(args.before), load_build(args.after)]
    if args.threads:
        for ops in builds:
            ops.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print("| device | call | before (ms) | after (ms) | after / before, median of %d pairs |"
          % args.pairs)
    print("| --- | --- | --- | --- | --- |")
    for device in args.devices.split(","):
        for name, b, h, n, d, causal, dtype in CALLS[args.calls]:
            q, k, v, do = operands(name, b, h, n, d, dtype, rng)
            runs = [call(ops, name, q, k, v, do, causal, device) for ops in builds]
            for run in runs:    # warm-up: OpenCL programs, pages
                run()
            times, ratios = ([], []), []
            for i in range(args.pairs):
                pair = [0.0, 0.0]
                for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    runs[which]()
                    pair[which] = time.perf_counter() - t0
                for which in (0, 1):
                    times[which].append(pair[which])
                ratios.append(pair[1] / pair[0])
            print("| %s | %s | %.1f | %.1f | %.3f |" % (device, name, min(times[0]) * 1e3,
                                                       min(times[1]) * 1e3,
                                                       statistics.median(ratios)), flush=True)


if __name__ == "__main__":
    main()
