"""Decode step (one query token over a KV cache of 4,096 and 16,384 keys, 32 query heads over 8
and 32 KV heads, D 128, float32 and bfloat16): orchard against torch SDPA on the same tensors,
and against the machine's read bandwidth, in one run; on the native device also the same cache
as pages of 256 rows read in place (block_table), against torch on the contiguous tensors.

    python3 benchmarks/decode.py [--rounds 5] [--device cpu]
"""
import argparse

from orchard.decode_bench import measure, table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both calls (median)")
    parser.add_argument("--device", default="cpu", help="orchard device id")
    args = parser.parse_args()
    bandwidth, rows = measure(rounds=args.rounds, device=args.device)
    print(table(bandwidth, rows, args.device))


if __name__ == "__main__":
    main()
