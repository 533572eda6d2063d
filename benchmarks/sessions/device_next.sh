#!/usr/bin/env bash
# Planned first job of the next device session (TP = all local GPUs; one 10-minute call), to
# decide whether the opt-in direct kernel launch (MEGATRON_FLUX_DIRECT_LAUNCH=1, written in
# session 5 without a GPU) becomes the default:
#   1. the GPU-marked tests, which now include test_fused_ops_match_nccl[1-direct-launch]
#                                                                    -> $OUT/tests-gpu.json, .log
#   2. host cost per layer call (fc1 column, fc2 row; fwd+bwd) with the direct launch off and on
#                                                                    -> $OUT/host-{off,on}.json
#   3. if time is left: the interleaved micro-batch-1 training job with it on
#      (compare with results/e2e-interleaved-mbs1-h200x2-2026-11-22.json, or better, run it
#      off and on in two calls of their own: benchmarks/device_interleave.sh).
# Usage: OUT=/somewhere bash benchmarks/sessions/device_next.sh   (carry .whl for step 3)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/next}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
install_carried_wheels || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
timeout 330 python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -v \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "gpu tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"
for mode in off on; do
    direct=0; [ "${mode}" = on ] && direct=1
    MEGATRON_FLUX_DIRECT_LAUNCH="${direct}" timeout 100 python3 -m torch.distributed.run \
        --standalone --nproc-per-node "${NGPUS}" benchmarks/host_overhead.py --layers --ms 4096 \
        --backends nccl flux --iters 30 --trials 5 --out "${OUT}/host-${mode}.json" 2>&1 \
        | grep -E "^(nccl|flux) "
done
if [ "${SECONDS}" -lt 300 ]; then
    SKIP_TESTS=1 PROFILE=0 IL_ITERS=120 IL_COMM_MS=24.789 OUT="${OUT}/il-on" \
        MEGATRON_FLUX_DIRECT_LAUNCH=1 bash benchmarks/device_interleave.sh 2>&1 | grep -v -i warn | tail -6
fi
echo "== done in ${SECONDS}s"
