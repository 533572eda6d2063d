#!/usr/bin/env bash
# Every GPU test (tests/gpu) on one 4-GPU machine in one device call, in two phases of lanes
# (benchmarks/device_parallel.sh), then one merged record:
#
#   OUT=/somewhere bash benchmarks/device_tests.sh [cachepack]
#
# Phase 1, two 2-GPU lanes: test_flux_gpu.py (the longest file), and the other files that need
# two GPUs. Phase 2, four 1-GPU lanes: test_kernels_one_gpu.py split by test function, and the
# remaining one-GPU files. With a warm Triton cache (.device/) it takes about six minutes on
# 4×H200; a cold cache compiles for longer than one call allows. Each test also runs with
# pytest's own --timeout (TEST_TIMEOUT, default 300 s), so a hung test fails by name.
# -> $OUT/phase{1,2}/results.tgz and $OUT/tests-gpu.json (benchmarks/merge_pytest_records.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/megatron-flux-device}"
K=tests/gpu/test_kernels_one_gpu.py
export PYTEST_VERBOSITY=-v PYTEST_ARGS="--timeout=${TEST_TIMEOUT:-300}"
OUT="${OUT}/phase1" bash benchmarks/device_parallel.sh \
    "0,1:TESTS_PATHS=tests/gpu/test_flux_gpu.py TESTS_TIMEOUT=${PHASE1_TIMEOUT:-330} tests" \
    "2,3:TESTS_PATHS=tests/gpu/test_graphs_gpu.py,tests/gpu/test_layers_gpu.py TESTS_TIMEOUT=${PHASE1_TIMEOUT:-330} tests"
OUT="${OUT}/phase2" bash benchmarks/device_parallel.sh \
    "0:TESTS_PATHS=$K::test_gemm_rs_reduction_paths,$K::test_gemm_rs_stream_k_tail TESTS_TIMEOUT=${PHASE2_TIMEOUT:-200} tests" \
    "1:TESTS_PATHS=$K::test_ag_gemm_merged_local_rows,$K::test_rs_reduce_sums_in_rank_order,$K::test_gemm_rs_ws_bias_layouts_and_signals TESTS_TIMEOUT=${PHASE2_TIMEOUT:-200} tests" \
    "2:TESTS_PATHS=$K::test_gemm_rs_ws_merged_rows_bias_and_signals,$K::test_gemm_rs_ws_times_out_loudly_without_peer,$K::test_ag_gemm_ws_reads_shard_and_workspace,$K::test_ag_gemm_ws_times_out_loudly_on_a_missing_chunk TESTS_TIMEOUT=${PHASE2_TIMEOUT:-200} tests" \
    "3:TESTS_PATHS=$K::test_gemm_rs_two_ranks_on_one_gpu,$K::test_ag_gemm_waits_for_chunks_that_land_while_it_runs,tests/gpu/test_grad_accumulation_gpu.py,tests/gpu/test_phase_trace_gpu.py TESTS_TIMEOUT=${PHASE2_TIMEOUT:-200} tests" \
    "$@"
python3 benchmarks/merge_pytest_records.py "${OUT}/tests-gpu.json" "${OUT}/phase1/results.tgz" "${OUT}/phase2/results.tgz"
