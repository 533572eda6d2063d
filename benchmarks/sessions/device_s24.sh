#!/usr/bin/env bash
# Session 24, one GPU (kinds nvidia-h100-x1 / nvidia-h200 only, for the sixth session).
#   tworanks the two-rank-on-one-GPU tests alone, in a fresh process: session 23's epoch-0
#            warm-up launch per rank (CUDA lazy loading) had not run  -> $OUT/tests-tworanks.json
#   agseg    does the AG+GEMM's per-segment grouping cost the Gluon ping-pong at llama3-8b
#            m = 1024 what it cost the Triton kernel (segments of 4 row tiles, so group_m is
#            4 in effect)? The same GEMM [1024, 4096] x [4096, 14336] as TP 2 (two segments)
#            and as TP 1 (one segment of 8 row tiles), ping-pong 128x128x64/5 with group_m
#            4 / 8 / 16, comm off, alternating with cuBLAS  -> $OUT/agseg-tp{1,2}.json
#   outlayer the output layer's AG+GEMM (Llama-3-8B: h 4096, vocab 128256, so n = 64128 per
#            rank at TP 2) with comm off at m = 4096 / 8192: the default config and the two
#            Gluon forms against cuBLAS, alternating  -> $OUT/kvc-outlayer.json
#   outwgrad the output layer's weight gradient [64128, 4096] at m = 8192 accumulated into an
#            fp32 main_grad: bf16 GEMM + add_ (stock without apex) against one fp32-output GEMM
#            (experiments/wgrad_accum.py)          -> $OUT/wgrad-accum-output.json
#   flowtest (carry .whl) tests/test_examples.py's Megatron 0.19 flow tests (megatron.training
#            needs Python 3.12 and CUDA, so they skip on CI): the pretrain script's parsed
#            flags, spec hook and pre-wrap hooks          -> $OUT/tests-flow.json
#   outab    (2 GPUs) the output layer's AG+GEMM with communication (Llama-3-8B, n = 64128 per
#            rank, m = 4096 / 8192): cuBLAS, NCCL, the default config (flux) and the Gluon
#            ping-pong (flux_variant), twice; adopt into a table where both runs win:
#            python -m megatron_flux.tuning.adopt TABLE ab-out-1.json ab-out-2.json OUT_TABLE
#                                                  -> $OUT/ab-out-{1,2}.{json,log}
#   kvcgrid  comm off, alternating with cuBLAS, llama3-8b and llama3-70b at m = 1024-8192: the
#            default config (what a GPU without a shipped table runs, e.g. an H100), the plain
#            yardstick and the Gluon ping-pong / cooperative forms  -> $OUT/kvc-grid-{ag,rs}.json
#   custom1  (carry .whl) examples/custom_model.py under torchrun on this one GPU (TP 1: no
#            sequence parallelism, so the converted output layer runs megatron-core's code inside
#            a real GPTModel), 3 steps             -> $OUT/custom1.log
#   waves    is the Gluon ping-pong's 4 % at AG llama3-8b m = 1024 wave quantization? The same
#            GEMM family at TP 1, m = 1024 (8 row tiles of 128): n = 14336 (896 tiles of
#            128x128, 6.79 waves of 132), 16384 (7.76 waves) and 16896 (exactly 8 waves), comm
#            off, alternating with cuBLAS          -> $OUT/waves.json
#   check    `megatron-flux check` on this GPU, plain and for --tp 2 (JSON)  -> $OUT/check*.txt/json
#   agsmall  AG+GEMM's small-m default (every peer's rows gathered first, one tile space) on
#            other tiles: 64x128x128/4, 128x128x64/4 (4 and 8 warps), 64x256x64/4, 128x256x64/3
#            (the default from m = 256), m = 64-512, comm off, block timing (small kernels:
#            alternation biases ratios towards 1); RUNS="1 2" names the runs
#                                                  -> $OUT/agsmall-run<N>.json
#   agdefault after AG+GEMM's small-m default took gathered_ag_tile: the one-GPU kernel tests,
#            then the small-m AG grid with the default (block timing), twice
#                                      -> $OUT/tests-kernels.json, $OUT/agdefault-run{1,2}.json
#   tests    (carry .whl) every GPU-marked test on this one GPU -> $OUT/tests-1gpu.json
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s24.sh tworanks tests
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s24}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
case " $* " in
  *" outab "*) every_gpu_session ;;
  *) one_gpu_session ;;
