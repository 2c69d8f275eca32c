"""orchard-prepare: byte-level token sequences from a folder of text or code.

    orchard-prepare SRC_DIR -o data/token_sequences.json [--ext .py --ext .md] [--max-bytes N]
                    [--overwrite]

Writes {"vocab_size": 256, "sequences": [...]}, one sequence per text file (binary files,
recognised by a NUL byte, and hidden files are skipped), for orchard-train --sequences.
"""
import argparse
import json
import os
import sys

from ..atomic import is_stdout
from ..data import BYTE_VOCAB, folder_files, save_sequences, text_file_sequences
from ..progress import Progress
from .args import (Parser, UsageError, console_script, dotdot_problem, folder_problem, integer,
                   names_a_file, path, writing, written_where)

EXAMPLES = (
    "orchard-prepare ~/src/myproject -o data/token_sequences.json --ext .py --ext .md",
    "orchard-prepare docs/ -o data/docs.json --max-bytes 1000000 --json",
)


def counted(items, progress):
    # counted as it is handed out: --max-bytes may stop the reading within a file
    for n, item in enumerate(items, 1):
        progress.update(n)
        yield item


@console_script("orchard-prepare", uses_devices=False)
def main(argv=None):
    parser = Parser("orchard-prepare", __doc__.split("\n")[0], EXAMPLES)
    parser.add_argument("src_dir", type=path("a folder"), metavar="SRC_DIR",
                        help="The folder of text or source files to read, recursively.")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="The token_sequences.json to write (its folder is made if "
                             "missing). An existing file is kept unless --overwrite.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Replace --output if it exists (atomically: a reader sees the old "
                             "file or the new one).")
    parser.add_argument("--ext", action="append", metavar="SUFFIX",
                        help="Read only files ending in SUFFIX; repeatable. Default: every "
                             "text file.")
    parser.add_argument("--max-bytes", type=integer(1), metavar="N",
                        help="Stop after N bytes in all. Default: no limit.")
    parser.add_argument("--json", action="store_true",
                        help="Print the summary as one JSON object instead of a sentence.")
    args = parser.parse_args(argv)
    if "" in (args.ext or ()):      # (every file ends in "": it read them all)
        raise UsageError("argument --ext: must name a suffix (got '')")
    if not os.path.isdir(args.src_dir):
        raise UsageError("SRC_DIR %s (%r)" % ("is not a folder" if os.path.exists(args.src_dir)
                                             else "does not exist", args.src_dir))
    if not names_a_file(args.output):
        raise UsageError("argument --output: must name a file (got %r)" % args.output)
    problem = dotdot_problem(args.output)
    if problem:
        raise UsageError("argument --output: %s (got %r)" % (problem, args.output))
    if os.path.isdir(args.output):
        raise UsageError("argument --output: is a folder, not a file (%r)" % args.output)
    if os.path.exists(args.output) and not args.overwrite:
        raise UsageError("argument --output: the file exists; pass --overwrite to replace it "
                         "(%r)" % args.output)
    try:
        problem = folder_problem(*written_where(args.output))
    except argparse.ArgumentTypeError as exc:
        raise UsageError("argument --output: %s" % exc) from None
    if problem:
        raise UsageError("argument --output: cannot be made or written, %s (got %r)"
                         % (problem, args.output))

    paths = folder_files(args.src_dir, args.ext, exclude=args.output)   # not a past output
    progress = Progress(len(paths), "reading", unit="files", enabled=not args.quiet)
    sequences = text_file_sequences(counted(paths, progress), args.max_bytes)
    progress.close(report=bool(sequences))
    if not sequences:
        raise UsageError("no text files under SRC_DIR (%r)%s" % (
            args.src_dir, " ending in %s" % ", ".join(args.ext) if args.ext else ""))
    with writing("--output", args.output):
        save_sequences(args.output, sequences, BYTE_VOCAB)
    summary = {"output": args.output, "sequences": len(sequences),
               "tokens": sum(map(len, sequences)), "vocab_size": BYTE_VOCAB}
    # written to stdout, the data is the result there; the summary goes beside it, to stderr
    out = sys.stderr if is_stdout(args.output) else sys.stdout
    if args.json:
        print(json.dumps(summary), file=out)
    else:
        print("wrote %(sequences)d sequence(s), %(tokens)d tokens (vocabulary %(vocab_size)d) "
              "to %(output)s" % summary, file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
