#!/usr/bin/env bash
# Session 25, one GPU (kinds nvidia-h100-x1 / nvidia-h200 only, for the seventh session).
#   layers   (carry .whl) the GPU-marked layer and weight-gradient tests on this GPU (the
#            2-GPU ones skip), after the ops' outputs stopped being autograd views
#                                                  -> $OUT/tests-layers.json
#   report-ag / report-rs   issue 3's comm-off report of the current kernels (TP 2 wiring,
#            every peer signal pre-set): at m = 1024-8192 the table's config, the default and
#            both Gluon forms, alternating launch by launch with cuBLAS; at m = 64-512 the
#            table's config and the default, block timing (alternation biases small kernels'
#            ratios towards 1)     -> $OUT/report-{ag,rs}-{small,large}.json
#   cpu019   (carry .whl) the CPU (gloo) tests of whole models and layers under megatron-core
#            0.19.2 and Python 3.12, which CI (0.16.1, Python 3.11) cannot run: the GPTModel
#            through the plugin at TP 2 + SP against stock TP 1, the collective count, the layer
#            checks at TP 2/4                          -> $OUT/tests-cpu019.{json,log}
#   ppgrid   (2 GPUs) the Gluon ping-pong forms, best of the comm-off report on 21 of 24 m >= 1024
#            shapes, against the shipped table with communication on: the m >= 1024 grid, per op
#            cuBLAS, NCCL, the table (flux) and the table's configs turned into the ping-pong
#            (flux_variant); RUNS="1 2" names the runs. Adopt where every run wins:
#            python -m megatron_flux.tuning.adopt TABLE ab-pp-{ag,rs}-1.json ab-pp-{ag,rs}-2.json OUT
#                                                  -> $OUT/ab-pp-{ag,rs}-<run>.{json,log}
# nvidia-smi logs SM clock, power and temperature every 200 ms -> $OUT/smi.csv
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s25.sh layers report-ag
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s25}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
case " $* " in
  *" ppgrid "*) every_gpu_session ;;
  *) one_gpu_session ;;
esac
TIMING=(--trials 7 --iters 20 --warmup 10 --shuffle-seed 0 --queue-ahead-ms 5)
KVC=megatron_flux/bench/kernel_vs_cublas.py
forms() {  # forms KNOB EXTRA_FIELDS: the cooperative and ping-pong Gluon configs, a JSON list
  local c="\"$1\": true, \"block_m\": 128, \"block_k\": 64, \"epilogue_split\": 1$2"
  echo "[{${c}, \"block_n\": 256, \"num_stages\": 3, \"num_warps\": 8}, {${c}, \"block_n\": 128, \"num_stages\": 5, \"num_warps\": 4}]"
}
report() {  # report OP SHORT KNOB EXTRA_FIELDS SMALL_TIMEOUT LARGE_TIMEOUT
  timeout "$5" python3 ${KVC} --tp 2 --ops "$1" --m 64 128 256 512 --configs table default \
      "${TIMING[@]}" --json "${OUT}/report-$2-small.json" 2>&1 | grep -v Warning
  timeout "$6" python3 ${KVC} --tp 2 --ops "$1" --m 1024 2048 4096 8192 --configs table default \
      --extra "$(forms "$3" "$4")" --alternate "${TIMING[@]}" \
      --json "${OUT}/report-$2-large.json" 2>&1 | grep -v Warning
}
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    layers) gpu_tests 200 tests-layers tests/test_layers_gpu.py tests/test_grad_accumulation_gpu.py || exit 2 ;;
    report-ag) report AG+GEMM ag ag_warp_specialized ', "stream_k": 0' 120 $((580 - SECONDS - 120)) ;;
    report-rs) report GEMM+RS rs rs_warp_specialized ', "rs_copy_engine": false' 120 $((580 - SECONDS - 120)) ;;
    cpu019)
      install_carried_wheels || exit 2
      PYTHONPATH="${PYTHONPATH}:/tmp/site" CUDA_VISIBLE_DEVICES= timeout 300 python3 \
          benchmarks/record_pytest.py "${OUT}/tests-cpu019.json" tests/test_gpt_model_sp.py \
          tests/test_e2e_comm.py tests/test_linear_layers.py tests/test_specs.py -q \
          -p no:cacheprovider > "${OUT}/tests-cpu019.log" 2>&1
      echo "   exit $?"; tail -2 "${OUT}/tests-cpu019.log" ;;
    ppgrid)
      PP='"block_m": 128, "block_k": 64, "epilogue_split": 1, "programs_per_sm": 1, "block_n": 128, "num_stages": 5, "num_warps": 4, "group_m": 8'
      AG="{\"ag_warp_specialized\": true, \"ag_peer_group\": 1, \"ag_merge_local\": false, \"stream_k\": 0, ${PP}}"
      RS="{\"rs_warp_specialized\": true, \"rs_ce_bands\": false, \"rs_spread_reduce\": false, \"rs_copy_engine\": false, \"rs_tma_push\": true, \"rs_tma_reduce\": true, \"rs_merge_rows\": false, \"rs_split_k\": 1, ${PP}}"
      for run in ${RUNS:-1}; do
        for op in ag rs; do
          variant=$([ "${op}" = ag ] && echo "${AG}" || echo "${RS}")
          PYTHONPATH="${PWD}" timeout 280 python3 -m torch.distributed.run --standalone \
              --nproc-per-node "${NGPUS}" -m megatron_flux.bench --ops "${op}" --m-set large \
              --methods cublas_gemm nccl flux flux_variant --flux-variant "${variant}" \
              --trials 5 --iters 20 --out-json "${OUT}/ab-pp-${op}-${run}.json" --out-png none \
              > "${OUT}/ab-pp-${op}-${run}.log" 2>&1
          echo "   ab-pp-${op}-${run} exit $? (${SECONDS}s)"; grep -A4 "^summary" "${OUT}/ab-pp-${op}-${run}.log" | head -5
        done
      done ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
echo "== done in ${SECONDS}s"
