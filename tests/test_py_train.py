"""orchard-train end to end: falling loss, metrics, the validation split, resume, the
out-of-memory policy, crash-safe checkpoints, data parallelism, and --help of every command."""
import json
import logging
import math
import os
import pickle
import re
import shlex
import signal
import stat
import subprocess
import sys
import time

import orchard_ops
import pytest

torch = pytest.importorskip("torch")

from orchard.cli import train  # noqa: E402
from orchard.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from orchard.config import load_config  # noqa: E402
from orchard.data import (evaluation_windows, load_sequences, split_validation,  # noqa: E402
                          token_chunks)
from orchard.device_backend import get_device_backend  # noqa: E402
from orchard.trainer import Trainer  # noqa: E402
from test_py_support import (REPO_ROOT, TINY_CONFIG, fail_first_forward,  # noqa: E402
                             read_metrics, run_python, subprocess_env,
                             write_tiny_run_files)


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    return write_tiny_run_files(str(tmp_path_factory.mktemp("data")))


def train_cli(run_files, out, *extra):
    config, sequences = run_files
    return train.main(["--config", config, "--sequences", sequences, "--output", str(out),
                       "--device", "cpu"] + [str(e) for e in extra])


def final_parameters(out):
    return load_checkpoint(str(out))["model"]


def test_loss_falls_and_metrics_are_written(run_files, tmp_path):
    assert train_cli(run_files, tmp_path, "--max-steps", 30) == 0
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert set(metrics[0]) >= {"step", "epoch", "loss", "lr", "tokens_per_s", "device",
                               "micro_batch"}
    assert metrics[0]["device"] == "cpu" and metrics[0]["tokens_per_s"] > 0
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    state = load_checkpoint(str(tmp_path / "checkpoint.pt"))
    assert state["step"] == 30 and set(state["rng"]) == {"torch", "python", "torch_ranks"}
    assert len(state["rng"]["torch_ranks"]) == 1     # one process: its own
    assert state["data"]["byte_level"] is True and state["config"]["model"]["n_layer"] == 2


def test_metrics_are_written_whole_once_then_appended(run_files, tmp_path, monkeypatch):
    """metrics.jsonl is written whole at a run's first log line (and as of a resumed
    checkpoint), then a line is appended per log step: rewriting it whole at every line had
    made a long run's logging quadratic."""
    import orchard.trainer
    whole, real = [], orchard.trainer.write_atomically
    monkeypatch.setattr(orchard.trainer, "write_atomically",
                        lambda path, write: (whole.append(os.path.basename(path)),
                                             real(path, write))[1])
    assert train_cli(run_files, tmp_path, "--max-steps", 30) == 0     # log_interval 1
    assert whole.count("metrics.jsonl") == 1
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 31))
    whole.clear()
    assert train_cli(run_files, tmp_path, "--resume", tmp_path, "--max-steps", 33) == 0
    assert whole.count("metrics.jsonl") == 1
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 34))


def test_validation_split_is_the_end_of_the_data():
    chunks = torch.arange(200).view(100, 2)
    train_part, val = split_validation(chunks, 0.05)
    assert torch.equal(train_part, chunks[:95]) and torch.equal(val, chunks[95:])
    train_part, val = split_validation(chunks, 0.0)
    assert torch.equal(train_part, chunks) and len(val) == 0
    assert len(split_validation(chunks[:10], 0.05)[1]) == 0     # under one window: none


def test_evaluation_windows_are_spread_over_the_held_out_ones():
    val = torch.arange(20).view(10, 2)
    assert torch.equal(evaluation_windows(val, 10), val)
    assert torch.equal(evaluation_windows(val, 50), val)
    assert evaluation_windows(val, 4)[:, 0].tolist() == [0, 4, 10, 14]    # windows 0, 2, 5, 7
    assert evaluation_windows(val, 1)[:, 0].tolist() == [0]


def train_with(run_files, tmp_path, caplog, training, *extra):
    """orchard-train on the tiny config with these training keys changed, logging at INFO
    into caplog; returns the output folder."""
    import yaml

    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["training"].update(training)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="orchard"):
        assert train.main(["--config", str(config), "--sequences", run_files[1], "--output",
                           str(out), "--device", "cpu"] + list(extra)) == 0
    return out


def test_validation_loss_is_measured_periodically(run_files, tmp_path, caplog):
    out = train_with(run_files, tmp_path, caplog,
                     dict(eval_interval=4, val_fraction=0.1, eval_sequences=3),
                     "--max-steps", "10")
    metrics = read_metrics(out)
    val = {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}
    assert sorted(val) == [4, 8, 10]         # every eval_interval steps and at the end
    assert val[10] < val[4]
    assert "held out for validation" in caplog.text and "val loss %.4f" % val[8] in caplog.text
    assert "(3 of them, spread evenly, at each validation" in caplog.text


def test_a_diverged_run_writes_strict_json_and_uneven_micro_batches_are_named(
        run_files, tmp_path, caplog):
    out = train_with(run_files, tmp_path, caplog,
                     dict(learning_rate=1e30, min_lr=1e29, warmup_steps=0),
                     "--max-steps", "4", "--micro-batch", "3")
    assert "the run has diverged" in caplog.text
    # batch 8 as 3 + 3 + 2: "micro-batch 3 x 3" alone would read as 9
    assert "batch 8 = 1 process(es) x micro-batch 3 x 3 accumulation (the last of 2)" \
        in caplog.text

    def refuse(token):
        raise ValueError("not JSON: %s" % token)

    with open(out / "metrics.jsonl") as f:
        metrics = [json.loads(line, parse_constant=refuse) for line in f]
    assert metrics[-1]["loss"] is None and metrics[-1]["step"] == 4


def test_a_validation_loss_that_overflows_is_a_diverged_run(run_files, tmp_path, caplog,
                                                           monkeypatch):
    """Weights can overflow on held-out sequences while the training loss is still finite."""
    monkeypatch.setattr(Trainer, "evaluate", lambda self: math.inf)
    train_with(run_files, tmp_path, caplog, dict(eval_interval=2, val_fraction=0.1),
               "--max-steps", "4")
    assert caplog.text.count("the run has diverged") == 1
    assert "val loss inf at step 2: the run has diverged" in caplog.text


