# The GPU machine's OpenCL environment, sourced by gpu_check.sh and gpu_layouts.sh: the
# carried .deb files (gpu_check.sh --fetch) unpacked into .gpu/root (never into /), the
# headers and ICD loader there for the build, and the driver's libnvidia-opencl.so.1
# registered through OCL_ICD_VENDORS when the image does not register it.
GPU_DIR=$PWD/.gpu
ls "$GPU_DIR"/*.deb >/dev/null 2>&1 || { echo "gpu_env: no .deb files in .gpu/: run --fetch where apt works and carry .gpu" >&2; exit 2; }
rm -rf "$GPU_DIR/root" && mkdir -p "$GPU_DIR/root"
for deb in "$GPU_DIR"/*.deb; do dpkg -x "$deb" "$GPU_DIR/root"; done
export ORCHARD_OPENCL_INCLUDE=$GPU_DIR/root/usr/include
export ORCHARD_OPENCL_LIBRARY
ORCHARD_OPENCL_LIBRARY=$(find "$GPU_DIR/root" -name 'libOpenCL.so.1' | head -1)

# the driver's OpenCL library, registered for the loader unless the image already does
if ! grep -qs nvidia /etc/OpenCL/vendors/*.icd; then
    driver=$(find /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib \
                  -maxdepth 3 -name 'libnvidia-opencl.so.1' 2>/dev/null | head -1 || true)
    if [ -n "$driver" ]; then
        mkdir -p "$GPU_DIR/vendors"
        echo "$driver" >"$GPU_DIR/vendors/nvidia.icd"
        export OCL_ICD_VENDORS=$GPU_DIR/vendors
    fi
fi

