"""Every console script under bad input: one line `orchard-X: error: <what> (<value>)`, exit
status 2, no traceback (unless --verbose or ORCHARD_DEBUG asks for one), files untouched.

Most cases run in one child process that calls each script's main() in turn (a subprocess
per case would import torch again each time); a few run each script as its own process, as a
user does."""
import importlib.util
import json
import os
import pickle
import re
import shutil

import orchard_ops
import pytest

from conftest import OPENCL_IDS, REPO_ROOT
from test_py_support import write_tiny_run_files, run_python

SCRIPTS = ("train", "generate", "devices", "prepare", "bench", "tune", "demo")

# Calls main(argv) of each case with its environment, and reports exit status, stderr and
# stdout: SystemExit is argparse's way out, any other exception is a traceback a user would see.
HARNESS = r"""
import contextlib, importlib, io, json, os, sys, traceback
results = []
for module, argv, env in json.loads(sys.argv[1]):
    main = importlib.import_module("orchard.cli." + module).main
    saved = dict(os.environ)
    os.environ.update(env)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    os.environ.clear()
    os.environ.update(saved)
    results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
print(json.dumps(results))
"""


def run_cases(cases):
    """[(module, argv, env)] -> one result dict per case, from a single child process."""
    r = run_python(["-c", HARNESS, json.dumps(cases)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    config, sequences = write_tiny_run_files(str(folder))
    texts = {
        "type.yaml": "model:\n  n_layer: two\n",
        "syntax.yaml": "model: [1, 2\n",
        "huge_model.yaml": "model:\n  n_embd: 100000\n",
        "val_fraction.yaml": "training:\n  val_fraction: 0.99\n",
        "empty.json": "",
        "no_keys.json": "{}",
        "binary.yaml": b"\x89PNG\r\n\x1a\n\x00\xff",
        "short.json": json.dumps({"vocab_size": 256, "sequences": [list(range(200))]}),
        "bools.json": json.dumps([[1, 2, True] + list(range(300))]),
        "huge_id.json": json.dumps([list(range(300)) + [2 ** 63]]),
        "wide_id.json": json.dumps([list(range(300)) + [10 ** 12]]),
        "nested.json": json.dumps([[1, list(range(300))]]),
        "vocab_bool.json": json.dumps({"vocab_size": True, "sequences": [list(range(300))]}),
        "deep.json": "[" * 100000 + "]" * 100000,
        # deep enough for PyYAML's and transformers' recursion, not for json's parser
        "deep.yaml": "model:\n  context: " + "[" * 600 + "]" * 600 + "\n",
        "long_int.yaml": "model:\n  context: 1" + "0" * 5000 + "\n",
        "long_int.json": '{"vocab_size": 1%s, "sequences": [[1]]}' % ("0" * 5000),
        "vocab_huge.json": '{"vocab_size": 1%s, "sequences": [[1]]}' % ("0" * 400),
        "deep_hf.json": '{"model_type": "llama", "x": ' + "[" * 600 + "]" * 600 + "}",
        "damaged.pt": b"not a checkpoint",
        "pickle.pt": pickle.dumps({"a": 1}, protocol=4),    # torch warned of its protocol
    }
    for name, text in texts.items():
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    (folder / "empty_src").mkdir()
    (folder / "folder.png").mkdir()
    (folder / "empty_src" / "blob.bin").write_bytes(b"\0\1\2")
    (folder / "kept.json").write_text('{"vocab_size": 256, "sequences": [[1, 2]]}')
    (folder / "kept.png").write_text("a plot to keep\n")
    (folder / "link.png").symlink_to(folder / "kept.json")     # --plot onto --json's file
    (folder / "dangling").symlink_to(folder / "nowhere")       # an --output to nothing
    (folder / "loop.json").symlink_to(folder / "loop.json")    # a link to itself
    (folder / "no_proc.json").symlink_to("/proc/nowhere/x.json")    # to where none is made
    (folder / "proc_self.json").symlink_to("/proc/self/x.json")     # a folder that takes none
    import torch
    torch.save({"w": torch.zeros(2)}, str(folder / "statedict.pt"))     # a model's state dict
    torch.save(torch.zeros(3), str(folder / "tensor.pt"))
    from orchard.checkpoint import KEYS
    torch.save(dict({k: 0 for k in KEYS}, format=1, step=-5), str(folder / "negative.pt"))
    torch.save(dict({k: 0 for k in KEYS}, format=1, seed=2**70), str(folder / "seed.pt"))
    (folder / "u3" / "metrics.jsonl").mkdir(parents=True)
    # a run's files as links: to a folder that is not there (which had been made), to a file
    (folder / "u4").mkdir()
    (folder / "u4" / "checkpoint.pt").symlink_to(folder / "gone" / "x.pt")
    (folder / "u5").mkdir()
    (folder / "u5" / "metrics.jsonl").symlink_to(folder / "kept.json" / "m.jsonl")
    (folder / "bert.json").write_text(json.dumps({
        "model_type": "bert", "hidden_size": 32, "num_attention_heads": 2,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 300}))
    (folder / "badweights").mkdir()
    shutil.copy(os.path.join(REPO_ROOT, "configs", "hf_llama_tiny.json"),
                folder / "badweights" / "config.json")
    (folder / "badweights" / "model.safetensors").write_text("junk\n")
    return {"dir": folder, "config": config, "sequences": sequences,
            **{name: str(folder / name) for name in texts}}


def expected_cases(f):
    """(module, argv, env, words the one error line must hold)."""
    tiny = ["--config", f["config"], "--sequences", f["sequences"], "--device", "cpu"]
    missing = str(f["dir"] / "missing.yaml")
    tpu = {"ORCHARD_DEVICE": "tpu"}
    best_opencl = OPENCL_IDS and orchard_ops.resolve_device("opencl")
    return [
        # counts and sizes: typed and range-checked
        ("train", ["--micro-batch", "0"], {}, ["--micro-batch", ">= 1", "'0'"]),
        ("train", ["--micro-batch", "-4"], {}, ["--micro-batch", "'-4'"]),
        ("train", ["--epochs", "0"], {}, ["--epochs", "'0'"]),
        ("train", ["--max-steps", "ten"], {}, ["--max-steps", "integer", "'ten'"]),
        # decimal ASCII digits, as the config files' numbers (int() takes these too)
        ("train", ["--max-steps", "1_000"], {}, ["--max-steps", "integer", "'1_000'"]),
        # past int()'s 4,300 digits: past the bound, the value abbreviated
        ("train", ["--seed", "9" * 5000], {}, ["--seed", "must be <= 9223372036854775807",
                                               "'999999999999...9999999999999'"]),
        ("generate", ["--seed", "\u0661\u0662"], {}, ["--seed", "integer", "'\u0661\u0662'"]),
        ("tune", ["--candidates", "9_6x96"], {}, ["--candidates", "'9_6x96'"]),
        ("bench", ["--shape", "1,2,6_4,16"], {}, ["--shape", "'1,2,6_4,16'"]),
        ("train", ["--seed", "-1"], {}, ["--seed", "'-1'"]),
        # counts past 2**63 - 1 (what a checkpoint holds) ran "forever"
        ("train", ["--max-steps", str(2 ** 63)], {},
         ["--max-steps", "<= 9223372036854775807", "'9223372036854775808'"]),
        ("train", ["--epochs", "9" * 30], {}, ["--epochs", "<="]),
        ("bench", ["--repeats", str(2 ** 64)], {}, ["--repeats", "<="]),
        ("train", ["--seed", "99999999999999999999"], {}, ["--seed", "<=", "'99999999999999999999'"]),
        ("generate", ["--checkpoint", "x", "--seed", "99999999999999999999"], {}, ["--seed", "<="]),
        ("generate", ["--checkpoint", "x", "--temperature", "-1"], {},
         ["--temperature", ">= 0", "'-1'"]),
        ("generate", ["--checkpoint", "x", "--temperature", "inf"], {}, ["--temperature", "'inf'"]),
        # written as the config files' reals: float() took these (1_0 as 10.0)
        *[("generate", ["--checkpoint", "x", "--temperature", t], {},
           ["--temperature", "must be a number", repr(t)])
          for t in ("1_0", " 0.5 ", "\u0660.\u0665")],
        ("generate", ["--checkpoint", "x", "--top-k", "-1"], {}, ["--top-k", "'-1'"]),
        ("generate", ["--checkpoint", "x", "--max-new-tokens", "-5"], {}, ["--max-new-tokens"]),
        ("bench", ["--repeats", "0"], {}, ["--repeats", ">= 3", "'0'"]),
        ("bench", ["--repeats", "1"], {}, ["--repeats", "'1'"]),
        ("bench", ["--shapes", "0,0,0,0"], {}, ["--shapes", "'0,0,0,0'"]),
        ("bench", ["--shapes", "1,2,3"], {}, ["--shapes", "'1,2,3'"]),
        ("bench", ["--shapes", "1,2,64,512"], {}, ["--shapes", "at most 256", "'1,2,64,512'"]),
        ("bench", ["--shapes", "99999999,99999,99999,64"], {}, ["--shapes", "GiB"]),
        ("tune", ["--shape", "1,2,64,300"], {}, ["--shape", "at most 256", "'1,2,64,300'"]),
        ("bench", ["--quick", "--json", str(f["dir"] / "kept.json")], {},
         ["--json", "exists", "--overwrite", "kept.json"]),
        ("bench", ["--quick", "--plot", f["config"]], {}, ["--plot", "exists", "--overwrite"]),
        # matplotlib adds .png to a name without a suffix: that file is the one checked
        ("bench", ["--quick", "--plot", str(f["dir"] / "kept")], {},
         ["--plot", "exists", "--overwrite", "kept.png"]),
        ("bench", ["--quick", "--json", str(f["dir"] / "same.png"), "--plot",
                   str(f["dir"] / "same.png")], {}, ["--plot", "same file as --json", "same.png"]),
        ("bench", ["--quick", "--overwrite", "--json", str(f["dir"] / "kept.json"), "--plot",
                   str(f["dir"] / "link.png")], {}, ["--plot", "same file as --json", "link.png"]),
        ("bench", ["--quick", "--json", ""], {}, ["--json", "''"]),
        ("bench", ["--quick", "--plot", ""], {}, ["--plot", "''"]),
        # the file a name without a suffix writes, a folder: refused before the work, not after
        ("bench", ["--quick", "--overwrite", "--plot", str(f["dir"] / "folder")], {},
         ["--plot", "folder.png"]),
        ("bench", ["--dtypes", "float32,float8"], {}, ["--dtypes", "'float32,float8'"]),
        ("bench", ["--dtypes", "float32,float32"], {}, ["--dtypes", "each once",
                                                        "'float32,float32'"]),
        ("bench", ["--devices", "cpu,cpu"], {}, ["--devices", "each device once", "'cpu,cpu'"]),
        ("bench", ["--plot", "/nonexistent/plot.png"], {}, ["--plot", "'/nonexistent/plot.png'"]),
        ("bench", ["--json", "/nonexistent/r.json"], {}, ["--json", "'/nonexistent/r.json'"]),
        ("bench", ["--scaling", "--max-n", "100"], {}, ["--max-n", ">= 256", "'100'"]),
        ("bench", ["--scaling", "--max-n", "4k"], {}, ["--max-n", "integer", "'4k'"]),
        ("bench", ["--scaling", "--head-dims", "64,0"], {}, ["--head-dims", "1..256", "'64,0'"]),
        ("bench", ["--scaling", "--head-dims", "512"], {}, ["--head-dims", "1..256", "'512'"]),
        ("bench", ["--scaling", "--head-dims", "64,,128"], {}, ["--head-dims", "'64,,128'"]),
        ("bench", ["--scaling", "--head-dims", "64,64"], {}, ["--head-dims", "each once"]),
        ("bench", ["--max-n", "1024"], {}, ["--max-n", "only with argument --scaling"]),
        ("bench", ["--head-dims", "64"], {}, ["--head-dims", "only with argument --scaling"]),
        ("bench", ["--scaling", "--shapes", "1,1,64,64"], {},
         ["--shapes", "not allowed with argument --scaling"]),
        ("bench", ["--scaling", "--decode"], {},
         ["--decode", "not allowed with argument --scaling"]),
        ("bench", ["--decode", "--dtypes", "float16"], {},
         ["--decode", "float32 and bfloat16", "--dtypes float16"]),
        ("tune", ["--shape", "1,8,0,64"], {}, ["--shape", "'1,8,0,64'"]),
        ("bench", ["--quick", "--json", "/proc/self/r.json"], {},
         ["--json", "'/proc/self/r.json'", "can write", "takes no new files"]),
        ("tune", ["--candidates", "0x64"], {}, ["--candidates", "'0x64'"]),
        ("tune", ["--candidates", "-64x64"], {}, ["--candidates", "'-64x64'"]),
        ("tune", ["--candidates", "100000x64"], {}, ["--candidates", "1..4096", "'100000x64'"]),
        ("tune", ["--repeats", "0"], {}, ["--repeats", "'0'"]),
        ("tune", ["--timeout", "0.5"], {}, ["--timeout", ">= 1", "'0.5'"]),
        ("tune", ["--timeout", "inf"], {}, ["--timeout", "finite", "'inf'"]),
        ("tune", ["--timeout", "1_0"], {}, ["--timeout", "must be a number", "'1_0'"]),
        ("tune", ["--timeout", "3e6"], {}, ["--timeout", "<= 1e+06", "'3e6'"]),
        ("prepare", [str(f["dir"]), "-o", "x.json", "--ext", ""], {},
         ["argument --ext:", "got ''"]),
        ("prepare", [str(f["dir"]), "-o", "x.json", "--max-bytes", "0"], {},
         ["--max-bytes", "'0'"]),
        # devices: an argument, and the environment
        ("train", ["--device", "opencl:99"], {}, ["--device", "'opencl:99'", "available"]),
        ("train", ["--device", "tpu"], {}, ["--device", "'tpu'"]),
        ("train", [], tpu, ["ORCHARD_DEVICE", "'tpu'"]),
        ("generate", ["--checkpoint", "x", "--device", "tpu"], {}, ["--device", "'tpu'"]),
        ("generate", ["--checkpoint", "x"], tpu, ["ORCHARD_DEVICE", "'tpu'"]),
        ("devices", [], tpu, ["ORCHARD_DEVICE", "'tpu'"]),
        ("bench", ["--devices", "cpu,opencl:99"], {}, ["--devices", "'opencl:99'"]),
        ("bench", [], tpu, ["ORCHARD_DEVICE", "'tpu'"]),
    ] + ([
        ("train", [], {"ORCHARD_CL_FAMILY": "bogus"}, ["ORCHARD_CL_FAMILY", "'bogus'"]),
        # torchrun's process counts (int() had raised a traceback; a LOCAL_WORLD_SIZE alone
        # had planned memory for processes that were not started)
        ("train", [], {"WORLD_SIZE": "x"}, ["environment variable WORLD_SIZE", "'x'"]),
        # and the rest of its rendezvous (a WORLD_SIZE alone ended in a traceback, a RANK
        # past it waited forever)
        ("train", [], {"WORLD_SIZE": "2"}, ["environment variable RANK is not set"]),
        ("train", [], {"WORLD_SIZE": "2", "RANK": "1"}, ["MASTER_ADDR is not set"]),
        ("train", [], {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"},
         ["MASTER_PORT is not set"]),
        ("train", [], {"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}, ["RANK", "0 to 1", "'5'"]),
        ("devices", [], {"LOCAL_WORLD_SIZE": "0"}, ["LOCAL_WORLD_SIZE", "count", "'0'"]),
        ("generate", ["--checkpoint", "x"], {"LOCAL_WORLD_SIZE": "3"},
         ["LOCAL_WORLD_SIZE is 3, more processes than WORLD_SIZE's 1"]),
        ("bench", ["--quick"], {"ORCHARD_CL_FAMILY": "bogus"}, ["ORCHARD_CL_FAMILY"]),
        ("train", [], {"ORCHARD_CL_VECTOR": "3"}, ["ORCHARD_CL_VECTOR", "'3'", "4, 8 or 16"]),
        ("devices", [], {"ORCHARD_CL_BLOCK_Q": "abc"}, ["ORCHARD_CL_BLOCK_Q", "'abc'"]),
        ("tune", [], {"ORCHARD_CL_BLOCK_K": "0"}, ["ORCHARD_CL_BLOCK_K", "1..4096"]),
        ("tune", ["--candidates", "64x64", "32x32", "64x64"], {},
         ["--candidates", "each once", "got 64x64 more than once"]),
        # one device by two names: its id twice (it was timed twice)
        ("bench", ["--devices", "cpu,%s,opencl" % best_opencl], {},
         ["--devices", "each device once", "'cpu,%s,opencl': cpu,%s,%s"
          % ((best_opencl,) * 3)]),
    ] if OPENCL_IDS else []) + [
        ("tune", ["--device", "cpu"], {}, ["--device", "OpenCL", "'cpu'"]),
        ("tune", ["--device", "cpu", "--candidates", "96x96"], {}, ["--device", "OpenCL", "'cpu'"]),
        ("tune", ["--device", "tpu"], {}, ["--device", "'tpu'"]),
        ("demo", ["--device", "tpu"], {}, ["--device", "'tpu'"]),
        ("demo", [], tpu, ["ORCHARD_DEVICE", "'tpu'"]),
        # config files: the file, the key, the expected type
        ("devices", ["--config", missing], {}, ["argument --config:", missing, "no such config file"]),
        ("devices", ["--config", str(f["dir"])], {}, ["argument --config:", str(f["dir"]), "a folder, not a config"]),
        ("devices", ["--config", "/dev/null"], {}, ["argument --config:", "/dev/null", "not a regular file"]),
        ("devices", ["--config", "/proc/self/mem"], {}, ["argument --config:", "/proc/self/mem", "cannot be read"]),
        ("train", ["--hf-model", f["config"], "--device", "cpu"], {},
         ["tiny.yaml", "a file, not a model folder"]),
        ("devices", ["--config", f["type.yaml"]], {}, ["argument --config:", f["type.yaml"], "model.n_layer", "int",
                                                       "'two'"]),
        ("devices", ["--config", f["syntax.yaml"]], {}, ["argument --config:", f["syntax.yaml"], "line 2"]),
        ("devices", ["--config", f["binary.yaml"]], {}, ["argument --config:", f["binary.yaml"], "not valid YAML"]),
        ("train", ["--config", f["type.yaml"], "--device", "cpu"], {},
         ["argument --config:", f["type.yaml"], "model.n_layer"]),
        # a model no memory budget holds: the config that chose it is named
        ("train", ["--config", f["huge_model.yaml"], "--device", "cpu", "--output",
                   str(f["dir"] / "out_huge")], {},
         ["argument --config:", "optimizer state need", "model.n_embd 100000"]),
        ("devices", ["--config", f["huge_model.yaml"]], {},
         ["argument --config:", "optimizer state need", "model.n_embd 100000"]),
        # data, checkpoints, folders
        ("train", tiny[:2] + ["--sequences", f["short.json"], "--device", "cpu", "--output",
                              str(f["dir"] / "out_short")], {},
         [f["short.json"], "fewer than one batch"]),
        # what held the rest out is named
        ("train", ["--config", f["val_fraction.yaml"], "--sequences", f["sequences"], "--device",
                   "cpu", "--output", str(f["dir"] / "out_val")], {},
         ["fewer than one batch", "training.val_fraction 0.99 held out"]),
        ("train", tiny[:2] + ["--sequences", f["bools.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["bools.json"], "item 2 is True"]),
        # a model too large for the memory: the argument that chose its size named (--config
        # had been named where the data's token ids made the vocabulary)
        ("train", tiny[:2] + ["--sequences", f["wide_id.json"], "--device", "cpu"], {},
         ["argument --sequences: the model's weights", "vocab_size 1000000000001"]),
        ("train", tiny[:2] + ["--sequences", f["huge_id.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["huge_id.json"], "token id 9223372036854775808",
          "below 2**63"]),
        # a value in the wrong place shown cut short, not whole
        ("train", tiny[:2] + ["--sequences", f["nested.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["nested.json"], "item 1 is [0, 1, 2, 3, 4, 5, ...]"]),
        ("train", tiny[:2] + ["--sequences", f["vocab_bool.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["vocab_bool.json"], "'vocab_size' must be a positive "
          "integer below 2**63 (token ids are int64), got True"]),
        # ints past what int64 holds, and past the 4,300 digits Python converts: tracebacks
        ("train", tiny[:2] + ["--sequences", f["vocab_huge.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["vocab_huge.json"], "'vocab_size' must be", "got 1000"]),
        ("train", tiny[:2] + ["--sequences", f["long_int.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["long_int.json"]]),     # (the limit: Python 3.10.7 on)
        ("train", tiny[:2] + ["--sequences", f["deep.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["deep.json"], "nested too deeply"]),
        ("train", tiny[:2] + ["--sequences", f["empty.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["empty.json"], "the sequences file is empty"]),
        ("train", tiny[:2] + ["--sequences", f["no_keys.json"], "--device", "cpu"], {},
         ["argument --sequences:", f["no_keys.json"], "'sequences', got none"]),
        # a device read without end (memory grew until the process was killed, before)
        ("train", tiny[:2] + ["--sequences", "/dev/zero", "--device", "cpu"], {},
         ["argument --sequences:", "/dev/zero: not a regular file"]),
        # more steps than a checkpoint counts (written, then refused at --resume, before)
        ("train", tiny + ["--epochs", str(2**63 - 1), "--output", str(f["dir"] / "out_epochs")],
         {}, ["argument --epochs:", "steps are more than 9223372036854775807 steps"]),
        ("generate", ["--checkpoint", str(f["dir"] / "none.pt")], {},
         ["argument --checkpoint:", "none.pt", "no such checkpoint"]),
        # (read without end, before: the machine's OOM killer ended it)
        ("generate", ["--checkpoint", "/dev/zero"], {},
         ["argument --checkpoint:", "/dev/zero: not a regular file"]),
        ("train", ["--resume", "/dev/zero", "--output", str(f["dir"] / "out_zero")], {},
         ["argument --resume:", "/dev/zero: not a regular file"]),
        ("generate", ["--checkpoint", f["damaged.pt"]], {},
         ["argument --checkpoint:", "damaged.pt", "not a readable"]),
        ("generate", ["--checkpoint", f["pickle.pt"]], {},
         ["argument --checkpoint:", "pickle.pt", "not a readable"]),
        ("generate", ["--checkpoint", str(f["dir"] / "statedict.pt")], {},
         ["argument --checkpoint:", "statedict.pt", "not an orchard checkpoint", "model_config"]),
        ("generate", ["--checkpoint", str(f["dir"] / "tensor.pt")], {},
         ["argument --checkpoint:", "tensor.pt", "not an orchard checkpoint"]),
        ("generate", ["--checkpoint", str(f["dir"] / "negative.pt")], {},
         ["argument --checkpoint:", "negative.pt", "step is -5"]),
        ("train", ["--resume", str(f["dir"] / "seed.pt")], {},
         ["argument --resume:", "seed.pt", "seed is 1180591620717411303424"]),
        ("train", ["--resume", str(f["dir"] / "tensor.pt"), "--output", str(f["dir"] / "r2"),
                   "--device", "cpu"], {}, ["argument --resume:", "tensor.pt",
                                             "not an orchard checkpoint"]),
        ("prepare", [str(f["dir"] / "nowhere"), "-o", "x.json"], {},
         ["SRC_DIR does not exist", "nowhere"]),
        ("prepare", [f["config"], "-o", "x.json"], {}, ["SRC_DIR is not a folder", "tiny.yaml"]),
        ("prepare", [str(f["dir"] / "empty_src"), "-o", str(f["dir"] / "kept.json"),
                     "--overwrite"], {},
         ["no text files", "empty_src"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"])], {}, ["--output", "folder"]),
        # links: one that loops was replaced by the output; one to a folder that takes no
        # files was refused after the work; one to no folder had it made
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "loop.json")], {},
         ["--output", "a symbolic link that loops", "loop.json"]),
        ("bench", ["--quick", "--json", str(f["dir"] / "loop.json")], {},
         ["--json", "a symbolic link that loops", "loop.json"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "no_proc.json")], {},
         ["--output", "is a symbolic link to /proc/nowhere/x.json, and /proc/nowhere is no "
          "folder", "no_proc.json"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "proc_self.json")], {},
         ["--output", "takes no new files", "proc_self.json"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "kept.json")], {},
         ["--output", "exists", "--overwrite", "kept.json"]),
        ("bench", ["--quick", "--plot", str(f["dir"] / "x.txt")], {}, ["--plot", "x.txt"]),
        ("train", tiny + ["--output", f["config"]], {}, ["--output", "is a file", "tiny.yaml"]),
        ("train", tiny + ["--output", f["config"] + "/sub"], {},
         ["--output", "cannot be made", "tiny.yaml"]),
        ("train", tiny + ["--output", ""], {}, ["--output", "must name a folder"]),
        # names longer than the file system takes: refused before the work, not after it
        ("train", tiny + ["--output", str(f["dir"] / ("n" * 300) / "run")], {},
         ["--output", "cannot be made", "a name ('nnnn", "of 300 bytes"]),
        # (a file is written through a temporary one of 22 bytes more: 240 + 22 > 255)
        ("bench", ["--quick", "--json", str(f["dir"] / ("n" * 235 + ".json"))], {},
         ["--json", "a name ('nnnn", "with its temporary file's of 262 bytes"]),
        ("bench", ["--quick", "--plot", str(f["dir"] / ("n" * 300))], {},
         ["--plot", "a name ('nnnn", "of 322 bytes"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / ("n" * 300 + ".json"))], {},
         ["--output", "cannot be made", "of 327 bytes"]),
        # (its checkpoint's temporary file, 35 bytes, in a folder of 4,088)
        ("train", tiny + ["--output", "/" + "/".join(["p" * 254] * 16) + "/" + "p" * 7], {},
         ["--output", "the path of 4125 bytes", "at most 4096"]),
        # empty paths: each named (an empty --resume had started a new run)
        ("train", ["--resume", ""], {}, ["--resume", "must name a checkpoint", "''"]),
        ("train", ["--config", ""], {}, ["--config", "must name a config file", "''"]),
        ("train", ["--sequences", ""], {}, ["--sequences", "must name a token_sequences"]),
        ("devices", ["--config", ""], {}, ["--config", "must name a config file"]),
        ("train", ["--config", f["deep.yaml"]], {}, ["--config", "deep.yaml", "nested too deeply"]),
        ("devices", ["--config", f["deep.yaml"]], {}, ["--config", "nested too deeply"]),
        ("devices", ["--config", f["long_int.yaml"]], {}, ["--config", "long_int.yaml"]),
        ("generate", ["--checkpoint", ""], {}, ["--checkpoint", "must name a checkpoint"]),
        ("prepare", ["", "-o", "x.json"], {}, ["SRC_DIR", "must name a folder"]),
        ("prepare", [str(f["dir"]), "-o", ""], {}, ["--output", "must name a file", "''"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "new") + "/"], {},
         ["--output", "must name a file", "new/"]),
        ("bench", ["--quick", "--json", str(f["dir"] / "r.json") + "/"], {},
         ["--json", "must be a file", "r.json/"]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "new") + "/."], {},
         ["--output", "must name a file", "new/."]),
        # a missing folder before '..': the checks found no file there, and the writers
        # (os.path.realpath, os.makedirs) replaced the one the '..' leads to
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "none" / ".." / "kept.json")], {},
         ["--output", "none, before its '..', is not a folder", "kept.json"]),
        ("bench", ["--quick", "--json", str(f["dir"] / "none" / ".." / "kept.json")], {},
         ["--json", "none, before its '..', is not a folder", "kept.json"]),
        ("train", tiny + ["--output", str(f["dir"] / "none" / ".." / "u3")], {},
         ["--output", "none, before its '..', is not a folder", "u3"]),
        # (--output's default, --resume's folder: --resume named)
        ("train", ["--resume", str(f["dir"] / "none" / ".." / "u3" / "checkpoint.pt")], {},
         ["--resume", "none, before its '..', is not a folder", "checkpoint.pt"]),
        # a list that starts with a minus is a value, checked as such
        ("bench", ["--shapes", "-1,8,64,64"], {}, ["--shapes", "four integers", "'-1,8,64,64'"]),
        ("tune", ["--shape", "-1,2,128,32"], {}, ["--shape", "four integers", "'-1,2,128,32'"]),
        ("train", tiny + ["--output", "/proc/self/run"], {},
         ["--output", "cannot be made or written", "/proc/self"]),
        ("prepare", [str(f["dir"]), "-o", "/proc/self/q.json"], {},
         ["--output", "cannot be made or written", "/proc/self"]),
        ("prepare", [str(f["dir"]), "-o", f["config"] + "/q.json"], {},
         ["--output", "tiny.yaml is a file"]),
        ("train", tiny + ["--output", str(f["dir"] / "u3")], {},
         ["--output", "metrics.jsonl", "folder"]),
        ("train", tiny + ["--output", str(f["dir"] / "u4")], {},
         ["--output", "checkpoint.pt there cannot be written: is a symbolic link to",
          "gone/x.pt, and %s is no folder" % (f["dir"] / "gone")]),
        ("train", tiny + ["--output", str(f["dir"] / "u5")], {},
         ["--output", "metrics.jsonl there cannot be written: is a symbolic link to",
          "kept.json/m.jsonl, and %s is no folder" % (f["dir"] / "kept.json")]),
        ("prepare", [str(f["dir"]), "-o", str(f["dir"] / "u4" / "checkpoint.pt")], {},
         ["--output", "is a symbolic link to", "gone/x.pt, and %s is no folder"
          % (f["dir"] / "gone")]),
        ("bench", ["--quick", "--json", str(f["dir"] / "u4" / "checkpoint.pt")], {},
         ["--json", "is a symbolic link to", "gone/x.pt, and %s is no folder"
          % (f["dir"] / "gone")]),
        ("train", tiny + ["--output", str(f["dir"] / "dangling")], {},
         ["--output", "dangling is a symbolic link whose target cannot be reached"]),
        # "--option=--", which argparse gives no value unchecked: "--" is the value
        ("train", ["--config=--"], {}, ["--config", "--: no such config file"]),
        ("train", ["--resume=--", "--device", "cpu"], {}, ["--resume", "--: no such checkpoint"]),
        ("generate", ["--checkpoint=--"], {}, ["--checkpoint", "--: no such checkpoint"]),
        ("bench", ["--shapes=--"], {}, ["--shapes", "(got '--')"]),
    ] + ([
        # transformers models: an encoder's config, a damaged weights file
        ("train", tiny + ["--hf-config", str(f["dir"] / "bert.json"), "--output",
                          str(f["dir"] / "o_bert")], {},
         ["bert.json", "not causal", "is_decoder"]),
        ("train", tiny + ["--hf-config", f["deep_hf.json"], "--output",
                          str(f["dir"] / "o_deep")], {},
         ["--hf-config", "deep_hf.json", "nested more than 64 levels deep"]),
        ("train", tiny[2:] + ["--hf-model", str(f["dir"] / "badweights"), "--output",
                              str(f["dir"] / "o_weights")], {},
         ["badweights", "cannot load the pretrained model", "header"]),
    ] if importlib.util.find_spec("transformers") else []) + [
        # flags that exclude each other
        ("train", ["--fp16", "--bf16"], {}, ["--bf16", "not allowed with", "--fp16"]),
        ("bench", ["--verbose", "--quiet"], {}, ["--quiet", "not allowed with", "--verbose"]),
    ]


def test_bad_input_to_every_script_gives_one_line_and_status_2(files):
    cases = expected_cases(files)
    assert {c[0] for c in cases} == set(SCRIPTS)
    kept = (files["dir"] / "kept.json").read_bytes()
    results = run_cases([[m, argv, env] for m, argv, env, _ in cases])
    for (module, argv, env, words), r in zip(cases, results):
        what = "orchard-%s %s %s" % (module, env, argv)
        assert r["code"] == 2, (what, r)
        assert "Traceback" not in r["stderr"], (what, r["stderr"])
        lines = r["stderr"].splitlines()
        # the one error line (one process per case checks that nothing comes before it,
        # test_train_errors_come_alone: logging keeps the stream of the first case here)
        assert lines and lines[-1].startswith("orchard-%s: error: " % module), (what, lines)
        assert all(not line.startswith("usage:") for line in lines), (what, lines)
        for word in words:
            assert word in lines[-1], (what, word, lines[-1])
    # nothing written or replaced by a refused run
    assert (files["dir"] / "kept.json").read_bytes() == kept
    assert not (files["dir"] / "out_short").exists()
    assert not os.path.exists(os.path.join(str(files["dir"]), "x.json"))
    assert os.path.islink(files["dir"] / "loop.json")
    assert not (files["dir"] / "gone").exists()     # a link's folder is not made


def test_an_opencl_orchard_device_without_opencl_says_why():
    """ORCHARD_DEVICE=opencl:0 where no OpenCL library loads: the line quotes why, as the
    library's error and --device's do (the console scripts' own check had left it out)."""
    r = run_python(["-m", "orchard.cli.devices"], ORCHARD_DEVICE="opencl:0",
                   ORCHARD_OPENCL_LIBRARY="/nonexistent/libOpenCL.so")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "orchard-devices: error: environment variable ORCHARD_DEVICE names no available "
        "device ('opencl:0'); available: cpu; no OpenCL device: ORCHARD_OPENCL_LIBRARY="
        "'/nonexistent/libOpenCL.so' cannot be opened (/nonexistent/libOpenCL.so: cannot open "
        "shared object file: No such file or directory)"], r.stderr


def test_prepare_of_binary_files_alone_prints_the_error_alone(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    r = run_python(["-m", "orchard.cli.prepare", str(tmp_path), "-o", str(tmp_path / "t.json")])
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("orchard-prepare: error: no text")


@pytest.mark.parametrize("script, argv", [
    ("train", ["--micro-batch", "0"]),
    ("generate", ["--checkpoint", "x", "--top-k", "-1"]),
    ("devices", ["--config", "missing.yaml"]),
    ("prepare", ["missing_folder", "-o", "x.json"]),
    ("bench", ["--shapes", "0,1,1,1"]),
    ("tune", ["--repeats", "0"]),
    ("demo", ["--device", "opencl:99"]),
])
def test_each_script_as_a_process(script, argv, tmp_path):
    r = run_python(["-m", "orchard.cli." + script] + argv)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("orchard-%s: error: " % script)
    assert r.stdout == ""


def test_train_errors_come_alone(tmp_path):
    # the device, config and data notes of a run are held until its input has been checked
    (tmp_path / "empty.json").write_text("[]")
    for argv, words in ((["--config", "missing.yaml"], "missing.yaml: no such config file"),
                        (["--sequences", str(tmp_path / "empty.json")], "0 tokens are not")):
        r = run_python(["-m", "orchard.cli.train", "--output", str(tmp_path / "out")] + argv)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("orchard-train: error: "), \
            r.stderr
        assert words in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not OPENCL_IDS, reason="no OpenCL device")
def test_build_options_opencl_refuses_are_one_line():
    # OpenCL checks ORCHARD_CL_OPTIONS only when it builds a program, in the middle of a run
    r = run_python(["-m", "orchard.cli.bench", "--devices", OPENCL_IDS[0], "--quick",
                    "--dtypes", "float32"], ORCHARD_CL_OPTIONS="-cl-nonsense")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        "orchard-bench: error: environment variable ORCHARD_CL_OPTIONS='-cl-nonsense': OpenCL "
        "refused these build options (flash_attn_fwd() on %s: clBuildProgram failed: "
        "CL_INVALID_BUILD_OPTIONS (-43))" % OPENCL_IDS[0]], r.stderr[-2000:]


def test_verbose_or_orchard_debug_show_the_traceback():
    argv = ["-m", "orchard.cli.devices", "--config", "missing.yaml"]
    for r in (run_python(argv + ["--verbose"]), run_python(argv, ORCHARD_DEBUG="1")):
        assert r.returncode == 2     # a script's caller tells bad input by it either way
        assert "Traceback" in r.stderr and "ConfigError: missing.yaml: no such config file" \
            in r.stderr


def test_a_new_run_does_not_replace_a_checkpoint(files, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"a run of many steps")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    r = run_cases([["train", ["--config", files["config"], "--sequences", files["sequences"],
                              "--device", "cpu", "--output", str(out)], {}]])[0]
    assert r["code"] == 2
    assert r["stderr"].splitlines() == [
        "orchard-train: error: argument --output: already holds a checkpoint (%s); continue "
        "it with --resume %s, or pass --overwrite to replace it, or choose another folder "
        "(got %r)" % (out / "checkpoint.pt", out, str(out))]
    assert (out / "checkpoint.pt").read_bytes() == b"a run of many steps"
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (out / "checkpoint.pt").unlink()    # metrics alone: a run that never saved, or the user's
    r = run_cases([["train", ["--config", files["config"], "--sequences", files["sequences"],
                              "--device", "cpu", "--output", str(out)], {}]])[0]
    assert r["code"] == 2 and "already holds the metrics" in r["stderr"], r
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_overwrite_clears_the_previous_run_as_the_new_one_starts(files, tmp_path):
    """A run that takes a folder removes the temporary files a killed run's writes left
    (orchard.atomic), and with --overwrite the previous run's checkpoint and metrics, before
    its first step: killed before its first checkpoint, it leaves no other run's checkpoint
    beside its metrics. The folder's other files stay; --resume of the folder's own run keeps
    its checkpoint."""
    import argparse
    from orchard.cli.train import take_output

    def folder(name):
        out = tmp_path / name
        out.mkdir()
        for f in ("checkpoint.pt", "metrics.jsonl", ".checkpoint.pt.0123abcd.tmp",
                  ".metrics.jsonl.4567cdef.tmp", "notes.txt", ".other.tmp"):
            (out / f).write_bytes(b"old")
        return out

    stale = {".checkpoint.pt.0123abcd.tmp", ".metrics.jsonl.4567cdef.tmp"}
    run_files = {"checkpoint.pt", "metrics.jsonl"}
    everything = stale | run_files | {"notes.txt", ".other.tmp"}
    for overwrite, resume, gone in ((False, False, stale), (True, False, stale | run_files),
                                    (True, True, stale)):
        out = folder("%s_%s" % (overwrite, resume))
        args = argparse.Namespace(output=str(out), overwrite=overwrite,
                                  resume=str(out) if resume else None)
        take_output(args, held=False)   # another host's run may be writing: temporaries stay
        assert set(os.listdir(out)) == everything - (gone - stale), (overwrite, resume)
        take_output(args, held=True)
        assert set(os.listdir(out)) == everything - gone, (overwrite, resume)
    out = folder("run")
    r = run_cases([["train", ["--config", files["config"], "--sequences", files["sequences"],
                              "--device", "cpu", "--output", str(out), "--overwrite",
                              "--max-steps", "1"], {}]])[0]
    assert r["code"] == 0, r
    assert set(os.listdir(out)) == run_files | {"notes.txt", ".other.tmp"}
    from orchard.checkpoint import load_checkpoint
    assert load_checkpoint(str(out))["step"] == 1
    # a run that trains no step (resumed at its stopping point) removes nothing, --overwrite
    # or not: the folder's run stays as it was
    other = folder("other")
    r = run_cases([["train", ["--resume", str(out), "--output", str(other), "--overwrite",
                              "--max-steps", "1", "--device", "cpu"], {}]])[0]
    assert r["code"] == 0 and "nothing to train" in r["stderr"], r
    assert set(os.listdir(other)) == everything


def test_resuming_on_data_beyond_the_models_vocabulary_names_the_file(files, tmp_path):
    out, wide = tmp_path / "run", tmp_path / "wide.json"
    base = ["--config", files["config"], "--device", "cpu", "--max-steps", "1"]
    r = run_cases([["train", base + ["--sequences", files["sequences"], "--output", str(out)],
                    {}]])[0]
    assert r["code"] == 0, r
    vocab = json.load(open(files["sequences"]))["vocab_size"]
    wide.write_text(json.dumps({"vocab_size": vocab + 50,
                                "sequences": [list(range(vocab + 50))] * 4}))
    r = run_cases([["train", ["--resume", str(out), "--sequences", str(wide), "--max-steps",
                              "2", "--device", "cpu"], {}]])[0]
    assert r["code"] == 2 and r["stderr"].splitlines()[-1] == (
        "orchard-train: error: argument --sequences: %s: token ids up to %d, but the model of "
        "the checkpoint %s has a vocabulary of %d" % (wide, vocab + 49, out / "checkpoint.pt",
                                                      vocab)), r



def test_resuming_a_run_whose_metrics_cannot_be_written_is_refused_first(tmp_path, monkeypatch):
    """A run that continues its own appends to metrics.jsonl, --overwrite or not: one this
    user may not write is refused before any step, naming the file (it failed at the first log
    line, naming the folder); resumed into another folder, --overwrite removes it."""
    import argparse
    from orchard.cli import train
    from orchard.cli.args import UsageError
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"a checkpoint")
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    metrics.chmod(0o444)
    if os.access(metrics, os.W_OK):     # root: the bits do not bind it; as a user meets them
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
            not mode & os.W_OK and access(path, mode, **kw) if os.fspath(path) == str(metrics)
            else access(path, mode, **kw)))
    args = argparse.Namespace(output=str(run), output_given=False, overwrite=False,
                              resume=str(run / "checkpoint.pt"))
    for overwrite in (False, True):
        args.overwrite = overwrite
        with pytest.raises(UsageError, match=r"^argument --output: its metrics \(%s\) cannot "
                           r"be written: permission denied" % re.escape(str(metrics))):
            train.check_output(args)
    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoint.pt").write_bytes(b"another run's")
    args.resume = str(other / "checkpoint.pt")
    train.check_output(args)


def test_resuming_into_another_runs_folder_does_not_replace_its_checkpoint(files, tmp_path):
    """--resume A --output B continues A in B: refused where B holds another run's
    checkpoint (as a new run would be), unless --overwrite."""
    for run in ("A", "B"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "checkpoint.pt").write_bytes(b"run " + run.encode())
    r = run_cases([["train", ["--config", files["config"], "--sequences", files["sequences"],
                              "--device", "cpu", "--max-steps", "1", "--output",
                              str(tmp_path / "real")], {}]])[0]
    assert r["code"] == 0, r
    r = run_cases([["train", ["--resume", str(tmp_path / "A"), "--output", str(tmp_path / "B"),
                              "--device", "cpu"], {}]])[0]
    # (the advice is not to continue B's run, which is not the one resumed)
    assert r["code"] == 2 and "argument --output: already holds a checkpoint" in r["stderr"]
    assert "continue it" not in r["stderr"], r
    assert (tmp_path / "B" / "checkpoint.pt").read_bytes() == b"run B"
    # --resume of a copy beside B's checkpoint: --output defaults to B, which is named
    shutil.copy(tmp_path / "real" / "checkpoint.pt", tmp_path / "B" / "backup.pt")
    # ... and of a file beside it that is no checkpoint: refused as that (the advice to pass
    # --output led to that error in a second run)
    (tmp_path / "B" / "notes.txt").write_bytes(b"a note")
    r, note = run_cases([["train", ["--resume", str(tmp_path / "B" / name), "--device", "cpu"],
                          {}] for name in ("backup.pt", "notes.txt")])
    assert r["code"] == 2 and "argument --resume:" in r["stderr"] and (
        "backup.pt is not the checkpoint of its folder" in r["stderr"]), r
    assert "pass --output" in r["stderr"]
    assert note["code"] == 2 and note["stderr"].splitlines()[-1].startswith(
        "orchard-train: error: argument --resume: %s: not a readable orchard checkpoint"
        % (tmp_path / "B" / "notes.txt")), note
    assert (tmp_path / "B" / "checkpoint.pt").read_bytes() == b"run B"


def test_a_folder_another_run_is_writing_to_is_refused(files, tmp_path):
    """Two orchard-train runs on one --output would write their checkpoints and metrics over
    each other's: while one holds the folder (here this process, as a run does), another is
    refused, even with --overwrite, and the folder is left as it is; once it is let go, the
    run goes ahead."""
    from orchard.cli.train import hold_output
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"the running run's")
    argv = ["--config", files["config"], "--sequences", files["sequences"], "--device", "cpu",
            "--output", str(out), "--overwrite", "--max-steps", "1"]
    lock = hold_output(str(tmp_path / "." / "run"))     # the same folder, spelled otherwise
    try:
        r = run_cases([["train", argv, {}]])[0]
    finally:
        lock.release()
    assert r["code"] == 2 and r["stderr"].splitlines() == [
        "orchard-train: error: argument --output: another orchard-train (process %d) is "
        "writing to it; wait for that run to end, or choose another folder (got %r)"
        % (os.getpid(), str(out))], r
    assert (out / "checkpoint.pt").read_bytes() == b"the running run's"
    assert not os.path.exists(lock.path)    # let go, its file is gone: they piled up, one a run
    r = run_cases([["train", argv, {}]])[0]
    assert r["code"] == 0, r
    assert not os.path.exists(lock.path)


def test_help_gives_each_default_once_in_sentences_with_examples():
    results = run_cases([[module, ["--help"], {}] for module in SCRIPTS])
    for module, r in zip(SCRIPTS, results):
        text = r["stdout"]
        assert r["code"] == 0 and text.startswith("usage: orchard-%s" % module), r
        assert "examples:\n  " in text and "\n  orchard-%s" % module in text, module
        assert "(default:" not in text and "None" not in text, module
        options = text.split("options:")[1].split("examples:")[0]
        for entry in options.split("\n  -")[1:]:
            help_text = " ".join(entry.split())
            assert help_text.count("Default") <= 1, (module, help_text)
            # a sentence: it ends with a full stop (argparse's own -h line aside)
            assert help_text.endswith(".") or "show this help" in help_text, (module, help_text)


# A child whose files may not grow past 300 bytes: its writes fail with EFBIG (Python ignores
# SIGXFSZ), as a full disk's would with ENOSPC, after every check before the work has passed.
SMALL_FILES = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
               "(300, 300)); sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], "
               "run_name='__main__')")


def test_a_write_that_fails_is_one_line_naming_the_argument(files, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text " * 200)
    config, sequences = files["config"], files["sequences"]
    for script, argv, argument, output in (
            ("prepare", [str(tmp_path / "src"), "-o", str(tmp_path / "t.json")], "--output",
             tmp_path / "t.json"),
            ("train", ["--config", config, "--sequences", sequences, "--output",
                       str(tmp_path / "run"), "--device", "cpu", "--max-steps", "2"],
             "--output", tmp_path / "run" / "checkpoint.pt")):
        r = run_python(["-c", SMALL_FILES, "orchard.cli." + script] + argv)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.splitlines()[-1].startswith(
            "orchard-%s: error: argument %s: cannot write " % (script, argument)), r.stderr
        assert "File too large" in r.stderr and "Traceback" not in r.stderr
        assert not output.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("script, argv", [
    ("devices", []),
    ("prepare", ["SRC", "-o", "OUT", "--json"]),
])
def test_a_stdout_that_cannot_be_written_is_one_line(script, argv, tmp_path):
    """stdout on a full disk (/dev/full): one line naming it, status 1 (a traceback before:
    only a closed pipe was handled)."""
    import subprocess
    import sys
    from conftest import subprocess_env
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text\n")
    argv = [str(tmp_path / "src") if a == "SRC" else str(tmp_path / "t.json") if a == "OUT"
            else a for a in argv]
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "orchard.cli." + script] + argv, stdout=full,
                           stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                           cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == ("orchard-%s: error: cannot write to standard output: "
                                         "No space left on device" % script), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("script, argv", [
    ("devices", []),
    ("prepare", ["SRC", "-o", "OUT", "--json"]),
])
def test_a_closed_stdout_is_one_line(script, argv, tmp_path):
    """Started with stdout closed (`>&-`, which Python gives as sys.stdout None): one line,
    status 1, as a stdout that cannot be written (orchard-devices printed nothing and
    exited 0; orchard-generate's sample ended in an AttributeError's traceback)."""
    import subprocess
    import sys
    from conftest import subprocess_env
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text\n")
    argv = [str(tmp_path / "src") if a == "SRC" else str(tmp_path / "t.json") if a == "OUT"
            else a for a in argv]
    r = subprocess.run([sys.executable, "-m", "orchard.cli." + script] + argv,
                       preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True,
                       env=subprocess_env(), cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[-1] == ("orchard-%s: error: cannot write to standard output: "
                                         "Bad file descriptor" % script), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("stderr", ["closed", "reader gone"])
def test_a_stderr_that_cannot_be_written_loses_only_the_notes(files, stderr, tmp_path):
    """stderr carries notes, progress and errors, none of a script's results: closed (`2>&-`)
    or with its reader gone (`2>&1 >out | true`), the work is done and written (a closed one
    had ended orchard-train and orchard-prepare with status 1 and nothing written, and put
    orchard-generate's note on stdout; a broken pipe there was taken for stdout's, and
    orchard-prepare dropped its output)."""
    import subprocess
    import sys
    from conftest import subprocess_env
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text " * 200)
    run = tmp_path / "run"
    for script, argv in (
            ("prepare", [str(tmp_path / "src"), "-o", str(tmp_path / "t.json")]),
            ("train", ["--config", files["config"], "--sequences", files["sequences"],
                       "--output", str(run), "--device", "cpu", "--max-steps", "2"]),
            ("generate", ["--checkpoint", str(run), "--prompt", "te", "--max-new-tokens",
                          "3", "--seed", "1"])):
        read, write = os.pipe()
        os.close(read)
        try:
            r = subprocess.run(
                [sys.executable, "-m", "orchard.cli." + script] + argv,
                stdout=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT,
                timeout=120, **(dict(preexec_fn=lambda: os.close(2)) if stderr == "closed"
                                else dict(stderr=write)))
        finally:
            os.close(write)
        assert r.returncode == 0, (script, r.stdout)
        if script == "prepare":
            assert (tmp_path / "t.json").exists()
            assert r.stdout.startswith("wrote 1 sequence(s)"), r.stdout
        elif script == "train":
            assert (run / "checkpoint.pt").exists()
        else:
            assert r.stdout.startswith("te") and "checkpoint of step" not in r.stdout, r.stdout
        (tmp_path / "t.json").unlink(missing_ok=True)


def test_a_second_ctrl_c_while_a_script_exits_is_ignored():
    """After "interrupted" the script exits; a second Ctrl-C then had landed in torch's exit
    handlers ("Exception ignored in atexit callback", a traceback)."""
    script = "\n".join([
        "import os, signal, sys",
        "from orchard.cli.args import console_script",
        "@console_script('orchard-x', uses_devices=False)",
        "def main(argv):",
        "    raise KeyboardInterrupt",
        "code = main()",
        "os.kill(os.getpid(), signal.SIGINT)",
        "sys.exit(code)"])
    result = run_python(["-c", script])
    assert result.returncode == 130 and result.stderr == "orchard-x: interrupted\n", result
