"""Generation tokens/s with the KV cache against recomputing every step, in one run.

Greedy generation of --new tokens after a prompt of --prompt tokens, through orchard.generation
(orchard-generate's path), timed both ways on the same model: use_cache=False is the path
before the cache (every step a full forward over the window), use_cache=True prefills once
and then takes one decode step per token. The model is a checkpoint of orchard-train
(--checkpoint; the built-in GPT or a transformers model), or else the built-in GPT of the
default config (configs/universal.yaml: context 256, 4 layers, width 128) randomly
initialised, which times the same work as a trained one. Both runs also check that they give
the same tokens.

    python3 benchmarks/generate_speed.py [--checkpoint DIR] [--prompt 16] [--new 200]
                                         [--rounds 3] [--device cpu]

Past the model's context every step re-prefills the window (see orchard.generation), so the
default prompt + new tokens stay within the context of 256.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402

from orchard.config import default_config  # noqa: E402
from orchard.device_backend import get_device_backend  # noqa: E402
from orchard.generation import generate, load_model  # noqa: E402
from orchard.model import GPT, GPTConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="orchard-train checkpoint (default: random GPT)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=200, help="generated tokens")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (fastest taken)")
    parser.add_argument("--device", default="cpu", help="orchard device")
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.checkpoint:
        model, _ = load_model(args.checkpoint, args.device)
    else:
        model = GPT(GPTConfig.from_dict(default_config()["model"])).eval()
        get_device_backend(args.device).setup().patch_model(model)
    vocab = model(torch.zeros(1, 1, dtype=torch.long))[0].shape[-1]
    prompt = torch.randint(0, vocab, (args.prompt,)).tolist()

    best = {False: float("inf"), True: float("inf")}
    tokens = {}
    for _ in range(args.rounds):
        for use_cache in (False, True):      # alternated, so load on the machine hits both
            t0 = time.perf_counter()
            tokens[use_cache] = generate(model, prompt, args.new, temperature=0,
                                         use_cache=use_cache)
            best[use_cache] = min(best[use_cache], time.perf_counter() - t0)
    same = tokens[False] == tokens[True]
    before, after = args.new / best[False], args.new / best[True]
    print("model: %s, %s parameters, context %d; prompt %d, %d new tokens, greedy"
          % (args.checkpoint or "built-in GPT (default config, random)",
             f"{sum(p.numel() for p in model.parameters()):,}", model.context, args.prompt,
             args.new))
    print("without cache (before): %8.1f tokens/s" % before)
    print("with KV cache (after):  %8.1f tokens/s  (%.2fx)" % (after, after / before))
    print("same tokens: %s" % ("yes" if same else "NO"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
