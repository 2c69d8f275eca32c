"""Training data: token sequences loaded and validated, cut into windows of the model's
context, and split into training and held-out validation windows.

token_sequences.json is either a list of token-id lists or {"vocab_size": V, "sequences":
[...]}. Text becomes byte-level tokens (vocabulary 256), so nothing needs a tokenizer, and
with no file at all the trainer reads the Python standard library's own sources: every
machine that runs Python has them, so the demo needs no download.
"""
import array
import hashlib
import json
import os
import reprlib
import sysconfig

from .atomic import write_atomically

BYTE_VOCAB = 256
DEFAULT_MAX_BYTES = 1_500_000  # about one epoch of the default config in a few CPU minutes


class DataError(ValueError):
    """Training data that cannot be used; the message names the file and what is wrong."""


def file_problem(path, what):
    """Why `path` cannot be read as a `what` (a config file, ...), or None: it must be a
    regular file (a device such as /dev/zero would be read without end)."""
    if os.path.isfile(path):
        return None
    if os.path.isdir(path):
        return "a folder, not a %s" % what
    return "not a regular file" if os.path.exists(path) else "no such %s" % what


def read_json(path, error, what):
    """The JSON value in file `path`; an `error` (exception class) naming the path when it
    is not a regular file (file_problem), cannot be read (`what`: which file) or parsed."""
    problem = file_problem(path, what)
    if problem:
        raise error("%s: %s" % (path, problem))
    try:
        with open(path, "rb") as f:
            text = f.read()
        if not text.strip():    # (json's words for it: "Expecting value: line 1 column 1")
            raise error("%s: the %s is empty" % (path, what))
        return json.loads(text)
    except OSError as exc:
        raise error("%s: cannot read the %s: %s" % (path, what, exc.strerror)) from None
    except error:   # (a ValueError itself: the empty file's, above)
        raise
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, an int of 4,300+ digits
        raise error("%s: not valid JSON: %s" % (path, exc)) from None
    except RecursionError:
        raise error("%s: not a %s: nested too deeply" % (path, what)) from None


