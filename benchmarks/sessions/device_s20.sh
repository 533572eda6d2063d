#!/usr/bin/env bash
# Session 20, one GPU (kind nvidia-h100-x1 / nvidia-h200; no 2-GPU box lent), communication off.
# Why: the warp-specialized Gluon kernels (session 19) ran 128x128 tiles only (ping-pong: one
# warpgroup's accumulator per tile) and lost to the Triton kernel's 128x256 at long K. Their
# new cooperative form (num_warps=8: one 8-warp MMA partition, 128x256 tiles) is timed here.
#   coop     (carry .whl) the one-GPU tests of both warp-specialized kernels, both forms
#            -> $OUT/tests-coop-1gpu.json; kernel_vs_cublas GEMM+RS, table config against the
#            cooperative 128x256x64/3 (extra0), ping-pong 128x128x64/5 (extra1) and cooperative
#            128x128x64/4 (extra2): training shapes m = 8192, then the TP 2 grid (extra0-1)
#                                                  -> $OUT/kvc-coop-rs-{train,grid}.json
#   coopag   the same for AG+GEMM (table or default against the same forms)
#                                                  -> $OUT/kvc-coop-ag-{train,grid}.json
#   names    the cuBLAS kernel torch.matmul runs for every grid GEMM (tile, cluster, schedule)
#                                                  -> $OUT/cublas-names.json
#   mutants  (carry .whl) experiments/mutants_ws.py: break one line of a warp-specialized kernel,
#            run the one-GPU tests that should notice (MUTANTS="a b" picks some)
#                                                  -> $OUT/mutants.json
#   tests    (carry .whl) every GPU-marked test on this one GPU -> $OUT/tests-1gpu.json
# On 2 GPUs (kind nvidia-h200-x2), the next step for the warp-specialized kernels:
#   tests2   (carry .whl) the multi-GPU tests (test_flux_gpu.py runs the fused ops under
#            CUDA_DEVICE_MAX_CONNECTIONS=1, the default and direct launch, with both forms of
#            both Gluon kernels; test_layers_gpu.py the MLP block). The one-GPU tests, which took
#            5 min on their own in session 22, run on one GPU (device_s22.sh tests); together
#            they would not fit one call                   -> $OUT/tests-2gpu.json
#   wsab     comm-on A/B, megatron-flux bench, table configs (flux) against each Gluon form
#            (flux_variant): RS ping-pong and cooperative on the training shapes (m = 4096, 8192),
#            AG the same, then AG ping-pong on the grid's m = 1024/2048
#                                                  -> $OUT/ab-{rs,ag}-{pp,coop}-train.json, ab-ag-pp-grid.json
#            adopt where every run wins (a second run makes "every" mean something):
#            python -m megatron_flux.tuning.adopt TABLE AB.json [AB2.json] OUT_TABLE
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s20.sh coop names
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s20}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
case " $* " in
  *" tests2 "*|*" wsab "*) every_gpu_session ;;
  *) one_gpu_session ;;
esac
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0)
KVC=megatron_flux/bench/kernel_vs_cublas.py
EXP=benchmarks/experiments
TRAIN_SHAPES=(--model-shapes l8fc2:4096:14336:14336 l8proj:4096:4096:4096 l8qkv:4096:6144:6144
              l8fc1:4096:28672:28672 --rs-k ffn)
