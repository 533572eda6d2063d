#!/usr/bin/env bash
# GEMM+RS per-step schedule (session 4), one 10-minute call on 2 GPUs:
#   1. communication disabled, one GPU: the first schedule (per-tile signals, vector stores,
#      unflattened producer) against the per-step schedule's knobs, vs cuBLAS  -> $OUT/kvc-rs.json
#   2. the GPU-marked tests (RS knobs over every shape, back-to-back RS schedules, pull AG)
#                                                                             -> $OUT/tests-gpu.json
#   3. the GEMM+RS grid: flux = the shipped TP table's tuned configs on the first schedule
#      (exactly what earlier benchmarks ran), flux_default = the per-step default, in one
#      interleaved loop with nccl, torch async-TP, cuBLAS and the collective -> $OUT/bench-rs.json
# Ran during session 4 while GemmConfig still had the knob rs_tile_signals (the first GEMM+RS
# schedule), removed right after these runs (commit 8bdb9ff; the intermediate tree was not
# committed). Kept as the record of what ran: its pin of table entries to rs_tile_signals=True
# is now an unknown-field error, so the script does not run on later trees as it stands.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/rs_step}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
install_carried_wheels || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
DEADLINE="${DEADLINE:-585}"

echo "== kernel vs cuBLAS, GEMM+RS ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m megatron_flux.bench.kernel_vs_cublas --ops GEMM+RS \
    --trials 5 --iters 10 --json "${OUT}/kvc-rs.json" > "${OUT}/kvc-rs.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -v -i warn "${OUT}/kvc-rs.log" | tail -14

echo "== GPU tests ($(date +%T))"
timeout 230 python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -v \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -E "PASS|FAIL|ERROR|passed|failed" "${OUT}/tests-gpu.log" | tail -12

echo "== bench GEMM+RS ($(date +%T))"
python3 - "${NGPUS}" "${OUT}/first-schedule.json" <<'PY'
import json, sys
tp, out = sys.argv[1], sys.argv[2]
t = json.load(open(f"megatron_flux/tuning/tables/h200-sm132-tp{tp}-bf16.json"))
for e in t["entries"]:
    if e["op"] == "rs":
        e["config"].update(rs_tile_signals=True, rs_tma_push=False, flatten_consume=False)
t["source"] += " (GEMM+RS entries pinned to the first schedule for comparison)"
json.dump(t, open(out, "w"))
PY
MEGATRON_FLUX_CONFIG="${OUT}/first-schedule.json" timeout $((DEADLINE - SECONDS)) \
    python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.bench \
    --ops GEMM+RS --m-set all --methods cublas_gemm comm nccl torch_async_tp flux flux_default \
    --trials 7 --iters 20 --out-json "${OUT}/bench-rs.json" --out-png "${OUT}/bench-rs.png" \
    > "${OUT}/bench-rs.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -v -i warn "${OUT}/bench-rs.log" | tail -45
