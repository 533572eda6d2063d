# Sourced by the device scripts (benchmarks/device_*.sh, e2e_device.sh) from the repo root:
# the GPU box's environment (never NVLink multicast), TP = every local GPU unless NGPUS says
# otherwise, and install_carried_wheels (megatron-core from the carried .whl/ folder, into /tmp/site).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPUS="${NGPUS:-$(nvidia-smi -L | grep -c '^GPU ')}"

install_carried_wheels() {  # install_carried_wheels [GLOB]   (default: every carried wheel)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site ${1:-.whl/*.whl}
}
