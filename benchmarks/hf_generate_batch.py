"""transformers' continuous batching (model.generate_batch) of a Llama on
attn_implementation="orchard" against "sdpa", in one run: generated tokens per second.

On sdpa, continuous batching runs each batch of requests as one sequence under a block mask
(every query against every key of the batch); on orchard as FlashAttention, one varlen call
with each query over its own request's keys, and decode-only batches on the fast path, the
keys read in their pages through a block table. "orchard, gathered" turns the fast path off
(ContinuousBatchingConfig(max_blocks_per_request=0)): each step then copies every request's
keys out of the pages first, as sdpa's runs do.

The models share their weights; the requests have random prompts of prompt / 2 to prompt
tokens and generate --new tokens each, greedily, no end-of-sequence token. The three runs take
turns, --rounds times; the speed-ups are medians of the per-round ratios. The cache holds
what the requests need (num_blocks), so that no run spends its time zeroing a cache sized to
the machine's memory.

    python benchmarks/hf_generate_batch.py [--requests 16] [--prompt 512] [--new 32]

The default model: 2 layers, hidden 1024, 8 heads of 128 over 2 KV heads (GQA 4, D 128, as
hf_decode.py; --kv-heads 8 for none), intermediate 2816, vocabulary 2048, randomly
initialised (no download).
"""
import argparse
import copy
import logging
import math
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
from transformers import (ContinuousBatchingConfig, GenerationConfig, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM)

import orchard.hf  # noqa: E402, F401  (registers attn_implementation="orchard")

RUNS = {    # name: (attention, continuous batching options)
    "orchard": ("orchard", {}),
    "orchard, gathered": ("orchard", dict(max_blocks_per_request=0)),
    "sdpa": ("sdpa", {}),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512, help="longest prompt, in tokens")
    parser.add_argument("--new", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2, choices=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for name, value in vars(args).items():
        if name != "dtype" and value < 1:
            parser.error("argument --%s: must be at least 1, got %d" % (name, value))
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # (psutil notes)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.prompt + args.new + 16)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(max(1, args.prompt // 2), args.prompt + 1, (args.requests,),
                            generator=g)
    prompts = [torch.randint(0, 2048, (int(n),), generator=g).tolist() for n in lengths]
    page = 256
    blocks = sum(math.ceil((int(n) + args.new) / page) + 1 for n in lengths)
    generation = GenerationConfig(max_new_tokens=args.new, do_sample=False, pad_token_id=0,
                                  eos_token_id=-1)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    models = {}
    for name, (impl, _) in RUNS.items():
        models[name] = copy.deepcopy(model)     # (the config too: each keeps its attention)
        models[name].set_attn_implementation(impl)

    def run(name):
        batching = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, **RUNS[name][1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            out = models[name].generate_batch(prompts, generation_config=generation,
                                              continuous_batching_config=batching,
                                              progress_bar=False)
            seconds = time.perf_counter() - start
        return seconds, [out["req_%d" % i].generated_tokens for i in range(len(prompts))]

    times = {name: [] for name in RUNS}
    tokens = {}
    for n in range(args.rounds + 1):
        for name in RUNS:
            seconds, tokens[name] = run(name)
            if n > 0:       # round 0 is the warm-up
                times[name].append(seconds)
    print("Llama generate_batch, %d layers, hidden 1024, 8 heads of 128 over %d KV heads, %s; "
          "%d requests, prompts of %d-%d tokens, %d new tokens each; %d threads, %d rounds"
          % (args.layers, args.kv_heads, args.dtype, args.requests, int(lengths.min()),
             int(lengths.max()), args.new, torch.get_num_threads(), args.rounds))
    generated = args.requests * args.new
    for name, t in times.items():
        print("%-18s %8.2f s  %8.1f tokens/s" % (name, statistics.median(t),
                                                 generated / statistics.median(t)))
    for name in ("orchard", "orchard, gathered"):
        ratio = statistics.median(s / o for s, o in zip(times["sdpa"], times[name]))
        print("%s / sdpa speed (median of per-round ratios): %.2fx" % (name, ratio))
    ratio = statistics.median(g / o for g, o in zip(times["orchard, gathered"],
                                                    times["orchard"]))
    print("fast path / gathered speed: %.2fx" % ratio)
    same = all(tokens[name] == tokens["sdpa"] for name in RUNS)
    print("the same tokens from every run: %s" % ("yes" if same else "no"))


if __name__ == "__main__":
    main()
