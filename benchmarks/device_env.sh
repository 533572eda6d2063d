# Sourced from the repository root by the device scripts (benchmarks/device.sh,
# device_interleave.sh, e2e_device.sh): the GPU machine's environment (never NVLink multicast),
# TP = every local GPU unless NGPUS says otherwise, install_carried_wheels (megatron-core from the
# carried .whl/ folder, into /tmp/site), and the helpers below.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NGPUS="${NGPUS:-$(nvidia-smi -L | grep -c '^GPU ')}"

install_carried_wheels() {  # install_carried_wheels [GLOB]   (default: every carried wheel);
    # once per machine: concurrent scripts (device_parallel.sh's lanes) find it done. Compiled
    # to bytecode here, in parallel: every training job's every rank imports megatron-core, and
    # the job logs showed each of them compiling its sources again (its SyntaxWarnings)
    [ -f /tmp/site/.megatron-flux-installed ] && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site ${1:-.whl/*.whl} || return 1
    python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1 || true  # a file it cannot compile: imported as source
    touch /tmp/site/.megatron-flux-installed
}

sample_gpus() {  # sample_gpus CSV INTERVAL_MS [FIELDS]: nvidia-smi logs FIELDS (default: SM clock,
    # power and temperature per GPU) every INTERVAL_MS ms into CSV until the script exits
    nvidia-smi --query-gpu="${3:-timestamp,index,clocks.sm,power.draw,temperature.gpu}" \
        --format=csv,nounits -lms "$2" > "$1" &
    SMI_PID=$!
    trap 'kill ${SMI_PID} 2>/dev/null' EXIT
}

every_gpu_session() {  # every_gpu_session: every local GPU, experiments importable, Triton
    # cache in the ignored .device/, nvidia-smi logging SM clock, power and temperature per GPU
    # every 200 ms to $OUT/smi.csv until the script exits
    export PYTHONPATH="${PWD}:${PWD}/benchmarks/experiments"
    export TRITON_CACHE_DIR="${PWD}/.device/triton-cache"
    sample_gpus "${OUT}/smi.csv" 200
}

unpack_triton_cache() {  # unpack_triton_cache: the carried Triton cache archive
    # (.device/triton-cache.tgz, or its pieces .device/triton-cache.tgz.part-*, from a
    # `cachepack` stage) into $TRITON_CACHE_DIR, when it was carried and the cache is not there
    # yet, so a fresh machine skips the compiles
    [ -d "${TRITON_CACHE_DIR}" ] && return 0
    if [ -f .device/triton-cache.tgz ]; then
        mkdir -p "${TRITON_CACHE_DIR}" && tar -xzf .device/triton-cache.tgz -C "${TRITON_CACHE_DIR}"
    elif compgen -G ".device/triton-cache.tgz.part-*" > /dev/null; then
        mkdir -p "${TRITON_CACHE_DIR}" && cat .device/triton-cache.tgz.part-* | tar -xz -C "${TRITON_CACHE_DIR}"
    else
        return 0
    fi
    echo "triton cache unpacked: $(find "${TRITON_CACHE_DIR}" -type f | wc -l) files"
    # Triton keys a kernel by its source and starting line: say if this tree's kernels moved
    # since the pack (benchmarks/kernel_manifest.py; a pack without a manifest is not checked)
    if [ -f "${TRITON_CACHE_DIR}/kernel-manifest.json" ]; then
        python3 benchmarks/kernel_manifest.py --check "${TRITON_CACHE_DIR}/kernel-manifest.json" | tail -4
    fi
}

gpu_session_start() {  # gpu_session_start: every_gpu_session, the cards' name in GPU_NAME
    # (and printed), then the carried Triton cache unpacked: the start of a device script
    every_gpu_session
    GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    echo "cards: ${NGPUS} x ${GPU_NAME}"
    unpack_triton_cache
}

pack_triton_cache() {  # pack_triton_cache: $TRITON_CACHE_DIR as $OUT/triton-cache.tgz.part-*,
    # pieces of 15 MB (what comes back from a call: files of at most 16 MiB); carry them back
    # in .device/ for unpack_triton_cache. Only what a cache hit loads goes in: each kernel's
    # metadata (.json), binary (.cubin) and the launchers (.so); the IR texts (the .llir files
    # alone were 388 of 498 MB of one cache) stay behind: Triton 3.6's cache takes a group
    # without them (3.9 compiles again; benchmarks/experiments/host_micro_cpu.py). With it
    # goes this tree's kernel manifest (benchmarks/kernel_manifest.py), which
    # unpack_triton_cache and `kernel_manifest.py --check .device/` compare with the tree the
    # cache next travels with. At most 8 files come back from a call, the first 8 by name
    # (smi.csv and the start log among them): a script that writes more loses these pieces
    python3 benchmarks/kernel_manifest.py --write "${TRITON_CACHE_DIR}/kernel-manifest.json"
    tar -czf - -C "${TRITON_CACHE_DIR}" --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' \
        --exclude='*.ttgir' --exclude='*.source' . | split -b 15000000 - "${OUT}/triton-cache.tgz.part-"
    ls -la "${OUT}"/triton-cache.tgz.part-*
}

summarize_kvc() {  # summarize_kvc JSON: per shape of a kernel_vs_cublas record, each config's
    # ratio to cuBLAS
    python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['model'], r['m'], {c['label']: round(c['ratio'], 4) for c in r['configs'].values()})" "$1"
}

gpu_tests() {  # gpu_tests TIMEOUT NAME [PATH...]: every GPU-marked test under PATH (default:
    # tests/gpu/; a PATH may list several, comma-separated) on the visible GPUs (those that
    # need more skip), megatron-core from the carried wheel -> $OUT/NAME.json and .log
    # (PYTEST_VERBOSITY=-v names each test in the log as it starts, so a run cut off by TIMEOUT
    # still says which test it was in; the JSON comes only at the end; PYTEST_ARGS: more
    # pytest options, e.g. "--timeout 120")
    install_carried_wheels || return 1
    local timeout_s="$1" name="$2"; shift 2
    PYTHONPATH="${PYTHONPATH}:/tmp/site" timeout "${timeout_s}" python3 benchmarks/record_pytest.py \
        "${OUT}/${name}.json" $(echo "${@:-tests/gpu}" | tr ',' ' ') ${PYTEST_VERBOSITY:--q} ${PYTEST_ARGS:-} -m gpu -p no:cacheprovider > "${OUT}/${name}.log" 2>&1
    echo "tests exit $?"; tail -2 "${OUT}/${name}.log"
}
