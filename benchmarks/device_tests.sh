#!/usr/bin/env bash
# The whole test suite on the GPU box: megatron-core 0.19.2 (carried wheel), Python 3.12, CUDA.
# CPU tests (gloo) and GPU tests (marked gpu) together; the record goes to $OUT/tests-gpu.json.
source benchmarks/device_env.sh
install_carried_wheels || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 370 python3 benchmarks/record_pytest.py $OUT/tests-gpu.json tests -q -p no:cacheprovider > $OUT/tests-gpu.log 2>&1
echo "exit $?"; tail -3 $OUT/tests-gpu.log
python3 -c "import json; d=json.load(open('$OUT/tests-gpu.json')); [print(t['outcome'], t['test'], (t['message'] or '')[:300]) for t in d['tests'] if t['outcome'] != 'passed']"
