#!/usr/bin/env bash
# ARM64 check: builds orchard_ops from this source tree for aarch64 and runs the native (CPU)
# path's tests there, against the float64 reference.
#
# How: an arm64 Debian 13 (trixie) root filesystem with python3, numpy, pytest, gcc and
# python3-dev from Debian is made once with mmdebstrap; its programs run on this x86-64 machine
# through QEMU user-mode emulation (qemu-user-static, registered with the kernel's binfmt_misc).
# Each run copies the tree's files (git ls-files: tracked, and untracked but not ignored) into
# it, builds with its own arm64 gcc (`setup.py build_ext --inplace`, ORCHARD_NO_OPENCL=1: the
# native path only) and runs pytest on TESTS (below) or on the arguments given. There is no
# torch in the root filesystem, so the tests that need it skip.
#
# Needs: root on a Debian host (tested on Debian 12 x86-64: apt-get; chroot; mounting
# binfmt_misc and /proc, so a VM or a privileged container), Debian's mirror
# (ORCHARD_ARM64_MIRROR), about 0.6 GB of disk. On an arm64 host no emulation is set up (untried).
# Time on 2 shared cores of an x86-64 Xeon: 19 min from scratch (root filesystem 9.5 min, once;
# build 3.5 min, kept between runs so that only changed sources are recompiled; tests 6 min);
# about 7 min with the cache and unchanged sources.
# Cache: ORCHARD_ARM64_CACHE (default ~/.cache/orchard-arm64); delete it to start over.
#
# Usage: tools/arm64_check.sh [pytest arguments]   exit status: pytest's; 1 when setup or build fail
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CACHE=${ORCHARD_ARM64_CACHE:-$HOME/.cache/orchard-arm64}
MIRROR=${ORCHARD_ARM64_MIRROR:-http://deb.debian.org/debian}
SUITE=trixie    # numpy >= 2 (the extension uses its C API); bookworm has 1.24
PACKAGES=python3,python3-numpy,python3-pytest,python3-setuptools,python3-dev,gcc,libc6-dev
TESTS=(tests/test_forward.py tests/test_backward.py tests/test_varlen.py tests/test_decode.py
       tests/test_dropout.py tests/test_marshalling.py tests/test_index_limits.py
       tests/test_threads.py tests/test_devices.py tests/test_isa.py)
ROOT=$CACHE/rootfs

say() { echo "arm64_check: $*"; }
fail() { echo "arm64_check: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (apt-get, chroot, mount)"
mkdir -p "$CACHE"

# Host tools, and the kernel's hand-off of aarch64 programs to QEMU.
need=(mmdebstrap)
if [ "$(dpkg --print-architecture)" != arm64 ]; then
    need+=(qemu-user-static binfmt-support)
fi
missing=()
for pkg in "${need[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ "$(dpkg --print-architecture)" != arm64 ]; then
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc ||
            fail "cannot mount binfmt_misc (a container without privileges?)"
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        update-binfmts --enable qemu-aarch64 || fail "cannot register qemu-aarch64 with binfmt_misc"
    fi
fi

# The root filesystem, made once per suite and package list (the stamp), in a temporary folder
# first so that an interrupted run leaves no half-made one behind.
stamp="$SUITE $PACKAGES"
if [ ! -f "$CACHE/rootfs.stamp" ] || [ "$(cat "$CACHE/rootfs.stamp")" != "$stamp" ]; then
    say "making the arm64 $SUITE root filesystem in $ROOT (about 10 min; log: $CACHE/mmdebstrap.log)"
    rm -rf "$ROOT" "$ROOT.tmp" "$CACHE/rootfs.stamp"
    if ! mmdebstrap --arch=arm64 --variant=apt --include="$PACKAGES" \
            "$SUITE" "$ROOT.tmp" "$MIRROR" >"$CACHE/mmdebstrap.log" 2>&1; then
        tail -20 "$CACHE/mmdebstrap.log" >&2
        fail "mmdebstrap failed (log: $CACHE/mmdebstrap.log)"
    fi
    mv "$ROOT.tmp" "$ROOT"
    echo "$stamp" >"$CACHE/rootfs.stamp"
fi

# The source tree, copied fresh; build/ survives from the last run, so that setup.py recompiles
# only what changed (the copies keep their files' times).
say "copying $REPO into $ROOT/orchard"
rm -rf "$ROOT/orchard.build"
[ -d "$ROOT/orchard/build" ] && mv "$ROOT/orchard/build" "$ROOT/orchard.build"
rm -rf "$ROOT/orchard"
mkdir "$ROOT/orchard"
git ls-files -z --cached --others --exclude-standard |
    tar --null -T - -cf - | tar -xf - -C "$ROOT/orchard"
[ -d "$ROOT/orchard.build" ] && mv "$ROOT/orchard.build" "$ROOT/orchard/build"

if [ $# -eq 0 ]; then
    set -- "${TESTS[@]}"
fi
# In a mount namespace of its own, so that the /proc mounted for the chroot goes away with it.
script='
set -eu
cd /orchard
echo "arm64_check: $(uname -m), $(python3 --version), numpy $(python3 -c "import numpy; print(numpy.__version__)"), $(gcc --version | head -1)"
echo "arm64_check: ORCHARD_NO_OPENCL=1 python3 setup.py build_ext --inplace"
ORCHARD_NO_OPENCL=1 python3 setup.py -q build_ext --inplace -j "$(nproc)" >build.log 2>&1 ||
    { tail -40 build.log; echo "arm64_check: error: the build failed" >&2; exit 1; }
grep -i "warning" build.log | sort -u || true
PYTHONPATH=python python3 -c "
import platform, orchard_ops
assert platform.machine() == \"aarch64\", platform.machine()
print(\"arm64_check: built\", orchard_ops.__file__, orchard_ops.build_info())
print(\"arm64_check: devices\", [(d[\"id\"], d[\"simd\"]) for d in orchard_ops.devices()])
"
echo "arm64_check: python3 -m pytest -q $*"
exec python3 -m pytest -q -p no:cacheprovider "$@"
'
status=0
unshare --mount --fork sh -c 'mount -t proc proc "$1/proc" && shift && exec chroot "$@"' \
    sh "$ROOT" "$ROOT" sh -c "$script" sh "$@" || status=$?
say "exit status $status after $SECONDS s"
exit $status
