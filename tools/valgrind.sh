#!/usr/bin/env bash
# Runs tools/valgrind_workload.py (every feature on every device, and the error paths) under
# Valgrind's Memcheck and fails on any error or definite leak not covered by
# tools/valgrind.supp, whose entries are limited to the Python interpreter and the dynamic
# loader (see the file). Uses the orchard_ops that `import orchard_ops` finds from python/
# (python3 setup.py build_ext --inplace), unless PYTHONPATH says otherwise.
#
#     tools/valgrind.sh                  # about 2 minutes (1 of them compiling kernels)
#
# OpenCL programs are built once under Valgrind without instrumentation (--tool=none, into a
# temporary ORCHARD_CACHE_DIR), since compiling kernels under Memcheck takes many minutes;
# under Memcheck they load from the cache. Not outside Valgrind: its CPU has no AVX-512, so on
# an AVX-512 host PoCL names the device differently under it, and the cache keys differ.
# PYTHONMALLOC=malloc lets Memcheck see every Python object allocation.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/orchard-valgrind.XXXXXX")
trap 'rm -rf "$work"' EXIT
python=$(python3 -c "import sys; print(sys.executable)")   # the interpreter, not a shim
export PYTHONPATH="${PYTHONPATH:-$repo/python}"
export ORCHARD_CACHE_DIR="$work/cache"

valgrind --tool=none -q "$python" "$repo/tools/valgrind_workload.py" >/dev/null
PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 --num-callers=40 \
    --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
    --suppressions="$repo/tools/valgrind.supp" --log-file="$work/memcheck.log" \
    "$python" "$repo/tools/valgrind_workload.py" || status=$?
grep -E "ERROR SUMMARY|definitely lost:" "$work/memcheck.log" | sed 's/^==[0-9]*== //'
if [ "${status:-0}" -ne 0 ]; then
    cat "$work/memcheck.log" >&2
    exit 1
fi
