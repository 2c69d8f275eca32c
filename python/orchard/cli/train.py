"""orchard-train: train a GPT-style language model whose attention runs on orchard.

    orchard-train [--config configs/universal.yaml] [--sequences FILE] [--epochs N]
                  [--device auto|cpu|opencl:N] [--resume CKPT] [--max-steps N]
                  [--output DIR] [--overwrite] [--seed N] [--fp16 | --bf16]
                  [--grad-checkpointing] [--micro-batch N] [--verbose | --quiet]
                  [--hf-config FILE | --hf-model DIR]

The config is adapted to the device (orchard-devices shows how, and --verbose logs every
decision). --hf-config / --hf-model train a transformers causal LM instead of the built-in
GPT (orchard.hf_causal_lm). Data parallel: `torchrun --nproc-per-node 2 -m orchard.cli.train
...` (gloo); rank 0 writes the checkpoint and metrics.
"""
import argparse
import contextlib
import copy
import gc
import hashlib
import logging
import os
import shlex
import stat
import sys
import tempfile

from .args import (INT_MAX, Parser, UsageError, console_script, debug_requested, device,
                   dotdot_problem, folder_problem, integer, logs_held_until_checked, path,
                   reading, writing, written_where)

log = logging.getLogger("orchard")

# The files of a pretrained folder's tokenizer (transformers' fast and slow ones).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

DEFAULT_OUTPUT = "runs/orchard"
DEFAULT_SEED = 1337
EXAMPLES = (
    "orchard-train --config configs/universal.yaml --output runs/demo",
    "orchard-train --sequences data/token_sequences.json --epochs 3 --device opencl:0",
    "orchard-train --resume runs/demo          # continue where Ctrl-C stopped it",
    "orchard-train --hf-config configs/hf_llama_tiny.json --output runs/llama  # transformers",
    "torchrun --standalone --nproc-per-node 2 -m orchard.cli.train --output runs/ddp",
)


def parse_args(argv):
    parser = Parser("orchard-train", __doc__.split("\n")[0], EXAMPLES,
                    verbose_logs="the device's facts and the thread count")
    parser.add_argument("--config", type=path("a config file"), metavar="YAML",
                        help="The training config. Default: the built-in universal config, "
                             "the same as configs/universal.yaml.")
    parser.add_argument("--sequences", type=path("a token_sequences.json"), metavar="FILE",
                        help="A token_sequences.json to train on. Default: byte-level "
                             "sequences of the Python standard library's sources.")
    parser.add_argument("--epochs", type=integer(1), metavar="N",
                        help="Passes over the data. Default: 1, or with --resume the stopping "
                             "point of the run resumed.")
    parser.add_argument("--max-steps", type=integer(1), metavar="N",
                        help="Stop after N optimizer steps in all, resumed steps included, "
                             "over as many passes over the data as they take (with --epochs: "
                             "whichever comes first); the learning-rate schedule spans them. "
                             "Default: none, --epochs alone decides.")
    parser.add_argument("--device", type=device, default="auto",
                        help="The device: auto, cpu, opencl, opencl:N or opencl:NAME.")
    parser.add_argument("--resume", type=path("a checkpoint or a run's folder"), metavar="CKPT",
                        help="A checkpoint file or output folder to continue from; the model, "
                             "config, seed and stopping point come from it.")
    parser.add_argument("--output", metavar="DIR",
                        help="The folder for checkpoint.pt and metrics.jsonl. Default: the "
                             "folder of --resume, else %s." % DEFAULT_OUTPUT)
    parser.add_argument("--overwrite", action="store_true",
                        help="Start a new run even if --output holds a checkpoint (which is "
                             "then replaced).")
    parser.add_argument("--seed", type=integer(0), metavar="N",
                        help="The seed of initialisation, data order and dropout. Default: "
                             "%d (a resumed run keeps its own)." % DEFAULT_SEED)
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true",
                           help="Train in float16 with loss scaling, if the device supports it.")
    precision.add_argument("--bf16", action="store_true", help="Train in bfloat16.")
    parser.add_argument("--grad-checkpointing", action="store_true",
                        help="Recompute activations in backward to save memory.")
    parser.add_argument("--micro-batch", type=integer(1), metavar="N",
                        help="Sequences per forward and backward. Default: the largest that "
                             "fits the device's memory.")
    hf = parser.add_mutually_exclusive_group()
    hf.add_argument("--hf-config", metavar="FILE",
                    help="Train a randomly initialised transformers causal LM of this "
                         "config.json (e.g. configs/hf_llama_tiny.json) instead of the "
                         "built-in GPT; needs transformers.")
    hf.add_argument("--hf-model", metavar="DIR",
                    help="Train (fine-tune) the transformers causal LM of this local "
                         "pretrained folder; needs transformers.")
    args = parser.parse_args(argv)
    args.output_given = args.output is not None
    if args.output is None:
        from ..checkpoint import checkpoint_path

        args.output = (os.path.dirname(checkpoint_path(args.resume)) or "."
                       if args.resume else DEFAULT_OUTPUT)
    return args


