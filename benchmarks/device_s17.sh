#!/usr/bin/env bash
# Session 17 device calls (2 GPUs; carry .whl):
#   OUT=... bash benchmarks/device_s17.sh profile   the Llama-3-8B-16l job at micro-batch 2, backends
#                                                   megatron/nccl/flux rotated every 4 iterations, 56
#                                                   iterations, torch profiler on 37..48 on both ranks
#                                                   -> $OUT/interleave.json, trace-r{0,1}.json, rank-0.json.gz
#   OUT=... bash benchmarks/device_s17.sh tests     the 2-GPU fused-op and layer tests (flux vs NCCL)
#                                                   (both connection settings)  -> $OUT/tests.json
#   OUT=... bash benchmarks/device_s17.sh tune8k    the training config's own GEMMs at m = 8192 (its
#                                                   tokens per micro-batch at micro-batch 2)
#                                                   -> $OUT/tune-8k.json
# Stages run in the order given: device_s17.sh tests profile
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/s17}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
for stage in "$@"; do
    echo "== ${stage} ($(date +%T), ${SECONDS}s)"
    case "${stage}" in
    profile)
        SKIP_TESTS=1 IL_BACKENDS='megatron nccl flux' IL_STEPS=4 IL_ITERS=56 PROFILE=1 PROF_START=36 \
            PROF_END=48 IL_TOKENS=16384 IL_EXTRA='--micro-batch-size 2 --global-batch-size 4' \
            OUT="${OUT}" bash benchmarks/device_interleave.sh 2>&1 | grep -v "^step \|^ \{6\}" ;;
    tests)
        install_carried_wheels || exit 2
        PYTHONPATH="${PWD}:/tmp/site" timeout "${TEST_TIMEOUT:-300}" \
            python3 benchmarks/record_pytest.py "${OUT}/tests.json" tests/test_flux_gpu.py \
            tests/test_layers_gpu.py -q -m gpu -p no:cacheprovider > "${OUT}/tests.log" 2>&1
        echo "tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests.log" | cut -c1-300 ;;
    tune8k)
        PYTHONPATH="${PWD}" timeout "${TUNE_TIMEOUT:-150}" "${RUN[@]}" -m megatron_flux.tune \
            --model-config configs/llama3_8b_16l.json --ms 8192 --max-candidates 12 --top 2 \
            --screen-iters 5 --trials 3 --iters 10 --no-progress --no-merge --out "${OUT}/tune-8k.json" \
            > "${OUT}/tune-8k.log" 2>&1
        echo "   exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=|Error|Traceback" "${OUT}/tune-8k.log" | head -12 ;;
    *) echo "unknown stage ${stage}"; exit 2 ;;
    esac
done
echo "== done in ${SECONDS}s"
