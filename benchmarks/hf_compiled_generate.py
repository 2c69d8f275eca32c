"""Greedy generate() of a transformers Llama over a static KV cache, attn_implementation=
"orchard" against "sdpa", each eager and with the model's forward compiled by Inductor
(transformers' recipe for fast generation: cache_implementation="static", then
model.forward = torch.compile(model.forward)). The four run in turn in rounds
(orchard.benchmark.round_robin; the first round compiles and warms up). Milliseconds per new
token (a generate() call's time over its new tokens, the short prompt's prefill included),
medians; speed ratios, the medians of the rounds' ratios; and the graphs and recompiles Dynamo
made (a decode step that broke its graph or recompiled at every step would show here).

    python3 benchmarks/hf_compiled_generate.py [--batch 2] [--prompt 32] [--new 64] [--rounds 5]
                                               [--cache static|dynamic]

The model: 2 layers, hidden 256, 4 heads of 64 over 2 KV heads, intermediate 688, vocabulary
1024, randomly initialised (no download): small enough that the calls' overhead, which
compiling removes, is much of a step. With --batch above 1 the first row's prompt is
left-padded by a quarter of its length. --cache dynamic times transformers' default cache
instead, eagerly only (compiled, a padding mask over it breaks the graph where orchard reads it).
"""
import argparse
import copy
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import orchard.hf  # noqa: E402, F401  (registers attn_implementation="orchard")
from orchard import benchmark  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens a generate() makes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--cache", choices=["static", "dynamic"], default="static")
    args = parser.parse_args(argv)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 43 // 16,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128),
                         max_position_embeddings=args.prompt + args.new + 16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1024, (args.batch, args.prompt), generator=g)
    real = torch.ones_like(ids)
    if args.batch > 1:
        real[0, :args.prompt // 4] = 0
    kw = dict(attention_mask=real, max_new_tokens=args.new, min_new_tokens=args.new,
              do_sample=False, pad_token_id=0)
    static = args.cache == "static"
    if static:
        kw["cache_implementation"] = "static"
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = 64     # recompiles are counted, not capped early
    calls, tokens, weights = {}, {}, None
    for impl in ("sdpa", "orchard"):
        for compiled in (False, True) if static else (False,):
            torch.manual_seed(0)
            model = LlamaForCausalLM._from_config(copy.deepcopy(config),
                                                  attn_implementation=impl).eval()
            if weights is None:
                weights = model.state_dict()
            model.load_state_dict(weights)
            if compiled:
                model.forward = torch.compile(model.forward)
            name = impl + (" compiled" if compiled else "")

            def call(model=model, name=name):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tokens[name] = model.generate(ids, **kw)

            calls[name] = call
    torch._dynamo.utils.counters.clear()
    times = benchmark.round_robin(calls, args.rounds)
    stats = torch._dynamo.utils.counters["stats"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    ms = {name: 1e3 * statistics.median(t) / args.new for name, t in times.items()}
    # a speed ratio: the median of the rounds' ratios (the VM drifts more between rounds)
    speed = lambda slow, fast: statistics.median(times[slow] / times[fast])
    same = all(torch.equal(tokens[n], tokens["sdpa"]) for n in tokens)
    print("Llama greedy generate(), %s cache: %d layers, hidden %d, batch %d%s, prompt %d, "
          "%d new tokens, float32, %d threads, %d rounds"
          % (args.cache, args.layers, args.hidden, args.batch, " (row 0 left-padded)"
             if args.batch > 1 else "", args.prompt, args.new, torch.get_num_threads(),
             args.rounds))
    if not static:
        print("eager ms/token: sdpa %.2f, orchard %.2f; orchard / sdpa speed %.2fx; tokens the "
              "same: %s" % (ms["sdpa"], ms["orchard"], speed("sdpa", "orchard"), same))
        return
    print("| attention | eager ms/token | compiled ms/token | compiling: speed-up |")
    print("| --- | --- | --- | --- |")
    for impl in ("sdpa", "orchard"):
        print("| %s | %.2f | %.2f | %.2fx |" % (impl, ms[impl], ms[impl + " compiled"],
                                                speed(impl, impl + " compiled")))
    print("orchard / sdpa speed, compiled: %.2fx; eager: %.2fx"
          % (speed("sdpa compiled", "orchard compiled"), speed("sdpa", "orchard")))
    print("Dynamo: %d graphs, %d graph breaks (both models); tokens the same on all four: %s"
          % (stats["unique_graphs"], breaks, same))


if __name__ == "__main__":
    main()
