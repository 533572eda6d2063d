#!/usr/bin/env bash
# Device call 5: device-side TMA descriptors + lean host path. GPU tests (kernels + layers with
# megatron-core 0.19.2), host overhead per call, then the full FLUX-metric benchmark.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 240 python3 -m pytest tests/test_flux_gpu.py tests/test_layers_gpu.py -x -q -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/host_overhead.py 2>&1 | grep -v -i warn | tee $OUT/host_overhead.log
timeout 300 torchrun --standalone --nproc-per-node 2 -m megatron_flux.bench --m-set all --trials 7 --iters 20 \
  --out-json $OUT/bench.json --out-png $OUT/bench.png 2>&1 | grep -v -i warn > $OUT/bench.log; tail -12 $OUT/bench.log
