"""DeviceBackend.estimate_memory against the measured peak memory of CPU training steps.

The measurement is the growth of the process's peak resident memory from before the model
exists to after two optimizer steps, in a fresh process: the kernel's high-water mark (VmHWM)
is reset to the current resident size first, since an earlier peak (imports, warm-up) would
hide part of the growth. The estimate must be within 25 % of it, with and without gradient
checkpointing.
"""
import json

import pytest

pytest.importorskip("torch")

from orchard.config import default_config  # noqa: E402
from orchard.device_backend import get_device_backend  # noqa: E402
from test_py_support import run_python  # noqa: E402

TOLERANCE = 0.25

MEASURE = r"""
import gc, json, sys, torch
from orchard.model import GPT, GPTConfig
from orchard.torch import patch_model
model_cfg, batch, checkpointing = json.loads(sys.argv[1])
x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["context"]))
# A throw-away step first, checkpointed as the measured one, so that the libraries' own pages
# are already counted (a CUDA build of torch loads its CUDA libraries at the first checkpoint).
warm = GPT(GPTConfig(vocab_size=model_cfg["vocab_size"], context=8, n_layer=1, n_head=1,
                     n_kv_head=1, n_embd=8))
warm.grad_checkpointing = checkpointing
patch_model(warm)
warm(x[:1, :8], x[:1, :8])[1].backward()
del warm
gc.collect()

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                        # VmHWM := VmRSS
before = status("VmRSS:")
model = GPT(GPTConfig(**model_cfg))
model.grad_checkpointing = checkpointing
patch_model(model)
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):  # the second step has the optimizer state too
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(status("VmHWM:") - before)
"""


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_matches_measured_peak(checkpointing):
    model_cfg = dict(default_config()["model"], n_layer=4, n_embd=128, context=256)
    batch = 48
    result = run_python(["-c", MEASURE, json.dumps([model_cfg, batch, checkpointing])],
                        OMP_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    measured = int(result.stdout.strip())
    estimate = get_device_backend("cpu").estimate_memory(
        model_cfg, batch, model_cfg["context"], "fp32", checkpointing)["total_bytes"]
    assert abs(estimate - measured) <= TOLERANCE * measured, (estimate, measured)
