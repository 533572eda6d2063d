"""Host (CPU) cost per fused call vs its GPU time, under torchrun (2 ranks).

If issuing a call takes longer on the CPU than the call runs on the GPU, back-to-back timings
measure Python, not kernels. Prints, per op and m: CPU issue time per call (no sync inside the
loop) and GPU time per call (events), for the flux and nccl backends."""
import os
import time

import torch
import torch.distributed as dist

from megatron_flux.backends import get_backend

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
group = dist.group.WORLD
h, ffn = 4096, 28672
for name in ("nccl", "flux"):
    be = get_backend(name)
    for m in (64, 1024, 4096):
        x = torch.randn(m // world, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(ffn // world, h, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(m, ffn // world, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(h, ffn // world, device="cuda", dtype=torch.bfloat16)
        for op, fn in (("AG+GEMM", lambda: be.all_gather_matmul(x, w.t(), group)),
                       ("GEMM+RS", lambda: be.matmul_reduce_scatter(a, w2.t(), group))):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            n = 50
            t0 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            t_issue = (time.perf_counter() - t0) / n * 1e3
            end.record()
            end.synchronize()
            t_gpu = start.elapsed_time(end) / n
            if rank == 0:
                print(f"{name:5s} {op:8s} m={m:5d}  cpu issue {t_issue:.3f} ms/call  gpu {t_gpu:.3f} ms/call", flush=True)
dist.destroy_process_group()
