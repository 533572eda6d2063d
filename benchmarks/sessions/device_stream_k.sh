#!/usr/bin/env bash
# One device call (2 GPUs, < 10 minutes), session 6:
#   1. GEMM quality with communication disabled (megatron_flux.bench.kernel_vs_cublas) on the
#      m >= 1024 grid: heuristic default, the shipped table's config and their stream-K variants
#      (AG+GEMM) against cuBLAS; AG+GEMM on GPU 0 and GEMM+RS on GPU 1 at the same time
#                                                        -> $OUT/kvc-ag.json, $OUT/kvc-rs.json
#   2. unless SKIP_IL=1: the interleaved micro-batch-1 training job with the direct kernel
#      launch off (the same job with it on ran in the session's first call)  -> $OUT/il-off/
# Usage: OUT=/somewhere bash benchmarks/sessions/device_stream_k.sh   (carry .whl for step 2)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/stream_k}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}:/tmp/site"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
KVC=(python3 -m megatron_flux.bench.kernel_vs_cublas --configs ${KVC_CONFIGS:-default table sk}
     --trials "${KVC_TRIALS:-7}" --iters "${KVC_ITERS:-10}" ${KVC_EXTRA:-})
CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-280}" "${KVC[@]}" --ops AG+GEMM \
    --json "${OUT}/kvc-ag.json" > "${OUT}/kvc-ag.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout "${KVC_TIMEOUT:-280}" "${KVC[@]}" --ops GEMM+RS \
    --json "${OUT}/kvc-rs.json" > "${OUT}/kvc-rs.log" 2>&1 &
wait
echo "== kvc done (${SECONDS}s)"
grep -hE "^(AG|GEMM)|Error|error" "${OUT}/kvc-ag.log" "${OUT}/kvc-rs.log" | cut -c1-260
if [ "${SKIP_IL:-0}" != 1 ]; then
    install_carried_wheels || exit 2
    SKIP_TESTS=1 PROFILE=0 IL_ITERS=120 IL_COMM_MS=24.789 OUT="${OUT}/il-off" \
        MEGATRON_FLUX_DIRECT_LAUNCH=0 bash benchmarks/device_interleave.sh 2>&1 | grep -v -i warn | tail -6
fi
echo "== done in ${SECONDS}s"
