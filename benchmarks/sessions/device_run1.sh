#!/usr/bin/env bash
# Device call 1 (2xH200): fused-kernel GPU tests + kernel-vs-cuBLAS (comm disabled), default configs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
nvidia-smi -L; nvidia-smi topo -m | head -5
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python3 -m pytest tests/test_flux_gpu.py -x -q -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -40
timeout 240 python3 -m megatron_flux.bench.kernel_vs_cublas --default-only --trials 3 --iters 5 --json $OUT/kvc.json 2>&1 | tail -40
