"""orchard-generate: sample text from a checkpoint written by orchard-train.

    orchard-generate --checkpoint runs/orchard/checkpoint.pt --prompt "def " \
                     [--device auto] [--max-new-tokens 200] [--temperature 0.8] [--top-k 40]

Models trained on byte-level data (a vocabulary of 256: the default data and orchard-prepare's
output) take the prompt as text and print text; others take and print space-separated token
ids (orchard.generation). The model (the built-in GPT or a transformers model trained with
--hf-config/--hf-model) keeps a KV cache: the prompt is prefilled once, then one decode step
per token, each token printed as it is sampled (Ctrl-C keeps what was printed). Before the
sample, a line on stderr says how far the checkpoint was trained and what that means for the
sample; it and the prompt are printed once the first token is sampled, so that a checkpoint
whose logits are not finite is one error line.
"""
import signal
import sys
import threading

from .args import Parser, UsageError, console_script, device, integer, number, path

EXAMPLES = (
    'orchard-generate --checkpoint runs/demo --prompt "def "',
    'orchard-generate --checkpoint runs/demo/checkpoint.pt --prompt "import " --temperature 0',
    'orchard-generate --checkpoint runs/ids --prompt "17 4 99" --max-new-tokens 50',
)


@console_script("orchard-generate")
def main(argv=None):
    parser = Parser("orchard-generate", __doc__.split("\n")[0], EXAMPLES)
    parser.add_argument("--checkpoint", required=True, type=path("a checkpoint or a run's folder"),
                        metavar="CKPT",
                        help="A checkpoint file, or an orchard-train output folder.")
    parser.add_argument("--prompt",
                        help="The text (or, for models not trained on bytes, the "
                             "space-separated token ids) to continue. Default: a newline "
                             "(byte-level models; others need one).")
    parser.add_argument("--device", type=device, default="auto",
                        help="The device: auto, cpu, opencl, opencl:N or opencl:NAME. A "
                             "transformers model's attention runs on orchard's default device "
                             "(ORCHARD_DEVICE), with a warning where that is another.")
    parser.add_argument("--max-new-tokens", type=integer(1), default=200, metavar="N",
                        help="How many tokens to sample after the prompt.")
    parser.add_argument("--temperature", type=number(minimum=0.0), default=0.8, metavar="T",
                        help="The softmax temperature; 0 (or one too small to divide the "
                             "logits by) always picks the most likely token.")
    parser.add_argument("--top-k", type=integer(0), default=40, metavar="K",
                        help="Sample among the K most likely tokens only; 0 samples among "
                             "all of them, as HuggingFace's top_k=0.")
    parser.add_argument("--seed", type=integer(0), default=0, metavar="N",
                        help="The sampling seed.")
    args = parser.parse_args(argv)

    from ..checkpoint import CheckpointError, checkpoint_path, load_checkpoint
    from ..config import ConfigError
    from ..generation import (Detokenizer, NonFiniteLogits, describe_training, encode,
                              load_model, stream)

    try:
        state = load_checkpoint(args.checkpoint)
        model, byte_level = load_model(state, args.device, checkpoint_path(args.checkpoint))
    except (CheckpointError, ConfigError) as exc:  # ConfigError: its hf_config (HFModelError)
        raise UsageError("argument --checkpoint: %s" % exc) from None
    if args.prompt is None and not byte_level:
        raise UsageError("argument --prompt: needed for a model of token ids (not byte-level), "
                         "e.g. --prompt '17 4 99' (got none)")
    try:
        ids = encode("\n" if args.prompt is None else args.prompt, byte_level)
    except ValueError as exc:
        raise UsageError("argument --prompt: %s" % exc) from None
    vocab = state["model_config"]["vocab_size"]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UsageError("argument --prompt: token id %d is out of range for the model's "
                         "vocabulary of %d (got %r)" % (bad[0], vocab, args.prompt))
    # the text is written as it is sampled, so that what came before an interrupt stays; the
    # note and the prompt once the first token is: a checkpoint whose logits are not finite is
    # one error line, with nothing printed before it
    text = Detokenizer(byte_level)
    shown = []

    def begin():
        if not shown:
            shown.append(True)
            if not args.quiet:
                print(describe_training(state), file=sys.stderr)
            sys.stdout.write(text(ids))

    # Ctrl-C ends the sample after the token in flight. A KeyboardInterrupt raised wherever
    # the signal lands could land inside torch (a function mode's __exit__), leave its state
    # broken and end in a RuntimeError, or be lost there while sampling went on.
    stop = []

    def request_stop(signum, frame):
        stop.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)    # a second one: at once

    # Python allows signal handlers in the main thread only; a Ctrl-C the process was started
    # ignoring (a shell's background job) stays ignored
    watch = (threading.current_thread() is threading.main_thread()
             and signal.getsignal(signal.SIGINT) != signal.SIG_IGN)
    previous = signal.signal(signal.SIGINT, request_stop) if watch else None
    try:
        for token in stream(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                            args.seed):
            begin()
            sys.stdout.write(text([token]))
            sys.stdout.flush()
            if stop:
                break
        begin()
    except NonFiniteLogits as exc:
        raise UsageError("argument --checkpoint: %s: %s"
                         % (checkpoint_path(args.checkpoint), exc)) from None
    finally:
        if watch:
            signal.signal(signal.SIGINT, previous)
        if shown:
            print(text([], final=True))
    if stop:
        raise KeyboardInterrupt     # console_script: "interrupted", status 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
