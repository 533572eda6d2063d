#!/usr/bin/env bash
# One device call (2 GPUs, < 10 minutes), session 6's final tree (stream-K default for AG+GEMM,
# TMA reads in GEMM+RS's reduction):
#   1. kernel_vs_cublas, m >= 1024 grid: AG+GEMM on GPU 0 (default with/without stream-K, table
#      with/without), GEMM+RS on GPU 1 (default/table, TMA or vector reduction), at once
#                                                          -> $OUT/kvc-ag.json, $OUT/kvc-rs.json
#   2. the fused backend's GPU tests (tests/test_flux_gpu.py)  -> $OUT/tests-gpu.json, .log
#   3. the FLUX-metric benchmark, m >= 1024, every method, `flux` = the shipped table's configs,
#      `flux_default` = the heuristic (stream-K) -> $OUT/bench.json, .png, .log
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s6_final.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s6_final}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export PYTHONPATH="${PWD}:/tmp/site"
KVC=(python3 -m megatron_flux.bench.kernel_vs_cublas --trials 7 --iters 10)
CUDA_VISIBLE_DEVICES=0 timeout 150 "${KVC[@]}" --ops AG+GEMM --json "${OUT}/kvc-ag.json" > /tmp/kvc-ag.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 150 "${KVC[@]}" --ops GEMM+RS --json "${OUT}/kvc-rs.json" > /tmp/kvc-rs.log 2>&1 &
wait
echo "== kvc done (${SECONDS}s)"
grep -hE "^(AG|GEMM)|Error|error" /tmp/kvc-ag.log /tmp/kvc-rs.log | cut -c1-300
timeout 300 python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests/test_flux_gpu.py -v \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "gpu tests exit $? (${SECONDS}s)"; tail -2 "${OUT}/tests-gpu.log"
python3 -c "import json; d=json.load(open('${OUT}/tests-gpu.json')); [print(t['outcome'], t['test'], (t.get('message') or '')[-1500:]) for t in d['tests'] if t['outcome'] != 'passed']" 2>/dev/null
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.bench \
    --m-set large --methods cublas_gemm comm nccl torch_async_tp flux flux_default --trials 5 --iters 20 \
    --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
echo "bench exit $? (${SECONDS}s)"; grep -A24 "^summary" "${OUT}/bench.log"
echo "== done in ${SECONDS}s"
