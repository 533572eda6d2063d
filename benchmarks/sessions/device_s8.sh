#!/usr/bin/env bash
# One device call (2 GPUs, < 10 minutes), session 8, on the retuned table:
#   1. GEMM+RS phases with communication off, GPU 0 (bench/rs_phases.py)  -> $OUT/rs-phases.json
#   2. the whole test suite (CPU + GPU-marked), megatron-core 0.19.2       -> $OUT/tests-gpu.json
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s8.sh   (carry .whl)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s8}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}"
echo "== rs phases ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m megatron_flux.bench.rs_phases --trials 5 --iters 10 \
    --json "${OUT}/rs-phases.json" 2>&1 | tail -14
echo "   (${SECONDS}s)"
echo "== tests ($(date +%T))"
OUT="${OUT}" bash benchmarks/device_tests.sh 2>&1 | grep -v "^skipped\|warn" | tail -12
echo "== done in ${SECONDS}s"
