#!/usr/bin/env bash
# One device call (2 GPUs, < 10 minutes), session 7: retune GEMM+RS at m >= 1024 on the current
# kernels (TMA reduction, new knobs in the search) with the tuner's 1 % rule for leaving the
# default, plus AG+GEMM llama3-8b at m = 1024/2048, then benchmark the shipped table with those
# entries replaced:
#   1. tune rs, 3 models x m in {1024..8192}       -> $OUT/table-new.json, tune-rs.log
#      tune ag:14336:4096 at m 1024 2048            -> merged into the same file, tune-ag.log
#   2. shipped table <- new entries                  -> $OUT/table.json
#   3. benchmark m >= 1024, flux = that table         -> $OUT/bench.json, .png, .log
# Then (on this machine): python -m megatron_flux.tuning.confirm $OUT/table.json $OUT/bench.json
#   megatron_flux/tuning/tables/h200-sm132-tp2-bf16.json
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s7.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s7}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
TUNE=(--max-candidates 16 --top 3 --screen-iters 5 --trials 5 --iters 10 --min-gain 0.01 --no-progress)
echo "== tune rs ($(date +%T))"
timeout 250 "${RUN[@]}" -m megatron_flux.tune --ops rs --m-set large "${TUNE[@]}" --no-merge \
    --out "${OUT}/table-new.json" > "${OUT}/tune-rs.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=|Error|Traceback" "${OUT}/tune-rs.log" | head -20
echo "== tune ag llama3-8b m 1024 2048 ($(date +%T))"
timeout 100 "${RUN[@]}" -m megatron_flux.tune --shapes ag:14336:4096 --ms 1024 2048 "${TUNE[@]}" \
    --max-candidates 24 --out "${OUT}/table-new.json" > "${OUT}/tune-ag.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=|Error|Traceback" "${OUT}/tune-ag.log" | head -5
python3 - "${OUT}" <<'PY'
import sys
from megatron_flux.tuning.schema import load_table, merge_tables, write_table
out = sys.argv[1]
shipped = load_table("megatron_flux/tuning/tables/h200-sm132-tp2-bf16.json")
new = load_table(f"{out}/table-new.json")
merged = merge_tables(shipped, new)
write_table(merged, f"{out}/table.json")
for e in new.entries:
    print(f"   new {e.op} n={e.n} k={e.k} m={e.m} flux {e.flux_ms:.4f} nccl {e.nccl_ms:.4f} "
          f"default {e.notes.get('default_ms')} kept_default {e.notes.get('kept_default')}")
print(f"   {len(merged.entries)} entries in the merged table")
PY
echo "== bench ($(date +%T), ${SECONDS}s)"
MEGATRON_FLUX_CONFIG="${OUT}/table.json" timeout $((585 - SECONDS)) "${RUN[@]}" -m megatron_flux.bench \
    --m-set large --methods cublas_gemm comm nccl torch_async_tp flux flux_default --trials 5 \
    --iters 20 --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
echo "   exit $? (${SECONDS}s)"; grep -A12 "^summary" "${OUT}/bench.log"
tar czf "${OUT}/tune-logs.tgz" -C "${OUT}" tune-rs.log tune-ag.log && rm -f "${OUT}"/tune-*.log
echo "== done in ${SECONDS}s"
