#!/usr/bin/env bash
# Final device call (2xH200): the whole test suite with megatron-core 0.19.2 on Python 3.12 (CPU +
# GPU tests), GEMM quality with comm disabled, and the FLUX-metric benchmark on the full grid.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 330 python3 benchmarks/record_pytest.py $OUT/tests-gpu.json tests -q -p no:cacheprovider 2>&1 | tail -6
timeout 90 python3 -m megatron_flux.bench.kernel_vs_cublas --default-only --trials 5 --iters 10 --json $OUT/kvc.json 2>&1 | grep -E "^(AG|GEMM)"
timeout 300 torchrun --standalone --nproc-per-node 2 -m megatron_flux.bench --m-set all --trials 7 --iters 20 \
  --out-json $OUT/bench.json --out-png $OUT/bench.png > $OUT/bench.log 2>&1; grep -A12 "^summary" $OUT/bench.log
