#!/usr/bin/env bash
# Session 24, one GPU (kinds nvidia-h100-x1 / nvidia-h200 only, for the sixth session).
#   tworanks the two-rank-on-one-GPU tests alone, in a fresh process: session 23's epoch-0
#            warm-up launch per rank (CUDA lazy loading) had not run  -> $OUT/tests-tworanks.json
#   tests    (carry .whl) every GPU-marked test on this one GPU -> $OUT/tests-1gpu.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/device_s24.sh tworanks tests
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/s24}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    tworanks)
      timeout 200 python3 benchmarks/record_pytest.py "${OUT}/tests-tworanks.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k two_ranks 2>&1 | tail -3 ;;
    tests)
      gpu_tests $((590 - SECONDS)) tests-1gpu ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done (${SECONDS}s)"
