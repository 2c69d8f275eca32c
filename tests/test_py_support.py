"""Helpers shared by the tests of the orchard Python layer (test_py_*.py); no tests here."""
import json
import os
import signal
import subprocess
import sys

import orchard
import orchard_ops

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# A model small enough that a training step takes milliseconds.
TINY_CONFIG = {
    "model": {"context": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32},
    "training": {"batch_size": 8, "learning_rate": 0.01, "min_lr": 0.001, "warmup_steps": 2,
                 "log_interval": 1, "checkpoint_interval": 3},
}


def subprocess_env(**extra):
    """The environment for a child Python that imports the same orchard and orchard_ops as
    this process (an in-place build or an installed one)."""
    paths = [os.path.dirname(orchard_ops.__file__),
             os.path.dirname(os.path.dirname(orchard.__file__))]
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Runs are compared bit for bit across processes (resume, kills). torch's CPU matrix
    # products (MKL) may round differently when a process lays out its memory differently, as
    # a resumed one does: MKL's strict reproducible mode rules that out. (Once, a killed and
    # resumed run's loss differed from the straight run's by 4e-5; orchard's own kernels give
    # the same bits for any thread count or alignment.) It did again once with that mode
    # (4e-5 at step 4, thirty-third session, not reproduced in 6 runs since): MKL's
    # reproducibility conditions also ask for a thread count that never adapts at run time,
    # MKL_DYNAMIC and OMP_DYNAMIC false, and a child polled by a busy parent is where it would.
    env.setdefault("MKL_CBWR", "AUTO,STRICT")
    env.setdefault("MKL_DYNAMIC", "FALSE")
    env.setdefault("OMP_DYNAMIC", "FALSE")
    return env


def run_python(args, timeout=120, **env):
    """Run a child Python in its own process group, so that a timeout also ends whatever it
    started (torchrun's workers)."""
    proc = subprocess.Popen([sys.executable] + list(args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(**env),
                            cwd=REPO_ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def write_tiny_run_files(folder):
    """(config path, sequences path) for a fast training run on highly regular text, whose
    loss falls within a few steps."""
    import yaml

    config = os.path.join(folder, "tiny.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(TINY_CONFIG, f)
    text = "".join("def f%d(x):\n    return x * %d + 1\n\n" % (i % 7, i % 5)
                   for i in range(600)).encode()
    sequences = os.path.join(folder, "seqs.json")
    with open(sequences, "w") as f:
        json.dump({"vocab_size": 256, "sequences": [list(text)]}, f)
    return config, sequences


def read_metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def fail_first_forward(model):
    """Makes model.forward raise OrchardOutOfMemory once, on its first call, as a device out of
    memory does; returns the list of every call's micro-batch size."""
    import orchard_ops
    forward, calls = model.forward, []

    def fails_once(x, y=None):
        calls.append(len(x))
        if len(calls) == 1:
            raise orchard_ops.OrchardOutOfMemory("simulated: CL_MEM_OBJECT_ALLOCATION_FAILURE")
        return forward(x, y)

    model.forward = fails_once
    return calls
