#!/usr/bin/env bash
# Tune on the GPU box (TP = all local GPUs), then benchmark tuned vs untuned vs nccl vs auto, in one job (one
# 10-minute device call):
#   1. megatron-flux tune over the benchmark grid (3 models x 2 ops x 8 m-buckets), writing the
#      table after every entry to $OUT/table.json (TUNE_TIMEOUT bounds it; what was measured stays);
#      then the training config's own GEMMs at m=4096 (TUNE_MODEL_CONFIG; empty skips it);
#   2. the benchmark with MEGATRON_FLUX_CONFIG=$OUT/table.json: flux (tuned), flux_default
#      (untuned), auto, nccl, cublas_gemm, comm, torch_async_tp -> $OUT/bench.json + png.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/tune}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
TUNE_TIMEOUT="${TUNE_TIMEOUT:-250}"
DEADLINE="${DEADLINE:-590}"  # seconds this script may take in all (the benchmark gets the rest)

echo "== tune ($(date +%T))"
timeout "${TUNE_TIMEOUT}" python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
    -m megatron_flux.tools.tune --m-set all --max-candidates 12 --top 2 --screen-iters 5 \
    --trials 3 --iters 10 --no-progress --no-merge --out "${OUT}/table.json" > "${OUT}/tune.log" 2>&1
echo "   exit $? at $(date +%T) (${SECONDS}s)"
grep -E "^(ag|rs) n=" "${OUT}/tune.log" | tail -60
grep -E "Error|Traceback" "${OUT}/tune.log" | head -5

if [ -n "${TUNE_MODEL_CONFIG-configs/llama3_8b_16l.json}" ]; then
    # the training config's own TP GEMMs (QKV, proj, fc1, fc2 and their data gradients), at its
    # tokens per micro-batch; merged into the same table (no bench rows: left unconfirmed)
    echo "== tune ${TUNE_MODEL_CONFIG-configs/llama3_8b_16l.json} ($(date +%T))"
    timeout "${TUNE_MODEL_TIMEOUT:-120}" python3 -m torch.distributed.run --standalone \
        --nproc-per-node "${NGPUS}" -m megatron_flux.tools.tune \
        --model-config "${TUNE_MODEL_CONFIG-configs/llama3_8b_16l.json}" --ms 4096 --max-candidates 12 \
        --top 2 --screen-iters 5 --trials 3 --iters 10 --no-progress --out "${OUT}/table.json" \
        > "${OUT}/tune_model.log" 2>&1
    echo "   exit $? at $(date +%T) (${SECONDS}s)"
    grep -E "^(ag|rs) n=" "${OUT}/tune_model.log" | tail -8
fi

echo "== bench, tuned table ($(date +%T))"
MEGATRON_FLUX_CONFIG="${OUT}/table.json" timeout $((DEADLINE - SECONDS)) python3 -m torch.distributed.run \
    --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.tools.bench --m-set all \
    --methods cublas_gemm comm nccl torch_async_tp flux flux_default auto --trials 5 --iters 20 \
    --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
echo "   exit $? (${SECONDS}s)"
tail -60 "${OUT}/bench.log"
