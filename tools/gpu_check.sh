#!/usr/bin/env bash
# GPU check (issue 17): on a machine with a GPU and no network, builds orchard_ops from this
# tree, makes the GPU's OpenCL driver reachable, runs the OpenCL tests on it and
# benchmarks/gpu_opencl.py, and leaves the logs and figures in $OUT (default ./gpu_out).
#
#   bash tools/gpu_check.sh --fetch      where apt works (here): the OpenCL headers and the
#                                        ICD loader as .deb files into .gpu/ (ignored by git)
#   bash tools/gpu_check.sh [--quick]    on the GPU machine, with .gpu/ carried along
#
# Why the carried files: an image with NVIDIA's driver but no OpenCL development packages has
# no CL/cl.h to build against and often no libOpenCL.so.1 (the ICD loader orchard_ops opens at
# run time) or no /etc/OpenCL/vendors entry for the driver. The .deb files are unpacked into
# .gpu/root (never into /); the driver's own libnvidia-opencl.so.1 is looked for in the usual
# places and registered through OCL_ICD_VENDORS when the image does not register it.
# Needs there: python3 with numpy, pytest, setuptools (torch and PyYAML for the Python tests),
# a C compiler. On a lease of fixed length, BENCH_SECONDS and TESTS_SECONDS bound the two
# steps (default: no bound); the benchmark runs first, as its figures are what the lease is for,
# and it prints each figure as it is measured, so a step cut short keeps what it got.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=$PWD/.gpu
PACKAGES="ocl-icd-libopencl1 opencl-c-headers"

if [ "${1:-}" = "--fetch" ]; then
    mkdir -p "$GPU_DIR"
    (cd "$GPU_DIR" && rm -f ./*.deb && apt-get download $PACKAGES)
    ls -l "$GPU_DIR"
    exit 0
fi
QUICK=()
[ "${1:-}" = "--quick" ] && QUICK=(--quick)
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"

source tools/gpu_env.sh

{
    nvidia-smi 2>&1 || true
    echo "ORCHARD_OPENCL_LIBRARY=$ORCHARD_OPENCL_LIBRARY OCL_ICD_VENDORS=${OCL_ICD_VENDORS:-}"
    echo "registered: $(cat /etc/OpenCL/vendors/*.icd "${OCL_ICD_VENDORS:-/nonexistent}"/*.icd 2>/dev/null | tr '\n' ' ')"
    echo "driver OpenCL libraries: $(find /usr /opt /lib /lib64 -maxdepth 6 -name 'libnvidia-opencl.so*' 2>/dev/null | tr '\n' ' ')"
    python3 --version; cc --version | head -1; nproc
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
ORCHARD_TEST_HOOKS=1 python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import json, orchard_ops; print(json.dumps(orchard_ops.devices(), indent=1))" \
    | tee "$OUT/devices.json"
gpu=$(python3 -c "import orchard_ops; print(next((d['id'] for d in orchard_ops.devices()
                  if d['kind'] == 'gpu'), ''))")
[ -n "$gpu" ] || { echo "gpu_check: no OpenCL GPU is listed (see $OUT/machine.txt)" >&2; exit 1; }

PYTHONUNBUFFERED=1 timeout "${BENCH_SECONDS:-0}" python3 benchmarks/gpu_opencl.py \
    --device "$gpu" "${QUICK[@]}" --out "$OUT/gpu_opencl.json" 2>&1 | tee "$OUT/gpu_opencl.md"
status=${PIPESTATUS[0]}

# the OpenCL tests (every family on the first OpenCL device: the GPU when it is the only one)
# and the numerical suite, which runs on every device listed; in parallel where pytest-xdist is
# there: each test process builds its programs with the driver's compiler, seconds apiece
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n "$(nproc)" -p no:benchmark)
timeout "${TESTS_SECONDS:-0}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
    "${parallel[@]}" tests/test_opencl.py \
    tests/test_device_array.py tests/test_forward.py tests/test_backward.py \
    >"$OUT/tests.log" 2>&1 || status=1
tail -15 "$OUT/tests.log"
exit $status
