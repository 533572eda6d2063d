#!/usr/bin/env bash
# Session 21, one GPU (kind nvidia-h100-x1 / nvidia-h200; again no 2-GPU box lent), comm off.
# Why: issue 3 asks for the fused kernels within 1.02x cuBLAS, communication disabled, on every
# grid shape, and for that to be reported; the last whole-grid run (session 19, call 5) predates
# both Gluon forms. And the Gluon AG kernel walked every step forwards while the Triton kernels
# walk odd steps backwards (serpentine, session 12: 1.2-1.6 % at AG llama3-8b m = 1024).
#   serp   (carry .device/head_ag_gemm_ws.py = `git show HEAD~:megatron_flux/kernels/ag_gemm_ws.py`
#          before the serpentine commit, and .device/aa_ag_gemm_ws.py = a copy of the current one)
#          experiments/kernel_ab.py: the Gluon AG kernel before ("prev") and after ("new") the
#          serpentine order, plus an A/A copy of "new" ("aa"), both forms, the m <= 2048 grid
#          (where a segment has at most group_m row tiles)      -> $OUT/ab-serp-ag.json
#   grid   kernel_vs_cublas on the whole TP 2 grid: per op, the config the backend runs (table,
#          else default) and both Gluon forms at m >= 1024 (extra0 cooperative 128x256x64/3,
#          extra1 ping-pong 128x128x64/5); the small-m set with the backend's config only
#                                     -> $OUT/kvc-grid-{ag,rs}.json, kvc-small.json
#   smallag  the small-m set, GPU time alone: AG+GEMM with the backend's config against merged
#          local rows (ag_merge_local, lead 0: one wait, then every segment's rows in one tile
#          space, so B is streamed once instead of once per segment) with four tiles; GEMM+RS
#          with the backend's config               -> $OUT/kvc-small-ag-merge.json, kvc-small-rs.json
#   smallnew the AG+GEMM small-m set, GPU time alone: the table's config (per segment) against
#          the new default (gathered first)           -> $OUT/kvc-small-ag-default.json
#          and the one-GPU merged-rows tests         -> $OUT/tests-merged.json
#   smallrs  the GEMM+RS small-m set, GPU time alone: the table's config against narrower
#          tiles (more of them, so more SMs stream B) and the plain yardstick GEMM of the same
#          tiles                                       -> $OUT/kvc-small-rs-tiles.json
#   smallrs2 the GEMM+RS small-m set, GPU time alone: the table's config (per segment) against
#          the new default (every rank's rows in one tile space, rs_merge_rows, 64x128x128/4)
#          and merged rows with three other tiles     -> $OUT/kvc-small-rs-merged.json
#          then the one-GPU tests of merged rows and two ranks -> $OUT/tests-merged-rs.json
#   smallrs3 the GEMM+RS small-m set, GPU time: table, default, and merged rows with every
#          tile split along K over the grid (stream_k=1) on three tiles (reverted: apply
#          benchmarks/results/raw/s21/splitk_gemm_rs.patch first, or stream_k does nothing)
#                                                     -> $OUT/kvc-small-rs-splitk.json
#          then the one-GPU tests of merged rows and two ranks -> $OUT/tests-splitk.json
#   smallrs4 the GEMM+RS small-m set (m <= 256), GPU time: the merged default against merged
#          rows with narrower tiles (64x64x128/4, 64x32x256/4, 64x64x256/3): more column tiles,
#          so more SMs stream B at small n             -> $OUT/kvc-small-rs-narrow.json
#   smallrs5 the GEMM+RS small-m set (m <= 256), GPU time: the table's config (per segment)
#          against the default (merged rows, tiles narrowed at small n), twice
#                                                     -> $OUT/kvc-small-rs-default{1,2}.json
#   bigmerge GEMM+RS m = 1024/2048, GPU time: the table's config against merged rows with the
#          same 128x256 tile (B streamed once instead of once per segment) and against the
#          per-segment spread reduction alone (what merging costs without the reuse)
#                                                     -> $OUT/kvc-rs-bigmerge.json
#   splitk   the GEMM+RS small-m set (m <= 256), GPU time: table, default, and merged rows split
#          along K (rs_split_k) on four tiles        -> $OUT/kvc-small-rs-split.json
#   mergedtests (carry .whl) the one-GPU tests of merged rows, gathered rows and two ranks
#                                                     -> $OUT/tests-merged-final.json
#   report the comm-off report of the final tree, GPU time alone (--queue-ahead-ms 5): per op,
#          the table's config and the heuristic default over the whole grid (m = 64-8192), and
#          both Gluon forms at m >= 1024 (extra0 cooperative, extra1 ping-pong)
#                                     -> $OUT/report-{ag,rs}-{small,large}.json
#   tests  (carry .whl) every GPU-marked test on this one GPU -> $OUT/tests-1gpu.json
# On 2 GPUs (kind nvidia-h200-x2): device_s20.sh's tests2 and wsab first (unchanged), then
#   smalltune  tune the small-m set with the new defaults (every rank's rows in one tile space;
#          the per-segment default is a seed) -> $OUT/table-small.json, tune-small.log; then the
#          small-m benchmark with it (MEGATRON_FLUX_CONFIG: the new entries first, the shipped
#          table for the rest): flux, flux_default, auto, nccl, torch_async_tp
#                                                     -> $OUT/bench-small.{json,png,log}
#          To ship: python -m megatron_flux.tuning.confirm TABLE-SMALL BENCH-SMALL OUT, then merge
#          into megatron_flux/tuning/tables/h200-sm132-tp2-bf16.json (and test_tuning.py's chain).
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s21.sh serp grid
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s21}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
case " $* " in
  *" smalltune "*) every_gpu_session ;;
  *) one_gpu_session ;;
