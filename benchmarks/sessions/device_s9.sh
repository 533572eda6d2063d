#!/usr/bin/env bash
# Session 9 device calls (2 GPUs, each < 10 minutes), after the unrolled step loops:
#   OUT=... bash benchmarks/sessions/device_s9.sh tests   the whole suite (CPU + GPU-marked, megatron-core
#                                                0.19.2)                        -> $OUT/tests-gpu.json
#                                                then comm-off vs cuBLAS, table config, GPU 0
#                                                                               -> $OUT/kvc.json
#   OUT=... bash benchmarks/sessions/device_s9.sh bench   the m >= 1024 grid            -> $OUT/bench.json
#                                                then GEMM+RS comm-off vs cuBLAS (its wiring fixed
#                                                after the 'tests' call)        -> $OUT/kvc-rs.json
# (carry .whl)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s9}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
case "${1:-}" in
tests)
    echo "== tests ($(date +%T))"
    OUT="${OUT}" bash benchmarks/device_tests.sh 2>&1 | grep -v "^skipped\|warn" | tail -12
    echo "== kernel vs cublas ($(date +%T), ${SECONDS}s)"
    CUDA_VISIBLE_DEVICES=0 timeout $((580 - SECONDS)) python3 -m megatron_flux.bench.kernel_vs_cublas \
        --ops AG+GEMM GEMM+RS --trials 5 --iters 10 --configs table plain --json "${OUT}/kvc.json" \
        2>&1 | grep -E "^(AG|RS|GEMM)" ;;
bench)
    echo "== bench large ($(date +%T))"
    timeout 420 "${RUN[@]}" -m megatron_flux.bench --m-set large \
        --methods cublas_gemm comm nccl torch_async_tp flux --trials 5 --iters 20 \
        --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
    echo "   exit $? (${SECONDS}s)"; grep -A12 "^summary" "${OUT}/bench.log"
    echo "== kernel vs cublas, GEMM+RS ($(date +%T), ${SECONDS}s)"
    CUDA_VISIBLE_DEVICES=0 timeout $((580 - SECONDS)) python3 -m megatron_flux.bench.kernel_vs_cublas \
        --ops GEMM+RS --trials 5 --iters 10 --configs table plain --json "${OUT}/kvc-rs.json" \
        2>&1 | grep -E "^GEMM" ;;
*) echo "usage: $0 tests|bench"; exit 2 ;;
esac
echo "== done in ${SECONDS}s"
