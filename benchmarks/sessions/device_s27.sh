#!/usr/bin/env bash
# Session 27, two GPUs (kind nvidia-h200-x2, which session 26 got only as two H100s). The device
# gives a warm machine back 30 s after a call, so nothing is assumed to survive between calls:
# what a later stage needs comes back under $OUT and travels in the tree (raw/s27/), and the
# Triton cache travels as one archive (carry .device/triton-cache.tgz) so a fresh machine does
# not spend minutes recompiling.
#   pick       the first stage for the cards that came: abpp on H200s, h100tune on H100s
#   abpp       (H200) device_s26.sh abpp: the m >= 1024 grid with flux_variant = the Gluon
#              ping-pong, connections 1                     -> $OUT/ab-pp-conn1-<RUN_NAME>.*
#   adopt      (H200) tuning.adopt over every raw/s27/ab-pp-*.json (AB_GLOB), into the shipped
#              TP 2 table                                    -> $OUT/table-adopted.json
#   final, small  device_s26.sh's stages (the issue's benchmark; the small-m grid with auto)
#   h100tune   (H100) the small-m grid tuned and merged into session 26's m >= 1024 H100 table
#              (raw/s26/call6/table-h100-tp2.json), then the whole grid benchmarked with it
#              (flux = table, flux_default, auto)         -> $OUT/table-h100-tp2.json, bench-h100-*.*
#   h100fill   (H100) call 7's table completed (FILL_ARGS: the entries its tune had no time for),
#              then the whole grid benchmarked with it twice -> $OUT/table-h100-tp2.json, bench-h100-all-{2,3}.*
#   h100bench  (H100) the whole grid again with raw/s27/table-h100-tp2.json -> bench-h100-all-<RUN_NAME>.*
#   abctl      the abpp A/B plus flux_control (same configs as flux, second backend object)
#                                                           -> $OUT/ab-ctl-<RUN_NAME>.*
#   cachepack  the Triton cache as one archive, if it fits what comes back -> $OUT/triton-cache.tgz
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s27.sh pick cachepack
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s27}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
every_gpu_session
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "cards: ${NGPUS} x ${GPU_NAME}"
unpack_triton_cache
h100_bench() {  # h100_bench NAME TABLE TIMEOUT: the whole grid, connections 1, with TABLE
  MEGATRON_FLUX_CONFIG="$2" CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "$3" \
      "${RUN[@]}" -m megatron_flux.bench --m-set all \
      --methods cublas_gemm comm nccl torch_async_tp flux flux_default auto --trials 5 --iters 20 \
      --out-json "${OUT}/$1.json" --out-png "${OUT}/$1.png" > "${OUT}/$1.log" 2>&1
  echo "   $1 exit $? (${SECONDS}s)"; grep -A8 "^summary" "${OUT}/$1.log" | head -9
}
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    pick)
      case "${GPU_NAME}" in
        *H200*) RUN_NAME="${RUN_NAME:-1}" bash benchmarks/sessions/device_s26.sh abpp ;;
        *H100*) bash "$0" h100tune ;;
        *) echo "no plan for ${GPU_NAME}"; exit 2 ;;
      esac ;;
    abctl)
      # the ping-pong A/B with a same-config control (flux_control: the table's configs in a
      # second backend object), which tuning.adopt then requires the variant to beat
      CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "${AB_TIMEOUT:-420}" "${RUN[@]}" \
          -m megatron_flux.bench --m-set large --methods cublas_gemm nccl flux flux_variant \
          flux_control --flux-variant "$(cat benchmarks/variants/gluon-pingpong.json)" \
          --trials 5 --iters 20 --out-json "${OUT}/ab-ctl-${RUN_NAME:-1}.json" \
          --out-png "${OUT}/ab-ctl-${RUN_NAME:-1}.png" > "${OUT}/ab-ctl-${RUN_NAME:-1}.log" 2>&1
      echo "   ab-ctl exit $? (${SECONDS}s)"; grep -A8 "^summary" "${OUT}/ab-ctl-${RUN_NAME:-1}.log" | head -9 ;;
    abpp|final|small)
      bash benchmarks/sessions/device_s26.sh "${what}" ;;
    adopt)
      ls ${AB_GLOB:-benchmarks/results/raw/s27/ab-pp-*.json} || exit 2
      python3 -m megatron_flux.tuning.adopt megatron_flux/tuning/tables/h200-sm132-tp2-bf16.json \
          ${AB_GLOB:-benchmarks/results/raw/s27/ab-pp-*.json} "${OUT}/table-adopted.json" || exit 2
      cp "${OUT}/table-adopted.json" megatron_flux/tuning/tables/h200-sm132-tp2-bf16.json ;;
    h100tune)
      cp benchmarks/results/raw/s26/call6/table-h100-tp2.json "${OUT}/table-h100-tp2.json"
      CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "${TUNE_TIMEOUT:-240}" "${RUN[@]}" \
          -m megatron_flux.tune --m-set small --max-candidates 12 --top 2 --screen-iters 5 \
          --trials 3 --iters 10 --no-progress --out "${OUT}/table-h100-tp2.json" > "${OUT}/tune-small.log" 2>&1
      echo "   tune exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=" "${OUT}/tune-small.log" | tail -30
      h100_bench bench-h100-all-1 "${OUT}/table-h100-tp2.json" $(( ${DEADLINE:-585} - SECONDS )) ;;
    h100fill)
      # call 7's tune ran out of time 21 entries into the 24 small-m ones: tune the rest
      # (FILL_ARGS) into a copy of its table, then benchmark the whole grid with it twice
      cp benchmarks/results/raw/s27/call7/table-h100-tp2.json "${OUT}/table-h100-tp2.json"
      # shellcheck disable=SC2086
      CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "${TUNE_TIMEOUT:-150}" "${RUN[@]}" \
          -m megatron_flux.tune ${FILL_ARGS:---ops rs --shapes rs:4096:14336 --ms 128 256 512} \
          --max-candidates 12 --top 2 --screen-iters 5 --trials 3 --iters 10 --no-progress \
          --out "${OUT}/table-h100-tp2.json" > "${OUT}/tune-fill.log" 2>&1
      echo "   tune exit $? (${SECONDS}s)"; grep -E "^(ag|rs) n=" "${OUT}/tune-fill.log" | tail -5
      for run in 2 3; do h100_bench "bench-h100-all-${run}" "${OUT}/table-h100-tp2.json" 200; done ;;
    h100bench)
      h100_bench "bench-h100-all-${RUN_NAME:-2}" benchmarks/results/raw/s27/table-h100-tp2.json \
          "${BENCH_TIMEOUT:-400}" ;;
    cachepack)
      tar -czf "${OUT}/triton-cache.tgz" -C "${TRITON_CACHE_DIR}" . && ls -la "${OUT}/triton-cache.tgz"
      [ "$(stat -c %s "${OUT}/triton-cache.tgz")" -lt 16000000 ] || { echo "cache too big to come back"; rm -f "${OUT}/triton-cache.tgz"; } ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
