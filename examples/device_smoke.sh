#!/usr/bin/env bash
# Smoke run on a GPU box (>= 2 GPUs, no internet): install the carried megatron-core wheel(s)
# from .whl/ into /tmp/site (offline), then
#   1. the CPU-side example tests, now with megatron.training importable;
#   2. the tiny smoke config (configs/tiny_smoke.json) for SMOKE_ITERS (default 20) iterations
#      through examples/pretrain_gpt.py, with --flux-backend flux and with --flux-backend nccl,
#      printing both loss curves side by side (same seed and data, so they should agree to
#      bf16 noise);
#   3. examples/custom_model.py for a few steps, flux and nccl.
# Logs go to ${OUT:-/tmp/device_smoke}. Exit status is non-zero if any step failed.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-/tmp/device_smoke}"
SITE="${MCORE_SITE:-/tmp/site}"
ITERS="${SMOKE_ITERS:-20}"
mkdir -p "${OUT}"
status=0

echo "== install .whl/*.whl into ${SITE} (offline)"
shopt -s nullglob
wheels=("${REPO}"/.whl/*.whl)
if [ "${#wheels[@]}" -eq 0 ]; then
    echo "error: no wheels in ${REPO}/.whl (carry megatron_core-0.19.*.whl)" >&2
    exit 2
fi
"${PYTHON}" -m pip install -q --no-deps --no-index --target "${SITE}" "${wheels[@]}" || exit 2
export PYTHONPATH="${SITE}:${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
export MCORE_SITE="${SITE}" PYTHON
"${PYTHON}" - <<'PY' || exit 2
import sys, torch, megatron.core, megatron.training
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  megatron-core "
      f"{megatron.core.__version__}  GPUs {torch.cuda.device_count()}")
PY

echo "== tests/unit/test_examples.py tests/unit/test_patch.py"
"${PYTHON}" -m pytest -q "${REPO}/tests/unit/test_examples.py" "${REPO}/tests/unit/test_patch.py" \
    2>&1 | tee "${OUT}/pytest.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

for backend in flux nccl; do
    echo "== pretrain_gpt.py, configs/tiny_smoke.json, ${ITERS} iterations, --flux-backend ${backend}"
    MODEL_CONFIG=configs/tiny_smoke.json FLUX_BACKEND="${backend}" TRAIN_ITERS="${ITERS}" \
        LOG_INTERVAL=1 bash "${REPO}/examples/pretrain_llama.sh" \
        > "${OUT}/pretrain_${backend}.log" 2>&1
    rc=$?
    echo "   exit ${rc}; log ${OUT}/pretrain_${backend}.log"
    if [ "${rc}" -ne 0 ]; then status=1; tail -30 "${OUT}/pretrain_${backend}.log"; fi
done

echo "== losses (iteration, flux, nccl) and throughput"
"${PYTHON}" - "${OUT}/pretrain_flux.log" "${OUT}/pretrain_nccl.log" <<'PY' || status=1
import re, sys
def parse(path):
    losses, tput = {}, []
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return losses, tput
    for line in text.splitlines():
        it = re.search(r"iteration\s+(\d+)/", line)
        loss = re.search(r"lm loss: ([0-9.Ee+-]+)", line)
        if it and loss:
            losses[int(it.group(1))] = float(loss.group(1))
        t = re.search(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)", line)
        if t:
            tput.append(float(t.group(1)))
    return losses, tput
(fl, ft), (nl, nt) = parse(sys.argv[1]), parse(sys.argv[2])
for it in sorted(set(fl) | set(nl)):
    f, n = fl.get(it), nl.get(it)
    diff = "" if f is None or n is None else f"  diff {f - n:+.4e}"
    print(f"  {it:4d}  flux {f if f is not None else '-':>12}  nccl {n if n is not None else '-':>12}{diff}")
for name, t in (("flux", ft), ("nccl", nt)):
    if t:
        print(f"  {name}: TFLOP/s/GPU last {t[-1]:.1f}, median {sorted(t)[len(t) // 2]:.1f}")
if not fl or not nl:
    print("  no losses parsed from one of the runs", file=sys.stderr)
    sys.exit(1)
PY

for backend in flux nccl; do
    echo "== custom_model.py, 5 steps, backend ${backend}"
    (cd "${REPO}" && "${PYTHON}" -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/custom_model.py --steps 5 --backend "${backend}" --num-layers 2) \
        > "${OUT}/custom_${backend}.log" 2>&1
    rc=$?
    tail -6 "${OUT}/custom_${backend}.log"
    [ "${rc}" -eq 0 ] || status=1
done
echo "== device_smoke: $([ ${status} -eq 0 ] && echo OK || echo FAILED)"
exit "${status}"
