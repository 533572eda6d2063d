# Shared by the launchers (sourced, not run). Sets REPO, PYTHON, NGPUS; checks the machine;
# checks that megatron-core 0.19 (with megatron.training) and megatron-flux import.
#
# Environment knobs:
#   PYTHON        interpreter (default: python3); needs >= 3.12 (megatron.training)
#   FLUX_DRY_RUN=1  print the environment the training command gets ("ENV NAME=VALUE" lines)
#                   and its arguments, one per line, and run nothing (no GPU needed; NPROC
#                   defaults to 2): what tests/unit/test_launch_config.py checks
#   NPROC         processes = GPUs = tensor-parallel size (default: all local GPUs)
#   FLUX_BACKEND  backend of --flux-tp-overlap: auto (default), flux, nccl or megatron
#   FLUX_TP_OVERLAP=0  run without the flag: megatron-core's own linears (the baseline)
#   MODEL_CONFIG  the model config; relative: from the directory the launcher is started in,
#                 else from this checkout (configs/...)
# The job runs in the caller's directory: relative paths in its arguments mean what they say there.

set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER_DIR="$(pwd)"  # the launchers run from here (no cd): relative paths keep their meaning
PYTHON="${PYTHON:-python3}"

die() { echo "error: $*" >&2; exit 2; }

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
    else
        echo 0
    fi
}

require_gpus() {  # require_gpus MIN
    local min="$1"
    if [ "${FLUX_DRY_RUN:-0}" = 1 ]; then NPROC="${NPROC:-2}"; return 0; fi
    NGPUS="$(count_gpus)"
    if [ "${NGPUS}" -lt "${min}" ]; then
        die "this needs a machine with at least ${min} NVIDIA GPUs (found ${NGPUS}; nvidia-smi lists none or is missing).
  Tensor parallelism runs one process per GPU with TP = number of GPUs, sequence parallel on.
  Also needed: Python >= 3.12, PyTorch with CUDA, and Triton for --flux-backend flux.
  Without GPUs you can run the CPU tests: python -m pytest tests -q"
    fi
    NPROC="${NPROC:-${NGPUS}}"
}

# What ${PYTHON} imports, from one interpreter start (each start imports torch and megatron-core
# again, seconds each): lines "python X.Y.Z", "python_supported 0|1" (>= 3.12), "torch_cuda 0|1",
# "megatron_core VERSION", "megatron_training 0|1", "megatron_flux 1" or "megatron_flux 0 ERROR",
# as far as each import gets, with this checkout on PYTHONPATH. Kept in PROBE for require_python
# and ensure_megatron.
probe_python() {
    [ -n "${PROBE:-}" ] && return 0
    PROBE="$(PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}" "${PYTHON}" -c '
import platform, sys
print("python", platform.python_version())
print("python_supported", int(sys.version_info >= (3, 12)))
try:
    import torch
    print("torch_cuda", int(torch.cuda.is_available()))
except Exception:
    print("torch_cuda", 0)
try:
    import megatron.core as m
    print("megatron_core", m.__version__)
    try:
        import megatron.training
        print("megatron_training", 1)
    except Exception:
        print("megatron_training", 0)
except Exception:
    pass
try:
    import megatron_flux
    print("megatron_flux", 1)
except Exception as exc:
    print("megatron_flux", 0, type(exc).__name__ + ":", exc)
' 2>/dev/null || true)"
}

probed() {  # probed KEY: its value in PROBE (empty if the probe did not get that far)
    sed -n "/^$1 /{s/^$1 //p;q;}" <<< "${PROBE}"
}

require_python() {
    [ "${FLUX_DRY_RUN:-0}" = 1 ] && return 0
    probe_python
    local version
    version="$(probed python)"
    [ "$(probed python_supported)" = 1 ] \
        || die "${PYTHON} is Python ${version:-(not found)}; megatron.training (megatron-core 0.19) needs Python >= 3.12 (set PYTHON=...)"
    [ "$(probed torch_cuda)" = 1 ] \
        || die "${PYTHON}: PyTorch is missing or has no CUDA (install a CUDA build of torch >= 2.6)"
}

# megatron-core 0.19 with megatron.training must be importable by ${PYTHON}, from the user's
# environment (pip install 'megatron-flux[train]', or PYTHONPATH); nothing is installed here.
# megatron-flux is used from this checkout (PYTHONPATH), nothing to build.
ensure_megatron() {
    export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
    [ "${FLUX_DRY_RUN:-0}" = 1 ] && return 0
    probe_python
    local found
    found="$(probed megatron_core)"
    if [ -z "${found}" ]; then
        die "${PYTHON} cannot import megatron.core. Install megatron-core 0.19 (pip install 'megatron-flux[train]', or 'megatron-core>=0.19,<0.20'), or put it on PYTHONPATH."
    fi
    case "${found}" in
        0.19*) ;;
        *) die "${PYTHON} imports megatron-core ${found}; the training launchers need 0.19 (megatron.training's pretrain API). pip install 'megatron-core>=0.19,<0.20'." ;;
    esac
    [ "$(probed megatron_training)" = 1 ] \
        || die "megatron-core ${found} is importable but megatron.training is not (it needs Python >= 3.12 and the full wheel)."
    [ "$(probed megatron_flux)" = 1 ] \
        || die "cannot import megatron_flux with PYTHONPATH=${PYTHONPATH} ($(probed megatron_flux | cut -d' ' -f2-))"
}

