"""orchard-train: train a GPT-style language model whose attention runs on orchard.

    orchard-train [--config configs/universal.yaml] [--sequences FILE] [--epochs N]
                  [--device auto|cpu|opencl:N] [--resume CKPT] [--max-steps N]
                  [--output DIR] [--seed N] [--fp16 | --bf16] [--grad-checkpointing]
                  [--micro-batch N] [--verbose] [--hf-config FILE | --hf-model DIR]

The config is adapted to the device (orchard-devices shows how, and --verbose logs every
decision). --hf-config / --hf-model train a transformers causal LM instead of the built-in
GPT (orchard.hf_causal_lm). Data parallel: `torchrun --nproc-per-node 2 -m orchard.cli.train ...` (gloo); rank 0
writes the checkpoint and metrics.
"""
import argparse
import copy
import logging
import os
import sys

log = logging.getLogger("orchard")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="orchard-train", description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", metavar="YAML",
                        help="training config (default: the built-in universal config, the "
                             "same as configs/universal.yaml)")
    parser.add_argument("--sequences", metavar="FILE",
                        help="token_sequences.json (default: byte-level sequences of the "
                             "Python standard library's sources)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the data")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="stop after N optimizer steps in all (resumed steps included)")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, opencl, opencl:N or opencl:NAME")
    parser.add_argument("--resume", metavar="CKPT",
                        help="checkpoint file (or output folder) to continue from")
    parser.add_argument("--output", default="runs/orchard", metavar="DIR",
                        help="folder for checkpoint.pt and metrics.jsonl")
    parser.add_argument("--seed", type=int, default=1337,
                        help="initialisation, data order and dropout (a resume keeps its own)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true",
                           help="train in float16 with loss scaling (if the device supports it)")
    precision.add_argument("--bf16", action="store_true", help="train in bfloat16")
    parser.add_argument("--grad-checkpointing", action="store_true",
                        help="recompute activations in backward to save memory")
    parser.add_argument("--micro-batch", type=int, metavar="N",
                        help="sequences per forward/backward (default: the largest that fits)")
    parser.add_argument("--verbose", action="store_true",
                        help="also log the device's facts and the thread count")
    hf = parser.add_mutually_exclusive_group()
    hf.add_argument("--hf-config", metavar="FILE",
                    help="train a randomly initialised transformers causal LM of this "
                         "config.json (e.g. configs/hf_llama_tiny.json) instead of the "
                         "built-in GPT; needs transformers")
    hf.add_argument("--hf-model", metavar="DIR",
                    help="train (fine-tune) the transformers causal LM of this local "
                         "pretrained folder; needs transformers")
    return parser.parse_args(argv)


def apply_flags(cfg, args):
    cfg = copy.deepcopy(cfg)
    if args.fp16:
        cfg["training"]["dtype"] = "fp16"
    if args.bf16:
        cfg["training"]["dtype"] = "bf16"
    if args.grad_checkpointing:
        cfg["training"]["grad_checkpointing"] = True
    if args.micro_batch is not None:
        cfg["training"]["micro_batch"] = args.micro_batch
    return cfg


def setup_logging(rank):
    # On a terminal, clear the progress bar's line before a log line overwrites it.
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    logging.basicConfig(format=prefix + "%(message)s", stream=sys.stderr,
                        level=logging.INFO if rank == 0 else logging.WARNING)


