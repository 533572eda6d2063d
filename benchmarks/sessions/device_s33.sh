#!/usr/bin/env bash
# Session 33. The machine goes back 30 s after a call; carry `.device` (the Triton cache) and
# `.whl` (megatron-core), and check first that the copy fits (`python
# benchmarks/device_copy_size.py .device .whl`: 64 MiB at most). The pack call B1 built holds
# every jit function of this tree (`kernel_manifest.py --check .device/`).
#   tests2flux   tests/test_flux_gpu.py on both GPUs, each test named in the log as it ends
#                                                                  -> $OUT/tests-2gpu-flux.*
#   tests2layers tests/test_layers_gpu.py and the other multi-GPU files, likewise
#                                                                  -> $OUT/tests-2gpu-layers.*
#   tests1gpu    every GPU-marked test on GPU 0 (those that need two skip; 374 s cold)
#                                                                  -> $OUT/tests-1gpu.*
#   splitn       GPU 0, communication off: benchmarks/experiments/split_n_gemm.py, a plain GEMM
#                whose 128x224 tile is three dots, against cuBLAS and 128x256 / 128x128 tiles on
#                the local AG+GEMM shapes of llama3-8b m = 1024 / 2048 and llama3-70b m = 1024
#                                                                  -> $OUT/splitn.{json,log}
#   kvcgrid      GPU 0, communication off: the m >= 1024 grid with the shipped table's configs
#                (this GPU's table), AG+GEMM, then GEMM+RS with the stream-K twins, as session
#                32's stage of that name                   -> $OUT/kvc-{ag,rs}-grid.{json,log}
#   kvcbest      GPU 0, communication off, llama3-8b m = 1024 / 2048 (the H200 table's comm-off
#                gaps): each op's table and default configs, the plain persistent GEMM with
#                their tiles (the yardstick: no segments, no reduction), the Gluon ping-pong
#                (benchmarks/variants/gluon-pingpong.json) and its cooperative 128x256 form
#                (`--extra`), GEMM+RS also reducing the other way (`spread`)
#                                                        -> $OUT/kvc-best-{ag,rs}.{json,log}
#   bench        both GPUs, connections 1: the issue's benchmark on the m >= 1024 grid with the
#                shipped table (every method, and `auto`), as session 27's H100 run, now with
#                session 32's adoptions                           -> $OUT/bench.{json,png,log}
#   cachepack    the Triton cache in 15 MB pieces -> $OUT/triton-cache.tgz.part-*
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s33.sh tests2flux cachepack
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s33}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
gpu_session_start
export PYTEST_VERBOSITY=-v
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    tests2flux)
      gpu_tests "${TESTS_TIMEOUT:-480}" tests-2gpu-flux tests/test_flux_gpu.py ;;
    tests2layers)
      gpu_tests "${TESTS_TIMEOUT:-480}" tests-2gpu-layers tests/test_layers_gpu.py \
          tests/test_grad_accumulation_gpu.py tests/test_residency_gpu.py tests/test_phase_trace_gpu.py ;;
    tests1gpu)
      CUDA_VISIBLE_DEVICES=0 gpu_tests "${TESTS_TIMEOUT:-450}" tests-1gpu tests ;;
    splitn)
      # (call A ran this file's first version, 158919c: its own loop, 11 x 20, no arguments)
      CUDA_VISIBLE_DEVICES=0 timeout "${SPLITN_TIMEOUT:-150}" python3 benchmarks/experiments/split_n_gemm.py \
          --trials 11 --iters 20 --warmup 10 --shuffle-seed 0 \
          --json "${OUT}/splitn.json" > "${OUT}/splitn.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; cat "${OUT}/splitn.log" | tail -8 ;;
    kvcgrid)
      OUT="${OUT}" bash benchmarks/sessions/device_s32.sh kvcgrid ;;
    kvcbest)
      PP="$(python3 -c 'import json; print(json.dumps(json.load(open("benchmarks/variants/gluon-pingpong.json"))))')"
      COOP="$(python3 -c "import json; d = json.loads('${PP}'); d.update(block_n=256, num_warps=8, num_stages=3); print(json.dumps(d))")"
      KVC=(python3 megatron_flux/bench/kernel_vs_cublas.py --tp 2 --alternate --trials 7 --iters 20
           --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5 --models llama3-8b --m 1024 2048
           --extra "[${PP}, ${COOP}]")
      CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-200}" "${KVC[@]}" --ops AG+GEMM \
          --configs table default plain --json "${OUT}/kvc-best-ag.json" > "${OUT}/kvc-best-ag.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/kvc-best-ag.json"
      CUDA_VISIBLE_DEVICES=0 timeout "${KVC_TIMEOUT:-200}" "${KVC[@]}" --ops GEMM+RS \
          --configs table default plain spread --json "${OUT}/kvc-best-rs.json" > "${OUT}/kvc-best-rs.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; summarize_kvc "${OUT}/kvc-best-rs.json" ;;
    bench)
      CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH="${PWD}" timeout "${BENCH_TIMEOUT:-420}" \
          python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" \
          -m megatron_flux.bench --m-set large \
          --methods cublas_gemm comm nccl torch_async_tp flux auto --trials 5 --iters 20 \
          --out-json "${OUT}/bench.json" --out-png "${OUT}/bench.png" > "${OUT}/bench.log" 2>&1
      echo "   exit $? (${SECONDS}s)"; grep -A8 "^summary" "${OUT}/bench.log" | head -9 ;;
    cachepack) pack_triton_cache ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
