#!/usr/bin/env bash
# Session 19, one GPU (kind nvidia-h200; no 2-GPU box lent this session), communication off.
# Why: session 18's kvctrain (run in this session's call 1) put GEMM+RS at 1.08-1.14x cuBLAS on
# the training step's short-K shapes (proj k = 2048, qkv dgrad k = 3072 per rank, m = 8192),
# where the plain yardstick of the same tile runs 1.01-1.03x: the fused structure, not the GEMM.
#   rsflat   (carry .device/{head,flath,noread}_gemm_rs.py) kernel_ab, GEMM+RS: HEAD's kernel as
#            "prev" (an A/A control against the package's "new"), "new+" = split epilogue,
#            "flath" = reduction loop flattened (peers' reads unrolled, half-tile reads so it
#            fits shared memory, split epilogue), "noread" = no partial reads (diagnostic, wrong
#            sums): training shapes m = 8192, then llama3-8b and gpt3-175b m = 1024-8192
#                                                  -> $OUT/rsflat-train.json, rsflat-grid.json
#   rspf     (carry .device/{head,pf,pfall,noread}_gemm_rs.py) kernel_ab, GEMM+RS: "pf" bulk-prefetches
#            the peers' partial rows of each own tile after the first into L2 before its K loop,
#            "pfall" for the first (peeled, before the wait) too; training shapes m = 4096/8192,
#            grid llama3-8b, gpt3-175b, llama3-70b    -> $OUT/rspf-train.json, rspf-grid.json
#   rsacc    (carry .device/{head,accinit}_gemm_rs.py) kernel_ab, GEMM+RS: own tiles after the first
#            start their accumulator from the peers' partials (reads before the K loop, none in
#            the epilogue; rank 0 only, an experiment) -> $OUT/rsacc-train.json
#   chunks   experiments/cublas_chunks.py: cuBLAS cut into per-rank row chunks (c = 1, 2, 4 per
#            segment; GEMM+RS own chunks as addmm onto a received partial) against one cuBLAS
#            GEMM and the fused kernel: training shapes, and GEMM+RS llama3-8b/70b grid
#                                        -> $OUT/chunks-{rs,ag}-train.json, chunks-rs-grid.json
#   traceag  phase stamps, AG+GEMM proj dgrad and fc2 dgrad (training shapes, m = 8192)
#                                                  -> $OUT/trace-ag-train.json
#   kvcgrid  kernel_vs_cublas on the TP 2 grid (m >= 1024), table config and plain yardstick
#                                                  -> $OUT/kvc-grid.json
#   ws       (carry .whl) the package's warp-specialized GEMM+RS (rs_warp_specialized): the one-GPU
#            tests (test_kernels_one_gpu.py, with its WS cases) -> $OUT/tests-ws-1gpu.json; then
#            kernel_vs_cublas, GEMM+RS, table and plain against WS 128x128x64 at 5 and 4 stages:
#            training shapes m = 4096/8192 and the TP 2 grid  -> $OUT/kvc-ws-{train,grid}.json
#   wsag     (carry .whl) the same for AG+GEMM (ag_warp_specialized): one-GPU tests again (with the AG
#            cases) -> $OUT/tests-ws2-1gpu.json; kernel_vs_cublas AG+GEMM, table and default
#            against WS 128x128x64/5 -> $OUT/kvc-wsag-{train,grid}.json
#   pair     (carry .whl) the two-ranks-on-one-GPU tests -> $OUT/tests-pair-1gpu.json; a replicate of
#            both warp-specialized kernels against table/default on the training shapes, m = 8192
#                                                  -> $OUT/kvc-ws-train-rep.json
#   pps2     kernel_vs_cublas, training shapes: table against two programs per SM and plain
#                                                  -> $OUT/kvc-pps2-train.json
#   trace    phase stamps, GEMM+RS proj and qkv dgrad (training shapes, table and default)
#                                                  -> $OUT/trace-rs-train.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# The variant kernels are HEAD's kernels/gemm_rs.py (617e2d5) with the patches kept in
# results/raw/s19/; make them (in the ignored .device/, carried to the box) with
#   bash benchmarks/sessions/device_s19.sh variants        (on this machine, no GPU)
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s19.sh rsflat pps2
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s19}"
mkdir -p "${OUT}"
if [ "${1:-}" = variants ]; then
  mkdir -p .device && cp megatron_flux/kernels/gemm_rs.py .device/head_gemm_rs.py
  for v in flath noread pf pfall accinit; do
    patch -s -o ".device/${v}_gemm_rs.py" megatron_flux/kernels/gemm_rs.py \
        "benchmarks/results/raw/s19/${v}_gemm_rs.patch" || exit 1
  done
  exit 0
