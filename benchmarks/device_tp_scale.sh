#!/usr/bin/env bash
# Issue 6, first job on a 4- or 8-GPU box (TP = all local GPUs; one 10-minute device call):
#   1. the GPU-marked tests at TP = GPU count        -> $OUT/tests-gpu.json, tests-gpu.log
#   2.-3. benchmarks/device_tune.sh: megatron-flux tune over the grid, then the grid benchmark
#      (small m too) with that table        -> $OUT/table.json, tune.log, bench.json, .png, .log
# Budgets (seconds): TESTS_TIMEOUT (the GPU tests took 163 s at TP=4), TUNE_TIMEOUT; the benchmark
# gets what is left of 585 s, so with all three one call is tight: give the tests their own call.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/tp_scale}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
install_carried_wheels || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
nvidia-smi topo -m | head -$((NGPUS + 1))

echo "== gpu-marked tests at TP=${NGPUS} ($(date +%T))"
timeout "${TESTS_TIMEOUT:-300}" python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -q \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "   exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"

# steps 2 and 3 are device_tune.sh's job, within what is left of 585 s; grid only (the model
# config's shapes would not fit beside the tests)
TUNE_TIMEOUT="${TUNE_TIMEOUT:-190}" TUNE_MODEL_CONFIG="${TUNE_MODEL_CONFIG-}" DEADLINE=$((585 - SECONDS)) \
    OUT="${OUT}" bash benchmarks/device_tune.sh
