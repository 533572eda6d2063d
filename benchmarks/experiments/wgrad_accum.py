"""Weight-gradient accumulation into an fp32 ``main_grad`` on the training step's shapes.

Megatron with ``--bf16`` keeps fp32 gradient buffers (``main_grad``). Without apex's
``fused_weight_gradient_mlp_cuda`` the weight gradient is a bf16 GEMM into ``param.grad``, then
DDP's hook adds it into ``main_grad`` (``main_grad.add_(grad)``): one more pass over the weight
in memory per micro-batch (read bf16 + read fp32 + write fp32), and the gradient rounded to bf16
before it is summed. One cuBLAS GEMM can do both: bf16 inputs, fp32 output, beta = 1
(``torch.addmm(main_grad, go.t(), x, out_dtype=torch.float32, out=main_grad)``) -- if this
torch takes an fp32 ``self`` there. This script finds out, and times, per shape:

* ``cublas``: the bf16 GEMM alone (what the unfused path's GEMM costs);
* ``unfused``: that GEMM, then ``main_grad.add_`` (what runs now);
* ``fused``: the fp32-output GEMM accumulating into ``main_grad``;
* ``fp32_out``: the fp32-output GEMM without accumulation (``torch.mm(..., out_dtype=)``).

Errors are against float64 math. Kernel names per method come from the profiler.

    python3 benchmarks/experiments/wgrad_accum.py --json wgrad.json
"""

import argparse
import statistics

import torch

from common import add_timing_args, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import _time

# Llama-3-8B at TP 2 (per rank): name -> (n, k) of the weight [n, k]
SHAPES = {"qkv": (3072, 4096), "proj": (4096, 2048), "fc1": (14336, 4096), "fc2": (4096, 7168),
          "output": (64128, 4096)}  # output: the output layer (vocabulary 128256 / 2)


def fused_accumulate(main, go, x):
    return torch.addmm(main, go.t(), x, out_dtype=torch.float32, out=main)


def unfused_accumulate(main, go, x):
    main.add_(go.t().matmul(x))


def kernels_of(fn):
    """The CUDA kernels one call of ``fn`` launches (names, in order)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def check(m, n, k):
    """Errors of both paths against float64, from one fresh ``main_grad``; the fused path's
    error (or why it cannot run)."""
    go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    main0 = torch.randn(n, k, device="cuda", dtype=torch.float32) * 64
    ref = main0.double() + go.double().t() @ x.double()
    scale = float(ref.norm())
    out = {}
    main = main0.clone()
    unfused_accumulate(main, go, x)
    out["unfused"] = dict(rel_err=float((main.double() - ref).norm()) / scale,
                          max_abs=float((main.double() - ref).abs().max()))
    main = main0.clone()
    try:
        res = fused_accumulate(main, go, x)
        out["fused"] = dict(rel_err=float((main.double() - ref).norm()) / scale,
                            max_abs=float((main.double() - ref).abs().max()),
                            returned_out=res.data_ptr() == main.data_ptr())
    except Exception as e:  # noqa: BLE001 - the record says why
        out["fused"] = dict(error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    add_timing_args(p)
    args = p.parse_args()
    rows, checks = [], []
    for m in args.m:
        for name in args.shapes:
            n, k = SHAPES[name]
            c = check(m, n, k)
            checks.append({"shape": name, "m": m, "n": n, "k": k, **c})
            print(name, m, c, flush=True)
            go = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
            fns = {"cublas": lambda: go.t().matmul(x),
                   "unfused": lambda: unfused_accumulate(main_grad, go, x)}
            if "error" not in c["fused"]:
                fns["fused"] = lambda: fused_accumulate(main_grad, go, x)
                fns["fp32_out"] = lambda: torch.mm(go.t(), x, out_dtype=torch.float32)
            names = {key: kernels_of(fn) for key, fn in fns.items()}
            times = _time(fns, args.trials, args.iters, args.warmup, args.shuffle_seed,
                          args.queue_ahead_ms)
            base = statistics.median(times["cublas"])
            line = [f"{name} m={m} cublas {base:.4f} ms"]
            for key, ts in times.items():
                med = statistics.median(ts)
                rows.append({"shape": name, "m": m, "n": n, "k": k, "method": key,
                             "median_ms": med, "spread_ms": max(ts) - min(ts), "times_ms": ts,
                             "kernels": names[key]})
                if key != "cublas":
                    line.append(f"{key} {med:.4f} (x{med / base:.3f})")
            print("  ".join(line), flush=True)
    write_record(args.json, rows, checks=checks)


if __name__ == "__main__":
    main()