fi
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0)
KVC=megatron_flux/bench/kernel_vs_cublas.py
EXP=benchmarks/experiments
TRAIN_SHAPES=(--model-shapes l8fc2:4096:14336:14336 l8proj:4096:4096:4096 l8qkv:4096:6144:6144
              l8fc1:4096:28672:28672 --rs-k ffn)
RS_VARIANTS=(--prev .device/head_gemm_rs.py --new-override '{"epilogue_split": 2}'
             --variant flath=.device/flath_gemm_rs.py --variant noread=.device/noread_gemm_rs.py)
PF_VARIANTS=(--prev .device/head_gemm_rs.py --variant pf=.device/pf_gemm_rs.py
             --variant pfall=.device/pfall_gemm_rs.py --variant noread=.device/noread_gemm_rs.py)
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    rsflat)
      timeout 200 python3 ${EXP}/kernel_ab.py --op rs --tp 2 "${RS_VARIANTS[@]}" "${TRAIN_SHAPES[@]}" \
          --m 8192 "${TIMING[@]}" --json "${OUT}/rsflat-train.json" 2>&1 | grep -v Warning
      timeout 240 python3 ${EXP}/kernel_ab.py --op rs --tp 2 "${RS_VARIANTS[@]}" \
          --models llama3-8b gpt3-175b --m 1024 2048 4096 8192 "${TIMING[@]}" \
          --json "${OUT}/rsflat-grid.json" 2>&1 | grep -v Warning ;;
    rspf)
      timeout 200 python3 ${EXP}/kernel_ab.py --op rs --tp 2 "${PF_VARIANTS[@]}" "${TRAIN_SHAPES[@]}" \
          --m 4096 8192 "${TIMING[@]}" --json "${OUT}/rspf-train.json" 2>&1 | grep -v Warning
      timeout 240 python3 ${EXP}/kernel_ab.py --op rs --tp 2 "${PF_VARIANTS[@]}" \
          --models llama3-8b gpt3-175b llama3-70b --m 1024 2048 4096 8192 "${TIMING[@]}" \
          --json "${OUT}/rspf-grid.json" 2>&1 | grep -v Warning ;;
    rsacc)
      timeout 200 python3 ${EXP}/kernel_ab.py --op rs --tp 2 --prev .device/head_gemm_rs.py \
          --variant accinit=.device/accinit_gemm_rs.py "${TRAIN_SHAPES[@]}" --m 8192 "${TIMING[@]}" \
          --json "${OUT}/rsacc-train.json" 2>&1 | grep -v Warning ;;
    chunks)
      timeout 150 python3 ${EXP}/cublas_chunks.py --op rs --tp 2 "${TRAIN_SHAPES[@]}" --m 4096 8192 \
          --chunks 1 2 4 "${TIMING[@]}" --json "${OUT}/chunks-rs-train.json" 2>&1 | grep -v Warning
      timeout 150 python3 ${EXP}/cublas_chunks.py --op ag --tp 2 "${TRAIN_SHAPES[@]}" --m 4096 8192 \
          --chunks 1 2 4 "${TIMING[@]}" --json "${OUT}/chunks-ag-train.json" 2>&1 | grep -v Warning
      timeout 150 python3 ${EXP}/cublas_chunks.py --op rs --tp 2 --models llama3-8b llama3-70b \
          --m 1024 2048 4096 8192 --chunks 1 2 4 "${TIMING[@]}" --json "${OUT}/chunks-rs-grid.json" \
          2>&1 | grep -v Warning ;;
    traceag)
      timeout 120 python3 ${EXP}/phase_trace.py --op ag --tp 2 "${TRAIN_SHAPES[@]}" --models l8proj l8fc2 \
          --m 8192 --configs table default --json "${OUT}/trace-ag-train.json" 2>&1 | grep -v Warning ;;
    kvcgrid)
      timeout 300 python3 ${KVC} --tp 2 --configs table plain --trials 5 --iters 10 --warmup 5 \
          --shuffle-seed 0 --json "${OUT}/kvc-grid.json" 2>&1 | grep -v Warning ;;
    ws)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 240 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-ws-1gpu.json" tests/test_kernels_one_gpu.py tests/test_gemm_rs_ws_cpu.py \
          -q -p no:cacheprovider > "${OUT}/tests-ws-1gpu.log" 2>&1
      echo "tests exit $?"; tail -3 "${OUT}/tests-ws-1gpu.log"
      WS_EXTRA='[{"rs_warp_specialized": true, "block_m": 128, "block_n": 128, "block_k": 64,
                  "num_stages": 5, "num_warps": 4, "epilogue_split": 1, "rs_copy_engine": false},
                 {"rs_warp_specialized": true, "block_m": 128, "block_n": 128, "block_k": 64,
                  "num_stages": 4, "num_warps": 4, "epilogue_split": 1, "rs_copy_engine": false}]'
      timeout 150 python3 ${KVC} --tp 2 --ops GEMM+RS "${TRAIN_SHAPES[@]}" --m 4096 8192 \
          --configs table plain --extra "${WS_EXTRA}" "${TIMING[@]}" --json "${OUT}/kvc-ws-train.json" \
          2>&1 | grep -v Warning
      timeout 200 python3 ${KVC} --tp 2 --ops GEMM+RS --m 1024 2048 4096 8192 --configs table plain \
          --extra "${WS_EXTRA}" "${TIMING[@]}" --json "${OUT}/kvc-ws-grid.json" 2>&1 | grep -v Warning ;;
    wsag)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 240 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-ws2-1gpu.json" tests/test_kernels_one_gpu.py tests/test_warp_specialized_cpu.py \
          -q -p no:cacheprovider > "${OUT}/tests-ws2-1gpu.log" 2>&1
      echo "tests exit $?"; tail -3 "${OUT}/tests-ws2-1gpu.log"
      AG_EXTRA='[{"ag_warp_specialized": true, "block_m": 128, "block_n": 128, "block_k": 64,
                  "num_stages": 5, "num_warps": 4, "epilogue_split": 1, "stream_k": 0}]'
      timeout 150 python3 ${KVC} --tp 2 --ops AG+GEMM "${TRAIN_SHAPES[@]}" --m 4096 8192 \
          --configs table default --extra "${AG_EXTRA}" "${TIMING[@]}" --json "${OUT}/kvc-wsag-train.json" \
          2>&1 | grep -v Warning
      timeout 200 python3 ${KVC} --tp 2 --ops AG+GEMM --m 1024 2048 4096 8192 --configs table \
          --extra "${AG_EXTRA}" "${TIMING[@]}" --json "${OUT}/kvc-wsag-grid.json" 2>&1 | grep -v Warning ;;
    pair)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 200 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-pair-1gpu.json" tests/test_kernels_one_gpu.py -k "two_ranks or land_while" --durations=0 \
          -q -p no:cacheprovider > "${OUT}/tests-pair-1gpu.log" 2>&1
      echo "tests exit $?"; tail -3 "${OUT}/tests-pair-1gpu.log"
      timeout 150 python3 ${KVC} --tp 2 "${TRAIN_SHAPES[@]}" --m 8192 --configs table default \
          --extra '[{"ag_warp_specialized": true, "rs_warp_specialized": true, "block_m": 128,
                     "block_n": 128, "block_k": 64, "num_stages": 5, "num_warps": 4,
                     "epilogue_split": 1, "stream_k": 0, "rs_copy_engine": false}]' \
          "${TIMING[@]}" --json "${OUT}/kvc-ws-train-rep.json" 2>&1 | grep -v Warning ;;
    pps2)
      timeout 200 python3 ${KVC} --tp 2 "${TRAIN_SHAPES[@]}" --m 8192 --configs table pps2 plain \
          "${TIMING[@]}" --json "${OUT}/kvc-pps2-train.json" 2>&1 | grep -v Warning ;;
    trace)
      timeout 120 python3 ${EXP}/phase_trace.py --op rs --tp 2 "${TRAIN_SHAPES[@]}" --models l8proj l8qkv \
          --m 8192 --configs table default --json "${OUT}/trace-rs-train.json" 2>&1 | grep -v Warning ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
