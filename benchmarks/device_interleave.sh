#!/usr/bin/env bash
# One device call (TP = all local GPUs, fits 10 minutes):
#   1. unless SKIP_TESTS=1: the GPU-marked tests of this tree      -> $OUT/tests-gpu.json, .log
#   2. one Llama-3-8B-shaped training job (configs/llama3_8b_16l.json) whose Flux linears rotate
#      between backends every IL_STEPS iterations (--flux-interleave-backends; 'megatron' is
#      megatron-core's own code in the same layers), IL_ITERS iterations, with a torch-profiler
#      trace of iterations PROF_START+1..PROF_END on every rank (PROFILE=0: none); IL_EXTRA
#      holds extra Megatron arguments (e.g. "--manual-gc --manual-gc-interval 50"); IL_VARIANTS,
#      fused-config variants to name in IL_BACKENDS, one NAME=JSON per line (e.g.
#      rsce={"ops": ["rs"], "rs_copy_engine": true}; --flux-interleave-variants); IL_COMM_MS,
#      the TP communication per step (benchmarks/e2e_comm.py), adds the share each backend hid;
#      IL_REFERENCE: the backend the paired speedups are against (default megatron);
#   3. benchmarks/interleave_report.py (step times per backend, the profiled iterations excluded)
#      -> $OUT/interleave.json; benchmarks/trace_summary.py per rank -> $OUT/trace-r<r>.json;
#      rank 0's trace -> $OUT/rank-0.json.gz when under 15 MB; the log -> $OUT/logs.tgz.
# Usage: OUT=/somewhere [IL_BACKENDS="megatron nccl flux auto"] bash benchmarks/device_interleave.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/interleave}"
IL_BACKENDS="${IL_BACKENDS:-megatron nccl flux auto}"
IL_STEPS="${IL_STEPS:-4}"
IL_ITERS="${IL_ITERS:-150}"
IL_TOKENS="${IL_TOKENS:-8192}"  # tokens per step (the config's 8192; more with IL_EXTRA's batch sizes)
PROF_START="${PROF_START:-100}"
PROF_END="${PROF_END:-116}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
install_carried_wheels || exit 2
export PYTHONPATH="${PWD}:/tmp/site"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "${OUT}/gpus.csv"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_TIMEOUT:-330}" python3 benchmarks/record_pytest.py "${OUT}/tests-gpu.json" tests/gpu -v \
        -p no:cacheprovider -m gpu > "${OUT}/tests-gpu.log" 2>&1
    echo "gpu tests exit $? (${SECONDS}s)"; tail -3 "${OUT}/tests-gpu.log"
    python3 -c "import json; d=json.load(open('${OUT}/tests-gpu.json')); [print(t['outcome'], t['test'], (t.get('message') or '')[:600]) for t in d['tests'] if t['outcome'] != 'passed']" 2>/dev/null
fi

PROF=/tmp/prof; rm -rf "${PROF}"; mkdir -p "${PROF}/tb"
PROFILE_ARGS=(--profile --use-pytorch-profiler --profile-step-start "${PROF_START}"
              --profile-step-end "${PROF_END}" --profile-ranks $(seq -s ' ' 0 $((NGPUS - 1)))
              --tensorboard-dir "${PROF}/tb")
EXCLUDE="$((PROF_START - 1))-$((PROF_END + 2))"
if [ "${PROFILE:-1}" = 0 ]; then PROFILE_ARGS=(); EXCLUDE="0-0"; fi
# IL_VARIANTS: fused-config variants to name in IL_BACKENDS, one NAME=JSON per line
# (--flux-interleave-variants; JSON keeps its spaces here, unlike in IL_EXTRA)
VARIANT_ARGS=()
if [ -n "${IL_VARIANTS:-}" ]; then
    VARIANT_ARGS=(--flux-interleave-variants)
    while IFS= read -r line; do [ -n "${line}" ] && VARIANT_ARGS+=("${line}"); done <<< "${IL_VARIANTS}"
