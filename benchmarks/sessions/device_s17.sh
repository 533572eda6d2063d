#!/usr/bin/env bash
# Session 17 device calls (2 GPUs; carry .whl):
#   OUT=... bash benchmarks/sessions/device_s17.sh profile   the Llama-3-8B-16l job at micro-batch 2, backends
#                                                   megatron/nccl/flux rotated every 4 iterations, 56
#                                                   iterations, torch profiler on 37..48 on both ranks
#                                                   -> $OUT/interleave.json, trace-r{0,1}.json, rank-0.json.gz
#   OUT=... bash benchmarks/sessions/device_s17.sh tests     the 2-GPU fused-op and layer tests (flux vs NCCL)
#                                                   (both connection settings)  -> $OUT/tests.json
#   OUT=... bash benchmarks/sessions/device_s17.sh tune8k    the training config's own GEMMs at m = 8192 (its
#                                                   tokens per micro-batch at micro-batch 2)
#                                                   -> $OUT/tune-8k.json
#   OUT=... bash benchmarks/sessions/device_s17.sh ceab      the fused-op tests under CUDA_DEVICE_MAX_CONNECTIONS=1
#                                                   (with the banded copy-engine GEMM+RS variants),
#                                                   then GEMM+RS on the llama3_8b_16l training shapes at
#                                                   m = 8192 and 4096, table configs (flux) against
#                                                   rs_copy_engine + rs_ce_bands (flux_variant), twice
#                                                   -> $OUT/tests-conn1.json, ab-bands-{1,2}.json
#   OUT=... bash benchmarks/sessions/device_s17.sh dgradab   two Llama-3-8B-16l jobs at micro-batch 2, backends
#                                                   megatron/flux rotated every 4 iterations, 110
#                                                   iterations: MEGATRON_FLUX_COLUMN_DGRAD=nccl, then
#                                                   =fused (DGRAD_MODES="nccl fused copy_engine" to add
#                                                   one)  -> $OUT/dgrad-<mode>/interleave.json
# Stages run in the order given: device_s17.sh tests profile
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
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
    ceab)
        install_carried_wheels || exit 2
        CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}:/tmp/site" timeout 240 \
            python3 benchmarks/record_pytest.py "${OUT}/tests-conn1.json" \
            "tests/test_flux_gpu.py::test_fused_ops_match_nccl[1]" -q -p no:cacheprovider \
            > "${OUT}/tests-conn1.log" 2>&1
        echo "tests exit $? (${SECONDS}s)"; tail -2 "${OUT}/tests-conn1.log" | cut -c1-300
        for run in 1 2; do
            CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout 100 "${RUN[@]}" -m megatron_flux.bench \
                --ops rs --rs-k ffn --ms 8192 4096 --model-shapes l8fc2:4096:14336:14336 \
                l8proj:4096:4096:4096 l8qkv:4096:6144:6144 l8fc1:4096:28672:28672 \
                --methods cublas_gemm comm nccl flux flux_variant \
                --flux-variant '{"rs_copy_engine": true, "rs_ce_bands": true}' --trials 5 --iters 20 \
                --out-json "${OUT}/ab-bands-${run}.json" --out-png none > "${OUT}/ab-bands-${run}.log" 2>&1
            echo "   ab ${run} exit $? (${SECONDS}s)"
            python3 - "${OUT}/ab-bands-${run}.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
t = {(r["model"], r["m"], r["method"]): r["median_ms"] for r in rows}
for (model, m, method), v in sorted(t.items()):
    if method == "flux":
        print(f"{model:7s} m={m:5d} cublas {t[(model, m, 'cublas_gemm')]:.4f} nccl {t[(model, m, 'nccl')]:.4f} "
              f"flux {v:.4f} bands {t[(model, m, 'flux_variant')]:.4f} ratio {t[(model, m, 'flux_variant')] / v:.3f}")
PY
        done ;;
    dgradab)
        for mode in ${DGRAD_MODES:-nccl fused}; do
            MEGATRON_FLUX_COLUMN_DGRAD="${mode}" SKIP_TESTS=1 IL_BACKENDS='megatron flux' IL_STEPS=4 \
                IL_ITERS=110 PROFILE=0 IL_TOKENS=16384 \
                IL_EXTRA='--micro-batch-size 2 --global-batch-size 4' OUT="${OUT}/dgrad-${mode}" \
                bash benchmarks/device_interleave.sh 2>&1 | grep -E "paired|megatron:|exit|Error"
        done ;;
    *) echo "unknown stage ${stage}"; exit 2 ;;
    esac
done
echo "== done in ${SECONDS}s"
