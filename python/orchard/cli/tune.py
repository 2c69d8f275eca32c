"""orchard-tune: picks the block sizes of an OpenCL device by timing a few, and stores the
choice beside the device's program binaries, where every later process finds it.

    orchard-tune [--device opencl:0] [--shape B,H,N,D] [--candidates 48x96,96x96 ...]
                 [--repeats 3]

orchard.tuning says how the candidates are timed.
"""
import argparse
import sys

from ..tuning import tune


def parse_pair(text):
    try:
        bq, bk = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("a candidate is BQxBK, such as 96x96") from None
    return bq, bk


def main(argv=None):
    parser = argparse.ArgumentParser(prog="orchard-tune", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="opencl:0")
    parser.add_argument("--shape", default="1,8,1024,64", help="B,H,N,D of the timed call")
    parser.add_argument("--candidates", type=parse_pair, nargs="+", help="BQxBK ...")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4:
        parser.error("argument --shape: a shape is B,H,N,D, got %r" % args.shape)
    print("timing block sizes on %s, causal forward + backward at B,H,N,D = %s, float32"
          % (args.device, args.shape))
    try:
        times = tune(args.device, shape, args.candidates, args.repeats)
    except (ValueError, RuntimeError) as exc:
        print("orchard-tune: error: %s" % exc, file=sys.stderr)
        return 2
    best = min(times, key=times.get)
    print("chosen: %d x %d; stored for %s (ORCHARD_CL_BLOCK_Q/K override it)"
          % (best + (args.device,)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
