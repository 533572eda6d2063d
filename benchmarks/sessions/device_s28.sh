#!/usr/bin/env bash
# Session 28: the Gluon AG+GEMM's stream-K split (stream_k=2: the partial last wave's tiles
# split along K over the grid and run first). It lost everywhere and was taken out of the tree;
# the stages sktest, skkvc, probe and ncu apply it first from
# benchmarks/results/raw/s28/stream_k_first_ws.patch (kernel, tests, probe script, variant).
# The machine goes back 30 s after a call, so each call carries what it needs
# (.device/triton-cache.tgz: the benchmark's compiles).
#   sktest   every one-GPU test of the Gluon AG+GEMM, the new stream-K cases included, on GPU 0
#                                                     -> $OUT/tests-sk.{json,log}
#   skkvc    communication off, launches alternating with cuBLAS, AG+GEMM m >= 1024 on GPU 0:
#            the table's config, the ping-pong 128x128x64/5 and the same with stream_k=2
#            (RUNS names the runs)                    -> $OUT/kvc-sk-ag-run<N>.json
#   probe    benchmarks/experiments/sk_first_probe.py on GPU 0 (PROBE_SHAPES, PROBE_ARGS): the
#            Gluon AG+GEMM launched directly as the data-parallel loop, the work-item loop with
#            nothing split, the split, and copies of the kernel with parts of the split cut out
#            or globaltimer stamps added            -> $OUT/sk-probe.json
#   ncu      Nsight Compute on the probe's --once launches (dp, items0, sk at llama3-8b m = 1024):
#            DRAM bytes, L2 hit rate, duration          -> $OUT/ncu-sk.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s28.sh sktest skkvc
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s28}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
gpu_session_start
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
KVC=megatron_flux/bench/kernel_vs_cublas.py
PP='{"ag_warp_specialized": true, "block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 5, "num_warps": 4, "epilogue_split": 1, "stream_k": 0}'
PPSK='{"ag_warp_specialized": true, "block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 5, "num_warps": 4, "epilogue_split": 1, "stream_k": 2}'
apply_sk() {  # the session's stream-K code, from its patch (once)
  [ -f benchmarks/experiments/sk_first_probe.py ] || git apply benchmarks/results/raw/s28/stream_k_first_ws.patch
}
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    sktest|skkvc|probe|ncu) apply_sk || exit 2 ;;
  esac
  case "${what}" in
    sktest)
      CUDA_VISIBLE_DEVICES=0 timeout "${TEST_TIMEOUT:-240}" python3 benchmarks/record_pytest.py \
          "${OUT}/tests-sk.json" tests/test_kernels_one_gpu.py -q -p no:cacheprovider \
          -k "ag_gemm_ws" > "${OUT}/tests-sk.log" 2>&1
      echo "   tests exit $?"; tail -3 "${OUT}/tests-sk.log" ;;
    skkvc)
      for run in ${RUNS:-1}; do
        CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-240}" python3 ${KVC} --tp 2 --ops AG+GEMM \
            --m ${KVC_M:-1024 2048 4096 8192} --configs table --extra "[${PP}, ${PPSK}]" \
            --alternate "${TIMING[@]}" --json "${OUT}/kvc-sk-ag-run${run}.json" 2>&1 | grep -v Warning
      done ;;
    probe)
      CUDA_VISIBLE_DEVICES=0 timeout "${PROBE_TIMEOUT:-200}" python3 benchmarks/experiments/sk_first_probe.py \
          --shape ${PROBE_SHAPES:-1024x14336x4096 4096x14336x4096 1024x24576x12288} --tp 2 \
          ${PROBE_ARGS:-} "${TIMING[@]}" --json "${OUT}/sk-probe.json" 2>&1 | grep -v Warning ;;
    ncu)
      CUDA_VISIBLE_DEVICES=0 timeout 240 ncu --kernel-name regex:ag_gemm_ws --launch-skip 3 --launch-count 3 \
          --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
          --csv python3 benchmarks/experiments/sk_first_probe.py --once --cuts --shape 1024x14336x4096 --tp 2 \
          > "${OUT}/ncu-sk.csv" 2> "${OUT}/ncu-sk.err"; echo "   ncu exit $?"; grep -v "^==PROF==" "${OUT}/ncu-sk.csv" | tail -20 ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
rm -f "${OUT}/smi.csv"
echo "== done in ${SECONDS}s"
