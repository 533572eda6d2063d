#!/usr/bin/env bash
# Second device call of session 8 (2 GPUs, < 10 minutes):
#   1. GEMM+RS phases, llama3-8b, with the 128x128x64 / 4 stages / 4 warps tile that a plain
#      Triton GEMM prefers at N=4096 (reference file), against the backend's 128x256 (call 1)
#                                                                   -> $OUT/rs-phases-128x128.json
#   2. interleaved Llama-3-8B-shaped training on the retuned table: megatron, nccl, flux, auto
#      every 4 iterations, 150 iterations, no profiler              -> $OUT/il/interleave.json
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s8b.sh   (carry .whl)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s8b}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}"
echo "== rs phases 128x128 ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m megatron_flux.bench.rs_phases --models llama3-8b \
    --trials 5 --iters 10 --json "${OUT}/rs-phases-128x128.json" \
    --config '{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "num_warps": 4, "epilogue_split": 1}' \
    2>&1 | tail -5
echo "   (${SECONDS}s)"
SKIP_TESTS=1 PROFILE=0 IL_ITERS=150 IL_COMM_MS=24.789 IL_TIMEOUT=300 OUT="${OUT}/il" \
    bash benchmarks/device_interleave.sh 2>&1 | grep -v -i warn | tail -8
echo "== done in ${SECONDS}s"
