# Sourced by the device scripts (benchmarks/device_*.sh, e2e_device.sh) from the repo root:
# the GPU box's environment (never NVLink multicast), TP = every local GPU unless NGPUS says
# otherwise, and install_carried_wheels (megatron-core from the carried .whl/ folder, into /tmp/site).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPUS="${NGPUS:-$(nvidia-smi -L | grep -c '^GPU ')}"

install_carried_wheels() {  # install_carried_wheels [GLOB]   (default: every carried wheel)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site ${1:-.whl/*.whl}
}

one_gpu_session() {  # one_gpu_session: GPU 0 only, experiments importable, Triton cache in the
    # ignored .device/, and nvidia-smi logging SM clock, power and temperature every 200 ms
    # to $OUT/smi.csv until the script exits
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments" CUDA_VISIBLE_DEVICES=0
    export TRITON_CACHE_DIR="${PWD}/.device/triton-cache"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,nounits \
        -lms 200 > "${OUT}/smi.csv" &
    SMI_PID=$!
    trap 'kill ${SMI_PID} 2>/dev/null' EXIT
}

one_gpu_tests() {  # one_gpu_tests: the GPU-marked tests on this one GPU (2-GPU ones skip),
    # megatron-core from the carried wheel -> $OUT/tests-1gpu.json and .log
    install_carried_wheels || return 1
    PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 200 python3 benchmarks/record_pytest.py \
        "${OUT}/tests-1gpu.json" tests -q -m gpu -p no:cacheprovider > "${OUT}/tests-1gpu.log" 2>&1
    echo "tests exit $?"; tail -2 "${OUT}/tests-1gpu.log"
}
