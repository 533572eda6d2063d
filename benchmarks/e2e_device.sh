#!/usr/bin/env bash
# End-to-end proof on the GPU box (TP = all local GPUs), one job (fits one 10-minute device call):
#   1. Llama-3-8B-shaped pretraining (configs/llama3_8b_16l.json) for E2E_ITERS iterations,
#      back to back with: stock megatron-core linears (FLUX_TP_OVERLAP=0), the plugin's nccl
#      backend, the plugin's flux backend; same seed, same mock data, --log-interval 1;
#   2. the TP communication per step at that shape (benchmarks/e2e_comm.py);
#   3. benchmarks/e2e_report.py -> $OUT/e2e.json (losses, step times, tokens/s, parity, hidden
#      communication);
#   4. if time is left, examples/custom_model.py for a few steps with the flux backend.
# E2E_KEEP_GATHERED=1 adds a run of flux with --flux-keep-gathered-input (no wgrad re-gather);
# E2E_AUTO=1 a run with FLUX_BACKEND=auto (the launchers' default); E2E_STOCK_TWICE=1 a second
# stock run (stock2), whose difference from the first is the noise floor of the loss-parity
# check against stock (benchmarks/e2e_report.py); E2E_EXTRA: Megatron arguments for every run
# (e.g. "--lr 1.5e-5 --min-lr 1.5e-6", which slows the mock data's loss collapse, or
# "--cuda-graph-impl local"); E2E_NCCL=0 leaves out the run of the plugin's NCCL path;
# E2E_SKIP_COMM=1 the communication timing (E2E_COMM_JSON: an earlier run's). Every run samples GPU
# utilization (nvidia-smi, 200 ms); the logs and samples end up in $OUT/logs.tgz.
# Needs: .whl/megatron_core-0.19*.whl carried. Usage: OUT=/somewhere bash benchmarks/e2e_device.sh
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO}"
OUT="${OUT:-/tmp/e2e}"
ITERS="${E2E_ITERS:-200}"
RUN_TIMEOUT="${E2E_RUN_TIMEOUT:-170}"
CONFIG=configs/llama3_8b_16l.json
mkdir -p "${OUT}"
source benchmarks/device_env.sh  # TP = local GPUs (the launchers' rule)
export PYTHONPATH="/tmp/site${PYTHONPATH:+:${PYTHONPATH}}"
install_carried_wheels ".whl/megatron_core-0.19*.whl" || exit 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "${OUT}/gpus.csv"

RUN_ARGS=()  # extra pretrain arguments for the next run() only
REPORT_ARGS=()  # --log/--util of every run, for e2e_report.py
run() {  # run NAME ENV...
    local name="$1"; shift
    echo "== ${name}: $(date +%T)"
    # GPU busy share, sampled beside the run (e2e_report.py keeps the timed iterations' samples)
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader,nounits -lms 200 \
        > "${OUT}/${name}.util.csv" 2>/dev/null &
    local smi=$!
    # shellcheck disable=SC2086
    env "$@" TRAIN_ITERS="${ITERS}" LOG_INTERVAL=1 MODEL_CONFIG="${CONFIG}" \
        timeout "${RUN_TIMEOUT}" bash examples/pretrain_llama.sh ${E2E_EXTRA:-} "${RUN_ARGS[@]}" > "${OUT}/${name}.log" 2>&1
    local rc=$?
    kill "${smi}" 2>/dev/null; wait "${smi}" 2>/dev/null
    RUN_ARGS=()
    REPORT_ARGS+=(--log "${name}=${OUT}/${name}.log" --util "${name}=${OUT}/${name}.util.csv")
    echo "   exit ${rc} at $(date +%T)"
    grep -E "iteration +(1|${ITERS})/" "${OUT}/${name}.log" | cut -c1-400
    grep -iE "^\S*(error|Traceback)|Error:" "${OUT}/${name}.log" | grep -v "error_inj\|ignore_errors" | head -8
}
run stock FLUX_TP_OVERLAP=0
if [ "${E2E_STOCK_TWICE:-0}" = 1 ]; then  # the noise floor of the parity check against stock
    run stock2 FLUX_TP_OVERLAP=0