def interrupted_run(run_files, out, monkeypatch, step, *extra, sig=signal.SIGINT):
    """A run that gets Ctrl-C (or sig) during optimizer step `step`; returns its exit status."""
    train_step = Trainer.train_step

    def ctrl_c_in_step(self, *args):
        if self.step == step - 1:
            os.kill(os.getpid(), sig)
        return train_step(self, *args)

    monkeypatch.setattr(Trainer, "train_step", ctrl_c_in_step)
    return train_cli(run_files, out, *extra)


def test_overwrite_stopped_before_its_first_log_line_keeps_no_old_metrics(run_files, tmp_path,
                                                                           monkeypatch):
    import yaml

    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 2) == 0
    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["training"]["log_interval"] = 10
    config = tmp_path / "quiet.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert interrupted_run((str(config), run_files[1]), out, monkeypatch, 2, "--overwrite",
                           "--max-steps", 8) == 130
    assert load_checkpoint(str(out))["metrics"] == [] and read_metrics(out) == []


def test_a_ctrl_c_the_process_ignores_stays_ignored(run_files, tmp_path, monkeypatch):
    """A background job of a shell starts with Ctrl-C ignored: the run goes on to its end
    (its own handler had stopped it at the next step)."""
    out = tmp_path / "run"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert interrupted_run(run_files, out, monkeypatch, 2, "--max-steps", 4) == 0
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert load_checkpoint(str(out))["step"] == 4


def test_sigterm_saves_a_checkpoint_and_exits_143(run_files, tmp_path, monkeypatch):
    """A scheduler's SIGTERM stops the run as Ctrl-C does, with the status a shell gives a
    process it ended: 128 + 15 (it was 130)."""
    out = tmp_path / "run"
    assert interrupted_run(run_files, out, monkeypatch, 3, "--max-steps", 8,
                           sig=signal.SIGTERM) == 143
    assert load_checkpoint(str(out))["step"] == 3




def test_a_metrics_fifo_gets_every_line(run_files, tmp_path):
    """metrics.jsonl as a FIFO (written in place) takes every log line (the second failed:
    fsync of a pipe is EINVAL, "cannot write ...: Invalid argument")."""
    out = tmp_path / "run"
    out.mkdir()
    fifo = out / "metrics.jsonl"
    os.mkfifo(fifo)
    # held open for reading and writing here: the run's opens never wait, and its lines stay
    # in the pipe until read
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        assert train_cli(run_files, out, "--max-steps", 3, "--overwrite") == 0
        lines = os.read(fd, 1 << 20).splitlines()
    finally:
        os.close(fd)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_sigterm_ends_a_wait_for_the_reader_of_a_metrics_fifo(run_files, tmp_path, monkeypatch,
                                                             caplog):
    """metrics.jsonl as a FIFO that no process reads holds the run in open() at its first log
    line: SIGTERM, which has no second signal to end what the first left waiting, ends the
    wait there, and the run stops with its checkpoint (it waited for ever)."""
    import threading

    from orchard import trainer as trainer_module

    out = tmp_path / "run"
    out.mkdir()
    fifo = out / "metrics.jsonl"
    os.mkfifo(fifo)
    found = trainer_module.written_in_place

    def signalled_once_waiting(path):
        waits = found(path)
        if waits:   # (the signal lands in open(), or just before it: handled alike)
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return waits

    # a reader after a minute, so that a failure is a failed test, not a hung one
    rescue = threading.Timer(60, lambda: open(fifo, "rb").read())
    rescue.daemon = True
    monkeypatch.setattr(trainer_module, "written_in_place", signalled_once_waiting)
    start = time.monotonic()
    rescue.start()
    try:
        assert train_cli(run_files, out, "--max-steps", 8, "--overwrite") == 143
    finally:
        rescue.cancel()
    assert time.monotonic() - start < 50
    assert load_checkpoint(str(out))["step"] == 1 and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert "stopped while writing to %s, a FIFO or device, which waits for its reader" % fifo \
        in caplog.text