def check_output(args):
    """--output is a folder (or can be made one) whose checkpoint.pt and metrics.jsonl can be
    files, and no run replaces another run's checkpoint unless asked to (--resume continues
    the one in its own folder)."""
    if not args.output:
        raise UsageError("argument --output: must name a folder (got %r)" % args.output)
    problem = dotdot_problem(args.output)
    if problem:     # (an --output not given is --resume's folder)
        raise UsageError("argument %s: %s (got %r)"
                         % (("--output", problem, args.output) if args.output_given
                            else ("--resume", problem, args.resume)))
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError("argument --output: is a file, not a folder (%r)" % args.output)
    problem = folder_problem(args.output)
    if problem:
        raise UsageError("argument --output: cannot be made or written, %s (got %r)"
                         % (problem, args.output))
    for name in ("checkpoint.pt", "metrics.jsonl"):
        path = os.path.join(args.output, name)
        if os.path.isdir(path):
            raise UsageError("argument --output: %s there is a folder, not a file (got %r)"
                             % (name, args.output))
        if os.path.islink(path):    # written through, as by a shell's `>`: where it leads
            try:
                problem = folder_problem(*written_where(path))
            except argparse.ArgumentTypeError as exc:
                problem = str(exc)
            if problem:
                raise UsageError("argument --output: %s there cannot be written: %s"
                                 % (name, problem))
    metrics = os.path.join(args.output, "metrics.jsonl")
    # continuing its own run, orchard-train appends to its metrics (--overwrite keeps them
    # then): a file this user may not write failed at the first log line
    if continues_its_own_run(args) and os.path.isfile(metrics) and not os.access(metrics,
                                                                                 os.W_OK):
        raise UsageError("argument --output: its metrics (%s) cannot be written: permission "
                         "denied (got %r)" % (metrics, args.output))
    path = os.path.join(args.output, "checkpoint.pt")
    if continues_its_own_run(args) or args.overwrite:
        return
    if os.path.exists(path):
        if args.resume and not args.output_given:     # (a copy beside a run's checkpoint)
            resumed_state(args)     # (the advice below is for a checkpoint: not one, refused)
            raise UsageError("argument --resume: %s is not the checkpoint of its folder, whose "
                             "checkpoint (%s) a resumed run would replace; pass --output to "
                             "choose another folder for it, or --overwrite to replace that one "
                             "(got %r)" % (args.resume, path, args.resume))
        # (resuming another run into this folder: continuing this one is not the advice)
        advice = "" if args.resume else "continue it with --resume %s, or " % args.output
        raise UsageError("argument --output: already holds a checkpoint (%s); %spass "
                         "--overwrite to replace it, or choose another folder (got %r)"
                         % (path, advice, args.output))
    if os.path.exists(metrics):
        raise UsageError("argument --output: already holds the metrics (%s) of a run without a "
                         "checkpoint; pass --overwrite to replace them, or choose another "
                         "folder (got %r)" % (metrics, args.output))


def resumed_state(args):
    """The checkpoint --resume names, loaded."""
    from ..checkpoint import CheckpointError, load_checkpoint

    try:
        return load_checkpoint(args.resume)
    except CheckpointError as exc:
        raise UsageError("argument --resume: %s" % exc) from None


def continues_its_own_run(args):
    """--resume names the checkpoint of the --output folder itself."""
    from ..checkpoint import checkpoint_path

    return bool(args.resume) and os.path.realpath(checkpoint_path(args.resume)) == \
        os.path.realpath(os.path.join(args.output, "checkpoint.pt"))