def load_sequences(path):
    """(sequences, vocab_size) from a token_sequences.json; vocab_size is max id + 1 when the
    file does not say."""
    data = read_json(path, DataError, "sequences file")
    vocab_size = None
    if isinstance(data, dict):
        unknown = set(data) - {"vocab_size", "sequences"}
        if unknown or "sequences" not in data:
            raise DataError("%s: expected keys 'vocab_size' and 'sequences', got %s"
                            % (path, ", ".join(map(repr, sorted(data))) or "none"))
        vocab_size, data = data.get("vocab_size"), data["sequences"]
        if vocab_size is not None and (not isinstance(vocab_size, int)
                                       or isinstance(vocab_size, bool) or vocab_size < 1
                                       or vocab_size >= 2 ** 63):
            raise DataError("%s: 'vocab_size' must be a positive integer below 2**63 (token "
                            "ids are int64), got %s" % (path, reprlib.repr(vocab_size)))
    if not isinstance(data, list) or not all(isinstance(s, list) for s in data):
        raise DataError("%s: 'sequences' must be a list of token-id lists" % path)
    top = -1
    for n, seq in enumerate(data):
        # JSON's true and false are Python bools, which are ints: not token ids
        bad = next((i for i, t in enumerate(seq)
                    if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
        if bad is not None:
            # (reprlib: a list or string in the wrong place is shown cut short, not whole)
            raise DataError("%s: sequence %d holds something other than non-negative integer "
                            "token ids: item %d is %s" % (path, n, bad, reprlib.repr(seq[bad])))
        top = max(top, max(seq, default=-1))
        if top >= 2 ** 63:      # torch's int64 tokens, and the digest's, hold none larger
            raise DataError("%s: sequence %d holds token id %d; ids must be below 2**63"
                            % (path, n, top))
    if vocab_size is None:
        vocab_size = top + 1
    elif top >= vocab_size:
        raise DataError("%s: token id %d is out of range for vocab_size %d"
                        % (path, top, vocab_size))
    return data, vocab_size


def save_sequences(path, sequences, vocab_size=BYTE_VOCAB):
    text = json.dumps({"vocab_size": vocab_size, "sequences": sequences},
                      separators=(",", ":")) + "\n"
    write_atomically(path, lambda f: f.write(text.encode()))


def _text_of(path, limit):
    """The first `limit` bytes of the file (None: all of it), or None where it is empty or
    holds a NUL byte anywhere (no text file). It is read a chunk at a time, to its first NUL:
    memory stays within the text kept (a binary file was read whole before it was skipped,
    and a --max-bytes past the memory was one buffer asked for up front)."""
    data = bytearray()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                if b"\0" in chunk:
                    return None
                data += chunk if limit is None else chunk[:max(0, limit - len(data))]
    except OSError as exc:
        raise DataError("%s: cannot read it: %s" % (path, exc.strerror)) from None
    return data or None


def text_file_sequences(paths, max_bytes=None):
    """Byte-level sequences (one per file) of the text files among paths, in order, until
    max_bytes in all."""
    sequences, total = [], 0
    for path in paths:
        data = _text_of(path, None if max_bytes is None else max_bytes - total)
        if data is None:
            continue
        sequences.append(list(data))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return sequences


def folder_files(src_dir, extensions=None, exclude=None):
    """Regular files under src_dir in a stable order, skipping hidden folders and files, the
    file exclude (an output written there), and what is no file to read (a FIFO, which would
    wait for a writer forever; a link to nothing)."""
    found = []
    skip = os.path.realpath(exclude) if exclude else None
    for root, dirs, files in os.walk(src_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(root, name)
            if (name.startswith(".") or (extensions and not name.endswith(tuple(extensions)))
                    or not os.path.isfile(path) or os.path.realpath(path) == skip):
                continue
            found.append(path)
    return found


def stdlib_sequences(max_bytes=DEFAULT_MAX_BYTES):
    """Byte-level sequences of the standard library's .py files (not its tests or
    site-packages), in sorted order, so every machine with this Python gets the same data."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = [p for p in folder_files(stdlib, [".py"])
             if not any(part in ("site-packages", "dist-packages", "test", "tests")
                        for part in os.path.relpath(p, stdlib).split(os.sep))]
    if not paths:
        raise DataError("no .py sources under %s (this Python ships without its standard "
                        "library sources); pass --sequences FILE" % stdlib)
    return text_file_sequences(paths, max_bytes)


def sequences_digest(sequences):
    """SHA-256 of token sequences (each one's length, then its ids): what a resume compares
    to tell the data its checkpoint was trained on, whatever the path's spelling."""
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(array.array("q", [len(seq)]).tobytes())
        digest.update(array.array("q", seq).tobytes())
    return digest.hexdigest()


def load_training_data(path=None):
    """(sequences, vocab_size, info) of a token_sequences.json, or of the standard library's
    sources for None; info names the source, says whether the tokens are bytes (generation
    then reads and writes text) and holds their digest."""
    if path is None:
        sequences, vocab_size, source = stdlib_sequences(), BYTE_VOCAB, "python standard library"
    else:
        sequences, vocab_size = load_sequences(path)
        source = path
    # orchard-prepare's output is byte-level
    return sequences, vocab_size, {"source": source, "byte_level": vocab_size == BYTE_VOCAB,
                                   "digest": sequences_digest(sequences)}


def token_chunks(sequences, context):
    """LongTensor (n, context + 1): the sequences concatenated and cut into windows, each an
    input of `context` tokens and, shifted by one, its targets. Sequences run into each other
    as in nanoGPT, so short ones are not lost."""
    import torch

    stream = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    n = (len(stream) - 1) // context
    if n < 1:
        raise DataError("%d tokens are not enough for one sequence of context %d"
                        % (len(stream), context))
    inputs = stream[:n * context].view(n, context)
    targets = stream[1:n * context + 1].view(n, context)
    return torch.cat([inputs, targets[:, -1:]], dim=1)


def split_validation(chunks, val_fraction):
    """(train, val): the last floor(len(chunks) * val_fraction) windows are held out. The end
    of the data, as in nanoGPT, so that the split is the same in every run and resume and no
    training window shares text with a validation one (but for the one token at the seam)."""
    n_val = int(len(chunks) * val_fraction)
    return chunks[:len(chunks) - n_val], chunks[len(chunks) - n_val:]


def evaluation_windows(val, n):
    """At most n of the held-out windows val, spread evenly over them: the same ones at every
    validation, so that its losses compare across steps, and a cost that does not grow with
    the data (a pass over 5 % of 100 MB at every eval_interval would outlast the training)."""
    if len(val) <= n:
        return val
    return val[[i * len(val) // n for i in range(n)]]
