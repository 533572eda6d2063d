#!/usr/bin/env bash
# Session 10, one GPU (communication disabled, one interleaved loop per shape):
#   rs   experiments/rs_loops.py: which part of the GEMM+RS structure costs time against the
#        plain yardstick (peel, signals, reduction reads, one loop)     -> $OUT/rs-loops.json
#   occ-ag, occ-rs  experiments/occupancy.py: two persistent programs per SM (128x128 tiles,
#        4 warps), so one program's epilogue overlaps the other's K loop -> $OUT/occ-{ag,rs}.json
#        (occ-ag also tries three per SM with 65 KB tiles                -> $OUT/occ3-ag.json)
#   ws   experiments/gluon_ws_gemm.py: a warp-specialized Gluon GEMM (two MMA warpgroups taking
#        turns, one TMA warp) against cuBLAS and the plain yardstick      -> $OUT/gluon-ws.json
#        (never run before: under a timeout, in case a barrier phase is wrong and it hangs)
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s10.sh rs occ-ag     (one call, < 10 minutes)
#        OUT=/somewhere bash benchmarks/sessions/device_s10.sh ws occ-rs     (a second call)
# Every grid size is a constexpr (NUM_SMS), so each config x programs-per-SM compiles anew; the
# Triton cache sits in the ignored .device/ folder, kept while the machine stays warm.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s10}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments" CUDA_VISIBLE_DEVICES=0
export TRITON_CACHE_DIR="${PWD}/.device/triton-cache"
EXP=benchmarks/experiments
C128_4='{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 4, "epilogue_split": 1}'
C128_2='{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 2, "num_warps": 4, "epilogue_split": 2}'
C128_3='{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 3, "num_warps": 4, "epilogue_split": 2}'
C128_K32='{"block_m": 128, "block_n": 128, "block_k": 32, "num_stages": 4, "num_warps": 4, "epilogue_split": 2}'
C128_K32_3='{"block_m": 128, "block_n": 128, "block_k": 32, "num_stages": 3, "num_warps": 4, "epilogue_split": 2}'
C256='{"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8, "epilogue_split": 2}'
for what in "$@"; do
  case "${what}" in
    rs)
      timeout 200 python3 ${EXP}/rs_loops.py --shapes 1024x4096x14336 4096x4096x14336 \
          8192x4096x14336 2048x8192x28672 4096x12288x24576 8192x12288x24576 --trials 7 --iters 10 \
          --json "${OUT}/rs-loops.json" 2>&1 | grep -v Warning ;;
    occ-ag)
      timeout 250 python3 ${EXP}/occupancy.py --op ag --shapes 1024x14336x4096 2048x14336x4096 \
          4096x14336x4096 1024x28672x8192 --config "${C128_4}" --config "${C128_2}" \
          --config "${C128_3}" --config "${C128_K32}" --config "${C256}" --trials 7 --iters 10 \
          --json "${OUT}/occ-ag.json" 2>&1 | grep -v Warning
      # 65 KB of shared memory, ~165 registers: three programs fit on one SM
      timeout 100 python3 ${EXP}/occupancy.py --op ag --shapes 1024x14336x4096 2048x14336x4096 \
          --config "${C128_K32_3}" --per-sm 1 2 3 --trials 7 --iters 10 \
          --json "${OUT}/occ3-ag.json" 2>&1 | grep -v Warning ;;
    occ-rs)
      timeout 290 python3 ${EXP}/occupancy.py --op rs --shapes 1024x4096x14336 2048x4096x14336 \
          4096x4096x14336 8192x4096x14336 2048x8192x28672 --config "${C128_4}" --config "${C128_2}" \
          --config "${C128_3}" --config "${C128_K32}" --config "${C256}" --trials 7 --iters 10 \
          --json "${OUT}/occ-rs.json" 2>&1 | grep -v Warning ;;
    ws)
      timeout 280 python3 ${EXP}/gluon_ws_gemm.py --shapes 1024x14336x4096 2048x14336x4096 \
          4096x14336x4096 1024x4096x14336 4096x4096x14336 8192x4096x14336 4096x28672x8192 \
          --trials 7 --iters 10 --json "${OUT}/gluon-ws.json" 2>&1 | grep -v Warning
      echo "gluon ws rc=${PIPESTATUS[0]}" ;;
  esac
  echo "== ${what} done at ${SECONDS}s"
done
