#!/usr/bin/env bash
# One device call (1 GPU used, < 5 minutes): the fused kernels' tile loop against the plain
# persistent TMA GEMM (bench/plain_gemm.py) and cuBLAS, communication disabled, in one
# interleaved loop per shape (bench/rs_phases.py: full, produce, consume, single, plain,
# triton_plain, cublas), for the table's config and 128x128/4/4:
#   llama3-8b m = 1024..8192 (N = 4096, where the RS kernel loses most)  -> $OUT/yardstick-8b.json
#   gpt3-175b m = 2048, 8192                                              -> $OUT/yardstick-175b.json
# and AG+GEMM llama3-8b m = 1024..8192 (1.04-1.20x cuBLAS in session 6) against the yardstick
# with the default's and the table's tile (bench/kernel_vs_cublas.py --configs ... plain)
#                                                                         -> $OUT/yardstick-ag-8b.json
# Usage: OUT=/somewhere bash benchmarks/sessions/device_yardstick.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/yardstick}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}" CUDA_VISIBLE_DEVICES=0
T128='{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 4, "epilogue_split": 2}'
timeout 150 python3 -m megatron_flux.bench.rs_phases --models llama3-8b --trials 7 --iters 10 \
    --config '{}' --config "${T128}" --json "${OUT}/yardstick-8b.json" 2>&1 | grep "^RS"
timeout 120 python3 -m megatron_flux.bench.rs_phases --models gpt3-175b --m 2048 8192 --trials 5 \
    --iters 5 --config '{}' --json "${OUT}/yardstick-175b.json" 2>&1 | grep "^RS"
timeout 150 python3 -m megatron_flux.bench.kernel_vs_cublas --ops AG+GEMM --models llama3-8b \
    --trials 7 --iters 10 --configs default table sk plain --json "${OUT}/yardstick-ag-8b.json" \
    2>&1 | grep "^AG"
echo "== done in ${SECONDS}s"
