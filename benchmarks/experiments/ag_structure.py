"""Experiment: what the AG+GEMM kernel's segment structure costs, communication disabled.

One GPU. Per shape, in one interleaved loop (``kernel_vs_cublas._time``): cuBLAS, the plain
persistent yardstick (``bench/plain_gemm.py``) and ``ag_gemm_kernel`` with every signal
pre-set, as rank 0 of ``world`` = 1 (one segment: the whole A is the local shard) and of 2
(local shard + one "peer" segment), each with the config's epilogue split and the other one,
and with ``--panels`` column-panel widths when the kernel has them. Prints time / cuBLAS.

    python benchmarks/experiments/ag_structure.py --shapes 1024x14336x4096 ... [--json PATH]
"""

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from megatron_flux.bench.kernel_vs_cublas import _time
from megatron_flux.bench.plain_gemm import launch_plain_gemm
from megatron_flux.kernels.ag_gemm import launch_ag_gemm
from megatron_flux.kernels.config import GemmConfig, default_config


def ag_runner(a, w, out, world, cfg, sms):
    """``out = a @ w.T`` through ``ag_gemm_kernel`` as rank 0 of ``world`` (flags pre-set)."""
    m = a.shape[0]
    m_local = m // world
    x = a[:m_local]
    cfg = dataclasses.replace(cfg, chunk_rows=m_local, stream_k=0)
    flags = torch.full((world,), 1 << 30, dtype=torch.int32, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    return lambda: launch_ag_gemm(x, a, w.t(), out, flags, err, rank=0, world=world, epoch=1,
                                  cfg=cfg, num_sms=sms, max_spins=1 << 20)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, help="MxNxK (N, K per rank)")
    p.add_argument("--config", action="append", default=[], help="GemmConfig JSON (repeatable); "
                   "none: the AG default")
    p.add_argument("--panels", nargs="*", type=int, default=[])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        cfgs = [GemmConfig.from_dict(json.loads(c)) for c in args.config] or \
            [default_config("ag", m, n, k)]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.t().float()
        for ci, cfg in enumerate(cfgs):
            other = dataclasses.replace(cfg, epilogue_split=3 - cfg.epilogue_split)
            fns, outs = {"cublas": lambda: torch.matmul(a, w.t())}, {}

            def add(name, make):
                outs[name] = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                fns[name] = make(outs[name])

            add("plain", lambda o: (lambda: launch_plain_gemm(a, w, o, cfg, sms)))
            for world in (1, 2):
                add(f"w{world}", lambda o, wd=world: ag_runner(a, w, o, wd, cfg, sms))
                add(f"w{world}-epi{other.epilogue_split}",
                    lambda o, wd=world: ag_runner(a, w, o, wd, other, sms))
            for pn in args.panels:
                add(f"w2-panel{pn}", lambda o, pn=pn: ag_runner(
                    a, w, o, 2, dataclasses.replace(cfg, panel_n=pn), sms))
            times = _time(fns, args.trials, args.iters)
            base = statistics.median(times["cublas"])
            line = [f"{m}x{n}x{k} cfg{ci} cublas {base:.4f}"]
            for name, ts in times.items():
                med = statistics.median(ts)
                err = None
                if name in outs:
                    err = float((outs[name].float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        line.append(f"{name} WRONG({err:.3g})")
                rows.append({"m": m, "n": n, "k": k, "config": cfg.to_dict(), "method": name,
                             "median_ms": med, "spread_ms": max(ts) - min(ts), "times_ms": ts,
                             "rel_err": err})
                if name != "cublas":
                    line.append(f"{name} x{med / base:.3f}")
            print("  ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
