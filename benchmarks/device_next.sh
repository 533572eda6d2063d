#!/usr/bin/env bash
# Planned first job of the next device session (TP = all local GPUs; one 10-minute call):
#   1. the GPU-marked tests, now with back-to-back fused calls alternating two signal layouts
#      (the per-parity signal regions; untested on GPUs so far)       -> $OUT/tests-gpu.json, .log
#   2. host cost per call, with a cProfile of the fused path on rank 0 -> $OUT/host.json, .log
#      (TP=4 showed a 0.3 ms floor per fused AG call and a slower training step than stock)
#   3. if time is left, the TP=2 e2e jobs again (stock / nccl / flux) for a step-time spread:
#      run benchmarks/e2e_device.sh in a call of its own.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/next}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
install_carried_wheels || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
timeout 330 python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -v \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "gpu tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
    benchmarks/host_overhead.py --out "${OUT}/host.json" > "${OUT}/host.log" 2>&1
echo "host overhead exit $? (${SECONDS}s)"; grep -v -i warn "${OUT}/host.log" | tail -40