fi
echo "== interleaved job: ${IL_BACKENDS} every ${IL_STEPS} iterations, ${IL_ITERS} iterations ($(date +%T))"
# shellcheck disable=SC2086
FLUX_BACKEND=auto TRAIN_ITERS="${IL_ITERS}" LOG_INTERVAL=1 \
    timeout "${IL_TIMEOUT:-240}" bash examples/pretrain_llama.sh \
    --flux-interleave-backends ${IL_BACKENDS} --flux-interleave-steps "${IL_STEPS}" \
    "${PROFILE_ARGS[@]}" "${VARIANT_ARGS[@]}" ${IL_EXTRA:-} > "${OUT}/interleave.log" 2>&1
echo "   exit $? at $(date +%T) (${SECONDS}s)"
grep -iE "^\S*(error|Traceback)|Error:" "${OUT}/interleave.log" | grep -v "error_inj\|ignore_errors" | head -8

versions="$(python3 -c 'import json,torch,triton,megatron.core as m; print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "megatron_core": m.__version__, "gpu": torch.cuda.get_device_name(0), "tp": torch.cuda.device_count()}))')"
# the command as a JSON string (IL_VARIANTS holds double quotes)
command_json="$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "OUT=\$OUT IL_BACKENDS='${IL_BACKENDS}' IL_STEPS=${IL_STEPS} IL_ITERS=${IL_ITERS} PROFILE=${PROFILE:-1} PROF_START=${PROF_START} PROF_END=${PROF_END} IL_EXTRA='${IL_EXTRA:-}' IL_VARIANTS='${IL_VARIANTS:-}' IL_REFERENCE=${IL_REFERENCE:-megatron} bash benchmarks/device_interleave.sh (TP=${NGPUS}; FLUX_BACKEND=auto bash examples/pretrain_llama.sh --flux-interleave-backends ${IL_BACKENDS} --flux-interleave-steps ${IL_STEPS} ${IL_EXTRA:-}, + Megatron's --profile --use-pytorch-profiler on the excluded iterations unless PROFILE=0)")"
python3 benchmarks/interleave_report.py --log "${OUT}/interleave.log" --tokens-per-step "${IL_TOKENS}" \
    --warmup 20 --drop-first 1 --exclude "${EXCLUDE}" ${IL_COMM_MS:+--comm-ms "${IL_COMM_MS}"} \
    --reference "${IL_REFERENCE:-megatron}" \
    --extra "command=${command_json}" \
    --extra "model=\"llama3-8b-16l (configs/llama3_8b_16l.json)\"" \
    --extra "versions=${versions}" --extra "tp=${NGPUS}" \
    --extra "env={\"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"NCCL_NVLS_ENABLE\": \"0\", \"TORCH_SYMM_MEM_DISABLE_MULTICAST\": \"1\", \"MEGATRON_FLUX_COLUMN_DGRAD\": \"${MEGATRON_FLUX_COLUMN_DGRAD:-}\"}" \
    --out "${OUT}/interleave.json"
for trace in "${PROF}"/torch_profile/rank-*.json.gz; do
    [ -e "${trace}" ] || { echo "no trace written"; break; }
    r="$(basename "${trace}" .json.gz)"; r="${r#rank-}"
    python3 benchmarks/trace_summary.py "${trace}" --log "${OUT}/interleave.log" \
        --out "${OUT}/trace-r${r}.json" > "${OUT}/trace-r${r}.txt" 2>&1
    echo "== trace rank ${r} ($(du -h "${trace}" | cut -f1))"; cut -c1-330 "${OUT}/trace-r${r}.txt"
done
if [ -e "${PROF}/torch_profile/rank-0.json.gz" ] && [ "$(stat -c %s "${PROF}/torch_profile/rank-0.json.gz")" -lt 15000000 ]; then
    cp "${PROF}/torch_profile/rank-0.json.gz" "${OUT}/"
fi
(cd "${OUT}" && shopt -s nullglob && logs=(*.log *.txt) && tar czf logs.tgz -- "${logs[@]}" \
    && rm -f -- interleave.log trace-r*.txt)
echo "== done in ${SECONDS}s"