def take_output(args, held):
    """The folder, for a run whose input is checked and that trains: where it is held (a
    lock: no other run of this host writes there) the temporary files of a killed run's
    writes (orchard.atomic) go, and with --overwrite the previous run's checkpoint and
    metrics, so that a crash before the new run's first checkpoint leaves no other run's
    checkpoint beside its metrics (--resume and orchard-generate would take it for its own)."""
    from ..atomic import leftovers

    files = [os.path.join(args.output, name) for name in ("checkpoint.pt", "metrics.jsonl")]
    old = [tmp for path in files for tmp in leftovers(path)] if held else []
    if args.overwrite and not continues_its_own_run(args):
        old += [path for path in files if os.path.isfile(path)]
    for path in old:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class RunLock:
    """An --output held by this run (hold_output) until release(), or the process's end (a
    kill included: a killed run's lock file stays, empty of any lock, and is taken again)."""

    def __init__(self, fd, path):
        self.fd, self.path = fd, path

    def release(self):
        # removed while held, so the folder of locks does not grow by one file a run; a run
        # that opened it meanwhile finds it gone once it holds it, and opens a new one
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)


def hold_output(output):
    """Refuses an --output that another orchard-train is writing to (two runs would write their
    checkpoints and metrics over each other's); else a RunLock, or None where there is none to
    take. The lock is a file named for the output's real path in this user's own folder of the
    temporary folder, so a folder not made yet is held too."""
    try:
        import fcntl
    except ImportError:     # not POSIX
        return None
    key = hashlib.sha256(os.fsencode(os.path.realpath(output))).hexdigest()[:32]
    try:
        folder = os.path.join(tempfile.gettempdir(), "orchard-runs-%d" % os.getuid())
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        # another user's folder (made first in a shared /tmp) could point the lock at any
        # file: only our own, closed to others, and never through a symbolic link
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
                or st.st_mode & 0o077):
            return None
    except OSError:         # no temporary folder to write: run without
        return None
    path = os.path.join(folder, key + ".lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError("argument --output: another orchard-train (process %s) is "
                             "writing to it; wait for that run to end, or choose another "
                             "folder (got %r)" % (holder, output)) from None
        try:
            held, named = os.fstat(fd), os.stat(path)
        except FileNotFoundError:   # released (removed) by its run after this one opened it
            held = named = None
        if held is not None and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, b"%d\n" % os.getpid(), 0)
    return RunLock(fd, path)


def _as_path(path):
    """path as a command line word: a relative path that starts with "-" would read as an
    option, "./" keeps it a path."""
    return "./" + path if path.startswith("-") else path


def resume_command(args, distributed):
    """The command that continues this run: same output, data and device; the checkpoint
    carries the config, seed and stopping point."""
    from ..device_backend import process_count
    processes = process_count("LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in os.environ
                              else "WORLD_SIZE")
    words = (["torchrun", "--standalone", "--nproc-per-node", str(processes), "-m",
              "orchard.cli.train"] if distributed else ["orchard-train"])
    words += ["--resume", _as_path(args.output), "--output", _as_path(args.output)]
    if args.sequences:
        words += ["--sequences", _as_path(args.sequences)]
    if args.device != "auto":
        words += ["--device", args.device]
    return " ".join(shlex.quote(w) for w in words)


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


def setup_logging(rank, quiet=False):
    # On a terminal, clear the progress bar's line before a log line overwrites it.
    prefix = "\r\033[K" if sys.stderr.isatty() else ""
    logging.basicConfig(format=prefix + "%(message)s", stream=sys.stderr,
                        level=logging.INFO if rank == 0 and not quiet else logging.WARNING)


