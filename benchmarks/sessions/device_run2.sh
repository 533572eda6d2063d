#!/usr/bin/env bash
# Device call 2: fused-kernel GPU tests + kernel-vs-cuBLAS sweep of flatten / warp-spec / epilogue knobs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest tests/test_flux_gpu.py -x -q -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -15
timeout 330 python3 -m megatron_flux.bench.kernel_vs_cublas --trials 3 --iters 5 --json $OUT/kvc.json 2>&1 | grep -v Warning | tail -30
