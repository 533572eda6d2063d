#!/usr/bin/env bash
# Planned first job of the next device session (TP = all local GPUs; one 10-minute call):
#   1. the GPU-marked tests (fused kernels, layers; new since the last GPU run: comm_priority,
#      the reserved-SM grid, the overlapped re-gather beside a non-fused dgrad);
#   2. the benchmark grid with the shipped (tuned, confirmed) table, the 2 % auto margin and GC
#      off during trials: is auto ever slower than nccl beyond noise?  -> $OUT/bench.json
#   3. if time is left, flux training with --flux-keep-gathered-input (no re-gathers).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/next}"
mkdir -p "${OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPUS="${NGPUS:-$(nvidia-smi -L | grep -c '^GPU ')}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
timeout 200 python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -q \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "gpu tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
    -m megatron_flux.bench --m-set all --methods cublas_gemm comm nccl torch_async_tp flux auto \
    --trials 7 --iters 20 --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" \
    > "${OUT}/bench.log" 2>&1
echo "bench exit $? (${SECONDS}s)"; tail -20 "${OUT}/bench.log"
if [ "${SECONDS}" -lt 430 ]; then
    FLUX_BACKEND=flux TRAIN_ITERS=100 LOG_INTERVAL=1 MODEL_CONFIG=configs/llama3_8b_16l.json \
        timeout $((580 - SECONDS)) bash examples/pretrain_llama.sh --flux-keep-gathered-input \
        > "${OUT}/flux_keep.log" 2>&1
    echo "flux keep-gathered exit $?"; grep -E "iteration +(50|100)/" "${OUT}/flux_keep.log" | cut -c1-200
fi
