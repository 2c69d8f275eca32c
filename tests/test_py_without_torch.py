"""PyTorch is optional: everything but training imports and runs without it."""
from test_py_support import run_python

WITHOUT_TORCH = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import orchard, orchard_ops
import orchard.config, orchard.data, orchard.device_backend, orchard.reference
import orchard.cli.bench, orchard.cli.demo, orchard.cli.devices, orchard.cli.prepare, orchard.cli.tune
backend = orchard.device_backend.get_device_backend()
cfg, reasons = backend.adapt_config(orchard.config.load_config("configs/universal.yaml"))
assert cfg["training"]["micro_batch"] >= 1 and reasons
backend.setup()
assert orchard.cli.devices.main([]) == 0
import numpy as np   # attention on NumPy arrays: results come back as NumPy arrays
q = np.ones((1, 2, 4, 8), np.float32)
for device in [d["id"] for d in orchard_ops.devices()]:
    out, lse = orchard_ops.flash_attn_fwd(q, q, q, device=device)
    dq, dk, dv = orchard_ops.flash_attn_bwd(out, q, q, q, out, lse, device=device)
    assert type(out) is np.ndarray and type(dq) is np.ndarray
print("ok")
"""


def test_orchard_works_without_torch():
    result = run_python(["-c", WITHOUT_TORCH])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
