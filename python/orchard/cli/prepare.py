"""orchard-prepare: byte-level token sequences from a folder of text or code.

    orchard-prepare SRC_DIR -o data/token_sequences.json [--ext .py --ext .md] [--max-bytes N]

Writes {"vocab_size": 256, "sequences": [...]}, one sequence per text file (binary files,
recognised by a NUL byte, and hidden files are skipped), for orchard-train --sequences.
"""
import argparse
import sys

from ..data import BYTE_VOCAB, folder_files, save_sequences, text_file_sequences


def main(argv=None):
    parser = argparse.ArgumentParser(prog="orchard-prepare", description=__doc__.split("\n")[0])
    parser.add_argument("src_dir", metavar="SRC_DIR", help="folder of text or source files")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="token_sequences.json to write")
    parser.add_argument("--ext", action="append", metavar="SUFFIX",
                        help="only files ending in SUFFIX (repeatable; default: every text file)")
    parser.add_argument("--max-bytes", type=int, metavar="N", help="stop after N bytes in all")
    args = parser.parse_args(argv)

    sequences = text_file_sequences(folder_files(args.src_dir, args.ext), args.max_bytes)
    if not sequences:
        print("orchard-prepare: error: no text files under %s" % args.src_dir, file=sys.stderr)
        return 2
    save_sequences(args.output, sequences, BYTE_VOCAB)
    print("wrote %d sequences, %d tokens (vocabulary %d) to %s"
          % (len(sequences), sum(map(len, sequences)), BYTE_VOCAB, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
