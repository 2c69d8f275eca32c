"""orchard-generate: sample text from a checkpoint written by orchard-train.

    orchard-generate --checkpoint runs/orchard/checkpoint.pt --prompt "def " \
                     [--device auto] [--max-new-tokens 200] [--temperature 0.8] [--top-k 40]

Models trained on byte-level data (a vocabulary of 256: the default data and orchard-prepare's
output) take the prompt as text and print text; others take and print space-separated token
ids (orchard.generation). The model (the built-in GPT or a transformers model trained with
--hf-config/--hf-model) keeps a KV cache: the prompt is prefilled once, then one decode step
per token.
"""
import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="orchard-generate", description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="checkpoint file, or an orchard-train output folder")
    parser.add_argument("--prompt", default="\n", help="text (or token ids) to continue")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, opencl, opencl:N or opencl:NAME")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 picks the most likely token")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args(argv)

    from ..checkpoint import CheckpointError
    from ..generation import decode, encode, generate, load_model
    from ..hf_causal_lm import HFModelError

    try:
        model, byte_level = load_model(args.checkpoint, args.device)
    except (CheckpointError, HFModelError) as exc:
        print("orchard-generate: error: %s" % exc, file=sys.stderr)
        return 2
    try:
        ids = encode(args.prompt, byte_level)
    except ValueError as exc:
        parser.error("argument --prompt: %s" % exc)
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(decode(out, byte_level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
