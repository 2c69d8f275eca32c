#!/usr/bin/env bash
# Runs the test suite (or the pytest arguments given) against a build of orchard_ops with
# AddressSanitizer and UndefinedBehaviorSanitizer, and fails on any report:
#
#     tools/sanitize.sh                               # the whole suite
#     tools/sanitize.sh tests/test_errors.py -x       # any pytest arguments
#
# The extension is built (ORCHARD_SANITIZE=1, and ORCHARD_TEST_HOOKS=1 for the fault-injection
# tests; see setup.py) into a temporary folder that goes first on PYTHONPATH, so the in-place
# build in python/ is neither used nor touched; child interpreters started by the tests
# inherit it. Python itself is not instrumented, so the ASan runtime is preloaded, and
# PYTHONMALLOC=malloc sends Python's objects through it too.
#
# ASAN_OPTIONS: detect_leaks=0, because CPython and the OpenCL ICD/PoCL keep allocations for
# the life of the process on purpose and free few at exit; leaks of orchard's own are checked
# by tests/test_memory.py and test_faults.py (reference counts, resident memory over loops)
# and by tools/valgrind.sh. allocator_may_return_null=1, because the tests ask for impossible
# allocations and expect MemoryError, not an abort (ASan logs a warning for each: those are
# not reports). Reports are written to files (log_path) and counted at the end, so that one in
# a child process that a test expects to fail for another reason still fails this run.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
work=$(mktemp -d "${TMPDIR:-/tmp}/orchard-sanitize.XXXXXX")
trap 'rm -rf "$work"' EXIT

if ! ORCHARD_SANITIZE=1 ORCHARD_TEST_HOOKS=1 python3 setup.py build_ext --build-lib "$work/lib" \
        --build-temp "$work/obj" >"$work/build.log" 2>&1; then
    cat "$work/build.log" >&2
    exit 1
fi

mkdir "$work/reports"
# libstdc++ beside the ASan runtime: loaded later (by torch), its __cxa_throw is not found by
# ASan's interceptor, which then aborts the process at torch's first C++ exception
export LD_PRELOAD
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:log_path=$work/reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$work/reports/ubsan"
# tests/conftest.py adds python/ to sys.path unless it is there already: put it after ours
export PYTHONPATH="$work/lib:$repo/python:$repo/tests:$repo${PYTHONPATH:+:$PYTHONPATH}"

python3 -c "import orchard_ops, sys; sys.exit(not orchard_ops.__file__.startswith('$work'))" \
    || { echo "sanitize.sh: the sanitized orchard_ops was not the one imported" >&2; exit 1; }

status=0
python3 -m pytest -q -p no:cacheprovider "$@" || status=$?
reports=$(grep -l -r -e "ERROR: AddressSanitizer" -e "runtime error:" "$work/reports" || true)
if [ -n "$reports" ]; then
    cat $reports >&2
    echo "sanitize.sh: sanitizer reports in $(echo "$reports" | wc -l) process(es)" >&2
    exit 1
fi
echo "sanitize.sh: no sanitizer reports"
exit "$status"
