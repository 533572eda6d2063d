#!/usr/bin/env bash
# Session 14 device calls (2 GPUs, each < 10 minutes). The whole suite no longer fits one call
# (the interpreter and compile-only tests alone take minutes; CI runs them), so:
#   OUT=... bash benchmarks/sessions/device_s14.sh tests   GPU-marked tests first (2-GPU fused ops, layers,
#                                                 one-GPU kernels, phase stamps)  -> $OUT/tests-gpu.json
#                                                 then every other test except the interpreter and
#                                                 compile-only files, megatron-core 0.19.2
#                                                                                  -> $OUT/tests-rest.json
#   OUT=... bash benchmarks/sessions/device_s14.sh bench   the m >= 1024 grid, then the small-m grid
#                                                                                  -> $OUT/bench*.json
#   OUT=... bash benchmarks/sessions/device_s14.sh trace2  phase stamps with communication on, both ranks
#                                                 (experiments/phase_trace_tp.py), then the same
#                                                 GEMM+RS shapes with it off on GPU 0 (TRACE2_OFF=0:
#                                                 not)                             -> $OUT/trace2-*.json
#   OUT=... bash benchmarks/sessions/device_s14.sh trace2c the control session 14 lacked: GEMM+RS phase
#                                                 stamps on both GPUs at once with communication
#                                                 off, on, off, on (ABAB), nvidia-smi sampling SM
#                                                 clocks and power        -> $OUT/trace2c-*.json, smi.csv
#   OUT=... bash benchmarks/sessions/device_s14.sh merge   ag_merge_local (written in session 14, never run
#                                                 on a GPU): its 2-GPU and one-GPU tests, then
#                                                 AG+GEMM comm on, table configs with and without
#                                                 it (A B A B, phase_trace_tp.py), then comm off
#                                                 on GPU 0 paired against the per-segment kernel
#                                                 (kernel_ab "new" vs "new+"; "prev" is 73a0d7b's
#                                                 kernel: carry .device/prev_ag_gemm.py = git show
#                                                 73a0d7b:megatron_flux/kernels/ag_gemm.py)
#                                                                                  -> $OUT/merge-*.json
# (carry .whl)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s14}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
failures() {  # failures JSON: one line per test that did not pass
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(t['outcome'], t['test'], (t['message'] or '')[:400]) for t in d['tests'] if t['outcome'] != 'passed']" "$1"
}
case "${1:-}" in
tests)
    install_carried_wheels || exit 1
    export PYTHONPATH="${PWD}:/tmp/site"
    echo "== gpu-marked tests ($(date +%T))"
    timeout 330 python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests -q -m gpu \
        -p no:cacheprovider > "${OUT}/tests-gpu.log" 2>&1
    echo "exit $? (${SECONDS}s)"; tail -2 "${OUT}/tests-gpu.log"; failures "${OUT}/tests-gpu.json"
    echo "== other tests ($(date +%T))"
    timeout $((570 - SECONDS)) python3 benchmarks/record_pytest.py "${OUT}/tests-rest.json" tests -q \
        -m "not gpu" --ignore tests/test_kernels_interpret.py --ignore tests/test_kernels_compile.py \
        -p no:cacheprovider > "${OUT}/tests-rest.log" 2>&1
    echo "exit $? (${SECONDS}s)"; tail -2 "${OUT}/tests-rest.log"; failures "${OUT}/tests-rest.json" ;;
bench)
    export PYTHONPATH="${PWD}"
    echo "== bench large ($(date +%T))"
    timeout 400 "${RUN[@]}" -m megatron_flux.bench --m-set large \
        --methods cublas_gemm comm nccl torch_async_tp flux --trials 5 --iters 20 \
        --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
    echo "   exit $? (${SECONDS}s)"; grep -A12 "^summary" "${OUT}/bench.log"
    echo "== bench small ($(date +%T))"
    timeout $((580 - SECONDS)) "${RUN[@]}" -m megatron_flux.bench --m-set small \
        --methods cublas_gemm comm nccl torch_async_tp flux auto --trials 5 --iters 20 \
        --out-json "${OUT}/bench-small.json" --out-png "${OUT}/bench-small.png" > "${OUT}/bench-small.log" 2>&1
    echo "   exit $? (${SECONDS}s)"; grep -A12 "^summary" "${OUT}/bench-small.log" ;;
