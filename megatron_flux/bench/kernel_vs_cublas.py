"""GEMM quality of the fused kernels with communication disabled, against cuBLAS.

``python -m megatron_flux.bench.kernel_vs_cublas [--tp 2] [--json PATH]`` on one GPU.

The fused kernels run their exact production code path, but wired to this GPU alone: every
signal is pre-set (no wait ever spins), AG+GEMM's "remote" rows are read from a local buffer and
GEMM+RS pushes its "remote" tiles into local memory and reduces local partials. What is left is
the GEMM plus the fused epilogue, which must stay within ~1.02x of cuBLAS for the overlap to pay.
Shapes are the benchmark grid's per-rank shapes at ``--tp``. Timing: CUDA events, ``--iters``
back-to-back launches per trial, methods interleaved inside every trial, median over trials.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable, Dict, List

import torch

from megatron_flux.kernels.config import GemmConfig, default_config, rs_signal_count

CANDIDATES = [
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, warp_specialize=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=1, flatten=False),
    GemmConfig(128, 128, 64, 4, 4, 8, epilogue_split=1, flatten=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=False),
    GemmConfig(128, 128, 64, 4, 8, 8, epilogue_split=1, flatten=False),
    GemmConfig(64, 256, 64, 4, 4, 8, epilogue_split=2, flatten=True),
    GemmConfig(256, 128, 64, 3, 8, 8, epilogue_split=1, flatten=False),
]
#: GEMM+RS: the knobs of its schedule (TMA or vector pushes, flattened reduction loop)
RS_CANDIDATES = [
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=1, flatten=True, flatten_consume=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, flatten_consume=False),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, flatten_consume=True,
               rs_tma_push=False),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=1, flatten=True, flatten_consume=True,
               warp_specialize=True),
]


def _time(fns: Dict[str, Callable], trials: int, iters: int) -> Dict[str, List[float]]:
    out = {name: [] for name in fns}
    for fn in fns.values():  # warm-up / compile
        fn()
    torch.cuda.synchronize()
    for _ in range(trials):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            out[name].append(start.elapsed_time(end) / iters)
    return out


def _ag_runner(m, n, k, tp, cfg, dtype):
    from megatron_flux.kernels.ag_gemm import launch_ag_gemm

    m_local = m // tp
    x = torch.randn(m_local, k, device="cuda", dtype=dtype)
    ag = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    chunks = -(-m_local // min(cfg.chunk_rows, m_local))
    flags = torch.full((tp * chunks,), 1 << 30, dtype=torch.int32, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    import dataclasses

    cfg = dataclasses.replace(cfg, chunk_rows=min(cfg.chunk_rows, m_local))

    def fused():
        launch_ag_gemm(x, ag, w.t(), out, flags, err, rank=0, world=tp, epoch=1, cfg=cfg,
                       num_sms=sms, max_spins=1 << 20)

    full = ag.clone()
    full[:m_local] = x
    return fused, (lambda: torch.matmul(full, w.t())), (lambda: (out.float(), full.float() @ w.t().float())), err


def _rs_runner(m, n, k, tp, cfg, dtype):
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs

    m_local = m // tp
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.empty(m_local, n, device="cuda", dtype=dtype)
    data = torch.zeros(tp, m_local, n, device="cuda", dtype=dtype)
    flags = torch.full((rs_signal_count(tp),), 1 << 30, dtype=torch.int32, device="cuda")
    flags[tp:] = 0  # the per-step arrival counters start at zero
    data_ptrs = torch.tensor([data.data_ptr()] * tp, dtype=torch.int64, device="cuda")
    flag_ptrs = torch.tensor([flags.data_ptr()] * tp, dtype=torch.int64, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def fused():
        launch_gemm_rs(a, w.t(), out, data, data_ptrs, flag_ptrs, None, err, rank=0, world=tp,
                       epoch=1, cfg=cfg, num_sms=sms, max_spins=1 << 20)

    def check():
        # own rows = own partial + the other slots (this rank pushed its remote tiles into slot 0)
        ref = (a.float() @ w.t().float())[:m_local]
        for src in range(1, tp):
            ref = ref + data[src].float()
        return out.float(), ref

    return fused, (lambda: torch.matmul(a, w.t())), check, err


def run(args) -> dict:
    from megatron_flux.bench.grid import MODELS  # noqa: F401  (same grid as the main benchmark)

    dtype = torch.bfloat16
    rows = []
    for op, model, m, n, k in _grid(args):
        best = None
        results = {}
        extra = CANDIDATES if op == "AG+GEMM" else RS_CANDIDATES
        configs = [default_config("ag" if op == "AG+GEMM" else "rs", m, n, k)] + ([] if args.default_only else extra)
        if args.only_config is not None:  # one candidate per process: a faulting variant
            configs = [configs[args.only_config]]  # (sticky CUDA error) cannot hide the others
        fns = {}
        checks = {}
        cublas = None
        for i, cfg in enumerate(configs):
            try:
                maker = _ag_runner if op == "AG+GEMM" else _rs_runner
                fused, ref_fn, check, err = maker(m, n, k, args.tp, cfg, dtype)
                fused()
                torch.cuda.synchronize()
                got, ref = check()
                rel = float((got - ref).norm() / ref.norm())
                if rel > 2e-2 or int(err[0]):
                    results[f"cfg{i}"] = {"cfg": cfg.to_dict(), "error": f"rel err {rel}"}
                    continue
                fns[f"cfg{i}"] = fused
                checks[f"cfg{i}"] = cfg
                cublas = ref_fn
            except Exception as exc:  # out of shared memory etc.
                results[f"cfg{i}"] = {"cfg": cfg.to_dict(), "error": repr(exc)[:200]}
        if cublas is None:
            rows.append({"op": op, "model": model, "m": m, "n": n, "k": k, "error": results})
            continue
        fns["cublas"] = cublas
        times = _time(fns, args.trials, args.iters)
        cub = statistics.median(times["cublas"])
        for name, cfg in checks.items():
            med = statistics.median(times[name])
            results[name] = {"cfg": cfg.to_dict(), "ms": med, "ratio": med / cub}
            if best is None or med < best[1]:
                best = (name, med)
        row = {"op": op, "model": model, "m": m, "n": n, "k": k, "cublas_ms": cub,
               "default_ratio": results.get("cfg0", {}).get("ratio"), "best_ratio": best[1] / cub,
               "best_cfg": results[best[0]]["cfg"], "configs": results}
        rows.append(row)
        print(f"{op:8s} {model:11s} M={m:5d} N={n:6d} K={k:6d} cublas {cub:.4f} ms  "
              f"default x{row['default_ratio'] or float('nan'):.3f}  best x{row['best_ratio']:.3f} "
              f"({best[0]})", flush=True)
        del fns, checks
        torch.cuda.empty_cache()
    return {"what": "fused kernels with communication disabled vs cuBLAS (per-rank shapes)",
            "command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__, "tp": args.tp,
            "rows": rows}


def _grid(args):
    from megatron_flux.bench.grid import MODELS

    for model_name in args.models:
        spec = MODELS[model_name]
        for m in args.m:
            if "AG+GEMM" in args.ops:
                yield "AG+GEMM", model_name, m, spec.fc1 // args.tp, spec.hidden
            if "GEMM+RS" in args.ops:
                yield "GEMM+RS", model_name, m, spec.hidden, spec.fc1 // args.tp  # k as in the anchors file


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["gpt3-175b", "llama3-70b", "llama3-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--ops", nargs="+", default=["AG+GEMM", "GEMM+RS"])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--default-only", action="store_true")
    p.add_argument("--only-config", type=int, default=None,
                   help="run only candidate i (0 = the default heuristic, 1.. = CANDIDATES)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
