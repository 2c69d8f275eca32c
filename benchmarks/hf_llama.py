"""A tiny Llama's training step (forward + backward) with attn_implementation="orchard"
against "sdpa", in one run.

The two models share their weights and inputs; their steps alternate round by round
(orchard.benchmark.round_robin), and the speed-up is the median of the per-round ratios, which
a shared machine's drift moves much less than either time.

    python benchmarks/hf_llama.py [--batch 4] [--seq 512] [--rounds 10]

The default model: 4 layers, hidden 256, 4 heads of 64 over 2 KV heads (GQA), float32.
"""
import argparse
import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import orchard.hf  # noqa: E402, F401  (registers attn_implementation="orchard")
import orchard_ops  # noqa: E402
from orchard.benchmark import round_robin  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds after a warm-up")
    args = parser.parse_args(argv)

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.seq, use_cache=False)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    steps, weights = {}, None
    for impl in ("sdpa", "orchard"):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl,
                                              dtype=torch.float32)
        if weights is None:
            weights = model.state_dict()
        model.load_state_dict(weights)

        def step(model=model):
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        steps[impl] = step

    # every attention call of a step must run on orchard, or the comparison means nothing
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="orchard.hf")
        orchard_ops.reset_stats()
        steps["orchard"]()
        stats = orchard_ops.stats()
    assert stats["fwd_calls"] == stats["bwd_calls"] == args.layers, stats

    times = round_robin(steps, args.rounds)
    ratio = float(np.median(times["sdpa"] / times["orchard"]))
    tokens = args.batch * args.seq
    print("tiny Llama, forward + backward: batch %d, sequence %d, %d layers, hidden %d, "
          "%d heads over %d KV heads (head dim %d), float32, %d threads, %d rounds"
          % (args.batch, args.seq, args.layers, args.hidden, args.heads, args.kv_heads,
             args.hidden // args.heads, orchard_ops.get_num_threads(), args.rounds))
    print("%-22s %12s %12s" % ("attn_implementation", "ms per step", "tokens/s"))
    for impl in ("sdpa", "orchard"):
        best = times[impl].min()
        print("%-22s %12.1f %12.0f" % (impl, best * 1e3, tokens / best))
    print("orchard / sdpa speed (median of per-round ratios): %.2fx" % ratio)
    return ratio


if __name__ == "__main__":
    main()
