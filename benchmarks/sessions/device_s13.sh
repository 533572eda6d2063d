#!/usr/bin/env bash
# Session 13, one GPU (kind nvidia-h200; no 2-GPU box lent this session), communication off:
#   tests  the GPU-marked tests on this one GPU (2-GPU ones skip), with the phase-stamp tests
#                                                       -> $OUT/tests-1gpu.json
#   trace  where the fused kernels' time goes: per-program phase stamps of GEMM+RS and AG+GEMM
#          against the plain yardstick of the same tile (experiments/phase_trace.py), TP 2,
#          llama3-8b m = 1024-4096 (the shapes furthest behind cuBLAS), gpt3-175b m = 1024
#                                                       -> $OUT/trace-{rs,ag}.json
#   agsweep AG+GEMM tiles at llama3-8b m = 1024/2048 (TP 2) with stream-K allowed for a last
#          wave up to 0.45 of the grid (128x256 at m = 1024 leaves 0.39): kernel_vs_cublas
#          --extra, the plain yardstick beside        -> $OUT/agsweep.json
#   rsvar  (carry .device/v1_gemm_rs.py and .device/v3_gemm_rs.py) two ways to shorten GEMM+RS's
#          reduction epilogue (4-5 us per own tile in the trace): v1 issues both column halves'
#          TMA loads before adding; v3 starts every own tile after the first from the peers'
#          partials, so its epilogue is a plain store. kernel_ab, TP 2 grid ("prev" = v1)
#                                                       -> $OUT/rsvar.json, $OUT/trace-rs-v{1,3}.json
#   agorder whether AG+GEMM's per-segment tile order (4 row tiles per segment at llama3-8b
#          m = 1024, TP 2) is what makes its tiles slower than the plain GEMM's: the plain
#          yardstick with group_m 4 / 8 / 16                -> $OUT/agorder.json
#   flat   (carry .device/prev_gemm_rs.py = `git show 8d11048:megatron_flux/kernels/gemm_rs.py`)
#          GEMM+RS with its reduction tile loop really flattened (the peers' TMA reads unrolled)
#          against 8d11048, whose loop never flattened; "new+" = the new kernel unflattened.
#          TP 2 grid, TP 4 on llama3-8b/70b; then the phase stamps of the new kernel
#                                                       -> $OUT/flat-rs-tp*.json, $OUT/trace-rs-flat.json
#   rsread (carry .device/v4_gemm_rs.py and .device/v5_gemm_rs.py) the reduction epilogue's
#          reads: v4 reads each peer's whole tile in one TMA load instead of two column halves
#          (one latency); v5 (diagnostic, wrong sums) reads nothing. kernel_ab ("prev" = v4),
#          TP 2 grid, then their phase stamps     -> $OUT/rsread.json, $OUT/trace-rs-v{4,5}.json
#   kvc    comm off at TP 2 on the whole m >= 1024 grid: table configs, the heuristic default
#          and the plain yardstick (kernel_vs_cublas)   -> $OUT/kvc-tp2.json
#   trace48 the phase stamps at TP 4 and 8 (table or default configs), llama3-8b/70b m = 1024
#          and 4096, both ops                          -> $OUT/trace-{ag,rs}-tp{4,8}.json
#   fence  (carry .device/prev_gemm_rs.py = `git show b6f2f4d:megatron_flux/kernels/gemm_rs.py`)
#          GEMM+RS's last arrival raising every owner's signal after one system fence with
#          relaxed writes, instead of one release write (one fence) per owner: the GPU tests,
#          then kernel_ab at TP 8, 4, 2 on llama3-8b/70b  -> $OUT/fence-rs-tp*.json
#   peergroup (not run in session 13: no device time left; carry .device/prev_ag_gemm.py = any
#          copy of the current kernels/ag_gemm.py) AG+GEMM with the peers' segments grouped
#          (ag_peer_group 2 / 8, kernel_ab's "new+" runner) at TP 4 and 8
#                                                       -> $OUT/peergroup-ag-tp*-g*.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s13.sh tests trace ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s13}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0)
EXP=benchmarks/experiments
KVC=megatron_flux/bench/kernel_vs_cublas.py
for what in "$@"; do
  case "${what}" in
    tests)
      one_gpu_tests || exit 1 ;;
    trace)
      timeout 150 python3 ${EXP}/phase_trace.py --op rs --tp 2 --models llama3-8b gpt3-175b \
          --m 1024 2048 4096 --configs table --json "${OUT}/trace-rs.json" 2>&1 | grep -v Warning
      timeout 120 python3 ${EXP}/phase_trace.py --op ag --tp 2 --models llama3-8b \
          --m 1024 2048 --configs table --json "${OUT}/trace-ag.json" 2>&1 | grep -v Warning ;;
    agsweep)
      timeout 240 python3 ${KVC} --tp 2 --ops AG+GEMM --models llama3-8b --m 1024 2048 \
          --configs default table plain --sk-max-tail 0.45 "${TIMING[@]}" --extra '[
            {"block_n": 256, "num_stages": 3, "num_warps": 8, "epilogue_split": 2, "stream_k": 1},
            {"block_n": 256, "num_stages": 3, "num_warps": 8, "epilogue_split": 2, "stream_k": 0},
            {"block_n": 256, "num_stages": 3, "num_warps": 8, "epilogue_split": 1, "stream_k": 1,
             "warp_specialize": true},
            {"block_m": 256, "block_n": 128, "num_stages": 3, "num_warps": 8, "epilogue_split": 1,
             "stream_k": 1},
            {"block_n": 128, "num_stages": 4, "num_warps": 8, "epilogue_split": 1, "stream_k": 1},
            {"block_m": 64, "block_n": 256, "num_stages": 4, "num_warps": 4, "epilogue_split": 1,
             "stream_k": 1},
            {"runner": "plain", "block_n": 256, "num_stages": 3, "num_warps": 8}]' \
          --json "${OUT}/agsweep.json" 2>&1 | grep -v Warning ;;
    rsvar)
      timeout 300 python3 ${EXP}/kernel_ab.py --op rs --prev .device/v1_gemm_rs.py \
          --variant v3=.device/v3_gemm_rs.py --tp 2 "${TIMING[@]}" --json "${OUT}/rsvar.json" \
          2>&1 | grep -v Warning
      for v in 1 3; do
        timeout 100 python3 ${EXP}/phase_trace.py --op rs --tp 2 --models llama3-8b gpt3-175b \
            --m 1024 4096 --configs table --module .device/v${v}_gemm_rs.py \
            --json "${OUT}/trace-rs-v${v}.json" 2>&1 | grep -v Warning
      done ;;
    agorder)
      timeout 150 python3 ${KVC} --tp 2 --ops AG+GEMM --models llama3-8b --m 1024 2048 \
          --configs default plain "${TIMING[@]}" --extra '[
            {"runner": "plain", "group_m": 4}, {"runner": "plain", "group_m": 16},
            {"runner": "plain", "group_m": 2}]' --json "${OUT}/agorder.json" 2>&1 | grep -v Warning ;;
    flat)
      one_gpu_tests || exit 1
      timeout 200 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp 2 \
          --new-override '{"flatten_consume": false}' "${TIMING[@]}" \
          --json "${OUT}/flat-rs-tp2.json" 2>&1 | grep -v Warning
      timeout 100 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp 4 \
          --models llama3-8b llama3-70b --m 1024 2048 4096 \
          --new-override '{"flatten_consume": false}' "${TIMING[@]}" \
          --json "${OUT}/flat-rs-tp4.json" 2>&1 | grep -v Warning
      timeout 100 python3 ${EXP}/phase_trace.py --op rs --tp 2 --models llama3-8b gpt3-175b \
          --m 1024 4096 --configs table --json "${OUT}/trace-rs-flat.json" 2>&1 | grep -v Warning ;;
    rsread)
      timeout 300 python3 ${EXP}/kernel_ab.py --op rs --prev .device/v4_gemm_rs.py \
          --variant v5=.device/v5_gemm_rs.py --tp 2 "${TIMING[@]}" --json "${OUT}/rsread.json" \
          2>&1 | grep -v Warning
      for v in 4 5; do
        timeout 100 python3 ${EXP}/phase_trace.py --op rs --tp 2 --models llama3-8b gpt3-175b \
            --m 1024 4096 --configs table --module .device/v${v}_gemm_rs.py \
            --json "${OUT}/trace-rs-v${v}.json" 2>&1 | grep -v Warning
      done ;;
    kvc)
      timeout 400 python3 ${KVC} --tp 2 --configs table default plain "${TIMING[@]}" \
          --json "${OUT}/kvc-tp2.json" 2>&1 | grep -v Warning ;;
    trace48)
      for tp in 4 8; do
        for op in ag rs; do
          timeout 120 python3 ${EXP}/phase_trace.py --op ${op} --tp ${tp} \
              --models llama3-8b llama3-70b --m 1024 4096 --configs table \
              --json "${OUT}/trace-${op}-tp${tp}.json" 2>&1 | grep -v Warning
        done
      done ;;
    fence)
      one_gpu_tests || exit 1
      for tp in 8 4 2; do
        timeout 100 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp ${tp} \
            --models llama3-8b llama3-70b --m 1024 2048 4096 "${TIMING[@]}" \
            --json "${OUT}/fence-rs-tp${tp}.json" 2>&1 | grep -v Warning
      done ;;
    peergroup)
      for tp in 4 8; do
        for g in 2 8; do
          timeout 120 python3 ${EXP}/kernel_ab.py --op ag --prev .device/prev_ag_gemm.py \
              --tp ${tp} --models llama3-8b llama3-70b --m 1024 2048 4096 \
              --new-override "{\"ag_peer_group\": ${g}}" "${TIMING[@]}" \
              --json "${OUT}/peergroup-ag-tp${tp}-g${g}.json" 2>&1 | grep -v Warning
        done
      done ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
