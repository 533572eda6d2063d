#!/usr/bin/env bash
# Session 22, one GPU (kind nvidia-h100-x1 / nvidia-h200; again no 2-GPU box lent), comm off.
# Why: at small m the GEMM streams B from memory, and a merged GEMM+RS tile loop with fewer
# tiles than SMs leaves SMs idle (gpt3-175b m = 128: 96 tiles of 128x128 on 132 SMs, 1.25-1.41x
# cuBLAS). rs_split_k now takes any count 1..16, so tiles x slices can fill the grid evenly.
#   splitsweep the GEMM+RS small-m set (m = 64-512), GPU time alone: table, default, merged rows
#          with three tiles split along K into 2, 3, 4, 6 slices, and the plain yardstick of the
#          default's tile                              -> $OUT/kvc-rs-split-sweep.json
#          then the one-GPU tests of the reduction paths (split into 3 slices among them)
#          and of two ranks                            -> $OUT/tests-split.json
#   gluonsmall the small-m GEMMs alone (AG's [m, K] x [K, fc1 / TP] and GEMM+RS's merged
#          [m, K] x [K, h]), GPU time: cuBLAS, the plain Triton yardstick (three tiles) and the
#          warp-specialized Gluon GEMM (ping-pong, a dedicated load warp, deeper rings): would
#          small m gain from moving the gathered / merged schedules onto it?
#                                                     -> $OUT/gluon-small.json
#   wsmerged every rank's rows in one tile space on the warp-specialized Gluon
#          GEMM+RS (rs_warp_specialized + rs_merge_rows): the one-GPU tests of the reduction
#          paths and two ranks                      -> $OUT/tests-wsmerged.json
#          then the GEMM+RS small-m set, GPU time: table, default, and merged rows on the Gluon
#          kernel, ping-pong 64x128x64/8, 64x128x128/4, 128x128x64/5, cooperative 128x256x64/3
#                                                     -> $OUT/kvc-rs-wsmerged.json
#   wskvc  the kvc half of wsmerged alone (the GEMM+RS small-m set: table, default, merged
#          rows on the Gluon kernel)                 -> $OUT/kvc-rs-wsmerged.json
#   wskvc2 a replicate of wskvc's timing with ping-pong 128x128x64/5 and 64x128x64/8, and a
#          narrow 64x64x128/6 for small n          -> $OUT/kvc-rs-wsmerged2.json
#   wsbig  GEMM+RS m = 1024/2048, GPU time: the table's config against merged rows on the Gluon
#          kernel (cooperative 128x256x64/3, ping-pong 128x128x64/5): does one tile space
#          help the Gluon forms where the per-segment ones lost?  -> $OUT/kvc-rs-wsbig.json
#   wstests the one-GPU tests of the Gluon merged rows (bias, fp16, TP 4, 40 rows per rank,
#          the loud timeout) with the reduction paths and two ranks  -> $OUT/tests-ws.json
#   tests  (carry .whl) every GPU-marked test on this one GPU -> $OUT/tests-1gpu.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s22.sh splitsweep
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s22}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
KVC=megatron_flux/bench/kernel_vs_cublas.py
EXP=benchmarks/experiments
MERGED='"rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "epilogue_split": 1'
T64='"block_m": 64, "block_n": 128, "block_k": 128, "num_stages": 4, "num_warps": 4'
T128='"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 8'
T256='"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8'
splits() {  # splits TILE S...: merged-rows configs of TILE split along K into S slices
  local tile="$1"; shift
  for s in "$@"; do printf '{%s, %s, "rs_split_k": %s}, ' "${MERGED}" "${tile}" "${s}"; done
}
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    splitsweep)
      EXTRA="[$(splits "${T128}" 1 2 3 4 6)$(splits "${T64}" 2 3 4)$(splits "${T256}" 2 3){\"runner\": \"plain\"}]"
      timeout 560 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 --configs table default \
          --extra "${EXTRA}" "${TIMING[@]}" --json "${OUT}/kvc-rs-split-sweep.json" 2>&1 | grep -v Warning
      timeout $((590 - SECONDS)) python3 benchmarks/record_pytest.py "${OUT}/tests-split.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k "reduction_paths or two_ranks" 2>&1 | tail -3 ;;
    gluonsmall)
      SHAPES=()
      for m in 64 128 256; do
        SHAPES+=("${m}x24576x12288" "${m}x28672x8192" "${m}x14336x4096"
                 "${m}x12288x24576" "${m}x8192x28672" "${m}x4096x14336")
      done
      timeout 400 python3 ${EXP}/gluon_ws_gemm.py --shapes "${SHAPES[@]}" --ag-world 1 \
          --plain-configs 64x128x128x4x4 128x128x64x4x8 128x256x64x3x8 \
          --ws-configs 64x128x64x8 64x128x128x4 128x128x64x5 \
          --trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5 \
          --json "${OUT}/gluon-small.json" 2>&1 | grep -v Warning ;;
    wsmerged|wskvc)
      [ "${what}" = wsmerged ] && timeout 300 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-wsmerged.json" tests/test_kernels_one_gpu.py -q -p no:cacheprovider \
          -k "reduction_paths or two_ranks" 2>&1 | tail -15
      W='"rs_warp_specialized": true, "rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "epilogue_split": 1, "rs_split_k": 1'
      timeout 240 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 \
          --configs table default \
          --extra "[{${W}, \"block_m\": 64, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 8, \"num_warps\": 4},
                    {${W}, \"block_m\": 64, \"block_n\": 128, \"block_k\": 128, \"num_stages\": 4, \"num_warps\": 4},
                    {${W}, \"block_m\": 128, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 5, \"num_warps\": 4},
                    {${W}, \"block_m\": 128, \"block_n\": 256, \"block_k\": 64, \"num_stages\": 3, \"num_warps\": 8}]" \
          "${TIMING[@]}" --json "${OUT}/kvc-rs-wsmerged.json" 2>&1 | grep -v Warning ;;
    wskvc2)
      W='"rs_warp_specialized": true, "rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "epilogue_split": 1, "rs_split_k": 1, "num_warps": 4'
      timeout 240 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 --configs table default \
          --extra "[{${W}, \"block_m\": 128, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 5},
                    {${W}, \"block_m\": 64, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 8},
                    {${W}, \"block_m\": 64, \"block_n\": 64, \"block_k\": 128, \"num_stages\": 6}]" \
          "${TIMING[@]}" --json "${OUT}/kvc-rs-wsmerged2.json" 2>&1 | grep -v Warning ;;
    wsbig)
      W='"rs_warp_specialized": true, "rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "epilogue_split": 1, "rs_split_k": 1, "block_m": 128, "block_k": 64'
      timeout 240 python3 ${KVC} --tp 2 --ops GEMM+RS --m 1024 2048 --configs table \
          --extra "[{${W}, \"block_n\": 256, \"num_stages\": 3, \"num_warps\": 8},
                    {${W}, \"block_n\": 128, \"num_stages\": 5, \"num_warps\": 4}]" \
          "${TIMING[@]}" --json "${OUT}/kvc-rs-wsbig.json" 2>&1 | grep -v Warning ;;
    wstests)
      timeout 400 python3 benchmarks/record_pytest.py "${OUT}/tests-ws.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider \
          -k "ws_merged or loudly or reduction_paths or two_ranks" 2>&1 | tail -4 ;;
    tests) gpu_tests $((590 - SECONDS)) tests-1gpu || exit 2 ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