def build_trainer(args):
    """The device, data, config and model of this run, each checked, as a Trainer."""
    from ..checkpoint import CheckpointError, check_model_size, checkpoint_path
    from ..config import ConfigError, load_config, validate
    from ..data import (DataError, evaluation_windows, load_training_data, split_validation,
                        token_chunks)
    from ..device_backend import auto_choice_reason, get_device_backend
    from ..hf_causal_lm import HFModelError, attention_device_note, load_hf_config, model_section
    from ..trainer import Trainer

    backend = get_device_backend(args.device, verbose=args.verbose)
    if args.device in (None, "auto"):
        log.info("device %s chosen automatically: %s", *auto_choice_reason())
    state = resumed_state(args) if args.resume else None
    hf_flag = "--hf-config" if args.hf_config is not None else "--hf-model"
    hf_path = args.hf_config if args.hf_config is not None else args.hf_model
    if hf_path is not None and state is not None:
        raise UsageError("argument %s: --resume continues the checkpoint's own model; leave "
                         "out %s" % (hf_flag, hf_flag))
    try:
        hf = (load_hf_config(hf_path, pretrained=args.hf_model is not None)
              if hf_path is not None else None)
    except HFModelError as exc:
        raise UsageError("argument %s: %s" % (hf_flag, exc)) from None
    with reading("--sequences", args.sequences):
        sequences, vocab_size, data_info = load_training_data(args.sequences)
    if state is not None:
        # The checkpoint fixes the model; the rest is re-adapted to this device.
        requested = dict(state["config"], model=state["model_config"])
        try:
            requested = validate(requested, "checkpoint %s" % checkpoint_path(args.resume))
            check_model_size(requested["model"], state["model"],
                             "checkpoint %s" % checkpoint_path(args.resume),
                             state.get("hf_config"))
        except (ConfigError, CheckpointError) as exc:
            raise UsageError("argument --resume: %s" % exc) from None
        seed = state["seed"]
        ignored = [flag for flag, given in (
            ("--config", args.config), ("--seed", args.seed is not None), ("--fp16", args.fp16),
            ("--bf16", args.bf16), ("--grad-checkpointing", args.grad_checkpointing),
            ("--micro-batch", args.micro_batch)) if given]
        if ignored:
            log.warning("ignored with --resume (the checkpoint's config holds): %s",
                        ", ".join(ignored))
        # the tokens' digest where the checkpoint has one (not a path's spelling)
        trained = state["data"]
        key = "digest" if "digest" in trained else "source"
        if trained.get(key) != data_info[key]:
            log.warning("the checkpoint was trained on %s%s, this run reads %s: its data order "
                        "and loss curve do not continue (--sequences chooses the data)",
                        trained.get("source"), " (other tokens then)"
                        if trained.get("source") == data_info["source"] else "",
                        data_info["source"])
    else:
        with reading("--config", args.config):
            config = load_config(args.config)
        requested = apply_flags(config, args)
        seed = DEFAULT_SEED if args.seed is None else args.seed
    hf_config = state.get("hf_config") if state is not None else None
    tokenizer = [name for name in TOKENIZER_FILES
                 if args.hf_model and os.path.exists(os.path.join(args.hf_model, name))]
    # what the data's errors name: the file, or the data orchard carries
    data = ("argument --sequences: %s" % args.sequences if args.sequences
            else "the built-in data (no --sequences)")
    if tokenizer and data_info["byte_level"]:
        raise DataError("%s: bytes (a vocabulary of 256), but %s has a tokenizer (%s) whose "
                        "token ids orchard does not map bytes to: prepare the sequences with "
                        "that tokenizer" % (data, hf_path, tokenizer[0]))
    # the data's token ids past the model's vocabulary, which then grows to them
    grown = vocab_size > (hf.vocab_size if hf is not None else requested["model"]["vocab_size"])
    if hf is not None:
        if vocab_size > hf.vocab_size:
            if args.hf_model:
                raise DataError("%s: token ids up to %d, but the model of %s has a "
                                "vocabulary of %d" % (data, vocab_size - 1, hf_path,
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
    note = attention_device_note(backend.device)
    if hf_config is not None and note:
        log.info("note: %s", note)
    if vocab_size > requested["model"]["vocab_size"]:
        if state is not None:
            raise DataError("%s: token ids up to %d, but the model of the checkpoint %s "
                            "has a vocabulary of %d" % (data, vocab_size - 1,
                                                        checkpoint_path(args.resume),
                                                        requested["model"]["vocab_size"]))
        log.info("config model.vocab_size: %d -> %d: the data's vocabulary",
                 requested["model"]["vocab_size"], vocab_size)
        requested["model"]["vocab_size"] = vocab_size
    # a model too large for the device: the argument that chose the model is named (the
    # data's, where its token ids grew the vocabulary)
    model_flag, model_path = (("--sequences", args.sequences) if grown and args.sequences
                              else (hf_flag, hf_path) if hf_path is not None
                              else ("--resume", args.resume) if state is not None
                              else ("--config", args.config))
    with reading(model_flag, model_path):
        cfg, reasons = backend.adapt_config(requested, fixed_model=state is not None)
    for key, why in reasons.items():
        log.info("config %s: %s", key, why)
    backend.setup(cfg["device"]["num_threads"])
    for note in backend.check_limitations(cfg["training"]["dtype"]):
        log.info("note: %s", note)
    try:
        chunks = token_chunks(sequences, cfg["model"]["context"])
    except DataError as exc:
        with reading("--sequences", args.sequences):    # --sequences names the file, if given
            raise DataError("%s: %s" % (data_info["source"], exc)) from None
    chunks, held_out = split_validation(chunks, cfg["training"]["val_fraction"])
    val_chunks = evaluation_windows(held_out, cfg["training"]["eval_sequences"])
    log.info("data: %s, %d tokens, %d sequences of %d for training, %d held out for "
             "validation%s", data_info["source"],
             (len(chunks) + len(held_out)) * cfg["model"]["context"], len(chunks),
             cfg["model"]["context"], len(held_out),
             " (%d of them, spread evenly, at each validation: training.eval_sequences)"
             % len(val_chunks) if len(val_chunks) < len(held_out) else "")
    try:
        return Trainer(cfg, backend, chunks, args.output, requested_cfg=requested, seed=seed,
                       data_info=data_info, resume_state=state, val_chunks=val_chunks,
                       hf_config=hf_config, pretrained=args.hf_model if state is None else None,
                       resume_from=args.resume and checkpoint_path(args.resume))
    except DataError as exc:
        with reading("--sequences", args.sequences):    # --sequences names the file, if given
            raise DataError("%s: %s" % (data_info["source"], exc)) from None
    except CheckpointError as exc:      # contents that do not make the model (checkpoint_contents)
        raise UsageError("argument --resume: %s" % exc) from None
    except HFModelError as exc:
        if state is not None:   # the checkpoint's hf_config: the message names the file
            raise UsageError("argument --resume: %s" % exc) from None
        if hf_path is None:
            raise
        # a pretrained folder's messages name it; a config file's are named here
        raise UsageError("argument %s: %s%s" % (hf_flag, "" if args.hf_model else
                                                 hf_path + ": ", exc)) from None
    except ConfigError as exc:
        # (after HFModelError, which is one) a batch torchrun's processes do not divide:
        # the file it came from
        if state is not None:
            raise UsageError("argument --resume: checkpoint %s: %s"
                             % (checkpoint_path(args.resume), exc)) from None
        with reading("--config", args.config):
            raise ConfigError("%s: %s" % (args.config, exc) if args.config else str(exc)) from None


def check_rendezvous(world):
    """UsageError unless torchrun's RANK (0 to WORLD_SIZE - 1), MASTER_ADDR and MASTER_PORT,
    which init_process_group reads beside WORLD_SIZE, are set: a WORLD_SIZE alone had ended in
    a traceback, and a RANK past it waited for ranks that never come."""
    from ..device_backend import env_integer
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UsageError("environment variable %s is not set, which WORLD_SIZE %d needs "
                             "(torchrun sets it)" % (name, world))
    try:
        env_integer("RANK", "this process's rank", 0, world - 1, None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@console_script("orchard-train")
def main(argv=None):
    args = parse_args(argv)
    check_output(args)
    import torch.distributed as dist

    from ..device_backend import process_count
    world = process_count("WORLD_SIZE")     # (checked by console_script)
    distributed = world > 1
    if distributed:
        check_rendezvous(world)
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    setup_logging(rank, args.quiet)
    trainer = lock = None
    try:
        refused = None
        if rank == 0:   # the one that writes
            try:
                lock = hold_output(args.output)
            except UsageError as exc:
                refused = str(exc)
        if distributed:     # every rank ends, not only the one refused
            box = [refused]
            dist.broadcast_object_list(box, src=0)
            refused = box[0]
        if refused:
            raise UsageError(refused)
        # the setup's notes only once the run is known to start: a mistake in the input is
        # reported in one line
        with logs_held_until_checked(log, debug_requested(sys.argv[1:] if argv is None
                                                          else list(argv))):
            trainer = build_trainer(args)
            if trainer.stopping_point(args.epochs, args.max_steps) > INT_MAX:
                # (a checkpoint counts its steps in 63 bits: it would not load again)
                raise UsageError("argument --epochs: %d passes of %d steps are more than %d "
                                 "steps (got %r)" % (args.epochs, trainer.steps_per_epoch,
                                                     INT_MAX, args.epochs))
        with writing("--output", args.output):     # checkpoints and metrics
            # (a run that trains no step, at or past its stopping point, removes nothing)
            if rank == 0 and trainer.step < trainer.stopping_point(args.epochs, args.max_steps):
                take_output(args, lock is not None)
            code = trainer.run(args.epochs, args.max_steps)
        if code > 128 and rank == 0:    # stopped by a signal
            log.warning("resume with: %s", resume_command(args, distributed))
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
    finally:
        if lock is not None:
            lock.release()
        if distributed:
            # DDP keeps the process group alive in reference cycles; freed only at exit, after
            # torch's own teardown, gloo aborted the process ("terminate called without an
            # active exception", about 1 run in 10): free them while the group still exists
            trainer = None
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