# the tiles of the warp-specialized kernels' two forms (JSON fields)
PP='"block_n": 128, "num_stages": 5, "num_warps": 4'
COOP='"block_n": 256, "num_stages": 3, "num_warps": 8'
forms() {  # forms KNOB [EXTRA_FIELDS]: the cooperative 128x256/3, ping-pong 128x128/5 and
  # cooperative 128x128/4 configs of the warp-specialized kernel named by KNOB, as a JSON list
  local c="\"$1\": true, \"block_m\": 128, \"block_k\": 64, \"epilogue_split\": 1${2:-}"
  echo "[{${c}, ${COOP}},
        {${c}, ${PP}},
        {${c}, \"block_n\": 128, \"num_stages\": 4, \"num_warps\": 8}]"
}
first_two() { python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])[:2]))' "$1"; }
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    coop)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 240 python3 benchmarks/record_pytest.py \
          "${OUT}/tests-coop-1gpu.json" tests/test_kernels_one_gpu.py tests/test_warp_specialized_cpu.py \
          -q -p no:cacheprovider > "${OUT}/tests-coop-1gpu.log" 2>&1
      echo "tests exit $?"; tail -3 "${OUT}/tests-coop-1gpu.log"
      EXTRA="$(forms rs_warp_specialized ', "rs_copy_engine": false')"
      timeout 100 python3 ${KVC} --tp 2 --ops GEMM+RS "${TRAIN_SHAPES[@]}" --m 8192 \
          --configs table --extra "${EXTRA}" "${TIMING[@]}" --json "${OUT}/kvc-coop-rs-train.json" \
          2>&1 | grep -v Warning
      timeout 220 python3 ${KVC} --tp 2 --ops GEMM+RS --m 1024 2048 4096 8192 --configs table \
          --extra "$(first_two "${EXTRA}")" "${TIMING[@]}" --json "${OUT}/kvc-coop-rs-grid.json" \
          2>&1 | grep -v Warning ;;
    coopag)
      EXTRA="$(forms ag_warp_specialized ', "stream_k": 0')"
      timeout 100 python3 ${KVC} --tp 2 --ops AG+GEMM "${TRAIN_SHAPES[@]}" --m 8192 \
          --configs table default --extra "${EXTRA}" "${TIMING[@]}" \
          --json "${OUT}/kvc-coop-ag-train.json" 2>&1 | grep -v Warning
      timeout 260 python3 ${KVC} --tp 2 --ops AG+GEMM --m 1024 2048 4096 8192 --configs table \
          --extra "$(first_two "${EXTRA}")" "${TIMING[@]}" --json "${OUT}/kvc-coop-ag-grid.json" \
          2>&1 | grep -v Warning ;;
    names)
      timeout 120 python3 ${EXP}/cublas_kernel_names.py --tp 2 --json "${OUT}/cublas-names.json" \
          2>&1 | grep -v Warning ;;
    mutants)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout 560 python3 ${EXP}/mutants_ws.py --timeout 130 \
          --json "${OUT}/mutants.json" ${MUTANTS:+--only ${MUTANTS}} 2>&1 | grep -v Warning ;;
    tests) gpu_tests 540 tests-1gpu || exit 2 ;;
    tests2) gpu_tests 560 tests-2gpu tests/test_flux_gpu.py tests/test_layers_gpu.py || exit 2 ;;
    wsab)
      RS_FIXED='"rs_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "rs_ce_bands": false, "rs_spread_reduce": false, "programs_per_sm": 1'
      AG_FIXED='"ag_warp_specialized": true, "block_m": 128, "block_k": 64, "epilogue_split": 1, "ag_peer_group": 1, "ag_merge_local": false, "stream_k": 0, "programs_per_sm": 1'
      for run in rs:pp rs:coop ag:pp ag:coop ag:pp:grid; do
        IFS=: read -r op form grid <<< "${run}"
        fixed=$([ "${op}" = rs ] && echo "${RS_FIXED}" || echo "${AG_FIXED}")
        tile=$([ "${form}" = pp ] && echo "${PP}" || echo "${COOP}")
        if [ -n "${grid}" ]; then
          shapes=(--ms 1024 2048); name="ab-${op}-${form}-grid"
        else
          shapes=("${TRAIN_SHAPES[@]}" --ms 4096 8192); name="ab-${op}-${form}-train"
        fi
        PYTHONPATH="${PWD}" timeout 110 python3 -m torch.distributed.run --standalone \
            --nproc-per-node "${NGPUS}" -m megatron_flux.bench --ops "${op}" "${shapes[@]}" \
            --methods cublas_gemm nccl flux flux_variant --flux-variant "{${fixed}, ${tile}}" \
            --trials 5 --iters 20 --out-json "${OUT}/${name}.json" --out-png none \
            > "${OUT}/${name}.log" 2>&1
        echo "   ${name} exit $? (${SECONDS}s)"; grep -A4 "^summary" "${OUT}/${name}.log" | head -5
      done ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