# Arguments every launcher passes: TP over all local GPUs with sequence parallelism, the local
# (non-Transformer-Engine) layer implementation, mock data and the null tokenizer (no dataset).
common_megatron_args() {
    COMMON_ARGS=(
        --tensor-model-parallel-size "${NPROC}"
        --sequence-parallel
        --transformer-impl local
        --mock-data
        --tokenizer-type NullTokenizer
        --split 99,1,0
        --train-iters "${TRAIN_ITERS:-30}"
        --log-interval "${LOG_INTERVAL:-5}"
        --log-throughput
        --eval-iters 0
        --eval-interval 1000000
        --distributed-timeout-minutes 10
    )
}

# The plugin's flag, or nothing with FLUX_TP_OVERLAP=0 (stock megatron-core linears).
flux_megatron_args() {
    if [ "${FLUX_TP_OVERLAP:-1}" = "0" ]; then
        FLUX_ARGS=()
    else
        FLUX_ARGS=(--flux-tp-overlap --flux-backend "${FLUX_BACKEND:-auto}")
    fi
}

# A model config as given (MODEL_CONFIG or the launcher's default), as an absolute path: a
# relative one is looked up from the directory the launcher was started in, then from this
# checkout (so MODEL_CONFIG=configs/tiny_smoke.json works from anywhere).
resolve_model_config() {  # resolve_model_config PATH: prints the absolute path
    local path="$1"
    case "${path}" in
        /*) ;;
        *) if [ -e "${CALLER_DIR}/${path}" ]; then path="${CALLER_DIR}/${path}"
           elif [ -e "${REPO}/${path}" ]; then path="${REPO}/${path}"
           else path="${CALLER_DIR}/${path}"; fi ;;
    esac
    [ -f "${path}" ] || die "model config ${1} not found (looked in ${CALLER_DIR} and ${REPO})"
    printf '%s/%s\n' "$(cd "$(dirname "${path}")" && pwd)" "$(basename "${path}")"
}

# With the flag: what `megatron-flux check` says of this node at this TP size (its verdict and
# notes), so the log shows up front whether the fused backend can run here; and, given the model
# config, `megatron-flux plan --offer`'s one line when some of the model's TP GEMMs have no
# current tuning-table entry on this GPU: how many, and the tune command for the rest (planned
# on the CPU from the config, at the job's tokens per micro-batch: the config's seq-length x
# micro-batch-size, or the command line's where it overrides them; never fatal). Other
# overrides of the model's shape (--hidden-size, ...) are not seen: the plan reads the config.
flux_preflight() {  # flux_preflight [MODEL_CONFIG [megatron args...]]
    [ "${#FLUX_ARGS[@]}" -gt 0 ] || return 0
    "${PYTHON}" -m megatron_flux.tools.cli check --tp "${NPROC}" 2>/dev/null \
        | sed -n '/^fused backend/,$p' | sed 's/^/> megatron-flux check: /' || true
    [ -n "${1:-}" ] || return 0
    local config="$1" m
    shift
    m="$("${PYTHON}" "${REPO}/examples/pretrain_support.py" --tokens-per-microbatch \
        --model-config "${config}" "$@" 2>/dev/null)" || m=""
    "${PYTHON}" -W ignore -m megatron_flux.tools.cli plan --model-config "${config}" --tp "${NPROC}" \
        ${m:+--m "${m}"} --offer 2>/dev/null | sed 's/^/> megatron-flux plan: /' || true
}

run_pretrain() {  # run_pretrain MODEL_CONFIG [extra megatron args...]
    local config
    config="$(resolve_model_config "$1")"
    shift
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    common_megatron_args
    if [ "${FLUX_DRY_RUN:-0}" = 1 ]; then  # the environment it sets, then the arguments
        printf 'ENV %s\n' "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS}" "WORLD_SIZE=${NPROC}"
        printf '%s\n' --model-config "${config}" "${COMMON_ARGS[@]}" "$@"
        return 0
    fi
    flux_preflight "${config}" "$@"
    set -x
    "${PYTHON}" -m torch.distributed.run --standalone --nproc-per-node "${NPROC}" \
        "${REPO}/examples/pretrain_gpt.py" --model-config "${config}" "${COMMON_ARGS[@]}" "$@"
}