trace2)
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    echo "== GEMM+RS, communication on ($(date +%T))"
    timeout 200 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op rs \
        --models llama3-70b gpt3-175b llama3-8b --ms 4096 8192 --json "${OUT}/trace2-rs-on.json" \
        2>&1 | grep -E "^(rs|Traceback)|Error"
    echo "== AG+GEMM, communication on ($(date +%T), ${SECONDS}s)"
    timeout $((330 - SECONDS)) "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op ag \
        --models llama3-8b llama3-70b --ms 1024 --json "${OUT}/trace2-ag-on.json" \
        2>&1 | grep -E "^(ag|Traceback)|Error"
    [ "${TRACE2_OFF:-1}" = 1 ] || exit 0
    echo "== GEMM+RS, communication off, GPU 0 ($(date +%T), ${SECONDS}s)"
    CUDA_VISIBLE_DEVICES=0 timeout $((400 - SECONDS)) python3 benchmarks/experiments/phase_trace.py \
        --op rs --tp 2 --models llama3-70b gpt3-175b llama3-8b --m 4096 8192 --configs table \
        --json "${OUT}/trace2-rs-off.json" 2>&1 | grep -E "^(rs|Traceback)|Error" ;;
trace2c)
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    sample_gpus "${OUT}/smi.csv" 200
    for run in off1 on1 off2 on2; do
        echo "== GEMM+RS, communication ${run%?} ($(date +%T), ${SECONDS}s)"
        timeout 120 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op rs --comm "${run%?}" \
            --models llama3-70b gpt3-175b llama3-8b --ms 4096 8192 --launches 5 \
            --json "${OUT}/trace2c-rs-${run}.json" 2>&1 | grep -E "^(rs|Traceback)|Error" | cut -c1-90
    done ;;
merge)
    install_carried_wheels || exit 1
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments:/tmp/site"
    echo "== tests ($(date +%T))"
    # the fused-ops test under CUDA_DEVICE_MAX_CONNECTIONS=1 and the default: merged, the kernel
    # waits for its own rows' copy, queued behind it on the side stream
    timeout 260 python3 benchmarks/record_pytest.py "${OUT}/merge-tests.json" \
        tests/test_flux_gpu.py tests/test_kernels_one_gpu.py -q -m gpu \
        -k "(match_nccl and not direct) or merged" -p no:cacheprovider > "${OUT}/merge-tests.log" 2>&1
    echo "exit $? (${SECONDS}s)"; tail -2 "${OUT}/merge-tests.log"; failures "${OUT}/merge-tests.json"
    for run in base1 merge1 base2 merge2; do
        case ${run} in merge*) O=(--override '{"ag_merge_local": true}') ;; *) O=() ;; esac
        echo "== AG+GEMM comm on, ${run} ($(date +%T), ${SECONDS}s)"
        timeout 60 "${RUN[@]}" benchmarks/experiments/phase_trace_tp.py --op ag "${O[@]}" \
            --models llama3-8b llama3-70b --ms 1024 2048 --launches 3 \
            --json "${OUT}/merge-ag-${run}.json" 2>&1 | grep -E "^(ag|Traceback)|Error" | cut -c1-90
    done
    echo "== AG+GEMM comm off, GPU 0, paired ($(date +%T), ${SECONDS}s)"
    CUDA_VISIBLE_DEVICES=0 timeout $((570 - SECONDS)) python3 benchmarks/experiments/kernel_ab.py \
        --op ag --prev .device/prev_ag_gemm.py --tp 2 --models llama3-8b llama3-70b \
        --m 1024 2048 --new-override '{"ag_merge_local": true}' --trials 7 --iters 20 \
        --warmup 10 --shuffle-seed 0 --json "${OUT}/merge-ag-kab-tp2.json" 2>&1 | grep -v Warning ;;
*) echo "usage: $0 tests|bench|trace2|trace2c|merge"; exit 2 ;;
esac
echo "== done in ${SECONDS}s"