def test_interrupted_run_resumes_exactly(run_files, tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_cli(run_files, straight, "--max-steps", 8) == 0
    assert interrupted_run(run_files, resumed, monkeypatch, 5, "--max-steps", 8) == 130
    monkeypatch.undo()
    assert load_checkpoint(str(resumed))["step"] == 5  # the step in flight completes
    assert train_cli(run_files, resumed, "--max-steps", 8, "--resume", resumed) == 0
    assert [m["step"] for m in read_metrics(resumed)] == list(range(1, 9))
    assert [m["loss"] for m in read_metrics(resumed)] == [m["loss"] for m in
                                                          read_metrics(straight)]
    a, b = final_parameters(straight), final_parameters(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_in_the_last_step_completes_the_run(run_files, tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert interrupted_run(run_files, out, monkeypatch, 3, "--max-steps", 3) == 0
    assert load_checkpoint(str(out))["step"] == 3


def test_tokens_per_s_leaves_out_the_checkpoints_writes(run_files, tmp_path, monkeypatch):
    """On a clock where a step takes 1 s and a checkpoint's write 100 s, every metrics line
    reads one step's tokens a second (the line after a periodic checkpoint read 1/101 of it)."""
    import types

    from orchard import trainer as trainer_module

    now = [0.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    train_step, save = Trainer.train_step, trainer_module.save_checkpoint

    def timed_step(self, *args):
        now[0] += 1
        return train_step(self, *args)

    def timed_save(*args):
        now[0] += 100
        return save(*args)

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(trainer_module, "save_checkpoint", timed_save)
    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 5) == 0     # checkpoints after step 3, 5
    tokens = TINY_CONFIG["training"]["batch_size"] * TINY_CONFIG["model"]["context"]
    assert [m["tokens_per_s"] for m in read_metrics(out)] == [tokens] * 5


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_last_checkpoint_is_written_waits_for_it(run_files, tmp_path,
                                                                    monkeypatch, sig):
    """A Ctrl-C (or SIGTERM) while the run's last checkpoint is written is held until it is
    written, as one while a periodic checkpoint is: the handlers were put back first, the write
    was interrupted and every step since the last periodic checkpoint lost (here the whole run,
    with no checkpoint at all)."""
    from orchard import checkpoint as ckpt

    save = ckpt.save_checkpoint

    def signalled_save(state, path):
        os.kill(os.getpid(), sig)     # delivered at the write's next Python bytecode
        return save(state, path)

    class Signalled(Exception):
        pass

    def raise_signalled(signum, frame):    # what the run found in place, and put back
        raise Signalled(signum)

    monkeypatch.setattr("orchard.trainer.save_checkpoint", signalled_save)
    out = tmp_path / "run"
    previous = signal.signal(sig, raise_signalled)
    try:
        assert train_cli(run_files, out, "--max-steps", 2) == 0    # the run was complete
    finally:
        signal.signal(sig, previous)
    assert load_checkpoint(str(out))["step"] == 2
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_an_output_folder_named_by_bytes_that_are_not_utf8(run_files, tmp_path):
    """Linux names are bytes: a folder whose name is not UTF-8 takes a run (its run lock's
    key was made from the name encoded as UTF-8: UnicodeEncodeError, a traceback)."""
    out = tmp_path / os.fsdecode(b"bad\xff")
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    assert load_checkpoint(str(out))["step"] == 1


def test_an_interrupted_run_says_where_it_stopped_even_quiet(run_files, tmp_path, monkeypatch,
                                                             caplog):
    """The checkpoint and the resume command of an interrupted run are warnings, which --quiet
    keeps (as info lines, a quiet run stopped by Ctrl-C or SIGTERM said nothing)."""
    caplog.set_level(logging.INFO, logger="orchard")
    assert interrupted_run(run_files, tmp_path / "run", monkeypatch, 2, "--max-steps", 5,
                           "--quiet") == 130
    said = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records}
    assert said["interrupted"] == said["resume with"] == logging.WARNING, said


def test_resumed_loss_curve_between_log_lines_is_the_same(run_files, tmp_path, monkeypatch):
    """Interrupted between two log lines (log_interval 3, stopped after step 5), the resumed
    run's step-6 line averages steps 4-6 as the uninterrupted run's does, bit for bit."""
    import yaml

    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["training"]["log_interval"] = 3
    config = tmp_path / "log3.yaml"
    config.write_text(yaml.safe_dump(cfg))
    files = (str(config), run_files[1])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_cli(files, straight, "--max-steps", 9) == 0
    assert interrupted_run(files, resumed, monkeypatch, 5, "--max-steps", 9) == 130
    monkeypatch.undo()
    assert load_checkpoint(str(resumed))["pending_losses"] != []
    assert train_cli(files, resumed, "--resume", resumed) == 0
    want = read_metrics(straight)
    assert [m["step"] for m in want] == [3, 6, 9]
    got = [m for m in read_metrics(resumed) if m["step"] in (3, 6, 9)]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]


def test_ctrl_c_prints_the_command_that_resumes_the_same_schedule(run_files, tmp_path,
                                                                   monkeypatch, caplog):
    """The printed command, run as printed, continues the learning-rate schedule and the
    stopping point of the interrupted run (given neither --max-steps nor --config)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_cli(run_files, straight, "--max-steps", 10) == 0
    caplog.set_level(logging.INFO, logger="orchard")
    assert interrupted_run(run_files, resumed, monkeypatch, 4, "--max-steps", 10) == 130
    monkeypatch.undo()
    hint = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume with: ")]
    words = shlex.split(hint[-1][len("resume with: "):])
    assert words == ["orchard-train", "--resume", str(resumed), "--output", str(resumed),
                     "--sequences", run_files[1], "--device", "cpu"]
    assert train.main(words[1:]) == 0
    got, want = read_metrics(resumed), read_metrics(straight)
    assert [m["step"] for m in got] == list(range(1, 11))
    assert [m["lr"] for m in got] == [m["lr"] for m in want]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]


@pytest.mark.skipif(not any(d["id"] == "opencl:0" and not d["fp16"]
                            for d in orchard_ops.devices()),
                    reason="needs an OpenCL device without fp16 (PoCL's CPU device)")
def test_fp16_loss_scale_survives_a_resume_on_a_device_without_fp16(run_files, tmp_path):
    """Resumed on a device that trains the fp16 run in fp32, the checkpoint it writes keeps the
    loss scale it was given (it had saved an empty one, so that a later resume in fp16 began
    scaling from scratch), and a resume in fp16 again picks it up."""
    assert train_cli(run_files, tmp_path, "--fp16", "--max-steps", 3) == 0
    scale = load_checkpoint(str(tmp_path))["scaler"]
    assert scale and scale["scale"] > 0
    assert train_cli(run_files, tmp_path, "--resume", tmp_path, "--max-steps", 5,
                     "--device", "opencl:0") == 0
    state = load_checkpoint(str(tmp_path))
    assert state["step"] == 5 and state["scaler"] == scale
    assert train_cli(run_files, tmp_path, "--resume", tmp_path, "--max-steps", 6) == 0
    got = load_checkpoint(str(tmp_path))["scaler"]     # one more step: grown, or halved
    assert (got["scale"], got["_growth_tracker"]) in (
        (scale["scale"], scale["_growth_tracker"] + 1), (scale["scale"] / 2, 0))


def test_resume_command_keeps_paths_that_start_with_a_dash():
    """`--output=--` was printed back as `--resume -- --output --`, which does not parse."""
    args = train.parse_args(["--output=-run", "--sequences=-data.json", "--device", "cpu"])
    words = shlex.split(train.resume_command(args, distributed=False))
    assert words == ["orchard-train", "--resume", "./-run", "--output", "./-run",
                     "--sequences", "./-data.json", "--device", "cpu"]
    again = train.parse_args(words[1:])
    assert (again.resume, again.output, again.sequences) == ("./-run", "./-run", "./-data.json")


def test_a_run_that_trains_no_step_writes_nothing(run_files, tmp_path):
    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 4) == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    # resumed at step 4 with a stopping point of 2: no step to train
    assert train_cli(run_files, out, "--resume", out, "--max-steps", 2) == 0
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


@pytest.mark.parametrize("exc", [
    MemoryError("flash_attn_fwd() on opencl:0: clCreateBuffer failed"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")])
def test_out_of_memory_at_micro_batch_1_is_one_line(run_files, tmp_path, capsys, monkeypatch,
                                                     exc):
    """Out of memory where the micro-batch cannot halve (orchard's, or PyTorch's CPU
    allocator's RuntimeError): one error line, status 1 (an 88-line traceback before)."""
    from orchard.trainer import Trainer as Trained

    def fail(self, *args):
        raise exc
    monkeypatch.setattr(Trained, "train_step", fail)
    assert train_cli(run_files, tmp_path / "run", "--max-steps", 1) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "orchard-train: error: out of memory: %s" % exc, err
    assert "Traceback" not in "\n".join(err)


def make_trainer(run_files, out, micro_batch):
    config, sequences = run_files
    backend = get_device_backend("cpu")
    cfg, _ = backend.adapt_config(load_config(config))
    cfg["training"]["micro_batch"] = micro_batch
    chunks = token_chunks(load_sequences(sequences)[0], cfg["model"]["context"])
    return Trainer(cfg, backend, chunks, str(out))


def test_out_of_memory_halves_the_micro_batch_and_retries(run_files, tmp_path, caplog):
    trainer = make_trainer(run_files, tmp_path, micro_batch=8)
    calls = fail_first_forward(trainer.model)
    with caplog.at_level(logging.WARNING, logger="orchard"):
        assert trainer.run(max_steps=2) == 0
    assert calls == [8, 4, 4, 4, 4]  # failed at 8, then the step retried as 2 x 4
    assert trainer.micro_batch == 4 and trainer.accumulation_steps() == 2
    assert "out of memory" in caplog.text and "micro-batch 4" in caplog.text
    assert [m["micro_batch"] for m in read_metrics(tmp_path)] == [4, 4]
    assert load_checkpoint(str(tmp_path))["step"] == 2


def test_a_model_whose_attention_orchard_cannot_compute_is_said_after_its_first_step(
        run_files, tmp_path, caplog):
    """A head dimension past 256 sends every call to torch: said after the first step, not only
    in the run's last line; a model orchard computes gets no such warning."""
    config, sequences = run_files
    backend = get_device_backend("cpu")
    for heads, warned in ((1, True), (4, False)):
        cfg, _ = backend.adapt_config(load_config(config))
        cfg["model"].update(n_embd=288, n_head=heads, n_kv_head=heads)
        chunks = token_chunks(load_sequences(sequences)[0], cfg["model"]["context"])
        trainer = Trainer(cfg, backend, chunks, str(tmp_path / str(heads)))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orchard"):
            assert trainer.run(max_steps=2) == 0
        said = [r.getMessage() for r in caplog.records if "computed none" in r.getMessage()]
        assert said == (["orchard computed none of the first step's attention calls (%d): "
                         "torch's scaled_dot_product_attention did them (head dimension)"
                         % cfg["model"]["n_layer"]] if warned else [])


def test_other_errors_are_not_retried(run_files, tmp_path):
    trainer = make_trainer(run_files, tmp_path, micro_batch=8)
    trainer.model.forward = lambda x, y=None: (_ for _ in ()).throw(ValueError("bug"))
    with pytest.raises(ValueError, match="bug"):
        trainer.run(max_steps=1)
    assert trainer.micro_batch == 8


def test_a_config_not_adapted_to_the_device_is_a_clear_error(tmp_path):
    from orchard.config import ConfigError, default_config

    with pytest.raises(ConfigError, match=r"adapt_config\(cfg\)\); still 'auto': "
                                          r"training.micro_batch, "):
        Trainer(default_config(), get_device_backend("cpu"), [[1] * 257] * 64, str(tmp_path))


KILL_MID_CHECKPOINT = r"""
import os, signal, sys, torch
from orchard import checkpoint
checkpoint.save_checkpoint({"step": 1, "w": torch.ones(1000)}, sys.argv[1])
real_save = torch.save
def save_then_die(obj, f):
    real_save(obj, f)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # after the data, before fsync and rename
torch.save = save_then_die
checkpoint.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, sys.argv[1])
"""


def test_writer_killed_mid_checkpoint_leaves_the_previous_one(tmp_path):
    path = tmp_path / "checkpoint.pt"
    result = run_python(["-c", KILL_MID_CHECKPOINT, str(path)])
    assert result.returncode == -signal.SIGKILL, result.stderr
    state = torch.load(str(path), weights_only=True)    # the file as written, whole
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(1000))
    assert any(name.endswith(".tmp") for name in os.listdir(tmp_path))  # the torn write


def test_torchrun_two_processes_agree(run_files, tmp_path):
    config, sequences = run_files
    result = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "orchard.cli.train", "--config", config,
                         "--sequences", sequences, "--output", str(tmp_path), "--max-steps",
                         "4", "--device", "cpu"], timeout=120, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"parameters identical on all 2 ranks", result.stderr), result.stderr
    assert "batch 8 = 2 process(es) x micro-batch 4" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "metrics.jsonl"]
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4]
    # a folder another run is writing to: rank 0 is refused, and every rank ends (none waits
    # in a collective for it)
    from orchard.cli.train import hold_output
    lock = hold_output(str(tmp_path))
    try:
        result = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             "2", "-m", "orchard.cli.train", "--config", config, "--sequences",
                             sequences, "--output", str(tmp_path), "--overwrite", "--max-steps",
                             "4", "--device", "cpu"], timeout=120, OMP_NUM_THREADS="1")
    finally:
        lock.release()
    assert result.returncode != 0
    assert result.stderr.count("another orchard-train (process %d)" % os.getpid()) == 2
    # a batch the processes do not divide: the error names the config it came from
    import yaml
    odd = tmp_path / "odd_batch.yaml"
    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["training"]["batch_size"] = 3
    odd.write_text(yaml.safe_dump(cfg))
    result = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "orchard.cli.train", "--config", str(odd), "--sequences",
                         sequences, "--output", str(tmp_path / "odd"), "--max-steps", "1",
                         "--device", "cpu"], timeout=120, OMP_NUM_THREADS="1")
    assert result.returncode != 0
    assert result.stderr.count("orchard-train: error: argument --config: %s: training.batch_size "
                               "must be a multiple of the 2 processes" % odd) == 2, result.stderr


