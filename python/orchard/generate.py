"""orchard-generate: sample text from a checkpoint written by orchard-train.

    orchard-generate --checkpoint runs/orchard/checkpoint.pt --prompt "def " \
                     [--device auto] [--max-new-tokens 200] [--temperature 0.8] [--top-k 40]

Models trained on byte-level data (a vocabulary of 256: the default data and orchard-prepare's
output) take the prompt as text and print text; others take and print space-separated token
ids.
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

    import torch

    from .checkpoint import CheckpointError, load_checkpoint
    from .device_backend import get_device_backend
    from .model import GPT, GPTConfig

    try:
        state = load_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        print("orchard-generate: %s" % exc, file=sys.stderr)
        return 2
    model = GPT(GPTConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    model.eval()
    get_device_backend(args.device).setup().patch_model(model)

    byte_level = state["data"].get("byte_level", False)
    if byte_level:
        prompt = list(args.prompt.encode("utf-8"))
    else:
        prompt = [int(t) for t in args.prompt.split()]
    if not prompt:
        parser.error("--prompt is empty")
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(torch.tensor([prompt]), args.max_new_tokens, args.temperature,
                         args.top_k, generator=generator)[0].tolist()
    if byte_level:
        sys.stdout.write(bytes(out).decode("utf-8", errors="replace") + "\n")
    else:
        print(" ".join(map(str, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
