"""The memory checkers of tools/ on a representative subset, so CI keeps them at zero reports:
tools/sanitize.sh (AddressSanitizer + UndefinedBehaviorSanitizer build; the full suite runs
with `tools/sanitize.sh` alone) and tools/valgrind.sh (Memcheck over
tools/valgrind_workload.py). Skipped where the tools are missing."""
import os
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

# Feature combinations forward and backward, varlen, and strided inputs on every device, the
# size limits and injected OpenCL faults, 0-d operands' messages (their dims are NULL); of the
# backward over chunks of keys and over parts of them (seconds each under ASan) one or two
# cases per kernel set.
SANITIZE_SUBSET = ["tests/test_forward.py", "tests/test_backward.py", "tests/test_varlen.py",
                   "tests/test_index_limits.py", "tests/test_faults.py", "tests/test_isa.py",
                   "tests/test_errors.py",
                   "-k", "test_combinations or test_bwd_features or test_varlen_vs_reference or "
                   "0d or "
                   "test_index_limits or recovers or (test_isa and (backward or decode or "
                   "score_features or bfloat16) and not chunks and not parts) or "
                   "(test_backward_in_chunks_of_keys and gqa and float32) or "
                   "(test_backward_in_parts_of_keys and window and float32) or "
                   "(test_varlen_backward_in_parts_of_keys and bfloat16)"]


def libasan():
    gcc = shutil.which("gcc")
    path = gcc and subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True,
                                  text=True).stdout.strip()
    return path if path and os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(libasan() is None, reason="gcc with libasan not installed")
def test_no_sanitizer_reports():
    # 2.4 minutes on a 2-core AMD EPYC, a minute of it the instrumented build (-O0, setup.py)
    r = subprocess.run([os.path.join(REPO_ROOT, "tools", "sanitize.sh"), *SANITIZE_SUBSET],
                       capture_output=True, text=True, timeout=1200, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "no sanitizer reports" in r.stdout
    assert " passed" in r.stdout and " failed" not in r.stdout


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
def test_valgrind_memcheck_clean():
    r = subprocess.run([os.path.join(REPO_ROOT, "tools", "valgrind.sh")], capture_output=True,
                       text=True, timeout=600, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "ERROR SUMMARY: 0 errors" in r.stdout and "definitely lost: 0 bytes" in r.stdout
