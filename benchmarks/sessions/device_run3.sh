#!/usr/bin/env bash
# Device call 3: kernel-vs-cuBLAS sweep, one process per candidate config (isolates faults).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
for i in 1 2 3 4 5 6; do
  echo "=== candidate $i"
  timeout 100 python3 -m megatron_flux.bench.kernel_vs_cublas --only-config $i --trials 3 --iters 5 --json $OUT/kvc_$i.json 2>&1 | grep -E "^(AG|GEMM)|Error|error" | tail -26
done
