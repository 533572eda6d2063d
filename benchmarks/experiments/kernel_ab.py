"""Experiment: a fused kernel against an earlier version of itself, communication disabled.

One GPU; per grid shape and config (the shipped table's and the heuristic default), in one
interleaved loop: cuBLAS, the plain yardstick, and the launcher of the module at ``--prev`` (a
copy of an earlier ``kernels/ag_gemm.py`` or ``kernels/gemm_rs.py``) and of the current one,
both wired as rank 0 of ``--tp`` with every signal pre-set (``kernel_vs_cublas``'s wiring;
GEMM+RS pushes into local slots and reduces them). Prints time / cuBLAS.

    python benchmarks/experiments/kernel_ab.py --op ag --prev benchmarks/experiments/ag_gemm_prev.py
    python benchmarks/experiments/kernel_ab.py --op rs --prev benchmarks/experiments/gemm_rs_prev.py
"""

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys

import torch

from megatron_flux.bench.grid import MODELS
from megatron_flux.bench.kernel_vs_cublas import _time
from megatron_flux.bench.plain_gemm import launch_plain_gemm
from megatron_flux.kernels import ag_gemm, gemm_rs
from megatron_flux.kernels.config import default_config, rs_signal_count
from megatron_flux.tuning.provider import TableConfigProvider


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prev", required=True)
    p.add_argument("--op", choices=["ag", "rs"], default="ag")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["gpt3-175b", "llama3-70b", "llama3-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args(argv)
    spec = importlib.util.spec_from_file_location("ag_gemm_prev", args.prev)
    prev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = TableConfigProvider()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for model in args.models:
        for m in args.m:
            if args.op == "ag":
                n, k = MODELS[model].fc1 // args.tp, MODELS[model].hidden
            else:
                n, k = MODELS[model].hidden, MODELS[model].fc1 // args.tp
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            full = (a.float() @ w.t().float())
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            cfgs = {"table": table(args.op, m, n, k, dtype=torch.bfloat16, tp=args.tp, device=dev),
                    "default": default_config(args.op, m, n, k)}
            for label, cfg in cfgs.items():
                if args.op == "ag":
                    wire = _ag_wiring(a, w, args.tp, cfg, err, sms)
                else:
                    wire = _rs_wiring(a, w, args.tp, cfg, err, sms)
                plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                fns = {"cublas": lambda: torch.matmul(a, w.t()),
                       "plain": lambda cfg=cfg: launch_plain_gemm(a, w, plain_out, cfg, sms)}
                outs = {"plain": (plain_out, lambda: full)}
                for name, mod in (("prev", prev), ("new", ag_gemm if args.op == "ag" else gemm_rs)):
                    fns[name], outs[name] = wire(mod)
                times = _time(fns, args.trials, args.iters)
                base = statistics.median(times["cublas"])
                line = [f"{args.op.upper()} {model:10s} m={m:5d} {label:7s} "
                        f"ws={int(cfg.warp_specialize)} sk={cfg.stream_k} "
                        f"{cfg.block_m}x{cfg.block_n} cublas {base:.4f}"]
                for name, ts in times.items():
                    med = statistics.median(ts)
                    e = None
                    if name in outs:
                        got, ref = outs[name]
                        ref = ref()
                        e = float((got.float() - ref).norm() / ref.norm())
                        if not e < 1e-2:
                            line.append(f"{name} WRONG({e:.3g})")
                    rows.append({"op": args.op, "model": model, "m": m, "n": n, "k": k,
                                 "config_label": label, "config": cfg.to_dict(), "method": name,
                                 "median_ms": med, "spread_ms": max(ts) - min(ts), "rel_err": e})
                    if name != "cublas":
                        line.append(f"{name} x{med / base:.3f}")
                assert err.tolist() == [0, 0, 0, 0], err.tolist()
                print("  ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "tp": args.tp, "rows": rows},
                      f, indent=1)


def _ag_wiring(a, w, tp, cfg, err, sms):
    """``wire(module) -> (fn, (out, ref_fn))``: the module's AG+GEMM of ``a @ w.T`` as rank 0."""
    m, m_local = a.shape[0], a.shape[0] // tp
    x = a[:m_local]
    cfg = dataclasses.replace(cfg, chunk_rows=min(cfg.chunk_rows, m_local))
    chunks = -(-m_local // cfg.chunk_rows)
    flags = torch.full((tp * chunks,), 1 << 30, dtype=torch.int32, device="cuda")

    def wire(mod):
        out = torch.full((m, w.shape[0]), float("nan"), device="cuda", dtype=a.dtype)
        return (lambda: mod.launch_ag_gemm(x, a, w.t(), out, flags, err, rank=0, world=tp,
                                           epoch=1, cfg=cfg, num_sms=sms, max_spins=1 << 20),
                (out, lambda: a.float() @ w.t().float()))
    return wire


def _rs_wiring(a, w, tp, cfg, err, sms):
    """``wire(module) -> (fn, (out, ref_fn))``: the module's GEMM+RS of ``a @ w.T`` as rank 0
    of ``tp`` on this GPU alone (``kernel_vs_cublas.rs_on_one_gpu``, per module)."""
    m_local, n = a.shape[0] // tp, w.shape[0]

    def wire(mod):
        out = torch.full((m_local, n), float("nan"), device="cuda", dtype=a.dtype)
        data = torch.zeros(tp, m_local, n, device="cuda", dtype=a.dtype)
        flags = torch.full((rs_signal_count(tp),), 1 << 30, dtype=torch.int32, device="cuda")
        flags[tp:] = 0
        data_ptrs = torch.tensor([data.data_ptr()] * tp, dtype=torch.int64, device="cuda")
        flag_ptrs = torch.tensor([flags.data_ptr()] * tp, dtype=torch.int64, device="cuda")

        def ref():
            r = (a.float() @ w.t().float())[:m_local]
            for src in range(1, tp):
                r = r + data[src].float()
            return r
        def fn():  # holds flags: the kernel reaches it only through flag_ptrs
            mod.launch_gemm_rs(a, w.t(), out, data, data_ptrs, flag_ptrs, None, err, rank=0,
                               world=tp, epoch=1, cfg=cfg, num_sms=sms, max_spins=1 << 20)
            return flags
        return fn, (out, ref)
    return wire


if __name__ == "__main__":
    main()
