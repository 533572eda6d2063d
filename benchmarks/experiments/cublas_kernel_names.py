"""Which cuBLAS kernel ``torch.matmul`` runs for each local GEMM of the TP grid (one GPU), and
its time: the kernel name says the tile, the cluster and the schedule (cooperative or ping-pong)
cuBLAS picked, the target our fused kernels' GEMMs are measured against.

    python3 benchmarks/experiments/cublas_kernel_names.py --tp 2 --json names.json
"""

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_flux.tools.diagnostics.kernel_vs_cublas import _grid, add_model_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--m", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--ops", nargs="+", default=["AG+GEMM", "GEMM+RS"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for op, model, m, n, k in _grid(args):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # Megatron's [out, in]
        for _ in range(3):
            torch.matmul(a, w.t())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.matmul(a, w.t())
            torch.cuda.synchronize()
        kernels = [(e.key, e.device_time_total / max(e.count, 1) / 1000.0)
                   for e in prof.key_averages() if e.device_time_total > 0]
        for name, ms in kernels:
            print(f"{op:8s} {model:10s} M={m:5d} N={n:6d} K={k:6d} {ms:.4f} ms  {name}")
            rows.append(dict(op=op, model=model, m=m, n=n, k=k, kernel=name, ms=ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "tp": args.tp, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
