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
#   modes    per-launch GPU times (one event pair per launch) of cuBLAS, the fused kernel and
#            its plain yardstick on the shapes whose samples were bimodal or moved most between
#            runs: launch-by-launch modes, or whole stretches?   -> $OUT/launch-modes.json
#   smid     per launch of the merged GEMM+RS at gpt3-175b m = 64: GPU time, and per program its
#            SM and phase stamps, to compare fast and slow launches  -> $OUT/smid-modes.json
#   gridcap  after the merged tile spaces' grid was capped at their tiles: the one-GPU merged,
#            split and two-rank tests, launch_modes on the small-m shapes that had idle
#            programs, and kvc's small-m default  -> $OUT/tests-gridcap.json,
#            $OUT/launch-modes-gridcap.json, $OUT/kvc-small-gridcap.json
#   altgrid  the m >= 1024 grid with communication off, methods taking turns launch by launch
#            (kernel_vs_cublas --alternate): table, default, the plain yardstick of both, the two
#            Gluon forms; RUNS="1 2" names the runs  -> $OUT/kvc-alt-{ag,rs}-run<N>.json
#   altsmall the small-m set (m = 64-512) the same way: table, default, their plain yardsticks
#            (device and host descriptors)          -> $OUT/kvc-alt-small.json
#   hostdesc the fused Triton kernels with host-encoded TMA descriptors (the new default): the
#            one-GPU kernel tests, then host vs device descriptors, GPU time alternating with
#            cuBLAS and host time per call, on the grid  -> $OUT/tests-hostdesc.json,
#            $OUT/host-desc-ab.json
#   hostdesc2 GEMM+RS's own-tile output and slot descriptors also from the host: its one-GPU
#            tests, then hostdesc's A/B for GEMM+RS  -> $OUT/tests-hostdesc2.json,
#            $OUT/host-desc-ab-rs.json
#   tests    (carry .whl) every GPU-marked test on this one GPU -> $OUT/tests-1gpu-final.json
#   wshostdesc the Gluon kernels with host descriptors too: their one-GPU tests, then host vs
#            device descriptors for the ping-pong on the m >= 1024 grid
#            -> $OUT/tests-wshostdesc.json, $OUT/host-desc-ab-ws.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s23.sh mutants wgrad
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s23}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
one_gpu_session
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
EXP=benchmarks/experiments
KVC=megatron_flux/bench/kernel_vs_cublas.py
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
    modes)
      # memory clock and the active clock-event reasons beside the SM clock
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active \
          --format=csv,nounits -lms 100 > "${OUT}/smi-modes.csv" 2>&1 & XSMI=$!
      timeout 400 python3 ${EXP}/launch_modes.py --case rs:gpt3-175b:64:default \
          --case rs:gpt3-175b:128:default --case rs:gpt3-175b:1024:table \
          --case rs:llama3-8b:1024:table --case ag:llama3-8b:1024:table \
          --case ag:gpt3-175b:1024:table --json "${OUT}/launch-modes.json"
      kill ${XSMI} 2>/dev/null ;;
    smid)
      timeout 300 python3 ${EXP}/smid_modes.py --model gpt3-175b --m 64 --json "${OUT}/smid-modes.json" | tail -45 ;;
    gridcap)
      timeout 250 python3 benchmarks/record_pytest.py "${OUT}/tests-gridcap.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider \
          -k "reduction_paths or two_ranks or merged or split" 2>&1 | tail -3
      timeout 200 python3 ${EXP}/launch_modes.py --case rs:gpt3-175b:64:default \
          --case rs:gpt3-175b:128:default --case rs:llama3-8b:64:default \
          --case rs:llama3-70b:64:default --case ag:llama3-8b:64:default \
          --json "${OUT}/launch-modes-gridcap.json"
      timeout $((590 - SECONDS)) python3 ${KVC} --tp 2 --ops GEMM+RS AG+GEMM --m 64 128 256 \
          --configs default "${TIMING[@]}" --json "${OUT}/kvc-small-gridcap.json" 2>&1 | grep -v Warning ;;
    altgrid)
      AGX='[{"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "stream_k": 0, "block_n": 256, "num_stages": 3, "num_warps": 8}, {"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "stream_k": 0, "block_n": 128, "num_stages": 5, "num_warps": 4}]'
      RSX='[{"rs_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "rs_copy_engine": false, "block_n": 256, "num_stages": 3, "num_warps": 8}, {"rs_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "rs_copy_engine": false, "block_n": 128, "num_stages": 5, "num_warps": 4}]'
      for run in ${RUNS:-1}; do
        timeout 280 python3 ${KVC} --tp 2 --ops AG+GEMM --m 1024 2048 4096 8192 --configs table default plain \
            --extra "${AGX}" --alternate "${TIMING[@]}" --json "${OUT}/kvc-alt-ag-run${run}.json" 2>&1 | grep -v Warning
        timeout 280 python3 ${KVC} --tp 2 --ops GEMM+RS --m 1024 2048 4096 8192 --configs table default plain \
            --extra "${RSX}" --alternate "${TIMING[@]}" --json "${OUT}/kvc-alt-rs-run${run}.json" 2>&1 | grep -v Warning
      done ;;
    altsmall)
      timeout 280 python3 ${KVC} --tp 2 --ops AG+GEMM GEMM+RS --m 64 128 256 512 --configs table default plain \
          --alternate "${TIMING[@]}" --json "${OUT}/kvc-alt-small.json" 2>&1 | grep -v Warning ;;
    hostdesc)
      timeout 300 python3 benchmarks/record_pytest.py "${OUT}/tests-hostdesc.json" \
          tests/test_kernels_one_gpu.py tests/test_phase_trace_gpu.py tests/test_residency_gpu.py \
          -q -p no:cacheprovider -x 2>&1 | tail -3
      timeout $((590 - SECONDS)) python3 ${EXP}/host_desc_ab.py --json "${OUT}/host-desc-ab.json" ;;
    hostdesc2)
      timeout 250 python3 benchmarks/record_pytest.py "${OUT}/tests-hostdesc2.json" \
          tests/test_kernels_one_gpu.py tests/test_phase_trace_gpu.py -q -p no:cacheprovider \
          -k "rs or reduction or two_ranks" 2>&1 | tail -3
      timeout $((590 - SECONDS)) python3 ${EXP}/host_desc_ab.py --ops rs --json "${OUT}/host-desc-ab-rs.json" ;;
    tests)
      gpu_tests 560 tests-1gpu-final ;;
    wshostdesc)
      timeout 240 python3 benchmarks/record_pytest.py "${OUT}/tests-wshostdesc.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k "ws or coop or pingpong" 2>&1 | tail -3
      timeout $((590 - SECONDS)) python3 ${EXP}/host_desc_ab.py --ws --m 1024 2048 4096 8192 \
          --trials 5 --json "${OUT}/host-desc-ab-ws.json" ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done (${SECONDS}s)"
