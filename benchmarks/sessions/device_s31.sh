#!/usr/bin/env bash
# Session 31. The machine goes back 30 s after a call; carry `.device` (the Triton cache,
# `python benchmarks/kernel_manifest.py --check .device/` first) and `.whl` (megatron-core).
#   train      the interleaved training job (benchmarks/device_interleave.sh, no tests, no
#              profile) with IL_BACKENDS (default "megatron nccl flux flux+keep auto"):
#              `flux+keep` is `flux` with the column layers keeping the gathered input, so one
#              job times the backward re-gather against keeping it  -> $OUT/interleave.json, logs.tgz
#   tests1     device_s29.sh tests1: the fused ops against NCCL, connections 1 (with this
#              session's column_regather="nccl" case)  -> $OUT/tests-2gpu.{json,log}
#   small      (H200) the small-m grid with the confirmed table (device_s26.sh small, connections 1)
#   cachepack  the Triton cache in 15 MB pieces -> $OUT/triton-cache.tgz.part-*
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s31.sh train
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s31}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
gpu_session_start
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    train)
      OUT="${OUT}" SKIP_TESTS=1 PROFILE=0 IL_BACKENDS="${IL_BACKENDS:-megatron nccl flux flux+keep auto}" \
          IL_ITERS="${IL_ITERS:-360}" IL_TIMEOUT="${IL_TIMEOUT:-480}" IL_EXTRA="${IL_EXTRA:-}" \
          bash benchmarks/device_interleave.sh
      python3 -c "
import json; d = json.load(open('${OUT}/interleave.json'))
print(json.dumps({k: d.get(k) for k in ('step_time_ms', 'speedup_vs_stock', 'paired_speedup_vs_reference', 'steps_logged', 'loss')}, indent=1)[:4000])" ;;
    small)
      bash benchmarks/sessions/device_s26.sh small ;;
    tests1)
      OUT="${OUT}" bash benchmarks/sessions/device_s29.sh tests1 ;;
    cachepack) pack_triton_cache ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
