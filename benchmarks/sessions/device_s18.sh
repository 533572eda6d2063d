#!/usr/bin/env bash
# Session 18, one GPU (kind nvidia-h200; no 2-GPU box lent this session), communication off:
#   kvctrain  the fused kernels against cuBLAS on the training step's own GEMMs (llama3_8b_16l at
#             TP 2, micro-batch 2: m = 8192; AG n = 2048 / 3072 / 7168 / 14336 at k = 4096, GEMM+RS
#             n = 4096 at k = 2048 / 3072 / 7168 / 14336 per rank): table, default, the fixed
#             candidates and the plain yardstick (kernel_vs_cublas)   -> $OUT/kvc-train.json
#   tests     the GPU-marked tests on this one GPU (2-GPU ones skip), including the copy-engine
#             ReduceScatter's reduction kernel (never run on a GPU before) -> $OUT/tests-1gpu.json
#   rsab      (carry .device/accinit_gemm_rs.py, .device/noread_gemm_rs.py) GEMM+RS whose own tiles
#             after the first start their accumulator from the peers' partials (the reads move
#             ahead of the K loop, no read in the epilogue; "prev" in kernel_ab) and a diagnostic
#             that reads nothing (wrong sums, "noread"), against the current kernel: training
#             shapes at m = 8192, then llama3-8b m = 1024-8192 (TP 2 grid)
#                                                          -> $OUT/rsab-train.json, rsab-grid.json
#   trace     phase stamps, fused against the plain yardstick of the same tile: GEMM+RS proj and
#             qkv-dgrad, AG+GEMM qkv and fc2-dgrad (training shapes, m = 8192, default configs)
#                                                          -> $OUT/trace-{rs,ag}-train.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s18.sh kvctrain tests
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s18}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0)
KVC=megatron_flux/bench/kernel_vs_cublas.py
EXP=benchmarks/experiments
TRAIN_SHAPES=(--model-shapes l8fc2:4096:14336:14336 l8proj:4096:4096:4096 l8qkv:4096:6144:6144
              l8fc1:4096:28672:28672 --rs-k ffn)
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    tests)
      one_gpu_tests || exit 1 ;;
    kvctrain)
      timeout "${KVC_TIMEOUT:-330}" python3 ${KVC} --tp 2 "${TRAIN_SHAPES[@]}" --m 8192 \
          --configs table default candidates plain "${TIMING[@]}" \
          --json "${OUT}/kvc-train.json" 2>&1 | grep -v Warning ;;
    rsab)
      timeout 200 python3 ${EXP}/kernel_ab.py --op rs --tp 2 --prev .device/accinit_gemm_rs.py \
          --variant noread=.device/noread_gemm_rs.py "${TRAIN_SHAPES[@]}" --m 8192 "${TIMING[@]}" \
          --json "${OUT}/rsab-train.json" 2>&1 | grep -v Warning
      timeout 200 python3 ${EXP}/kernel_ab.py --op rs --tp 2 --prev .device/accinit_gemm_rs.py \
          --variant noread=.device/noread_gemm_rs.py --models llama3-8b gpt3-175b --m 1024 2048 4096 8192 \
          "${TIMING[@]}" --json "${OUT}/rsab-grid.json" 2>&1 | grep -v Warning ;;
    trace)
      timeout 120 python3 ${EXP}/phase_trace.py --op rs --tp 2 "${TRAIN_SHAPES[@]}" --models l8proj l8qkv \
          --m 8192 --configs default --json "${OUT}/trace-rs-train.json" 2>&1 | grep -v Warning
      timeout 120 python3 ${EXP}/phase_trace.py --op ag --tp 2 "${TRAIN_SHAPES[@]}" --models l8qkv l8fc2 \
          --m 8192 --configs default --json "${OUT}/trace-ag-train.json" 2>&1 | grep -v Warning ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
