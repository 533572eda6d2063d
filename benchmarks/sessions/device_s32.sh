#!/usr/bin/env bash
# Session 32: GEMM+RS's stream-K tail. The machine goes back 30 s after a call; carry `.device`
# (the Triton cache; this session's kernel change recompiles GEMM+RS, so end a call with
# `cachepack`) and `.whl` (megatron-core).
#   kvcsk      GPU 0, communication off: GEMM+RS on the 128x256 shapes with the table's config
#              and its stream-K twin (`--configs table sk`), alternating with cuBLAS; gpt3-175b
#              m = 8192 is the shape whose tail (36 of 132 tiles) the rule splits, the others
#              are controls (their twins compile to the same kernel); then llama3-70b m = 8192
#              (tail 0.52) with the rule's threshold raised to 0.6   -> $OUT/kvc-rs-sk*.json
#   absk       both GPUs, communication on, connections 1: the issue's benchmark on GEMM+RS
#              gpt3-175b m = 4096 / 8192 with flux_variant = stream_k 1 and flux_control (the
#              table's configs in a second backend object)          -> $OUT/ab-sk.{json,log,png}
#   kvcgrid    GPU 0, communication off: the m >= 1024 grid with the table's configs, AG+GEMM,
#              then GEMM+RS with the stream-K twins (`--configs table sk`)
#                                                          -> $OUT/kvc-{ag,rs}-grid.{json,log}
#   abpp       both GPUs, communication on, connections 1: the Gluon ping-pong
#              (benchmarks/variants/gluon-pingpong.json) against the table on llama3-8b, both
#              ops, m = 1024-8192, with flux_control, AB_TRIALS (21) trials, no plot
#                                                          -> $OUT/ab-pp${AB_NAME}.{json,log}
#   tests1gpu  tests/test_kernels_one_gpu.py's stream-K cases          -> $OUT/tests-1gpu-sk.*
#   tests2     test_fused_ops_match_nccl[1] (two GPUs, connections 1), with the stream-K
#              GEMM+RS checks                                          -> $OUT/tests-2gpu.*
#   tests2all  every GPU test of test_flux_gpu.py and test_layers_gpu.py (both GPUs)
#                                                                      -> $OUT/tests-2gpu-all.*
#   cachepack  the Triton cache in 15 MB pieces -> $OUT/triton-cache.tgz.part-*
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s32.sh kvcsk absk cachepack
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s32}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
gpu_session_start
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
KVC=(python3 megatron_flux/bench/kernel_vs_cublas.py --tp 2 --alternate --trials 7 --iters 20
     --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    kvcsk)
      CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-360}" "${KVC[@]}" --ops GEMM+RS --configs table sk \
          --models gpt3-175b llama3-70b \
          --m 4096 8192 --json "${OUT}/kvc-rs-sk.json" > "${OUT}/kvc-rs-sk.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/kvc-rs-sk.json"
      CUDA_VISIBLE_DEVICES=0 timeout 200 "${KVC[@]}" --ops GEMM+RS --configs table sk \
          --models llama3-70b --m 8192 --sk-max-tail 0.6 \
          --json "${OUT}/kvc-rs-sk-tail06.json" > "${OUT}/kvc-rs-sk-tail06.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/kvc-rs-sk-tail06.json" ;;
    kvcgrid)
      CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-300}" "${KVC[@]}" --ops AG+GEMM --configs table \
          --json "${OUT}/kvc-ag-grid.json" > "${OUT}/kvc-ag-grid.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/kvc-ag-grid.json"
      CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-300}" "${KVC[@]}" --ops GEMM+RS --configs table sk \
          --json "${OUT}/kvc-rs-grid.json" > "${OUT}/kvc-rs-grid.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/kvc-rs-grid.json" ;;
    absk)
      CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "${AB_TIMEOUT:-300}" "${RUN[@]}" \
          -m megatron_flux.bench --ops rs --models gpt3-175b --ms ${AB_MS:-4096 8192} \
          --methods cublas_gemm nccl flux flux_variant flux_control --flux-variant '{"stream_k": 1}' \
          --trials "${AB_TRIALS:-7}" --iters 20 --out-json "${OUT}/ab-sk${AB_NAME:-}.json" \
          --out-png "${OUT}/ab-sk${AB_NAME:-}.png" > "${OUT}/ab-sk${AB_NAME:-}.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; tail -22 "${OUT}/ab-sk${AB_NAME:-}.log" ;;
    abpp)
      CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "${AB_TIMEOUT:-300}" "${RUN[@]}" \
          -m megatron_flux.bench --ops ag rs --models llama3-8b --ms 1024 2048 4096 8192 \
          --methods cublas_gemm nccl flux flux_variant flux_control \
          --flux-variant "$(cat benchmarks/variants/gluon-pingpong.json)" \
          --trials "${AB_TRIALS:-21}" --iters 20 --out-json "${OUT}/ab-pp${AB_NAME:-}.json" \
          --out-png none > "${OUT}/ab-pp${AB_NAME:-}.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; grep -A4 "^summary" "${OUT}/ab-pp${AB_NAME:-}.log" ;;
    tests1gpu)
      CUDA_VISIBLE_DEVICES=0 gpu_tests 300 tests-1gpu-sk tests/test_kernels_one_gpu.py -k stream_k ;;
    tests2)
      OUT="${OUT}" bash benchmarks/sessions/device_s29.sh tests1 ;;
    tests2all)
      gpu_tests "${TESTS_TIMEOUT:-540}" tests-2gpu-all tests/test_flux_gpu.py tests/test_layers_gpu.py ;;
    cachepack) pack_triton_cache ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