fi
if [ "${E2E_NCCL:-1}" = 1 ]; then  # E2E_NCCL=0: no run of the plugin's NCCL path
    run nccl FLUX_BACKEND=nccl
fi
run flux FLUX_BACKEND=flux
if [ "${E2E_KEEP_GATHERED:-0}" = 1 ]; then  # flux, keeping the gathered inputs for wgrad (no re-gather)
    RUN_ARGS=(--flux-keep-gathered-input)
    run flux_keep FLUX_BACKEND=flux
fi
if [ "${E2E_AUTO:-0}" = 1 ]; then  # the launchers' default: fused or NCCL per shape from the tables
    run auto FLUX_BACKEND=auto
fi

COMM_ARGS=(--comm "${OUT}/comm.json")
if [ "${E2E_SKIP_COMM:-0}" = 0 ]; then
echo "== TP communication per step"
python3 -m torch.distributed.run --standalone --nproc-per-node "${NGPUS}" benchmarks/e2e_comm.py \
    --tokens 4096 --hidden 4096 --layers 16 --microbatches 2 --out "${OUT}/comm.json" \
    > "${OUT}/comm.log" 2>&1 || tail -5 "${OUT}/comm.log"
elif [ -n "${E2E_COMM_JSON:-}" ]; then
    cp "${E2E_COMM_JSON}" "${OUT}/comm.json"  # from an earlier run of this script
else
    COMM_ARGS=()  # no hidden-communication share in the report
fi

versions="$(PYTHONPATH=/tmp/site python3 -c 'import json,torch,triton,megatron.core as m; print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "megatron_core": m.__version__, "gpu": torch.cuda.get_device_name(0), "tp": torch.cuda.device_count()}))')"
python3 benchmarks/e2e_report.py "${REPORT_ARGS[@]}" "${COMM_ARGS[@]}" --tokens-per-step 8192 --warmup 20 \
    --model "llama3-8b-16l (configs/llama3_8b_16l.json)" \
    --command "OUT=\$OUT E2E_KEEP_GATHERED=${E2E_KEEP_GATHERED:-0} E2E_AUTO=${E2E_AUTO:-0} E2E_STOCK_TWICE=${E2E_STOCK_TWICE:-0} E2E_NCCL=${E2E_NCCL:-1} E2E_EXTRA='${E2E_EXTRA:-}' E2E_RUN_TIMEOUT=${RUN_TIMEOUT} bash benchmarks/e2e_device.sh  (TP=${NGPUS}, E2E_ITERS=${ITERS}; each run: bash examples/pretrain_llama.sh with TRAIN_ITERS=${ITERS} LOG_INTERVAL=1, FLUX_TP_OVERLAP=0 | FLUX_BACKEND=nccl | FLUX_BACKEND=flux [| flux + --flux-keep-gathered-input] [| FLUX_BACKEND=auto])" \
    --extra "versions=${versions}" --extra "gpu=$(echo "${versions}" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["gpu"]))')" \
    --extra "tp=${NGPUS}" --extra 'env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}' \
    --out "${OUT}/e2e.json"

if [ "${SECONDS}" -lt 500 ] && [ "${E2E_SKIP_CUSTOM:-0}" = 0 ]; then
    echo "== custom_model.py, flux, 5 steps"
    PYTHONPATH="/tmp/site:${REPO}" timeout $((580 - SECONDS)) python3 -m torch.distributed.run \
        --standalone --nproc-per-node "${NGPUS}" examples/custom_model.py --steps 5 --backend flux \
        --num-layers 2 > "${OUT}/custom_flux.log" 2>&1
    echo "   exit $?"; tail -8 "${OUT}/custom_flux.log"
fi
# the logs and utilization samples travel as one file ($OUT returns at most 8)
(cd "${OUT}" && tar czf logs.tgz -- *.log *.util.csv 2>/dev/null && rm -f -- *.log *.util.csv)
echo "== done in ${SECONDS}s"