DDP_STOP_AT = r"""
import os, signal, sys
from orchard.cli import train
from orchard.trainer import Trainer
stop_at, train_step = int(os.environ["STOP_AT"]), Trainer.train_step
def ctrl_c_in_step(self, *args):
    if self.step == stop_at - 1:
        os.kill(os.getpid(), signal.SIGINT)
    return train_step(self, *args)
Trainer.train_step = ctrl_c_in_step
sys.exit(train.main(sys.argv[1:]))
"""


def test_torchrun_with_dropout_resumes_exactly_and_validates_fewer_windows_than_ranks(
        run_files, tmp_path):
    """Rank 1 drew new dropout masks at a resume (its RNG state was not saved), so a resumed
    run parted from an uninterrupted one; and one validation window for two ranks gave rank
    1 an empty batch, whose NaN made the validation loss NaN (and said the run diverged)."""
    import yaml

    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["model"]["dropout"] = 0.1
    cfg["training"].update(eval_sequences=1, eval_interval=2)
    config = tmp_path / "dropout.yaml"
    config.write_text(yaml.safe_dump(cfg))
    driver = tmp_path / "driver.py"
    driver.write_text(DDP_STOP_AT)

    def torchrun(out, stop_at, *extra):
        return run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(driver), "--config", str(config), "--sequences",
                           run_files[1], "--output", str(out), "--device", "cpu",
                           "--max-steps", "6"] + list(extra), timeout=180,
                          OMP_NUM_THREADS="1", STOP_AT=str(stop_at))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = torchrun(straight, 0)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "diverged" not in result.stderr
    result = torchrun(resumed, 3)   # (torchrun's own status is 1 for its workers' 130)
    assert "interrupted: checkpoint of step 3 of 6" in result.stderr, result.stderr[-3000:]
    result = torchrun(resumed, 0, "--resume", str(resumed))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(straight)
    assert all(math.isfinite(m["val_loss"]) for m in metrics if "val_loss" in m)
    assert [m["loss"] for m in read_metrics(resumed)] == [m["loss"] for m in metrics]
    a, b = final_parameters(straight), final_parameters(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("module, words", [
    ("orchard.cli.train", ["--config", "--sequences", "--epochs", "--device", "--resume",
                       "--max-steps", "--output", "--seed", "--fp16", "--grad-checkpointing"]),
    ("orchard.cli.generate", ["--checkpoint", "--prompt", "--device", "--max-new-tokens",
                          "--temperature", "--top-k"]),
    ("orchard.cli.devices", ["--json"]),
    ("orchard.cli.prepare", ["SRC_DIR", "--output"]),
    ("orchard.cli.demo", ["--device"]),
    ("orchard.cli.bench", ["--shapes", "--devices", "--json", "--plot", "--train"]),
    ("orchard.cli.tune", ["--device", "--shape", "--candidates"]),
])
def test_help_of_every_command(module, words):
    result = run_python(["-m", module, "--help"])
    assert result.returncode == 0, result.stderr
    for word in words:
        assert word in result.stdout


def test_every_command_is_a_console_script():
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n", f.read(), re.S).group(1)
    names = dict(re.findall(r'^(\S+) = "(\S+)"$', scripts, re.M))
    assert set(names) >= {"orchard-demo", "orchard-train", "orchard-generate",
                          "orchard-devices", "orchard-prepare", "orchard-bench", "orchard-tune"}
    import importlib

    for target in names.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_damaged_checkpoint_contents_are_one_line_errors(run_files, tmp_path, capsys):
    """A checkpoint whose keys are all there but whose contents do not make its model
    (weights of another shape or too few for its config, a model config of another type or
    with no heads, an hf_config that is not JSON or names no transformers model) is one error
    line naming the file and the flag, for orchard-generate and --resume alike."""
    from orchard.cli import generate

    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    state = load_checkpoint(str(out))
    first = next(iter(state["model"]))
    damaged = {"shape": dict(state, model=dict(state["model"], **{first: torch.zeros(3)})),
               "type": dict(state, model_config=dict(state["model_config"], n_layer="x")),
               "json": dict(state, hf_config="{bad"),
               # (past json's recursion limit: --resume's size check had let RecursionError out)
               "deep_json": dict(state, hf_config="[" * 100000 + "]" * 100000),
               "hf_type": dict(state, hf_config='{"model_type": "no-such-model"}'),
               "heads": dict(state, model_config=dict(state["model_config"], n_head=0)),
               "dropout": dict(state, model_config=dict(state["model_config"],
                                                        dropout=float("nan"))),
               # a model of 10**12 layers was built (until the system ran out of memory)
               # before its weights were compared
               "layers": dict(state, model_config=dict(state["model_config"],
                                                       n_layer=10**12)),
               "weights": dict(state, model=[1]),
               # fields edited by hand: each named, never a traceback further on
               "config": dict(state, config=[1]),
               "data": dict(state, data="x"),
               "record": dict(state, metrics=[{"foo": 1}]),
               "no_loss": dict(state, metrics=[{"step": 1, "loss": None}]),
               "no_val_loss": dict(state, metrics=[{"step": 1, "loss": 2.0, "val_loss": None}]),
               "metrics": dict(state, metrics="abc"),
               "seed": dict(state, seed="abc"),
               "schedule": dict(state, schedule_steps=-5)}
    capsys.readouterr()
    for name, bad in damaged.items():
        path = str(tmp_path / (name + ".pt"))
        torch.save(bad, path)
        for script, argv in ((generate, ["--checkpoint", path, "--max-new-tokens", "2"]),
                             (train, ["--resume", path, "--sequences", run_files[1],
                                      "--output", str(tmp_path / ("r_" + name)),
                                      "--device", "cpu"])):
            assert script.main(argv) == 2, (name, script)
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith("orchard-") and path in err[-1], (name, err)
            assert "argument %s: " % argv[0] in err[-1], (name, err)
            assert "Traceback" not in "\n".join(err)
            assert name != "layers" or "values its weights hold" in err[-1], err


def test_an_edited_optimizer_state_is_a_one_line_error(run_files, tmp_path, capsys):
    """torch's load_state_dict checks only how many parameters each group holds: a moment of
    another shape, betas past 1 or a step that is no count had ended --resume's first step in a
    traceback, leaving a metrics.jsonl that then refused a retry in the same --output."""
    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    state = load_checkpoint(str(out))
    opt = state["optimizer"]

    def edited(group=None, **moments):
        first = dict(opt["state"][0], **moments)
        groups = [dict(opt["param_groups"][0], **(group or {}))] + opt["param_groups"][1:]
        return dict(state, optimizer=dict(opt, state={**opt["state"], 0: first},
                                          param_groups=groups))

    damaged = {"shape": (edited(exp_avg=torch.zeros(3)), "exp_avg of shape (3,), torch.float32, for"),
               "betas": (edited({"betas": (2.0, 5.0)}), "betas are (2.0, 5.0)"),
               "lr": (edited({"lr": "x"}), "lr is 'x'"),
               "step": (edited(step=torch.tensor(float("nan"))), "a step count of"),
               "moment": (edited(exp_avg_sq="x"), "exp_avg_sq of str for")}
    capsys.readouterr()
    for name, (bad, why) in damaged.items():
        path = str(tmp_path / (name + ".pt"))
        torch.save(bad, path)
        again = tmp_path / ("r_" + name)
        assert train_cli(run_files, again, "--resume", path) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("orchard-train: error: argument --resume: %s: its "
                                  "optimizer state holds " % path), (name, err)
        assert why in err[-1], (name, err)
        assert not again.exists() or not os.listdir(again), name
    assert train_cli(run_files, tmp_path / "r_shape", "--resume", out, "--max-steps", 2) == 0


def test_a_python_without_its_stdlib_sources_needs_sequences(run_files, tmp_path, capsys,
                                                            monkeypatch):
    """Without --sequences the run trains on the standard library's .py files; a Python that
    ships without them (only .pyc) is one error line saying to pass --sequences, not a
    FileNotFoundError's traceback."""
    import sysconfig

    empty = tmp_path / "lib"
    empty.mkdir()
    (empty / "os.pyc").write_bytes(b"")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(empty)})
    assert train.main(["--config", run_files[0], "--output", str(tmp_path / "out"),
                       "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "orchard-train: error: no .py sources under %s (this Python ships without its "
        "standard library sources); pass --sequences FILE" % empty)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("content", [pickle.dumps({"a": 1}, protocol=4), b"notes\n"],
                         ids=["pickle", "text"])
def test_a_file_that_is_no_zip_archive_is_refused_as_that(tmp_path, content):
    """A pickle or a text file is no torch.save checkpoint: the one-line error says it is not
    the zip archive one is, without torch's warning about a pickle protocol (two more lines on
    stderr) or its KeyError (a text file's)."""
    import warnings

    path = tmp_path / "plain.pt"
    path.write_bytes(content)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=r"not a readable orchard checkpoint \(not a "
                                                  r"zip archive, as torch.save writes"):
            load_checkpoint(str(path))
    assert not said, [str(w.message) for w in said]



def test_a_checkpoint_cut_short_is_said_to_be(run_files, tmp_path):
    """A checkpoint cut short is refused as cut short or damaged, wherever the cut lands
    (torch.load's OSError for one cut late had read "cannot read the checkpoint: Invalid
    argument", as if the file could not be opened)."""
    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    data = (out / "checkpoint.pt").read_bytes()
    for size in (len(data) // 2, len(data) - 10, 100):
        path = tmp_path / "cut.pt"
        path.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"cut.pt: not a readable orchard checkpoint, "
                                                  r"cut short or damaged \(torch.load raised "):
            load_checkpoint(str(path))


def test_a_flipped_bit_is_a_damaged_checkpoint(run_files, tmp_path, capsys):
    """torch.load does not check the CRC-32 of a checkpoint's parts; orchard does, so a bit
    flipped in a weight is an error, not a model that differs unnoticed."""
    from orchard.cli import generate

    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    data = bytearray((out / "checkpoint.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    path = tmp_path / "flipped.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="flipped.pt: damaged: its part .* does not match"):
        load_checkpoint(str(path))
    capsys.readouterr()
    assert generate.main(["--checkpoint", str(path), "--max-new-tokens", "2"]) == 2
    assert "damaged" in capsys.readouterr().err


def test_diverged_checkpoint_is_a_one_line_error_for_generate(run_files, tmp_path, capsys):
    from orchard.cli import generate

    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    state = load_checkpoint(str(out))
    weights = {k: torch.full_like(x, math.nan) if x.is_floating_point() else x
               for k, x in state["model"].items()}    # all: tied weights load last-wins
    path = str(tmp_path / "nan.pt")
    torch.save(dict(state, model=weights), path)
    capsys.readouterr()
    assert generate.main(["--checkpoint", path, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not finite" in err[0] and path in err[0], err
    assert "argument --checkpoint: " in err[0], err


def test_overflowing_weights_are_a_one_line_error_for_generate(run_files, tmp_path, capsys):
    """Weights that are finite but overflow in the forward (a run that diverged before its loss
    turned NaN): no sample of garbage or traceback from torch.multinomial, at any temperature."""
    from orchard.cli import generate

    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 1) == 0
    state = load_checkpoint(str(out))
    weights = {k: x * 1e30 if x.is_floating_point() else x for k, x in state["model"].items()}
    assert all(torch.isfinite(x).all() for x in weights.values() if x.is_floating_point())
    path = str(tmp_path / "huge.pt")
    torch.save(dict(state, model=weights), path)
    capsys.readouterr()
    for temperature in ("0.8", "0"):
        assert generate.main(["--checkpoint", path, "--max-new-tokens", "2",
                              "--temperature", temperature]) == 2
        said = capsys.readouterr()
        err = said.err.strip().splitlines()
        # one line, nothing before it: the training note and the prompt had been printed
        assert len(err) == 1 and said.out == "", (err, said.out)
        assert err[-1].startswith("orchard-generate: error: argument --checkpoint: " + path), err
        assert "logits at token 1 are not finite" in err[-1], err


def test_generate_prompts_that_cannot_be_encoded(run_files, tmp_path, capsys):
    """A model of token ids has no default prompt, and text that is not valid Unicode (a lone
    surrogate that no byte of the command line stands behind) is one error line naming it;
    bytes that are not UTF-8 (surrogate escapes) go to a byte-level model as they are."""
    from orchard.cli import generate

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"vocab_size": 50, "sequences": [[i % 50 for i in range(3000)]]}))
    out = tmp_path / "ids_run"
    assert train.main(["--config", run_files[0], "--sequences", str(ids), "--output", str(out),
                       "--max-steps", "1", "--device", "cpu"]) == 0
    text_run = tmp_path / "text_run"
    assert train_cli(run_files, text_run, "--max-steps", 1) == 0
    capsys.readouterr()
    for run, argv, words in ((out, [], ["--prompt", "token ids", "'17 4 99'"]),
                             # int() reads these, but they are no token ids
                             (out, ["--prompt", "17_0 4"], ["--prompt", "token ids", "'17_0 4'"]),
                             (out, ["--prompt", "\u0663"], ["--prompt", "token ids"]),
                             (text_run, ["--prompt", "ab\ud83d"], ["--prompt", "'ab\\ud83d'"])):
        assert generate.main(["--checkpoint", str(run), "--max-new-tokens", "2"] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    assert generate.main(["--checkpoint", str(out), "--prompt", "1 2", "--max-new-tokens",
                          "2"]) == 0
    assert generate.main(["--checkpoint", str(text_run), "--prompt", "ab\udcff",
                          "--max-new-tokens", "2"]) == 0


def test_max_steps_past_one_epoch_and_large_seeds(run_files, tmp_path, caplog):
    """--max-steps alone trains that many steps over as many epochs as they take (as
    HuggingFace's max_steps); a seed past 1.8e13 (times the order's multiplier past 2^64)
    still runs; a resume on other data says so."""
    trainer = make_trainer(run_files, tmp_path / "a", micro_batch=8)
    steps = trainer.steps_per_epoch
    assert trainer.stopping_point(max_steps=steps + 3) == steps + 3
    assert trainer.stopping_point(epochs=1, max_steps=steps + 3) == steps
    out = tmp_path / "run"
    assert train_cli(run_files, out, "--max-steps", 2, "--seed", 2 ** 63 - 1) == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"sequences": [list(range(200)) * 20]}))
    with caplog.at_level(logging.WARNING, logger="orchard"):
        assert train.main(["--resume", str(out), "--sequences", str(other), "--max-steps", "3",
                           "--device", "cpu"]) == 0
    assert "the checkpoint was trained on %s, this run reads %s" % (run_files[1], other) \
        in caplog.text
    # the data is told by its tokens: the same file by another path is no other data, other
    # tokens in the same file are
    caplog.clear()
    spelled = os.path.join(os.path.dirname(str(other)), ".", "other.json")
    with caplog.at_level(logging.WARNING, logger="orchard"):
        assert train.main(["--resume", str(out), "--sequences", spelled, "--max-steps", "4",
                           "--device", "cpu"]) == 0
    assert "trained on" not in caplog.text
    other.write_text(json.dumps({"sequences": [list(range(100)) * 40]}))
    with caplog.at_level(logging.WARNING, logger="orchard"):
        assert train.main(["--resume", str(out), "--sequences", spelled, "--max-steps", "5",
                           "--device", "cpu"]) == 0
    assert "trained on %s (other tokens then), this run reads %s" % (spelled, spelled) \
        in caplog.text


