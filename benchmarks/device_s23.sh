#!/usr/bin/env bash
# Session 23, one GPU (kinds nvidia-h100-x1 / nvidia-h200 only, for the fifth session).
#   mutants  the mutation check of the Gluon merged GEMM+RS rows' one-GPU tests (session 22's
#            new cases): four mutants (a spanning tile skipped, the own signal not raised, the
#            wrong slot, a rank left out of the spread reduction); each must fail its tests
#                                                        -> $OUT/mutants-ws-merged.json
#   wgrad    weight-gradient accumulation into fp32 main_grad on the Llama-3-8B TP 2 shapes
#            (m = 8192): a bf16 GEMM then main_grad.add_ (what runs without apex) against one
#            fp32-output cuBLAS GEMM with beta = 1, if this torch takes it; errors against
#            float64                                    -> $OUT/wgrad-accum.json
#   wgradtest the GPU test of the fused accumulation (tests/test_grad_accumulation_gpu.py), then
#            wgrad's timing at m = 4096 and 16384 (one and four micro-batches of 4096 tokens
#            per rank at TP 2)                          -> $OUT/tests-wgrad.json, $OUT/wgrad-accum-m.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/device_s23.sh mutants wgrad
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/s23}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
EXP=benchmarks/experiments
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    mutants)
      timeout 480 python3 ${EXP}/mutants_ws.py --timeout 150 --json "${OUT}/mutants-ws-merged.json" \
          --only ws_merged_span_skipped ws_merged_own_signal_not_raised ws_merged_wrong_slot \
          ws_merged_reduce_drops_rank ;;
    wgrad)
      timeout 200 python3 ${EXP}/wgrad_accum.py "${TIMING[@]}" --m 8192 --json "${OUT}/wgrad-accum.json" ;;
    wgradtest)
      timeout 120 python3 benchmarks/record_pytest.py "${OUT}/tests-wgrad.json" \
          tests/test_grad_accumulation_gpu.py -q -p no:cacheprovider 2>&1 | tail -3
      timeout 300 python3 ${EXP}/wgrad_accum.py "${TIMING[@]}" --m 4096 16384 --json "${OUT}/wgrad-accum-m.json" ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done (${SECONDS}s)"
