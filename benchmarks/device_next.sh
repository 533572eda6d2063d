#!/usr/bin/env bash
# Planned first job of the next device session (2xH200, one 10-minute call):
#   1. the benchmark grid with the shipped (tuned, confirmed) table, the 2 % auto margin and GC
#      off during trials: is auto ever slower than nccl beyond noise?  -> $OUT/bench.json
#   2. if time is left, one more stock/nccl/flux training job for the step-time spread.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/next}"
mkdir -p "${OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_flux.bench \
    --m-set all --methods cublas_gemm comm nccl torch_async_tp flux auto --trials 7 --iters 20 \
    --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
echo "bench exit $? (${SECONDS}s)"; tail -20 "${OUT}/bench.log"
if [ "${SECONDS}" -lt 200 ]; then
    OUT="${OUT}/e2e" E2E_SKIP_COMM=1 E2E_COMM_JSON=benchmarks/results/raw/e2e-comm-h200x2-2026-11-22.json \
        E2E_SKIP_CUSTOM=1 E2E_ITERS=100 E2E_RUN_TIMEOUT=120 bash benchmarks/e2e_device.sh
fi
