#!/usr/bin/env bash
# Finish a tune that ran out of time (session 4: device_tune.sh's grid tune stopped after 26 of
# 48 entries at TUNE_TIMEOUT=240 s), in one call on 2 GPUs:
#   1. start from the partial table (TUNE_PART), tune the entries it lacks, merging into it:
#      llama3-8b (both ops), llama3-70b GEMM+RS at m >= 256;
#   2. the Llama training config's own GEMMs at m = 4096 (merged, unconfirmed);
#   3. the benchmark with the merged table -> $OUT/bench.json (what tuning/confirm.py reads).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/tune_rest}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
cp "${TUNE_PART:-benchmarks/results/raw/tune-h200x2-s4/table-part1.json}" "${OUT}/table.json"
TUNE=(--max-candidates 12 --top 2 --screen-iters 5 --trials 3 --iters 10 --no-progress --out "${OUT}/table.json")
tune() {  # tune LOG ARGS...
    local log="$1"; shift
    timeout 260 python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
        -m megatron_flux.tune "$@" "${TUNE[@]}" > "${OUT}/${log}" 2>&1
    echo "   ${log}: exit $? at $(date +%T) (${SECONDS}s)"
}
echo "== tune the rest ($(date +%T))"
tune tune-8b.log --models llama3-8b --m-set all
tune tune-70b-rs.log --models llama3-70b --ops rs --ms 256 512 1024 2048 4096 8192
tune tune-model.log --model-config configs/llama3_8b_16l.json --ms 4096
python3 -c "import json; print(len(json.load(open('${OUT}/table.json'))['entries']), 'entries')"

echo "== bench, merged table ($(date +%T))"
MEGATRON_FLUX_CONFIG="${OUT}/table.json" timeout $((590 - SECONDS)) python3 -m torch.distributed.run \
    --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.bench --m-set all \
    --methods cublas_gemm comm nccl torch_async_tp flux flux_default auto --trials 5 --iters 20 \
    --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -A20 "^summary" "${OUT}/bench.log"
tar czf "${OUT}/tune-logs.tgz" -C "${OUT}" tune-8b.log tune-70b-rs.log tune-model.log && rm -f "${OUT}"/tune-*.log
