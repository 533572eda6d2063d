#!/usr/bin/env bash
# Every GPU test (tests/gpu) in lanes of GPUs (benchmarks/device_parallel.sh), then one merged
# record:
#
#   OUT=/somewhere bash benchmarks/device_tests.sh [cachepack]
#
# On 4 GPUs, one call, two phases. Phase 1, two 2-GPU lanes: test_flux_gpu.py (the longest
# file), and the other files that need two GPUs. Phase 2, four 1-GPU lanes: test_kernels_one_gpu.py
# split by test function, and the remaining one-GPU files. With a warm Triton cache (.device/)
# it takes about six minutes on 4xH200; a cold cache compiles for longer than one call allows.
# On 2 GPUs the same sets run as four phases (a: test_flux_gpu.py; b: the other 2-GPU files;
# c, d: two 1-GPU lanes each), too long for one call: PHASES="a b" in one call and
# PHASES="c d" in the next, then merge_pytest_records.py over both calls' archives. GPUS
# overrides the GPU count, PHASES the phases (default: all of the layout's).
# Each test also runs with pytest's own --timeout (TEST_TIMEOUT, default 300 s), so a hung
# test fails by name.
# -> $OUT/phase*/results.tgz and $OUT/tests-gpu.json (benchmarks/merge_pytest_records.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/megatron-flux-device}"
K=tests/gpu/test_kernels_one_gpu.py
export PYTEST_VERBOSITY=-v PYTEST_ARGS="--timeout=${TEST_TIMEOUT:-300}"
FLUX="TESTS_PATHS=tests/gpu/test_flux_gpu.py"
TWO_GPU="TESTS_PATHS=tests/gpu/test_graphs_gpu.py,tests/gpu/test_layers_gpu.py"
ONE_A="TESTS_PATHS=$K::test_gemm_rs_reduction_paths,$K::test_gemm_rs_stream_k_tail"
ONE_B="TESTS_PATHS=$K::test_ag_gemm_merged_local_rows,$K::test_rs_reduce_sums_in_rank_order,$K::test_gemm_rs_ws_bias_layouts_and_signals"
ONE_C="TESTS_PATHS=$K::test_gemm_rs_ws_merged_rows_bias_and_signals,$K::test_gemm_rs_ws_split_tail,$K::test_gemm_rs_ws_split_tail_wait_times_out_loudly,$K::test_gemm_rs_ws_times_out_loudly_without_peer,$K::test_ag_gemm_ws_reads_shard_and_workspace,$K::test_ag_gemm_ws_times_out_loudly_on_a_missing_chunk"
ONE_D="TESTS_PATHS=$K::test_gemm_rs_two_ranks_on_one_gpu,$K::test_gemm_rs_four_ranks_on_one_gpu,$K::test_gemm_rs_ws_split_tail_ranks_on_one_gpu,$K::test_gemm_rs_ws_builds_spill_no_registers,$K::test_ag_gemm_waits_for_chunks_that_land_while_it_runs,tests/gpu/test_errors_gpu.py,tests/gpu/test_grad_accumulation_gpu.py,tests/gpu/test_phase_trace_gpu.py,tests/gpu/test_queues_gpu.py"
T1="TESTS_TIMEOUT=${PHASE1_TIMEOUT:-330}"
T2="TESTS_TIMEOUT=${PHASE2_TIMEOUT:-200}"
gpus="${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
if [ "${gpus}" -ge 4 ]; then default_phases="1 2"; else default_phases="a b c d"; fi
read -r -a phases <<< "${PHASES:-${default_phases}}"
archives=()
for i in "${!phases[@]}"; do
    extra=()
    if [ "$((i + 1))" -eq "${#phases[@]}" ]; then extra=("$@"); fi  # cachepack after the last
    case "${phases[$i]}" in
        1) lanes=("0,1:${FLUX} ${T1} tests" "2,3:${TWO_GPU} ${T1} tests") ;;
        2) lanes=("0:${ONE_A} ${T2} tests" "1:${ONE_B} ${T2} tests" "2:${ONE_C} ${T2} tests"
                  "3:${ONE_D} ${T2} tests") ;;
        a) lanes=("0,1:${FLUX} ${T1} tests") ;;
        b) lanes=("0,1:${TWO_GPU} ${T1} tests") ;;
        c) lanes=("0:${ONE_A} ${T2} tests" "1:${ONE_B} ${T2} tests") ;;
        d) lanes=("0:${ONE_C} ${T2} tests" "1:${ONE_D} ${T2} tests") ;;
        *) echo "device_tests.sh: unknown phase ${phases[$i]} (4 GPUs: 1 2; 2 GPUs: a b c d)"; exit 2 ;;
    esac
    OUT="${OUT}/phase${phases[$i]}" bash benchmarks/device_parallel.sh "${lanes[@]}" "${extra[@]}"
    archives+=("${OUT}/phase${phases[$i]}/results.tgz")
done
python3 benchmarks/merge_pytest_records.py "${OUT}/tests-gpu.json" "${archives[@]}"
