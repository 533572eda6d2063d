#!/usr/bin/env bash
# Session 11, one GPU (kind nvidia-h200; no 2-GPU box lent this session):
#   pps   tests/test_residency_gpu.py (occupancy answer, fallback, output of 2 programs per SM),
#         then the fused kernels, comm off, on the m >= 1024 grid: the shipped table's config
#         against the same config on 128x128 tiles run two per SM (kernel_vs_cublas --configs
#         table pps2), every sample after 10 untimed calls of the same method, shuffled order
#                                                              -> $OUT/kvc-pps2.json
#   ws    experiments/gluon_ws_gemm.py and occupancy.py again with the same warm-up, on the
#         shapes where session 10's numbers disagreed         -> $OUT/gluon-ws.json, occ-*.json
#   rs    the residency test again (its first shape had too few tiles to need two slots per SM),
#         then experiments/rs_loops.py and ag_structure.py with the same warm-up on the shapes
#         still above 1.02x cuBLAS                            -> $OUT/rs-loops.json, ag-structure.json
#   ab    (carry .whl and .device/prev_gemm_rs.py = git show 058db66:megatron_flux/kernels/gemm_rs.py)
#         the GPU-marked tests on this one GPU (2-GPU ones skip)  -> $OUT/tests-1gpu.json
#         GEMM+RS with one grid barrier after all producer steps against the per-step signals
#         (experiments/kernel_ab.py) at TP 2, 4 and 8, comm off  -> $OUT/rs-barrier-ab-tp*.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s11.sh pps|rs|ws ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s11}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--warmup 10 --shuffle-seed 0)
EXP=benchmarks/experiments
C128_3='{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 3, "num_warps": 4, "epilogue_split": 2}'
C128_4WS='{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 4, "epilogue_split": 1, "warp_specialize": true}'
C256='{"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "num_warps": 8, "epilogue_split": 2}'
for what in "$@"; do
  case "${what}" in
    pps)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_residency_gpu.py 2>&1 | tail -4
      timeout 330 python3 -m megatron_flux.bench.kernel_vs_cublas --configs table pps2 \
          --trials 7 --iters 20 "${TIMING[@]}" --json "${OUT}/kvc-pps2.json" 2>&1 \
          | grep -E "^(AG|GEMM)" ;;
    ab)
      one_gpu_tests || exit 1
      for tp in 2 4 8; do
        timeout 110 python3 ${EXP}/kernel_ab.py --op rs --prev .device/prev_gemm_rs.py --tp ${tp} \
            --models llama3-8b llama3-70b gpt3-175b --m 1024 2048 4096 8192 --trials 7 --iters 20 \
            "${TIMING[@]}" --json "${OUT}/rs-barrier-ab-tp${tp}.json" 2>&1 | grep "table" 
      done ;;
    rs)
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_residency_gpu.py 2>&1 | tail -4
      timeout 200 python3 ${EXP}/rs_loops.py --shapes 1024x4096x14336 2048x4096x14336 \
          4096x4096x14336 8192x4096x14336 4096x8192x28672 --variants steps steps-nopeel \
          steps-noread steps-bare one one-noread --trials 7 --iters 20 "${TIMING[@]}" \
          --json "${OUT}/rs-loops.json" 2>&1 | grep -v Warning
      timeout 150 python3 ${EXP}/ag_structure.py --shapes 1024x14336x4096 2048x14336x4096 \
          4096x14336x4096 --config "${C128_4WS}" --config "${C256}" --trials 7 --iters 20 \
          "${TIMING[@]}" --json "${OUT}/ag-structure.json" 2>&1 | grep -v Warning ;;
    ws)
      timeout 150 python3 ${EXP}/gluon_ws_gemm.py --shapes 1024x14336x4096 2048x14336x4096 \
          4096x14336x4096 1024x4096x14336 --trials 7 --iters 20 "${TIMING[@]}" \
          --json "${OUT}/gluon-ws.json" 2>&1 | grep -v Warning
      timeout 120 python3 ${EXP}/occupancy.py --op ag --shapes 1024x14336x4096 4096x14336x4096 \
          1024x28672x8192 --config "${C128_3}" --config "${C256}" --trials 7 --iters 20 \
          "${TIMING[@]}" --json "${OUT}/occ-ag.json" 2>&1 | grep -v Warning ;;
  esac
  echo "== ${what} done at ${SECONDS}s"
done
