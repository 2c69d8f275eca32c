#!/usr/bin/env bash
# The wg family's work-group layouts side by side on a GPU (issue 17): for each LANESxTM given
# (default: 16x4 8x4 16x8 8x8), a copy of this tree with kernels/params.h's OR_WG_LANES and
# OR_WG_TM set so, all built at once, then benchmarks/gpu_opencl.py's wg rows (float32 and
# float16, N 1024 and 4096, D 64 and 128, DeviceArrays) of each, one after another, into
# $OUT/layout_LANESxTM.jsonl (default ./gpu_out). Run where tools/gpu_check.sh runs, with
# .gpu/ carried; benchmarks/gpu_wg_layouts_h200.json holds the H200's figures.
#
#   bash tools/gpu_layouts.sh [--quick] [16x4 8x4 ...]     (--quick: small shapes, to check the
#                                                         script on PoCL)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
SHAPES=(2,16,4096,64 2,16,4096,128 4,8,1024,64 4,8,1024,128)
[ "${1:-}" = "--quick" ] && { SHAPES=(1,2,128,64 1,2,256,128); shift; }
source tools/gpu_env.sh
LAYOUTS=("$@")
[ ${#LAYOUTS[@]} -gt 0 ] || LAYOUTS=(16x4 8x4 16x8 8x8)

for layout in "${LAYOUTS[@]}"; do
    lanes=${layout%x*} rows=${layout#*x}
    tree=/tmp/orchard_layout_$layout
    rm -rf "$tree" && mkdir -p "$tree"
    tar --exclude=./.gpu --exclude=./build --exclude=./gpu_out -cf - . | tar -xf - -C "$tree"
    sed -i "s/^#define OR_WG_LANES .*/#define OR_WG_LANES $lanes/; s/^#define OR_WG_TM .*/#define OR_WG_TM $rows/" \
        "$tree/kernels/params.h"
    grep -q "^#define OR_WG_LANES $lanes\$" "$tree/kernels/params.h" \
        && grep -q "^#define OR_WG_TM $rows\$" "$tree/kernels/params.h" \
        || { echo "gpu_layouts: could not set $layout in kernels/params.h" >&2; exit 2; }
    (cd "$tree" && python3 setup.py build_ext --inplace -q >"$OUT/build_$layout.log" 2>&1) &
done
wait

for layout in "${LAYOUTS[@]}"; do
    echo "== $layout (OR_WG_LANES x OR_WG_TM)"
    (cd "/tmp/orchard_layout_$layout" && PYTHONPATH=$PWD/python ORCHARD_CL_FAMILY=wg \
        python3 benchmarks/gpu_opencl.py \
        --child --device opencl:0 --dtypes float32 float16 --shapes "${SHAPES[@]}") \
        | tee "$OUT/layout_$layout.jsonl" \
        || echo "gpu_layouts: $layout failed (its build: $OUT/build_$layout.log)" >&2
done
