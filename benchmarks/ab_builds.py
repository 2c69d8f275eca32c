"""A/B timing of two builds of orchard_ops, for changes that must not move speed.

    python3 benchmarks/ab_builds.py BEFORE_DIR AFTER_DIR [--rounds 10] [--devices cpu,opencl:0]
                                    [--decode]

Each DIR holds an orchard_ops extension (e.g. a checkout's python/ after
`python3 setup.py build_ext --inplace`, or a copy of the .so). Every round times both builds,
in alternating fresh processes, on the same calls (best of 3 each); the table gives the median
over rounds of the per-round ratio after / before, so that the machine's drift cancels.
--decode times decode steps (benchmarks/decode.py's shapes) instead.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CALLS = [  # (name, B, H, N, D, causal, dtype)
    ("fwd", 4, 8, 1024, 64, False, "float32"),
    ("fwd causal", 4, 8, 1024, 64, True, "float32"),
    ("bwd", 4, 8, 1024, 64, False, "float32"),
    ("fwd f16", 4, 8, 1024, 64, True, "float16"),
]

DECODE_CALLS = [  # (name, query heads, kv heads, cache length, D, causal, dtype): one query row
    ("decode gqa 4k", 32, 8, 4096, 128, True, "float32"),
    ("decode gqa 4k bf16", 32, 8, 4096, 128, True, "bfloat16"),
    ("decode mha 4k", 32, 32, 4096, 128, True, "float32"),
    ("decode mha 4k bf16", 32, 32, 4096, 128, True, "bfloat16"),
]

TIMER = r"""
import json, sys, time, numpy as np, orchard_ops as ops
device, calls = sys.argv[1], json.loads(sys.argv[2])
rng = np.random.default_rng(0)
result = {}
for name, b, h, n, d, causal, dtype in calls:
    if name.startswith("decode"):   # (name, H, Hkv, Nk, D, ...); bfloat16 needs torch
        import torch
        q, k, v = (torch.randn(shape).to(getattr(torch, dtype))
                   for shape in ((1, b, 1, d), (1, h, n, d), (1, h, n, d)))
    else:
        q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(dtype) for _ in range(4))
    out, lse = ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
    if name.startswith("bwd"):
        run = lambda: ops.flash_attn_bwd(do, q, k, v, out, lse, causal=causal, device=device)
    else:
        run = lambda: ops.flash_attn_fwd(q, k, v, causal=causal, device=device)
    run()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    result[name] = best
print(json.dumps(result))
"""


def time_build(folder, device, calls):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(folder))
    r = subprocess.run([sys.executable, "-c", TIMER, device, json.dumps(calls)], env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--decode", action="store_true", help="time decode steps")
    args = parser.parse_args()
    calls = DECODE_CALLS if args.decode else CALLS
    print("| device | call | before (ms) | after (ms) | after / before, median of %d rounds |"
          % args.rounds)
    print("| --- | --- | --- | --- | --- |")
    for device in args.devices.split(","):
        ratios = {name: [] for name, *_ in calls}
        best = {"before": {}, "after": {}}
        for _ in range(args.rounds):
            a, b = time_build(args.before, device, calls), time_build(args.after, device, calls)
            for name in ratios:
                ratios[name].append(b[name] / a[name])
                best["before"][name] = min(best["before"].get(name, 1e9), a[name])
                best["after"][name] = min(best["after"].get(name, 1e9), b[name])
        for name, r in ratios.items():
            print("| %s | %s | %.1f | %.1f | %.3f |" % (device, name, best["before"][name] * 1e3,
                                                       best["after"][name] * 1e3,
                                                       statistics.median(r)))


if __name__ == "__main__":
    main()
