#!/usr/bin/env bash
# Session 29: the fused path's host time per layer call, which decides host-bound training steps
# (session 28: 1.0-1.6 ms per fc1/fc2 layer call against NCCL's 0.9-1.1 ms on 2xH100).
# The machine goes back 30 s after a call, so each call carries what it needs: `.device`
# (the Triton cache in pieces, .device/triton-cache.tgz.part-*, from `cachepack`) and, for the
# tests, `.whl` (megatron-core).
#   sections   benchmarks/experiments/host_sections.py on every GPU: per layer call (fc1 column,
#              fc2 row, fwd+bwd, m = 4096), the inclusive host time of the functions the path
#              is made of, for nccl and flux -> $OUT/sections.{json,log}; then flux again once
#              per ENV=VALUE in SEC_VARIANTS (default MEGATRON_FLUX_DIRECT_LAUNCH=0)
#                                                   -> $OUT/sections-v<i>.{json,log}
#              (call 1 ran an earlier form: flux with MEGATRON_FLUX_DIRECT_LAUNCH=1, then
#              opt-in, as sections-direct.log; call 2 also ran MEGATRON_FLUX_RAW_LAUNCH=0,
#              see raw/s29)
#   layers     benchmarks/host_overhead.py --layers --ms 4096, backends in LAYER_BACKENDS
#              (default: nccl flux)                 -> $OUT/host-layers.json, .log
#   tests2     the multi-GPU tests, the fused ops against NCCL (direct launch, the default now,
#              and Triton's own launch) and the layers -> $OUT/tests-2gpu.{json,log}
#   ws1        the warp-specialized kernels' one-GPU tests on GPU 0 -> $OUT/tests-ws1.{json,log}
#   ab         benchmarks/experiments/host_launch_ab.py: host time per layer call of nccl and the
#              fused path's launch paths, alternating in one process (AB_ARGS) -> $OUT/host-ab.json
#   grid       the issue's m >= 1024 grid, nccl and flux only, 3 trials, --strict: every fused
#              output checked against NCCL through the default launch path -> $OUT/grid-check.*
#   tests1     tests2's first case only (the fused ops against NCCL, connections 1)
#   cachepack  the Triton cache in 15 MB pieces -> $OUT/triton-cache.tgz.part-*
# Prepared, not run this session (no device time left): the soft start barrier in the Gluon
# AG+GEMM, from benchmarks/results/raw/s29/start_barrier.patch (applied first):
#   sbtest     the Gluon AG+GEMM's one-GPU tests, the barrier's cases included, on GPU 0
#                                                    -> $OUT/tests-sb.{json,log}
#   sbkvc      communication off, launches alternating with cuBLAS, AG+GEMM m >= 1024 on GPU 0:
#              the table's config, the ping-pong 128x128x64/5, and the same with
#              start_barrier_spins 256 and 4096 (shuffle seed KVC_SEED, default 0) -> $OUT/kvc-sb-ag.json
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s29.sh sections
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s29}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
gpu_session_start
TR=(torchrun --nproc-per-node "${NGPUS}")
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    sections)
      timeout "${SEC_TIMEOUT:-200}" "${TR[@]}" benchmarks/experiments/host_sections.py \
          ${SEC_ARGS:-} --out "${OUT}/sections.json" > "${OUT}/sections.log" 2>&1
      echo "   exit $?"; grep -v Warning "${OUT}/sections.log" | grep -E "^(nccl|flux) |^ +[0-9]|primitive" | head -80
      i=0
      for variant in ${SEC_VARIANTS:-MEGATRON_FLUX_DIRECT_LAUNCH=0}; do
        i=$((i + 1))
        env "${variant}" timeout "${SEC_TIMEOUT:-200}" "${TR[@]}" benchmarks/experiments/host_sections.py \
            --backends flux ${SEC_ARGS:-} --out "${OUT}/sections-v${i}.json" > "${OUT}/sections-v${i}.log" 2>&1
        echo "   ${variant}: exit $?"; grep -E "^flux |^ +[0-9]" "${OUT}/sections-v${i}.log" | head -24
      done ;;
    layers)
      timeout "${LAYERS_TIMEOUT:-200}" "${TR[@]}" benchmarks/host_overhead.py --layers --ms 4096 \
          --backends ${LAYER_BACKENDS:-nccl flux} --iters 30 --trials 5 \
          --out "${OUT}/host-layers.json" > "${OUT}/host-layers.log" 2>&1
      echo "   exit $?"; grep -E "cpu issue" "${OUT}/host-layers.log" ;;
    tests2)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout "${TESTS_TIMEOUT:-420}" python3 benchmarks/record_pytest.py \
          "${OUT}/tests-2gpu.json" tests/test_flux_gpu.py tests/test_layers_gpu.py -v -s -m gpu \
          -p no:cacheprovider > "${OUT}/tests-2gpu.log" 2>&1
      echo "   tests exit $?"; grep -E "PASSED|FAILED|ERROR|[0-9]+ (passed|failed)" "${OUT}/tests-2gpu.log" | tail -15 ;;
    ws1)
      CUDA_VISIBLE_DEVICES=0 timeout "${WS_TIMEOUT:-240}" python3 benchmarks/record_pytest.py \
          "${OUT}/tests-ws1.json" tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k "ws" \
          > "${OUT}/tests-ws1.log" 2>&1
      echo "   tests exit $?"; tail -3 "${OUT}/tests-ws1.log" ;;
    ab)
      timeout "${AB_TIMEOUT:-240}" "${TR[@]}" benchmarks/experiments/host_launch_ab.py ${AB_ARGS:-} \
          --out "${OUT}/host-ab.json" > "${OUT}/host-ab.log" 2>&1
      echo "   exit $?"; grep -E "host .* us \(IQR" "${OUT}/host-ab.log" ;;
    grid)
      timeout "${GRID_TIMEOUT:-240}" "${TR[@]}" -m megatron_flux.bench --m-set large --methods nccl flux \
          --trials 3 --iters 10 --strict --out-json "${OUT}/grid-check.json" --out-png none \
          > "${OUT}/grid-check.log" 2>&1
      echo "   exit $?"; grep -E "FAIL|check|error" "${OUT}/grid-check.log" | head; grep -A6 "^summary" "${OUT}/grid-check.log" ;;
    tests1)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout "${TESTS_TIMEOUT:-420}" python3 benchmarks/record_pytest.py \
          "${OUT}/tests-2gpu.json" "tests/test_flux_gpu.py::test_fused_ops_match_nccl[1]" -v -s -m gpu \
          -p no:cacheprovider > "${OUT}/tests-2gpu.log" 2>&1
      echo "   tests exit $?"; grep -E "PASSED|FAILED|ERROR|rank 0 \+|[0-9]+ (passed|failed)" "${OUT}/tests-2gpu.log" | tail -15 ;;
    cachepack) pack_triton_cache ;;
    sbtest|sbkvc)
      [ -f .sb-applied ] || { git apply benchmarks/results/raw/s29/start_barrier.patch && touch .sb-applied; } || exit 2
      if [ "${what}" = sbtest ]; then
        CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-300}" python3 benchmarks/record_pytest.py \
            "${OUT}/tests-sb.json" tests/test_kernels_one_gpu.py -q -p no:cacheprovider \
            -k "ag_gemm_ws" > "${OUT}/tests-sb.log" 2>&1
        echo "   tests exit $?"; tail -3 "${OUT}/tests-sb.log"
      else
        PP='{"ag_warp_specialized": true, "block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 5, "num_warps": 4, "epilogue_split": 1, "stream_k": 0'
        CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-300}" python3 megatron_flux/bench/kernel_vs_cublas.py \
            --tp 2 --ops AG+GEMM --m 1024 2048 4096 8192 --configs table \
            --extra "[${PP}}, ${PP}, \"start_barrier_spins\": 256}, ${PP}, \"start_barrier_spins\": 4096}]" \
            --alternate --trials 7 --iters 20 --warmup 10 --shuffle-seed "${KVC_SEED:-0}" --queue-ahead-ms 5 \
            --json "${OUT}/kvc-sb-ag.json" 2>&1 | grep -v Warning
      fi ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
rm -f "${OUT}/smi.csv"
echo "== done in ${SECONDS}s"
