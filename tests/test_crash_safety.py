"""Training survives being killed: `python -m orchard.cli.train` is stopped with SIGKILL at random
moments and, in other rounds, the instant a checkpoint or metrics write is under way (its
temporary file exists); after every kill the latest checkpoint loads, --resume goes on from
it, and the run that was killed again and again ends with exactly the parameters and loss curve of a run that
never was. Malformed configs and data files end with one clear line and exit status 2, never a
traceback."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
yaml = pytest.importorskip("yaml")

from orchard.checkpoint import load_checkpoint  # noqa: E402
from test_py_support import (REPO_ROOT, TINY_CONFIG, read_metrics, run_python,  # noqa: E402
                             subprocess_env, write_tiny_run_files)

STEPS = 24
KILLS = 4           # at least; every other one, the first too, waits for a write


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("crash"))
    config, sequences = write_tiny_run_files(folder)
    cfg = json.loads(json.dumps(TINY_CONFIG))
    cfg["training"]["checkpoint_interval"] = 1      # a checkpoint write after every step
    cfg["model"]["n_embd"] = 256    # a checkpoint of ~20 MB: writes long enough to land a kill in
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    return config, sequences


def train_args(run_files, out, *extra):
    config, sequences = run_files
    return ["-m", "orchard.cli.train", "--config", config, "--sequences", sequences, "--output",
            str(out), "--device", "cpu", "--max-steps", str(STEPS), *extra]


def temp_files(out, prefix="."):
    """The temporary files of atomic writes in progress (orchard/atomic.py): the checkpoint's
    (.checkpoint.pt.*.tmp) and the metrics' (.metrics.jsonl.*.tmp). A kill inside either must
    leave the last complete file in place."""
    return ({n for n in os.listdir(out) if n.startswith(prefix) and n.endswith(".tmp")}
            if out.exists() else set())


def kill_during(args, out, mid_write, rng, duration):
    """Starts a run and SIGKILLs it: the moment a new checkpoint write's temporary file appears
    (the metrics' write is too short to land a kill in reliably: once, every mid-write kill came
    after its rename), or at a random moment within `duration` (seconds an uninterrupted run
    takes). Returns (killed, inside a write): a temporary file left behind means the kill came
    between its creation and the rename (SIGKILL skips the cleanup)."""
    stale, stale_checkpoints = temp_files(out), temp_files(out, ".checkpoint.pt.")
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=subprocess_env(), cwd=REPO_ROOT)
    deadline = time.monotonic() + (120 if mid_write else rng.uniform(0.4, 0.9) * duration)
    while proc.poll() is None and time.monotonic() < deadline:
        if mid_write and temp_files(out, ".checkpoint.pt.") - stale_checkpoints:
            break
        time.sleep(0.0005 if mid_write else 0.01)
    if proc.poll() is not None:
        return False, False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True, bool(temp_files(out) - stale)


def resume_args(out):
    """--resume the killed run's checkpoint; before its first one, start again over the
    metrics it left (--overwrite: a folder with metrics and no checkpoint is refused)."""
    return ["--resume", str(out)] if (out / "checkpoint.pt").exists() else ["--overwrite"]


def test_sigkill_at_random_moments_and_mid_checkpoint_then_resume(run_files, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    start = time.monotonic()
    result = run_python(train_args(run_files, straight))
    duration = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    rng = random.Random(int(os.environ.get("ORCHARD_CRASH_SEED", "1")))
    steps_seen, mid_write_kills = [], 0
    for round_ in range(3 * KILLS):     # more rounds while no kill has landed inside a write
        if round_ >= KILLS and mid_write_kills:
            break
        resume = resume_args(killed)
        mid_write = round_ % 2 == 0     # first: the run is young, its writes all ahead
        was_killed, inside_write = kill_during(train_args(run_files, killed, *resume), killed,
                                               mid_write, rng, duration)
        if not was_killed:
            break
        mid_write_kills += inside_write
        if (killed / "checkpoint.pt").exists():
            step = load_checkpoint(str(killed))["step"]     # always loads
            assert not steps_seen or step >= steps_seen[-1]
            steps_seen.append(step)
    assert mid_write_kills >= 1, "no kill landed inside a checkpoint or metrics write"
    result = run_python(train_args(run_files, killed, *resume_args(killed)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_checkpoint(str(killed))["step"] == STEPS
    assert [m["step"] for m in read_metrics(killed)] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in read_metrics(killed)] == [m["loss"] for m in
                                                         read_metrics(straight)]
    a, b = load_checkpoint(str(straight))["model"], load_checkpoint(str(killed))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


BAD_INPUTS = r"""
import sys
from orchard.cli import train
for args in CASES:
    print("RC", train.main(args + ["--device", "cpu", "--max-steps", "1", "--output", OUT]))
"""


def test_malformed_inputs_give_one_line_and_status_2(run_files, tmp_path):
    config, sequences = run_files
    files = {
        "syntax.yaml": "model: [1, 2\n",
        "type.yaml": "model:\n  n_layer: two\n",
        "unknown.yaml": "training:\n  batchsize: 4\n",
        "list.yaml": "- model\n",
        "syntax.json": "[[1, 2], [3",
        "binary.json": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
        "shape.json": '{"sequences": [1, 2, 3]}',
        "ids.json": '[[1, -2, 3]]',
        "short.json": "[[1, 2]]",
    }
    for name, text in files.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    cases = [(["--config", str(tmp_path / n), "--sequences", sequences], n)
             for n in files if n.endswith(".yaml")]
    cases += [(["--config", config, "--sequences", str(tmp_path / n)], n)
              for n in files if n.endswith(".json")]
    cases += [(["--config", config, "--sequences", str(tmp_path / "missing.json")],
               "missing.json"),
              (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
              (["--config", config, "--sequences", sequences, "--resume",
                str(tmp_path / "syntax.json")], "syntax.json")]
    code = BAD_INPUTS.replace("CASES", repr([c for c, _ in cases])).replace(
        "OUT", repr(str(tmp_path / "out")))
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.split() == ["RC", "2"] * len(cases), result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("orchard-train: ")]
    assert len(errors) == len(cases), result.stderr
    for line, (_, name) in zip(errors, cases):
        assert name in line, (name, line)