esac
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
KVC=megatron_flux/bench/kernel_vs_cublas.py
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    tworanks)
      timeout 200 python3 benchmarks/record_pytest.py "${OUT}/tests-tworanks.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider -k two_ranks 2>&1 | tail -3 ;;
    agseg)
      PPG='{"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "stream_k": 0, "ag_peer_group": 1, "ag_merge_local": false, "block_n": 128, "num_stages": 5, "num_warps": 4, "group_m": G}'
      X="[${PPG/G/4}, ${PPG/G/8}, ${PPG/G/16}]"
      timeout 200 python3 ${KVC} --tp 1 --model-shapes l8half:4096:14336:14336 --ops AG+GEMM --m 1024 \
          --configs default plain --extra "${X}" --alternate "${TIMING[@]}" --json "${OUT}/agseg-tp1.json" 2>&1 | grep -v Warning
      timeout 200 python3 ${KVC} --tp 2 --models llama3-8b --ops AG+GEMM --m 1024 2048 \
          --configs table plain --extra "${X}" --alternate "${TIMING[@]}" --json "${OUT}/agseg-tp2.json" 2>&1 | grep -v Warning ;;
    outlayer)
      WS='{"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "stream_k": 0, "ag_peer_group": 1, "ag_merge_local": false'
      X="[${WS}, \"block_n\": 256, \"num_stages\": 3, \"num_warps\": 8}, ${WS}, \"block_n\": 128, \"num_stages\": 5, \"num_warps\": 4}]"
      timeout 300 python3 ${KVC} --tp 2 --model-shapes l8out:4096:128256:128256 --ops AG+GEMM --m 4096 8192 \
          --configs default plain --extra "${X}" --alternate "${TIMING[@]}" --json "${OUT}/kvc-outlayer.json" 2>&1 | grep -v Warning ;;
    outwgrad)
      timeout 200 python3 benchmarks/experiments/wgrad_accum.py --shapes output --m 8192 \
          "${TIMING[@]}" --json "${OUT}/wgrad-accum-output.json" 2>&1 | tail -8 ;;
    flowtest)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 300 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-flow.json" tests/test_examples.py -q -p no:cacheprovider -rs 2>&1 | tail -6 ;;
    outab)
      PP='"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "ag_peer_group": 1, "ag_merge_local": false, "stream_k": 0, "programs_per_sm": 1, "block_n": 128, "num_stages": 5, "num_warps": 4'
      for run in 1 2; do
        PYTHONPATH="${PWD}" timeout 150 python3 -m torch.distributed.run --standalone \
            --nproc-per-node "${NGPUS}" -m megatron_flux.bench --ops ag \
            --model-shapes l8out:4096:128256:128256 --ms 4096 8192 \
            --methods cublas_gemm nccl flux flux_variant --flux-variant "{${PP}}" \
            --trials 5 --iters 20 --out-json "${OUT}/ab-out-${run}.json" --out-png none \
            > "${OUT}/ab-out-${run}.log" 2>&1
        echo "   ab-out-${run} exit $? (${SECONDS}s)"; grep -A4 "^summary" "${OUT}/ab-out-${run}.log" | head -5
      done ;;
    kvcgrid)
      for op in AG+GEMM GEMM+RS; do
        knob=$([ "${op}" = AG+GEMM ] && echo ag_warp_specialized || echo rs_warp_specialized)
        WS="{\"${knob}\": true, \"block_m\": 128, \"block_k\": 64, \"epilogue_split\": 1, \"stream_k\": 0"
        X="[${WS}, \"block_n\": 128, \"num_stages\": 5, \"num_warps\": 4}, ${WS}, \"block_n\": 256, \"num_stages\": 3, \"num_warps\": 8}]"
        name=$([ "${op}" = AG+GEMM ] && echo ag || echo rs)
        left=$(( (590 - SECONDS) / ($([ "${op}" = AG+GEMM ] && echo 2 || echo 1)) ))
        timeout "$(( left < 200 ? left : 200 ))" python3 ${KVC} --tp 2 --models llama3-8b llama3-70b --ops "${op}" --m 1024 2048 4096 8192 \
            --configs default plain --extra "${X}" --alternate "${TIMING[@]}" \
            --json "${OUT}/kvc-grid-${name}.json" 2>&1 | grep -v Warning
      done ;;
    custom1)
      install_carried_wheels || exit 2
      PYTHONPATH="${PWD}:/tmp/site" timeout 200 python3 -m torch.distributed.run --standalone \
          --nproc-per-node 1 examples/custom_model.py --steps 3 --num-layers 2 --backend flux \
          > "${OUT}/custom1.log" 2>&1
      echo "   exit $?"; grep -E "step|Error|Traceback" "${OUT}/custom1.log" | head -8 ;;
    waves)
      PPW='[{"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "stream_k": 0, "ag_peer_group": 1, "ag_merge_local": false, "block_n": 128, "num_stages": 5, "num_warps": 4, "group_m": 8}]'
      timeout 300 python3 ${KVC} --tp 1 --model-shapes w679:4096:14336:14336 w776:4096:16384:16384 \
          w800:4096:16896:16896 --ops AG+GEMM --m 1024 --configs default plain --extra "${PPW}" \
          --alternate "${TIMING[@]}" --json "${OUT}/waves.json" 2>&1 | grep -v Warning ;;
    check)
      python3 -m megatron_flux.cli check | tee "${OUT}/check.txt"
      python3 -m megatron_flux.cli check --tp 2 --json > "${OUT}/check-tp2.json"; tail -12 "${OUT}/check-tp2.json" ;;
    agsmall)
      G='"ag_merge_local": true, "ag_merge_lead": 0, "chunk_rows": 4096, "epilogue_split": 1, "flatten": true, "stream_k": 0, "group_m": 8'
      X="[{${G}, \"block_m\": 64, \"block_n\": 128, \"block_k\": 128, \"num_stages\": 4, \"num_warps\": 4},
          {${G}, \"block_m\": 128, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 4, \"num_warps\": 4},
          {${G}, \"block_m\": 128, \"block_n\": 128, \"block_k\": 64, \"num_stages\": 4, \"num_warps\": 8},
          {${G}, \"block_m\": 64, \"block_n\": 256, \"block_k\": 64, \"num_stages\": 4, \"num_warps\": 4},
          {${G}, \"block_m\": 128, \"block_n\": 256, \"block_k\": 64, \"num_stages\": 3, \"num_warps\": 8}]"
      for run in ${RUNS:-1}; do
        timeout 200 python3 ${KVC} --tp 2 --ops AG+GEMM --m 64 128 256 512 --configs default \
            --extra "${X}" "${TIMING[@]}" --json "${OUT}/agsmall-run${run}.json" 2>&1 | grep -v Warning
      done ;;
    agdefault)
      timeout 330 python3 benchmarks/record_pytest.py "${OUT}/tests-kernels.json" \
          tests/test_kernels_one_gpu.py -q -p no:cacheprovider 2>&1 | tail -2
      for run in 1 2; do
        timeout 100 python3 ${KVC} --tp 2 --ops AG+GEMM --m 64 128 256 512 --configs default \
            "${TIMING[@]}" --json "${OUT}/agdefault-run${run}.json" 2>&1 | grep -v Warning
      done ;;
    tests)
      gpu_tests $((590 - SECONDS)) tests-1gpu ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done (${SECONDS}s)"
