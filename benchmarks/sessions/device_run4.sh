#!/usr/bin/env bash
# Device call 4: the FLUX-metric benchmark on the full grid (large + small m) at TP=2, bf16,
# then the kernel-vs-cuBLAS sweep of the extra candidates (one process each).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 330 torchrun --standalone --nproc-per-node 2 -m megatron_flux.bench --m-set all --trials 7 --iters 20 \
  --out-json $OUT/bench.json --out-png $OUT/bench.png 2>&1 | grep -v -i warn | tee $OUT/bench.log | tail -75
for i in 5 6 7 8; do
  timeout 60 python3 -m megatron_flux.bench.kernel_vs_cublas --only-config $i --trials 3 --iters 5 --json $OUT/kvc_$i.json > $OUT/kvc_$i.log 2>&1
done
