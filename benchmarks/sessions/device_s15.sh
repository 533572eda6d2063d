#!/usr/bin/env bash
# Session 15 device calls (2 GPUs, each < 10 minutes):
#   OUT=... bash benchmarks/sessions/device_s15.sh control   session 14's trace2c (GEMM+RS stamps, both
#                                                   GPUs, communication off/on/off/on, nvidia-smi
#                                                   sampling), then GEMM+RS with communication on,
#                                                   TMA pushes vs vector-store pushes (A B A B)
#                                                                  -> $OUT/trace2c-*.json, smi.csv,
#                                                                     push-*.json
#                                                   (CONTROL_PUSH=0: the first part only)
#   OUT=... bash benchmarks/sessions/device_s15.sh bench3    runs 2 and 3 of the m >= 1024 grid
#                                                   (run 1: device_s14.sh bench) -> $OUT/bench-run*.json
#   OUT=... bash benchmarks/sessions/device_s15.sh link      cuBLAS beside no / 64 KiB / ReduceScatter-sized
#                                                   NVLink copies (experiments/link_power.py)
#                                                                  -> $OUT/link-power.json, smi-link.csv
#   OUT=... bash benchmarks/sessions/device_s15.sh epi       GEMM+RS, table configs vs the same with
#                                                   epilogue_split 1, comm on then off, A B A B
#                                                                  -> $OUT/epi-rs-*.json
#   OUT=... bash benchmarks/sessions/device_s15.sh trickle   GEMM+RS comm off, comm off beside a 64 KiB
#                                                   NVLink copy per call, comm on (A B C A B C)
#                                                                  -> $OUT/trickle-rs-*.json
#   OUT=... bash benchmarks/sessions/device_s15.sh gate      one GPU: copy-engine work gated on a flag the
#                                                   running kernel raises (stream wait-value), under
#                                                   CUDA_DEVICE_MAX_CONNECTIONS=1 and the default
#                                                                  -> $OUT/gate-*.json
#   OUT=... bash benchmarks/sessions/device_s15.sh bench1conn  (not run yet) the m >= 1024 grid under
#                                                   CUDA_DEVICE_MAX_CONNECTIONS=1, then unset
#                                                                  -> $OUT/bench-conn-*.json
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s15}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
case "${1:-}" in
control)
    OUT="${OUT}" bash benchmarks/sessions/device_s14.sh trace2c
    [ "${CONTROL_PUSH:-1}" = 1 ] || exit 0
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    for run in tma1 vec1 tma2 vec2; do
        case ${run} in vec*) O=(--override '{"rs_tma_push": false}') ;; *) O=() ;; esac
        echo "== GEMM+RS comm on, push ${run} ($(date +%T), ${SECONDS}s)"
        timeout 90 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op rs "${O[@]}" \
            --models llama3-8b gpt3-175b --ms 4096 --launches 3 \
            --json "${OUT}/push-rs-${run}.json" 2>&1 | grep -E "^(rs|Traceback)|Error" | cut -c1-90
    done ;;
bench3)
    # two more runs of the m >= 1024 grid (session 14's bench command), for three in all
    export PYTHONPATH="${PWD}"
    for run in 2 3; do
        echo "== bench large, run ${run} ($(date +%T))"
        bench_large "bench-run${run}" 250
    done ;;
link)
    # cuBLAS beside no / tiny / ReduceScatter-sized NVLink copies (experiments/link_power.py),
    # nvidia-smi sampling SM clocks and power
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    sample_gpus "${OUT}/smi-link.csv" 100
    timeout 300 "${RUN[@]}" benchmarks/experiments/link_power.py ${LINK_ARGS:-} --json "${OUT}/link-power${LINK_TAG:-}.json" \
        2>&1 | grep -E "rank|Traceback|Error" | grep -v Warning ;;
epi)
    # GEMM+RS with the producer epilogue in one store instead of two halves: with two, Triton
    # reuses one shared-memory buffer and waits for the first half's TMA store to be read out
    # before writing the second, which for a push is a wait on NVLink per tile. Communication
    # on and off (both GPUs), A B A B each.
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    for comm in on off; do
        for run in split1 one1 split2 one2; do
            case ${run} in one*) O=(--override '{"epilogue_split": 1}') ;; *) O=() ;; esac
            echo "== GEMM+RS comm ${comm}, ${run} ($(date +%T), ${SECONDS}s)"
            timeout 80 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op rs --comm "${comm}" \
                "${O[@]}" --models llama3-70b gpt3-175b llama3-8b --ms 4096 8192 --launches 2 \
                --json "${OUT}/epi-rs-${comm}-${run}.json" 2>&1 | grep -E "^(rs|Traceback)|Error" \
                | cut -c1-60
        done
    done ;;
trickle)
    # does the link tax account for GEMM+RS's whole comm-on cost? The kernel with its pushes
    # kept local (comm off), the same beside a 64 KiB NVLink copy per call, and comm on
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    for run in off1 trickle1 on1 off2 trickle2 on2; do
        case ${run} in
            off*) O=(--comm off) ;; trickle*) O=(--comm off --trickle-kib 64) ;; *) O=(--comm on) ;;
        esac
        echo "== GEMM+RS ${run} ($(date +%T), ${SECONDS}s)"
        timeout 45 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op rs "${O[@]}" \
            --models llama3-70b llama3-8b --ms 4096 8192 --launches 2 \
            --json "${OUT}/trickle-rs-${run}.json" 2>&1 | grep -E "^(rs|Traceback)|Error" \
            | cut -c1-70
    done ;;
gate)
    # one GPU: does copy-engine work gated by a stream wait-value op, queued behind a running
    # persistent kernel, run while the kernel runs? Under both CUDA_DEVICE_MAX_CONNECTIONS
    # settings (experiments/stream_wait_overlap.py)
    export CUDA_VISIBLE_DEVICES=0
    CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 60 python3 benchmarks/experiments/stream_wait_overlap.py \
        --json "${OUT}/gate-conn1.json" 2>&1 | tail -4
    timeout 60 python3 benchmarks/experiments/stream_wait_overlap.py \
        --json "${OUT}/gate-default.json" 2>&1 | tail -4 ;;
bench1conn)
    # the m >= 1024 grid with CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting) for every
    # method, then the same command with the default, for a paired comparison (not run yet)
    export PYTHONPATH="${PWD}"
    for conn in 1 default; do
        echo "== bench large, CUDA_DEVICE_MAX_CONNECTIONS=${conn} ($(date +%T))"
        if [ "${conn}" = 1 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=1; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
        bench_large "bench-conn-${conn}" 270
    done ;;
*) echo "usage: $0 control|bench3|link|epi|trickle|gate|bench1conn"; exit 2 ;;
esac
