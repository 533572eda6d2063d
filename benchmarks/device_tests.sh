#!/usr/bin/env bash
# The whole test suite on the GPU box: megatron-core 0.19.2 (carried wheel), Python 3.12, CUDA.
# CPU tests (gloo) and GPU tests (marked gpu) together; the record goes to $OUT/tests-gpu.json.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 370 python3 benchmarks/record_pytest.py $OUT/tests-gpu.json tests -q -p no:cacheprovider > $OUT/tests-gpu.log 2>&1
echo "exit $?"; tail -3 $OUT/tests-gpu.log
python3 -c "import json; d=json.load(open('$OUT/tests-gpu.json')); [print(t['outcome'], t['test'], (t['message'] or '')[:300]) for t in d['tests'] if t['outcome'] != 'passed']"
