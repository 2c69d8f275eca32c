"""Decode steps of a transformers Llama with a long KV cache, attn_implementation="orchard"
against "sdpa", in one run: attention there follows the model's torch operations, as it does
in generation, so this is what decode.py's kernel figures come to inside a model.

The two models share their weights. Each prefills the same prompt once (DynamicCache), then
both take one-token decode steps in turn, each step on a copy of its prefilled cache so that
every step sees the same cache length; the speed-up is the median of the per-round ratios.

    python benchmarks/hf_decode.py [--context 4096] [--dtype bfloat16] [--rounds 10]

The default model: 2 layers, hidden 1024, 8 heads of 128 over 2 KV heads (GQA 4, D 128 as in
decode.py), intermediate 2816, vocabulary 2048, randomly initialised (no download).
"""
import argparse
import copy
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import orchard.hf  # noqa: E402, F401  (registers attn_implementation="orchard")
from orchard.hf_causal_lm import cache_keyword  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096, help="cached tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=args.context + 16)
    ids = torch.randint(0, 2048, (1, args.context), generator=torch.Generator().manual_seed(0))
    step_ids = ids[:, -1:]
    steps, weights = {}, None
    for impl in ("sdpa", "orchard"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl,
                                              dtype=dtype).eval()
        if weights is None:
            weights = model.state_dict()
        model.load_state_dict(weights)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache, keyword = DynamicCache(config=config), cache_keyword(model)
            model(input_ids=ids, use_cache=True, **{keyword: cache})

        def step(model=model, cache=cache, keyword=keyword):
            c = copy.deepcopy(cache)
            with torch.no_grad():
                start = time.perf_counter()
                model(input_ids=step_ids, use_cache=True, **{keyword: c})
                return time.perf_counter() - start
        steps[impl] = step
    times = {impl: [] for impl in steps}
    for n in range(args.rounds + 1):
        for impl, step in steps.items():
            t = min(step() for _ in range(3))
            if n > 0:       # round 0 is the warm-up
                times[impl].append(t)
    ratio = statistics.median(s / o for s, o in zip(times["sdpa"], times["orchard"]))
    print("Llama decode step, %d layers, hidden 1024, 8 heads of 128 over 2 KV heads, %s, "
          "%d cached tokens, %d threads, %d rounds"
          % (args.layers, args.dtype, args.context, torch.get_num_threads(), args.rounds))
    for impl, t in times.items():
        print("%-8s %8.3f ms per step" % (impl, statistics.median(t) * 1e3))
    print("orchard / sdpa speed (median of per-round ratios): %.2fx" % ratio)


if __name__ == "__main__":
    main()
