"""orchard-tune: picks the block sizes of an OpenCL device by timing a few, and stores the
choice beside the device's program binaries, where every later process finds it.

    orchard-tune [--device opencl:0] [--shape B,H,N,D] [--candidates 48x96,96x96 ...]
                 [--repeats 3] [--timeout 600] [--json] [--quiet]

orchard.tuning says how the candidates are timed.
"""
import argparse
import json
import os
import sys

import orchard_ops

from ..progress import Progress
from ..tuning import default_candidates, tune
from .args import (Parser, UsageError, console_script, decimal, device, env_flag, integer,
                   number, shape)

EXAMPLES = (
    "orchard-tune",
    "orchard-tune --device opencl:0 --shape 1,8,2048,64 --candidates 32x64 64x64 --repeats 5",
)


def block_pair(text):
    """An argparse type: BQxBK, two integers in 1..the largest block a record may hold."""
    largest = orchard_ops.build_info()["max_cl_block"]
    try:
        bq, bk = (decimal(x) for x in text.lower().split("x"))
    except ValueError:
        bq = bk = 0
    if not (1 <= bq <= largest and 1 <= bk <= largest):
        raise argparse.ArgumentTypeError("a candidate is BQxBK, two integers in 1..%d such as "
                                         "96x96 (got %r)" % (largest, text))
    return bq, bk


@console_script("orchard-tune")
def main(argv=None):
    parser = Parser("orchard-tune", __doc__.split("\n\n")[0], EXAMPLES)
    parser.add_argument("--device", type=device, default="opencl:0",
                        help="The OpenCL device to tune.")
    parser.add_argument("--shape", type=shape, default="1,8,1024,64", metavar="B,H,N,D",
                        help="The shape of the timed causal forward and backward.")
    parser.add_argument("--candidates", type=block_pair, nargs="+", metavar="BQxBK",
                        help="Block sizes to time. Default: those of the device's kernel "
                             "family.")
    parser.add_argument("--repeats", type=integer(1), default=3, metavar="N",
                        help="Timed calls per candidate (its best is kept).")
    parser.add_argument("--timeout", type=number(1, 1e6), default=600.0, metavar="SECONDS",
                        help="The most a candidate may take, its program builds included; "
                             "one that takes longer is killed and reported as timed out.")
    parser.add_argument("--json", action="store_true",
                        help="Print the timings and the choice as one JSON object, the "
                             "timings keyed by the block sizes that ran (a candidate the "
                             "kernel family rounds runs as another; the faster is kept).")
    args = parser.parse_args(argv)
    try:
        default = default_candidates(args.device)
    except ValueError as exc:
        raise UsageError("argument --device: %s" % exc) from None
    candidates = args.candidates or default
    repeated = sorted({c for c in candidates if candidates.count(c) > 1})
    if repeated:
        raise UsageError("argument --candidates: each once (got %s more than once)"
                         % ", ".join("%dx%d" % c for c in repeated))

    log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    log("timing block sizes on %s, causal forward + backward at B,H,N,D = %s, float32"
        % (args.device, ",".join(map(str, args.shape))))
    progress = Progress(len(candidates), "tuning", unit="candidates", enabled=not args.quiet)
    try:
        times, stored = tune(args.device, args.shape, candidates, args.repeats, report=log,
                     progress=progress, timeout=args.timeout)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    finally:
        progress.close()
    best = min(times, key=times.get)
    if args.json:
        print(json.dumps({"device": args.device, "shape": args.shape,
                          "ms": {"%dx%d" % bb: t * 1e3 for bb, t in times.items()},
                          "chosen": "%dx%d" % best, "stored": stored}))
    elif stored:
        print("chosen: %d x %d; stored for %s (ORCHARD_CL_BLOCK_Q/K override it)"
              % (best + (args.device,)))
    elif env_flag("ORCHARD_NO_CACHE"):
        print("chosen: %d x %d; not stored: the OpenCL cache is off (ORCHARD_NO_CACHE)" % best)
    else:
        print("chosen: %d x %d; not stored: the cache folder %s cannot be made or written, "
              "or is another user's or writable by others (ORCHARD_CACHE_DIR chooses another)"
              % (best + (os.environ.get("ORCHARD_CACHE_DIR") or "(ORCHARD_CACHE_DIR, "
                         "$XDG_CACHE_HOME/orchard or ~/.cache/orchard)",)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
