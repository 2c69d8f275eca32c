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
print("ok")
"""


def test_orchard_works_without_torch():
    result = run_python(["-c", WITHOUT_TORCH])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