esac
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0)
KVC=megatron_flux/bench/kernel_vs_cublas.py
EXP=benchmarks/experiments
PP='"block_n": 128, "num_stages": 5, "num_warps": 4'
COOP='"block_n": 256, "num_stages": 3, "num_warps": 8'
forms() {  # forms KNOB [EXTRA_FIELDS]: the cooperative and ping-pong configs as a JSON list
  local c="\"$1\": true, \"block_m\": 128, \"block_k\": 64, \"epilogue_split\": 1${2:-}"
  echo "[{${c}, ${COOP}}, {${c}, ${PP}}]"
}
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    serp)
      AGF='"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "stream_k": 0'
      timeout 300 python3 ${EXP}/kernel_ab.py --op ag --tp 2 --m 1024 2048 \
          --prev .device/head_ag_gemm_ws.py --variant aa=.device/aa_ag_gemm_ws.py \
          --launcher launch_ag_gemm_ws \
          --forms "{\"coop\": {${AGF}, ${COOP}}, \"pp\": {${AGF}, ${PP}}}" \
          "${TIMING[@]}" --json "${OUT}/ab-serp-ag.json" 2>&1 | grep -v Warning ;;
    grid)
      timeout 200 python3 ${KVC} --tp 2 --ops AG+GEMM --m 1024 2048 4096 8192 --configs table \
          --extra "$(forms ag_warp_specialized ', "stream_k": 0')" "${TIMING[@]}" \
          --json "${OUT}/kvc-grid-ag.json" 2>&1 | grep -v Warning
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 1024 2048 4096 8192 --configs table \
          --extra "$(forms rs_warp_specialized ', "rs_copy_engine": false')" "${TIMING[@]}" \
          --json "${OUT}/kvc-grid-rs.json" 2>&1 | grep -v Warning
      timeout 120 python3 ${KVC} --tp 2 --ops AG+GEMM GEMM+RS --m 64 128 256 512 --configs table \
          "${TIMING[@]}" --json "${OUT}/kvc-small.json" 2>&1 | grep -v Warning ;;
    smallag)  # GPU time alone (--queue-ahead-ms): at small m the host's issue time bounds
      # back-to-back calls of the fused launchers (benchmarks/NOTES.md, session 21)
      M='"ag_merge_local": true, "ag_merge_lead": 0, "stream_k": 0'
      S='"stream_k": 0, "block_m": 64'
      T1='"block_m": 64, "block_n": 128, "block_k": 128, "num_stages": 4, "num_warps": 4'
      T2='"block_m": 64, "block_n": 256, "block_k": 64, "num_stages": 4, "num_warps": 4'
      T3='"block_m": 128, "block_n": 128, "block_k": 128, "num_stages": 3, "num_warps": 8'
      T4='"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8'
      timeout 240 python3 ${KVC} --tp 2 --ops AG+GEMM --m 64 128 256 512 --configs table \
          --extra "[{${M}, ${T1}}, {${M}, ${T2}}, {${M}, ${T3}}, {${M}, ${T4}}]" "${TIMING[@]}" \
          --queue-ahead-ms 5 --json "${OUT}/kvc-small-ag-merge.json" 2>&1 | grep -v Warning
      timeout 120 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 --configs table \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs.json" 2>&1 | grep -v Warning ;;
    smallnew)
      timeout 150 python3 ${KVC} --tp 2 --ops AG+GEMM --m 64 128 256 512 --configs table default \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-ag-default.json" 2>&1 | grep -v Warning
      timeout 200 python3 benchmarks/record_pytest.py "${OUT}/tests-merged.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k "merged" 2>&1 | tail -2 ;;
    smallrs)
      R='"block_m": 64, "num_warps": 4, "rs_copy_engine": false'
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 --configs table \
          --extra "[{${R}, \"block_n\": 64, \"block_k\": 128, \"num_stages\": 4},
                    {${R}, \"block_n\": 64, \"block_k\": 256, \"num_stages\": 3},
                    {${R}, \"block_n\": 128, \"block_k\": 128, \"num_stages\": 4},
                    {${R}, \"block_n\": 64, \"block_k\": 128, \"num_stages\": 4, \"runner\": \"plain\"},
                    {${R}, \"block_n\": 128, \"block_k\": 128, \"num_stages\": 4, \"runner\": \"plain\"}]" \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs-tiles.json" 2>&1 | grep -v Warning ;;
    smallrs2)
      R='"rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false'
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 --configs table default \
          --extra "[{${R}, \"block_m\": 64, \"block_n\": 256, \"block_k\": 64, \"num_stages\": 4, \"num_warps\": 4, \"epilogue_split\": 1},
                    {${R}, \"block_m\": 128, \"block_n\": 128, \"block_k\": 128, \"num_stages\": 3, \"num_warps\": 8, \"epilogue_split\": 1},
                    {${R}, \"block_m\": 128, \"block_n\": 256, \"block_k\": 64, \"num_stages\": 3, \"num_warps\": 8, \"epilogue_split\": 2}]" \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs-merged.json" 2>&1 | grep -v Warning
      timeout 300 python3 benchmarks/record_pytest.py "${OUT}/tests-merged-rs.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k "reduction_paths or two_ranks" 2>&1 | tail -3 ;;
    smallrs3)
      R='"rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "stream_k": 1'
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 512 --configs table default \
          --extra "[{${R}, \"block_m\": 64, \"block_n\": 128, \"block_k\": 128, \"num_stages\": 4, \"num_warps\": 4, \"epilogue_split\": 1},
                    {${R}, \"block_m\": 64, \"block_n\": 256, \"block_k\": 64, \"num_stages\": 4, \"num_warps\": 4, \"epilogue_split\": 1},
                    {${R}, \"block_m\": 128, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 4, \"num_warps\": 8, \"epilogue_split\": 1}]" \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs-splitk.json" 2>&1 | grep -v Warning
      timeout 300 python3 benchmarks/record_pytest.py "${OUT}/tests-splitk.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k "reduction_paths or two_ranks" 2>&1 | tail -3 ;;
    smallrs4)
      R='"rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "block_m": 64, "num_warps": 4, "epilogue_split": 1'
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 --configs default \
          --extra "[{${R}, \"block_n\": 64, \"block_k\": 128, \"num_stages\": 4},
                    {${R}, \"block_n\": 32, \"block_k\": 256, \"num_stages\": 4},
                    {${R}, \"block_n\": 64, \"block_k\": 256, \"num_stages\": 3}]" \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs-narrow.json" 2>&1 | grep -v Warning ;;
    smallrs5)
      for run in 1 2; do
        timeout 100 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 --configs table default \
            "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs-default${run}.json" \
            2>&1 | grep -v Warning
      done ;;
    bigmerge)
      T='"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8, "rs_copy_engine": false'
      M='"rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false'
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 1024 2048 --configs table \
          --extra "[{${T}, ${M}, \"epilogue_split\": 2}, {${T}, ${M}, \"epilogue_split\": 1},
                    {${T}, \"rs_spread_reduce\": true, \"epilogue_split\": 2}]" \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-rs-bigmerge.json" 2>&1 | grep -v Warning ;;
    splitk)
      R='"rs_merge_rows": true, "rs_spread_reduce": true, "rs_tma_push": false, "rs_copy_engine": false, "epilogue_split": 1'
      A='"block_m": 64, "block_n": 128, "block_k": 128, "num_stages": 4, "num_warps": 4'
      B='"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8'
      C='"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 8'
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 64 128 256 --configs table default \
          --extra "[{${R}, ${A}, \"rs_split_k\": 2}, {${R}, ${A}, \"rs_split_k\": 4},
                    {${R}, ${B}, \"rs_split_k\": 2}, {${R}, ${C}, \"rs_split_k\": 2}]" \
          "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/kvc-small-rs-split.json" 2>&1 | grep -v Warning ;;
    mergedtests)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 400 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-merged-final.json" tests/test_kernels_one_gpu.py -q -p no:cacheprovider \
          -k "reduction_paths or two_ranks or merged" 2>&1 | tail -3 ;;
    report)
      for op in AG+GEMM GEMM+RS; do
        short=$([ "${op}" = AG+GEMM ] && echo ag || echo rs)
        knob=$([ "${op}" = AG+GEMM ] && echo ag_warp_specialized || echo rs_warp_specialized)
        more=$([ "${op}" = AG+GEMM ] && echo ', "stream_k": 0' || echo ', "rs_copy_engine": false')
        timeout 120 python3 ${KVC} --tp 2 --ops "${op}" --m 64 128 256 512 --configs table default \
            "${TIMING[@]}" --queue-ahead-ms 5 --json "${OUT}/report-${short}-small.json" 2>&1 | grep -v Warning
        timeout 200 python3 ${KVC} --tp 2 --ops "${op}" --m 1024 2048 4096 8192 --configs table default \
            --extra "$(forms ${knob} "${more}")" "${TIMING[@]}" --queue-ahead-ms 5 \
            --json "${OUT}/report-${short}-large.json" 2>&1 | grep -v Warning
      done ;;
    smalltune)
      timeout 330 python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
          -m megatron_flux.tune --m-set small --max-candidates 8 --top 2 --screen-iters 5 \
          --trials 3 --iters 10 --no-progress --no-merge --out "${OUT}/table-small.json" \
          > "${OUT}/tune-small.log" 2>&1
      echo "   tune exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=" "${OUT}/tune-small.log" | tail -24
      MEGATRON_FLUX_CONFIG="${OUT}/table-small.json" timeout $((590 - SECONDS)) python3 -m \
          torch.distributed.run --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.bench \
          --m-set small --methods cublas_gemm comm nccl torch_async_tp flux flux_default auto \
          --trials 5 --iters 20 --out-json "${OUT}/bench-small.json" --out-png "${OUT}/bench-small.png" \
          > "${OUT}/bench-small.log" 2>&1
      echo "   bench exit $? (${SECONDS}s)"; grep -A8 "^summary" "${OUT}/bench-small.log" ;;
    tests) gpu_tests 560 tests-1gpu || exit 2 ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
