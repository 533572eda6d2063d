#!/usr/bin/env bash
# Session 26, two GPUs (kind nvidia-h200-x2, lent again for the first time since session 18; every
# call of the session ran on two H100s: results/raw/s26/README.md).
# Every stage runs at TP = the visible GPUs; KEEP (default /root/keep, outside the copied tree,
# so it survives between calls while the machine stays warm) holds the A/B runs and the adopted
# table from one call to the next.
#   tests2   (carry .whl) `megatron-flux check --tp 2`, then the multi-GPU tests: the fused ops
#            against NCCL under CUDA_DEVICE_MAX_CONNECTIONS=1, the default and the direct launch
#            (both Gluon kernels' forms, merged rows, copy-engine GEMM+RS, stream-K), the MLP block,
#            the converted output layer and the whole GPTModel through the fused backend
#                                                  -> $OUT/check-tp2.json, $OUT/tests-2gpu.{json,log}
#   abpp     the m >= 1024 grid, CUDA_DEVICE_MAX_CONNECTIONS=1, every method of the issue plus
#            flux_variant = the table's configs turned into the Gluon ping-pong (128x128x64/5,
#            group 8, per-segment AG rows, SM or copy-engine GEMM+RS pushes as the table says):
#            the comm-off report's best form on 21 of 24 shapes, now with communication
#                                                  -> $OUT/ab-pp-conn1-<RUN>.{json,log,png}, copied to KEEP
#   adopt    python -m megatron_flux.tuning.adopt over every KEEP/ab-pp-*.json: the ping-pong
#            where every run timed it faster, written over the repo's TP 2 table (and to KEEP
#            and $OUT)                             -> $OUT/table-adopted.json
#   final    the issue's benchmark (m >= 1024 grid, cublas_gemm comm nccl torch_async_tp flux)
#            with whatever table the tree holds now, under CONN (1 or default)
#                                                  -> $OUT/bench-conn<CONN>-<RUN>.{json,log,png}
#   small    the small-m grid (m = 64-512), with auto           -> $OUT/bench-small-conn<CONN>.{json,log,png}
# nvidia-smi logs SM clock, power and temperature per GPU every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s26.sh tests2
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s26}"
KEEP="${KEEP:-/root/keep}"
mkdir -p "${OUT}" "${KEEP}"
source benchmarks/device_env.sh
every_gpu_session
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}")
TABLE=megatron_flux/tuning/tables/h200-sm132-tp2-bf16.json
# the Gluon ping-pong for both ops in one variant (each op ignores the other's knobs); the
# GEMM+RS push mode (rs_copy_engine) stays the table's
PP='{"ag_warp_specialized": true, "ag_peer_group": 1, "ag_merge_local": false, "stream_k": 0,
     "rs_warp_specialized": true, "rs_ce_bands": false, "rs_spread_reduce": false,
     "rs_tma_push": true, "rs_tma_reduce": true, "rs_merge_rows": false, "rs_split_k": 1,
     "block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 5, "num_warps": 4,
     "group_m": 8, "epilogue_split": 1, "programs_per_sm": 1}'
conn_env() {  # conn_env CONN: Megatron's one hardware queue (1) or the driver default
  if [ "$1" = 1 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=1; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
}
bench() {  # bench NAME TIMEOUT ARGS...: megatron_flux.bench under torchrun -> $OUT/NAME.{json,png,log}
  local name="$1" limit="$2"; shift 2
  PYTHONPATH="${PWD}" timeout "${limit}" "${RUN[@]}" -m megatron_flux.bench "$@" --trials 5 \
      --iters 20 --out-json "${OUT}/${name}.json" --out-png "${OUT}/${name}.png" > "${OUT}/${name}.log" 2>&1
  echo "   ${name} exit $? (${SECONDS}s)"; grep -A8 "^summary" "${OUT}/${name}.log" | head -9
}
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    tests2)
      python3 -m megatron_flux.cli check --tp 2 --json > "${OUT}/check-tp2.json"; echo "   check exit $?"
      # -v -s: each test's name and test_flux_gpu's per-section lines reach the log as they
      # happen, so a run cut off by its limit still shows where it stood (call 1 ran -q: a cold
      # Triton cache took the whole 540 s and the log stayed empty)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout "${TESTS_TIMEOUT:-540}" python3 benchmarks/record_pytest.py \
          "${OUT}/tests-2gpu.json" tests/test_flux_gpu.py tests/test_layers_gpu.py -v -s -m gpu \
          -p no:cacheprovider > "${OUT}/tests-2gpu.log" 2>&1
      echo "tests exit $?"; grep -E "PASSED|FAILED|ERROR|[0-9]+ (passed|failed)" "${OUT}/tests-2gpu.log" | tail -15 ;;
    abpp)
      conn_env 1
      bench "ab-pp-conn1-${RUN_NAME:-1}" "${AB_TIMEOUT:-420}" --m-set large \
          --methods cublas_gemm comm nccl torch_async_tp flux flux_variant --flux-variant "${PP}"
      cp "${OUT}/ab-pp-conn1-${RUN_NAME:-1}.json" "${KEEP}/" ;;
    adopt)
      ls "${KEEP}"/ab-pp-*.json || { echo "no A/B runs in ${KEEP}"; exit 2; }
      python3 -m megatron_flux.tuning.adopt "${TABLE}" "${KEEP}"/ab-pp-*.json "${OUT}/table-adopted.json" \
          || exit 2
      cp "${OUT}/table-adopted.json" "${TABLE}"; cp "${OUT}/table-adopted.json" "${KEEP}/" ;;
    final)
      conn_env "${CONN:-1}"
      bench "bench-conn${CONN:-1}-${RUN_NAME:-1}" "${FINAL_TIMEOUT:-300}" --m-set large \
          --methods cublas_gemm comm nccl torch_async_tp flux ;;
    small)
      conn_env "${CONN:-1}"
      bench "bench-small-conn${CONN:-1}" "${SMALL_TIMEOUT:-240}" --m-set small \
          --methods cublas_gemm comm nccl torch_async_tp flux auto ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
