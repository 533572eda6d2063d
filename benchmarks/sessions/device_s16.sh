#!/usr/bin/env bash
# Session 16 device calls:
#   OUT=... bash benchmarks/sessions/device_s16.sh gate2   one GPU: copy-engine work on a side stream gated by
#                                                 an *event* after a first launch, queued behind a
#                                                 second, spinning launch (the two-launch GEMM+RS
#                                                 pattern), and the other gates, under
#                                                 CUDA_DEVICE_MAX_CONNECTIONS=1 and the default
#                                                                -> $OUT/gate-*.json
#   OUT=... bash benchmarks/sessions/device_s16.sh ceab    the 2-GPU fused-op tests under CUDA_DEVICE_MAX_CONNECTIONS=1
#                                                 (with the copy-engine GEMM+RS variants), then
#                                                 GEMM+RS comm on, table configs vs the same with
#                                                 rs_copy_engine, A B A B, under the same setting
#                                                                -> $OUT/tests-conn1.json, ceab-*.json
#   OUT=... bash benchmarks/sessions/device_s16.sh cebench GEMM+RS grid (m >= 1024, then small m) with flux and
#                                                 flux_variant = rs_copy_engine in the same
#                                                 interleaved trials, under CUDA_DEVICE_MAX_CONNECTIONS=1
#                                                 and the default; then the fused-op tests under
#                                                 the default       -> $OUT/cebench-*.json, tests-default.json
#   OUT=... bash benchmarks/sessions/device_s16.sh shipped  GEMM+RS on the llama3_8b_16l training shapes (flux vs
#                                                 flux_variant = rs_copy_engine), then the m >= 1024
#                                                 grid, both ops, shipped table, all under
#                                                 CUDA_DEVICE_MAX_CONNECTIONS=1  -> $OUT/train-rs.json,
#                                                 bench-shipped-conn1.{json,png} (at most 8 files come back)
# (session 16's first call ran benchmarks/sessions/device_s15.sh bench1conn)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s16}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
case "${1:-}" in
gate2)
    # GATE_DST=peer (2 GPUs): the copy goes to GPU 1 over NVLink, by the copy engine; the default
    # (local) copy within GPU 0 may run as a kernel, which cannot start beside the spinning grid
    DST="${GATE_DST:-local}"
    [ "${DST}" = peer ] || export CUDA_VISIBLE_DEVICES=0
    for gate in event event-first none value; do
        for conn in 1 default; do
            if [ "${conn}" = 1 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=1; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
            timeout 60 python3 benchmarks/experiments/stream_wait_overlap.py --gate "${gate}" \
                --dst "${DST}" --repeats 3 --json "${OUT}/gate-${DST}-${gate}-conn${conn}.json" 2>&1 | tail -1
        done
    done ;;
ceab)
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    timeout 270 python3 benchmarks/record_pytest.py "${OUT}/tests-conn1.json" \
        "tests/test_flux_gpu.py::test_fused_ops_match_nccl[1]" -q -p no:cacheprovider \
        > "${OUT}/tests-conn1.log" 2>&1
    echo "tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-conn1.log" | cut -c1-300
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    for run in sm1 ce1 sm2 ce2; do
        case ${run} in ce*) O=(--override '{"rs_copy_engine": true}') ;; *) O=() ;; esac
        echo "== GEMM+RS comm on, ${run} ($(date +%T), ${SECONDS}s)"
        timeout 75 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op rs "${O[@]}" \
            --models llama3-70b gpt3-175b llama3-8b --ms 4096 8192 --launches 1 \
            --json "${OUT}/ceab-${run}.json" 2>&1 | grep -E "^(rs|Traceback)|Error" | cut -c1-90
    done ;;
cebench)
    export PYTHONPATH="${PWD}"
    for conn in 1 default; do
        if [ "${conn}" = 1 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=1; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
        for mset in large small; do
            echo "== GEMM+RS ${mset}, CUDA_DEVICE_MAX_CONNECTIONS=${conn} ($(date +%T), ${SECONDS}s)"
            timeout 150 "${RUN[@]}" -m megatron_flux.bench --m-set "${mset}" --ops rs \
                --methods cublas_gemm comm nccl torch_async_tp flux flux_variant \
                --flux-variant '{"rs_copy_engine": true}' --trials 5 --iters 20 \
                --out-json "${OUT}/cebench-${mset}-conn${conn}.json" \
                --out-png "${OUT}/cebench-${mset}-conn${conn}.png" > "${OUT}/cebench-${mset}-conn${conn}.log" 2>&1
            echo "   exit $?"; grep -A5 "^summary" "${OUT}/cebench-${mset}-conn${conn}.log"
        done
    done
    unset CUDA_DEVICE_MAX_CONNECTIONS
    timeout $((590 - SECONDS)) python3 benchmarks/record_pytest.py "${OUT}/tests-default.json" \
        "tests/test_flux_gpu.py::test_fused_ops_match_nccl[default]" -q -p no:cacheprovider \
        > "${OUT}/tests-default.log" 2>&1
    echo "tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-default.log" | cut -c1-300 ;;
shipped)
    export PYTHONPATH="${PWD}" CUDA_DEVICE_MAX_CONNECTIONS=1
    echo "== GEMM+RS, training shapes ($(date +%T))"
    timeout 150 "${RUN[@]}" -m megatron_flux.bench --ops rs --rs-k ffn --ms 8192 4096 \
        --model-shapes l8fc2:4096:14336:14336 l8proj:4096:4096:4096 l8qkv:4096:6144:6144 \
        --methods cublas_gemm comm nccl torch_async_tp flux flux_variant \
        --flux-variant '{"rs_copy_engine": true}' --trials 5 --iters 20 \
        --out-json "${OUT}/train-rs.json" --out-png none > "${OUT}/train-rs.log" 2>&1
    echo "   exit $?"; grep -A4 "^summary" "${OUT}/train-rs.log"
    echo "== bench large, shipped table ($(date +%T), ${SECONDS}s)"
    bench_large bench-shipped-conn1 250 ;;
shipped2)
    # two more runs of the m >= 1024 grid with the shipped table: CUDA_DEVICE_MAX_CONNECTIONS=1,
    # then the default
    export PYTHONPATH="${PWD}" CUDA_DEVICE_MAX_CONNECTIONS=1
    bench_large bench-shipped-conn1-run2 140
    unset CUDA_DEVICE_MAX_CONNECTIONS
    bench_large bench-shipped-conndefault 150 ;;
*) echo "usage: $0 gate2|ceab|cebench|shipped|shipped2"; exit 2 ;;
esac