def main(argv=None):
    args = parse_args(argv)
    import torch.distributed as dist

    import orchard_ops

    from ..checkpoint import CheckpointError, load_checkpoint
    from ..config import ConfigError, load_config, validate
    from ..data import DataError, load_training_data, split_validation, token_chunks
    from ..device_backend import auto_choice_reason, get_device_backend
    from ..hf_causal_lm import HFModelError, load_hf_config, model_section
    from ..trainer import Trainer

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    setup_logging(rank)
    try:
        backend = get_device_backend(args.device, verbose=args.verbose)
        if args.device in (None, "auto"):
            log.info("device %s chosen automatically: %s", *auto_choice_reason())
        state = load_checkpoint(args.resume) if args.resume else None
        hf_path = args.hf_config or args.hf_model
        if hf_path and state is not None:
            raise HFModelError("%s: --resume continues the checkpoint's own model; leave out "
                               "--hf-config/--hf-model" % hf_path)
        hf = load_hf_config(hf_path, pretrained=args.hf_model is not None) if hf_path else None
        sequences, vocab_size, data_info = load_training_data(args.sequences)
        if state is not None:
            # The checkpoint fixes the model; the rest is re-adapted to this device.
            requested = validate(state["config"], "checkpoint %s" % args.resume)
            requested["model"] = dict(state["model_config"])
            seed = state["seed"]
        else:
            requested = apply_flags(load_config(args.config), args)
            seed = args.seed
        hf_config = state.get("hf_config") if state is not None else None
        if hf is not None:
            if vocab_size > hf.vocab_size:
                if args.hf_model:
                    raise DataError("the data has token ids up to %d but the model of %s has "
                                    "a vocabulary of %d" % (vocab_size - 1, hf_path,
                                                             hf.vocab_size))
                log.info("%s: vocab_size %d -> %d: the data's vocabulary", hf_path,
                         hf.vocab_size, vocab_size)
                hf.vocab_size = vocab_size
            # The model section follows the HF model; only its context (the sequence length
            # trained on) comes from the config, within the model's max_position_embeddings.
            model = model_section(hf, requested["model"]["context"])
            if model["context"] != requested["model"]["context"]:
                log.info("config model.context: %d -> %d: %s's max_position_embeddings",
                         requested["model"]["context"], model["context"], hf_path)
            requested["model"] = model
            hf_config = hf.to_json_string(use_diff=False)
            log.info("model: transformers %s, %s %s", hf.model_type, "pretrained from"
                     if args.hf_model else "randomly initialised from", hf_path)
        if hf_config is not None and orchard_ops.default_device() != backend.device:
            # orchard.hf calls orchard with device=None
            log.info("note: a transformers model computes its attention on orchard's default "
                     "device %s, not %s (ORCHARD_DEVICE chooses it)",
                     orchard_ops.default_device(), backend.device)
        if vocab_size > requested["model"]["vocab_size"]:
            if state is not None:
                raise DataError("the data has token ids up to %d but the checkpoint's model "
                                 "has a vocabulary of %d"
                                 % (vocab_size - 1, requested["model"]["vocab_size"]))
            log.info("config model.vocab_size: %d -> %d: the data's vocabulary",
                     requested["model"]["vocab_size"], vocab_size)
            requested["model"]["vocab_size"] = vocab_size
        cfg, reasons = backend.adapt_config(requested, fixed_model=state is not None)
        for key, why in reasons.items():
            log.info("config %s: %s", key, why)
        backend.setup(cfg["device"]["num_threads"])
        for note in backend.check_limitations(cfg["training"]["dtype"]):
            log.info("note: %s", note)
        try:
            chunks = token_chunks(sequences, cfg["model"]["context"])
        except DataError as exc:
            raise DataError("%s: %s" % (data_info["source"], exc)) from None
        chunks, val_chunks = split_validation(chunks, cfg["training"]["val_fraction"])
        log.info("data: %s, %d tokens, %d sequences of %d for training, %d held out for "
                 "validation", data_info["source"],
                 (len(chunks) + len(val_chunks)) * cfg["model"]["context"], len(chunks),
                 cfg["model"]["context"], len(val_chunks))
        trainer = Trainer(cfg, backend, chunks, args.output, requested_cfg=requested,
                          seed=seed, data_info=data_info, resume_state=state,
                          val_chunks=val_chunks, hf_config=hf_config,
                          pretrained=args.hf_model if state is None else None)
        code = trainer.run(args.epochs, args.max_steps)
        if distributed:
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, trainer.parameters_digest())
            if len(set(digests)) != 1:
                log.error("parameters differ between ranks: %s", digests)
                code = code or 1
            elif rank == 0:
                log.info("parameters identical on all %d ranks (sha256 %s)", len(digests),
                         digests[0][:16])
            # every rank out of its last collective before any tears the group down (gloo
            # aborted a rank that destroyed it while the other was still receiving)
            dist.barrier()
        return code
    except (ConfigError, DataError, CheckpointError) as exc:
        # a mistake in what the user gave: one line that says so, not a traceback
        log.error("orchard-train: error: %s", exc)
        return 2
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