def test_prepare_reads_regular_files_only_and_not_its_own_output(tmp_path):
    """A FIFO under SRC_DIR had made orchard-prepare wait forever, a link to nothing stopped
    it, and an earlier output written into SRC_DIR was read as text by the next run."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    os.mkfifo(src / "pipe.txt")
    (src / "broken.txt").symlink_to(tmp_path / "nothing")
    out = src / "tokens.json"
    for _ in range(2):
        result = run_python(["-m", "orchard.cli.prepare", str(src), "-o", str(out),
                             "--overwrite", "--json"], timeout=60)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["tokens"] == len("hello\n")


def a_doc_and_a_log(tmp_path):
    """(a source folder of one document, a log file holding a line, the log's inode)"""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.md").write_text("# doc\n")
    log = tmp_path / "log.txt"
    log.write_text("a line before\n")
    return src, log, log.stat().st_ino


DOC_DATA = '{"vocab_size":256,"sequences":[[35,32,100,111,99,10]]}\n'


@pytest.mark.parametrize("mode", ["ab", "wb", "pipe"])
def test_prepare_to_dev_stdout_writes_through_it(tmp_path, mode):
    """-o /dev/stdout where stdout is a file: replaced by a new file, it lost what a shell's
    `>>` appended to and left the `>` file the shell opened empty; the summary went to stdout
    after the data, with no newline between (JSON no longer read)."""
    src, log, inode = a_doc_and_a_log(tmp_path)
    with open(log, mode) if mode != "pipe" else open(os.devnull) as stdout:
        result = subprocess.run(
            [sys.executable, "-m", "orchard.cli.prepare", str(src), "-o", "/dev/stdout",
             "--overwrite", "--json"], stdout=subprocess.PIPE if mode == "pipe" else stdout,
            stderr=subprocess.PIPE, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    data = result.stdout if mode == "pipe" else log.read_text()
    assert log.stat().st_ino == inode
    assert data == ("a line before\n" if mode == "ab" else "") + DOC_DATA
    assert json.loads(result.stderr.splitlines()[-1])["output"] == "/dev/stdout"


def test_prepare_to_dev_stderr_appends_to_its_file(tmp_path):
    """-o /dev/stderr where stderr is appended to a log: written through it (the log was
    replaced by a new file holding only the data)."""
    src, log, inode = a_doc_and_a_log(tmp_path)
    with open(log, "ab") as stderr:
        result = subprocess.run(
            [sys.executable, "-m", "orchard.cli.prepare", str(src), "-o", "/dev/stderr",
             "--overwrite", "--quiet"], stdout=subprocess.PIPE, stderr=stderr, text=True,
            env=subprocess_env(), cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0
    assert log.stat().st_ino == inode
    assert log.read_text() == "a line before\n" + DOC_DATA


def test_prepare_to_dev_null_with_stdout_closed_writes_it(tmp_path):
    """-o /dev/null from a script started with stdout closed: written, status 0 (/dev/null,
    which then holds descriptor 1, was taken for the closed stdout and refused)."""
    src, _, _ = a_doc_and_a_log(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "orchard.cli.prepare", str(src), "-o", "/dev/null",
         "--overwrite", "--quiet"], preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE,
        text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr


def test_an_empty_sequences_file_is_named_once(tmp_path):
    """Its error was wrapped again as "not valid JSON: PATH: the sequences file is empty"."""
    from orchard.data import DataError
    path = tmp_path / "empty.json"
    path.write_text("\n")
    with pytest.raises(DataError) as e:
        load_sequences(str(path))
    assert str(e.value) == "%s: the sequences file is empty" % path


def test_prepare_to_a_closed_stdout_is_an_error(tmp_path):
    """-o /dev/stdout with stdout closed (`>&-`): one line naming the argument, status 2 (the
    data went to /dev/null, and the summary said it was written)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.md").write_text("# doc\n")
    result = subprocess.run(
        [sys.executable, "-m", "orchard.cli.prepare", str(src), "-o", "/dev/stdout",
         "--overwrite"], preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True,
        env=subprocess_env(), cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == ("orchard-prepare: error: argument --output: cannot "
                                              "write '/dev/stdout': Bad file descriptor")


def test_prepare_to_dev_stdout_whose_reader_goes_away_is_quiet(tmp_path):
    """-o /dev/stdout into `| head`: status 1 and no message, as every script's stdout whose
    reader went away (it was "cannot write '/dev/stdout': Broken pipe", status 2)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.md").write_text("words\n" * 100000)
    proc = subprocess.Popen([sys.executable, "-m", "orchard.cli.prepare", str(src), "-o",
                             "/dev/stdout", "--overwrite"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=subprocess_env(), cwd=REPO_ROOT)
    try:
        assert proc.stdout.read(10) == b'{"vocab_si'
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 1, err
    finally:
        proc.kill()
    assert "error" not in err and "Traceback" not in err, err


def test_prepare_takes_text_files_whole_and_reads_no_more_than_it_keeps(tmp_path, monkeypatch):
    """A NUL byte anywhere makes a file binary (only the first 8 KiB were looked at); files
    are read a chunk at a time, kept up to --max-bytes, to their first NUL: a large file was
    read whole first, a binary one too before it was skipped (2 GB for 3 tokens), and a
    --max-bytes past the memory was one buffer asked for (MemoryError, or OverflowError)."""
    import builtins
    import io
    import tracemalloc
    from orchard.data import text_file_sequences
    (tmp_path / "late_nul.txt").write_bytes(b"a" * 9000 + b"\0binary")
    (tmp_path / "text.txt").write_bytes(b"b" * 9000)
    paths = [str(tmp_path / "late_nul.txt"), str(tmp_path / "text.txt")]
    assert [bytes(s) for s in text_file_sequences(paths)] == [b"b" * 9000]
    assert [bytes(s) for s in text_file_sequences(paths, max_bytes=10)] == [b"b" * 10]
    reads, real_open = [], builtins.open

    class Counted(io.BufferedReader):
        def read(self, n=-1):
            reads.append(n)
            return super().read(n)

    monkeypatch.setattr(builtins, "open", lambda path, mode: Counted(real_open(path, "rb", 0)))
    text_file_sequences([str(tmp_path / "text.txt")], max_bytes=10)
    assert reads and all(0 < n <= 1 << 20 for n in reads)
    monkeypatch.undo()
    assert [bytes(s) for s in text_file_sequences(paths, max_bytes=2**63 - 1)] == [b"b" * 9000]
    with open(tmp_path / "disk.img", "wb") as f:    # sparse: no disk space taken
        f.truncate(1 << 30)
    tracing = tracemalloc.is_tracing()     # (PYTHONTRACEMALLOC: left on)
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert text_file_sequences([str(tmp_path / "disk.img")] + paths) == [[98] * 9000]
        assert tracemalloc.get_traced_memory()[1] - before < 16 << 20
    finally:
        if not tracing:
            tracemalloc.stop()


def test_generate_and_prepare(run_files, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("print('hello')\n" * 50)
    (src / "b.bin").write_bytes(b"\0\1\2")
    seqs = tmp_path / "seqs.json"
    result = run_python(["-m", "orchard.cli.prepare", str(src), "-o", str(seqs)])
    assert result.returncode == 0 and "wrote 1 sequence(s)," in result.stdout, result.stderr
    sequences, vocab = load_sequences(str(seqs))
    assert vocab == 256 and bytes(sequences[0]).startswith(b"print('hello')")
    out = tmp_path / "run"
    assert train.main(["--config", run_files[0], "--sequences", str(seqs), "--output", str(out),
                       "--max-steps", "2", "--device", "cpu"]) == 0
    result = run_python(["-m", "orchard.cli.generate", "--checkpoint", str(out), "--prompt",
                         "print", "--max-new-tokens", "20"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("print") and len(result.stdout) > len("print")
    # on a stdout of another encoding what it cannot hold (the U+FFFD of a byte that is no
    # UTF-8) is replaced, not a traceback; --top-k 0 samples among all tokens (HuggingFace's)
    result = run_python(["-m", "orchard.cli.generate", "--checkpoint", str(out), "--prompt",
                         "print", "--max-new-tokens", "200", "--seed", "3", "--top-k", "0"],
                        PYTHONIOENCODING="ascii")
    assert result.returncode == 0 and result.stdout.startswith("print"), result.stderr
    # what to expect of a model trained for two steps, before the sample
    assert re.match(r"checkpoint of step 2 of 2, validation loss [0-9.]+ \(uniform guessing: "
                    r"5\.55\): barely trained; expect near-random tokens$", result.stderr), \
        result.stderr
    # tokens are printed as they are sampled: Ctrl-C keeps what came before it
    proc = subprocess.Popen([sys.executable, "-m", "orchard.cli.generate", "--checkpoint",
                             str(out), "--prompt", "print", "--max-new-tokens", "10000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=subprocess_env(PYTHONUNBUFFERED="1"), cwd=REPO_ROOT)
    try:
        assert proc.stdout.read(len("print") + 10)  # the prompt, then sampled bytes
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.endswith("orchard-generate: interrupted\n"), err
    assert rest.endswith("\n")
