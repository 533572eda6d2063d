#!/usr/bin/env bash
# Session 30: the copy-engine collectives' copies issued to the CUDA driver
# (megatron_flux/comm/driver_copy.py, opt-in MEGATRON_FLUX_DRIVER_COPY=1): correct, and cheaper
# on the host than Tensor.copy_? It was correct and saved nothing (call 7), so it left the tree;
# these stages apply benchmarks/results/raw/s30/driver_copy.patch first, as the code they ran
# (commit 0413570). Carry `.device` (the Triton cache in pieces; kernels unchanged since its
# pack in session 30's call 3, so the tests load them).
#   dctest   the fused ops against NCCL with the driver's copies (connections 1), and the
#            one-GPU driver-copy test                   -> $OUT/tests-dc.{json,log}
#   micro    benchmarks/experiments/copy_issue_micro.py: host issue time of one copy, the ways
#            the collectives can make it, alternating in one process -> $OUT/copy-micro.{json,log}
#   abdc     benchmarks/experiments/host_launch_ab.py with nccl, flux run, flux drvcopy
#            (AB_ARGS)                                  -> $OUT/host-ab-dc.{json,log}
# Usage: OUT=/somewhere bash benchmarks/sessions/device_s30.sh dctest micro abdc
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/s30}"
mkdir -p "${OUT}"
source benchmarks/device_env.sh
gpu_session_start
TR=(torchrun --nproc-per-node "${NGPUS}")
[ -f megatron_flux/comm/driver_copy.py ] || git apply benchmarks/results/raw/s30/driver_copy.patch || exit 2
for what in "$@"; do
  echo "== ${what} ($(date +%T), ${SECONDS}s)"
  case "${what}" in
    dctest)
      timeout "${TESTS_TIMEOUT:-200}" python3 benchmarks/record_pytest.py "${OUT}/tests-dc.json" \
          "tests/test_flux_gpu.py::test_fused_ops_match_nccl[1-driver-copy]" tests/test_driver_copy.py \
          -v -s -m gpu -p no:cacheprovider > "${OUT}/tests-dc.log" 2>&1
      echo "   tests exit $?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)" "${OUT}/tests-dc.log" | tail -8 ;;
    micro)
      timeout "${MICRO_TIMEOUT:-120}" "${TR[@]}" benchmarks/experiments/copy_issue_micro.py \
          ${MICRO_ARGS:-} --out "${OUT}/copy-micro.json" > "${OUT}/copy-micro.log" 2>&1
      echo "   exit $?"; grep -E "^rank " "${OUT}/copy-micro.log" ;;
    abdc)
      timeout "${AB_TIMEOUT:-150}" "${TR[@]}" benchmarks/experiments/host_launch_ab.py \
          --variants nccl "flux run" "flux drvcopy" ${AB_ARGS:-} \
          --out "${OUT}/host-ab-dc.json" > "${OUT}/host-ab-dc.log" 2>&1
      echo "   exit $?"; grep -E "host .* us \(IQR" "${OUT}/host-ab-dc.log" ;;
    *) echo "unknown stage ${what}"; exit 2 ;;
  esac
done
rm -f "${OUT}/smi.csv"
echo "== done in ${SECONDS}s"
