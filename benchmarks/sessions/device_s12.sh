#!/usr/bin/env bash
# Session 12, one GPU (kind nvidia-h200; no 2-GPU box lent this session), communication off:
#   serp  (carry .whl, .device/prev_ag_gemm.py and .device/prev_gemm_rs.py = `git show
#         fa77dad:megatron_flux/kernels/<file>`): the GPU-marked tests on this one GPU (2-GPU
#         ones skip) -> $OUT/tests-1gpu.json; then both fused kernels with odd steps walked
#         backwards (serpentine) against fa77dad (experiments/kernel_ab.py): TP 2 on the whole
#         m >= 1024 grid, TP 4 and 8 on llama3-8b/70b   -> $OUT/serp-{ag,rs}-tp*.json
#   pf    (carry .whl, .device/prev_gemm_rs.py = `git show dec8e32:megatron_flux/kernels/gemm_rs.py`)
#         GEMM+RS prefetching the peers' partials into L2 as each own tile starts, against
#         dec8e32 (kernel_ab), TP 2 on the grid, TP 4 and 8 on llama3-8b/70b
#                                                       -> $OUT/pf-rs-tp*.json
#   spread (carry .whl, .device/prev_gemm_rs.py as for pf) the GPU-marked tests on one GPU, then
#         GEMM+RS with the reduction spread over the grid (rs_spread_reduce) against the
#         epilogue reduction: kernel_ab's "new+" runner, TP 2/4/8, small and training m
#                                                       -> $OUT/spread-rs-tp*.json
#   kvc   comm off at TP 2 on the whole m >= 1024 grid, table configs, the heuristic default and
#         the plain yardstick (kernel_vs_cublas)           -> $OUT/kvc-tp2.json
#   rt    (carry .device/rt_ag_gemm.py and .device/rt_gemm_rs.py: the kernels with the step loop
#         a runtime loop instead of unrolled, `tl.static_range` -> `range`) the unrolled
#         package kernels against them at TP 4 and 8 (kernel_ab, "prev" = runtime loop)
#                                                       -> $OUT/rt-{ag,rs}-tp*.json
#   unroll (carry .whl, .device/prev_{ag_gemm,gemm_rs}.py = `git show d85f94d:...`) the GPU-marked
#         tests on one GPU, then the kernels with the step loop unrolled only up to TP 4
#         against d85f94d (always unrolled): TP 8 (runtime loop now) and TP 2 (same code)
#                                                       -> $OUT/unroll-{ag,rs}-tp*.json
#   kvc48 comm off at TP 4 and 8 on the m >= 1024 grid, table (TP 4 has one) and default configs
#         and the plain yardstick                         -> $OUT/kvc-tp{4,8}.json
#   spread2 the spread reduction again after the one-GPU wiring fix (the own signal was pre-set,
#         so the spread consumers did not wait for their own grid): TP 8 (spread by default;
#         "new+" = epilogue reduction) and TP 4 ("new+" = spread)  -> $OUT/spread2-rs-tp*.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s12.sh serp ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s12}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0)
EXP=benchmarks/experiments
declare -A PREV=([ag]=.device/prev_ag_gemm.py [rs]=.device/prev_gemm_rs.py)
for what in "$@"; do
  case "${what}" in
    serp)
      one_gpu_tests || exit 1
      for op in ag rs; do
        timeout 150 python3 ${EXP}/kernel_ab.py --op ${op} --prev "${PREV[${op}]}" \
            --tp 2 "${TIMING[@]}" --json "${OUT}/serp-${op}-tp2.json" 2>&1 | grep -v Warning
        for tp in 4 8; do
          timeout 90 python3 ${EXP}/kernel_ab.py --op ${op} --prev "${PREV[${op}]}" \
              --tp ${tp} --models llama3-8b llama3-70b --m 1024 2048 4096 "${TIMING[@]}" \
              --json "${OUT}/serp-${op}-tp${tp}.json" 2>&1 | grep -v Warning
        done
      done ;;
    pf)
      timeout 150 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp 2 \
          "${TIMING[@]}" --json "${OUT}/pf-rs-tp2.json" 2>&1 | grep -v Warning
      for tp in 4 8; do
        timeout 90 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp ${tp} \
            --models llama3-8b llama3-70b --m 1024 2048 4096 "${TIMING[@]}" \
            --json "${OUT}/pf-rs-tp${tp}.json" 2>&1 | grep -v Warning
      done ;;
    spread)
      one_gpu_tests || exit 1
      for tp in 2 4 8; do
        timeout 130 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp ${tp} \
            --models llama3-8b llama3-70b gpt3-175b --m 256 1024 2048 4096 \
            --new-override '{"rs_spread_reduce": true}' "${TIMING[@]}" \
            --json "${OUT}/spread-rs-tp${tp}.json" 2>&1 | grep -v Warning
      done ;;
    rt)
      for op in ag rs; do
        for tp in 4 8; do
          timeout 100 python3 ${EXP}/kernel_ab.py --op ${op} --prev ".device/rt_${PREV[${op}]#.device/prev_}" \
              --tp ${tp} --models llama3-8b llama3-70b gpt3-175b --m 1024 2048 4096 "${TIMING[@]}" \
              --json "${OUT}/rt-${op}-tp${tp}.json" 2>&1 | grep -v Warning
        done
      done ;;
    unroll)
      one_gpu_tests || exit 1
      for op in ag rs; do
        for tp in 8 2; do
          timeout 100 python3 ${EXP}/kernel_ab.py --op ${op} --prev "${PREV[${op}]}" --tp ${tp} \
              --models llama3-8b llama3-70b gpt3-175b --m 1024 2048 4096 "${TIMING[@]}" \
              --json "${OUT}/unroll-${op}-tp${tp}.json" 2>&1 | grep -v Warning
        done
      done ;;
    spread2)
      timeout 100 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp 8 \
          --models llama3-8b llama3-70b gpt3-175b --m 1024 2048 4096 \
          --new-override '{"rs_spread_reduce": false}' "${TIMING[@]}" \
          --json "${OUT}/spread2-rs-tp8.json" 2>&1 | grep -v Warning
      timeout 100 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp 4 \
          --models llama3-8b llama3-70b gpt3-175b --m 1024 2048 4096 \
          --new-override '{"rs_spread_reduce": true}' "${TIMING[@]}" \
          --json "${OUT}/spread2-rs-tp4.json" 2>&1 | grep -v Warning ;;
    kvc48)
      for tp in 4 8; do
        timeout 200 python3 -m megatron_flux.bench.kernel_vs_cublas --tp ${tp} --configs table default plain \
            "${TIMING[@]}" --json "${OUT}/kvc-tp${tp}.json" 2>&1 | grep -E "^(AG|GEMM)"
      done ;;
    kvc)
      timeout 420 python3 -m megatron_flux.bench.kernel_vs_cublas --tp 2 --configs table default plain \
          "${TIMING[@]}" --json "${OUT}/kvc-tp2.json" 2>&1 | grep -E "^(AG|GEMM)" ;;
  esac
  echo "== ${what} done at ${SECONDS}s"
done
