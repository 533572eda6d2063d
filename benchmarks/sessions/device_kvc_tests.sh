#!/usr/bin/env bash
# One device call (2 GPUs, < 10 minutes), session 6, after the stream-K and TMA-reduction changes:
#   1. GEMM quality with communication disabled (kernel_vs_cublas, m >= 1024 grid, default /
#      table / stream-K / vector-reduction configs): AG+GEMM then GEMM+RS on GPU 0, and the same
#      on GPU 1 at the same time as a replicate   -> $OUT/kvc-{ag,rs}-gpu{0,1}.json
#   2. the fused backend's GPU tests (tests/test_flux_gpu.py)  -> $OUT/tests-gpu.json, .log
# Usage: OUT=/somewhere bash benchmarks/sessions/device_kvc_tests.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/kvc_tests}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}:/tmp/site"
KVC=(python3 -m megatron_flux.bench.kernel_vs_cublas --trials "${KVC_TRIALS:-7}" --iters "${KVC_ITERS:-10}")
for gpu in 0 1; do
    ( for op in AG+GEMM GEMM+RS; do
          tag="$( [ "${op}" = AG+GEMM ] && echo ag || echo rs )"
          CUDA_VISIBLE_DEVICES=${gpu} timeout 200 "${KVC[@]}" --ops "${op}" \
              --json "${OUT}/kvc-${tag}-gpu${gpu}.json" > "${OUT}/kvc-${tag}-gpu${gpu}.log" 2>&1
      done ) &
done
wait
echo "== kvc done (${SECONDS}s)"
grep -hE "^(AG|GEMM)|Error|error" "${OUT}"/kvc-ag-gpu0.log "${OUT}"/kvc-rs-gpu0.log | cut -c1-300
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_TIMEOUT:-330}" python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" \
        tests/test_flux_gpu.py -v -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
    echo "gpu tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"
    python3 -c "import json; d=json.load(open('${OUT}/tests-gpu.json')); [print(t['outcome'], t['test'], (t.get('message') or '')[:900]) for t in d['tests'] if t['outcome'] != 'passed']" 2>/dev/null
fi
echo "== done in ${SECONDS}s"
