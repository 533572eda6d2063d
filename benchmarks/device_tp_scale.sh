#!/usr/bin/env bash
# Issue 6, first job on a 4- or 8-GPU box (TP = all local GPUs; one 10-minute device call):
#   1. the GPU-marked tests at TP = GPU count        -> $OUT/tests-gpu.json, tests-gpu.log
#   2. megatron-flux tune over the grid               -> $OUT/table.json, tune.log
#   3. the grid benchmark (small m too) with that table: cublas, comm, nccl, torch async-TP,
#      flux (tuned), flux_default (untuned), auto     -> $OUT/bench.json, bench.png, bench.log
# Budgets (seconds): TESTS_TIMEOUT (the GPU tests took 163 s at TP=4), TUNE_TIMEOUT; the benchmark
# gets what is left of 585 s, so with all three one call is tight: give the tests their own call.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/tp_scale}"
mkdir -p "${OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPUS="${NGPUS:-$(nvidia-smi -L | grep -c '^GPU ')}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
nvidia-smi topo -m | head -$((NGPUS + 1))

echo "== gpu-marked tests at TP=${NGPUS} ($(date +%T))"
timeout "${TESTS_TIMEOUT:-300}" python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -q \
    -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
echo "   exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"

echo "== tune ($(date +%T))"
timeout "${TUNE_TIMEOUT:-190}" python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
    -m megatron_flux.tune --m-set all --max-candidates 12 --top 2 --screen-iters 5 \
    --trials 3 --iters 10 --no-progress --no-merge --out "${OUT}/table.json" > "${OUT}/tune.log" 2>&1
echo "   exit $? (${SECONDS}s)"
grep -cE "^(ag|rs) n=" "${OUT}/tune.log"
grep -E "Error|Traceback" "${OUT}/tune.log" | head -5

echo "== bench, tuned table ($(date +%T))"
MEGATRON_FLUX_CONFIG="${OUT}/table.json" timeout $((585 - SECONDS)) python3 -m torch.distributed.run \
    --standalone --nproc-per-node "${NGPUS}" -m megatron_flux.bench --m-set all \
    --methods cublas_gemm comm nccl torch_async_tp flux flux_default auto --trials 5 --iters 20 \
    --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
echo "   exit $? (${SECONDS}s)"
grep -E "Error|Traceback" "${OUT}/bench.log" | head -5
grep -iE "summary|median|geomean|slower" "${OUT}/bench.log" | tail -20
