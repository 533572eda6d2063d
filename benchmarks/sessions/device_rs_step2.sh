#!/usr/bin/env bash
# GEMM+RS per-step schedule, second pass (session 4): the first own tile is peeled before the
# wait. One call on 2 GPUs:
#   1. communication disabled, one GPU, one process per candidate (a faulting candidate leaves a
#      sticky CUDA error that would hide the others)         -> $OUT/kvc-rs-<i>.json, kvc-rs.log
#   2. the GEMM+RS grid: flux = the shipped table's tuned configs pinned to the first schedule,
#      flux_default = the per-step default                   -> $OUT/bench-rs.json
# Ran during session 4 while GemmConfig still had the knob rs_tile_signals (the first GEMM+RS
# schedule), removed right after these runs (commit 8bdb9ff; the intermediate tree was not
# committed). Kept as the record of what ran: its pin of table entries to rs_tile_signals=True
# is now an unknown-field error, so the script does not run on later trees as it stands.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/rs_step2}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
install_carried_wheels || exit 2
export PYTHONPATH="${PWD}:/tmp/site"

echo "== kernel vs cuBLAS, GEMM+RS ($(date +%T))"
for i in 0 1 2 3 4 5; do
    CUDA_VISIBLE_DEVICES=$((i % NGPUS)) timeout 120 python3 -m megatron_flux.bench.kernel_vs_cublas \
        --ops GEMM+RS --only-config "$i" --trials 5 --iters 10 --json "${OUT}/kvc-rs-$i.json" \
        > "${OUT}/kvc-rs-$i.log" 2>&1 &
    if [ $((i % NGPUS)) -eq $((NGPUS - 1)) ]; then wait; fi
done
wait
for i in 0 1 2 3 4 5; do echo "-- candidate $i"; grep -E "^GEMM\+RS|Error" "${OUT}/kvc-rs-$i.log" | tail -13; done > "${OUT}/kvc-rs.log"
cat "${OUT}/kvc-rs.log"; rm -f "${OUT}"/kvc-rs-?.log
echo "   (${SECONDS}s)"

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
MEGATRON_FLUX_CONFIG="${OUT}/first-schedule.json" timeout $((590 - SECONDS)) \
    python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.bench \
    --ops GEMM+RS --m-set all --methods cublas_gemm comm nccl torch_async_tp flux flux_default \
    --trials 7 --iters 20 --out-json "${OUT}/bench-rs.json" --out-png "${OUT}/bench-rs.png" \
    > "${OUT}/bench-rs.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -A8 "^summary" "${OUT}/bench-rs.log"
