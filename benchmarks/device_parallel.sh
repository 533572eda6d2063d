#!/usr/bin/env bash
# benchmarks/device.sh in GPU lanes at once, so one machine of 4 GPUs runs two 2-GPU workloads
# in the time of one:
#
#   OUT=/somewhere bash benchmarks/device_parallel.sh "0,1:main matrix" "2,3:tests" [cachepack]
#
# Each "GPUS:STAGES" lane runs `bash benchmarks/device.sh STAGES` with CUDA_VISIBLE_DEVICES=GPUS
# and NGPUS = NPROC = the number of GPUs named (TP of that lane), writing under $OUT/lane<N>;
# its other variables (MATRIX_CELLS, TESTS_PATHS, ...) are the caller's, or the lane's own
# where its STAGES start with NAME=VALUE words ("0,1:TESTS_PATHS=tests/gpu/a.py,tests/gpu/b.py tests"). The lanes share the
# Triton cache, and megatron-core is installed once before they start. When all lanes end, their
# files go into $OUT/results.tgz (a device tool returns few files), and `cachepack` as a last
# argument packs the Triton cache next to it. Lanes share the host: timings taken in a lane are
# compared only within that lane (paired), and the JSON says which lanes ran together.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/megatron-flux-device}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
export TRITON_CACHE_DIR="${PWD}/.device/triton-cache"
unpack_triton_cache
install_carried_wheels ".whl/megatron_core-0.19*.whl"
pack=0
lanes=()
for arg in "$@"; do
    if [ "${arg}" = cachepack ]; then pack=1; else lanes+=("${arg}"); fi
done
echo "lanes: ${lanes[*]}" | tee "${OUT}/lanes.txt"
pids=()
for i in "${!lanes[@]}"; do
    gpus="${lanes[$i]%%:*}"; stages="${lanes[$i]#*:}"
    n="$(echo "${gpus}" | tr ',' '\n' | wc -l)"
    settings=(); names=()
    for word in ${stages}; do
        if [[ "${word}" == *=* ]]; then settings+=("${word}"); else names+=("${word}"); fi
    done
    mkdir -p "${OUT}/lane${i}"
    env "${settings[@]}" CUDA_VISIBLE_DEVICES="${gpus}" NGPUS="${n}" NPROC="${n}" OUT="${OUT}/lane${i}" \
        bash benchmarks/device.sh "${names[@]}" > "${OUT}/lane${i}/device.log" 2>&1 &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; echo "== lane ${i} (${lanes[$i]}): exit $? at ${SECONDS}s"
    tail -25 "${OUT}/lane${i}/device.log"
done
(cd "${OUT}" && tar czf results.tgz lanes.txt lane[0-9]* && rm -rf lanes.txt lane[0-9]*)
if [ "${pack}" = 1 ]; then pack_triton_cache; fi
ls -la "${OUT}"
