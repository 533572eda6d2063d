"""Experiment: how many K-parts should the warp-specialized GEMM+RS cut its tail tiles into?

One GPU, communication off (``kernel_vs_cublas``'s one-GPU wiring, rank 0 of ``--tp``). Per
shape, launches alternating round by round (``kernel_vs_cublas._time_alternating``): cuBLAS,
the ping-pong GEMM+RS (``estimate.PINGPONG_RS``) without a split tail, with it at
``MAX_TAIL_SPLIT`` = each of ``--parts`` (the plan's ``(tail, parts)`` is recorded: the grid or
the K-steps may allow fewer), and the ping-pong AG+GEMM kernel at ``WORLD = 1`` with the same
tile (a plain warp-specialized GEMM: no pushes, no reduction, no split; the floor of the tile
loop). Prints each one's time / cuBLAS (median over trials of per-round ratios).

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/split_tail_parts.py \
        --shapes 1024x2304x5760 1024x4608x9216 --parts 2 4 8 --json parts.json
"""

import argparse
import dataclasses
import json
import statistics

import torch

from common import parse_shape
from megatron_flux.kernels import split_tail
from megatron_flux.kernels.config import GemmConfig
from megatron_flux.tools.diagnostics.kernel_vs_cublas import _rs_runner, _time_alternating, \
    ag_on_one_gpu, rel_err
from megatron_flux.tuning.estimate import PINGPONG_RS


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, metavar="MxNxK",
                   help="per-rank GEMM: m rows of all ranks, n the hidden size, k per rank")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--parts", nargs="+", type=int, default=[2, 3, 4, 6, 8])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args(argv)
    base = GemmConfig(**{**PINGPONG_RS, "stream_k": 0})
    split = dataclasses.replace(base, stream_k=1)
    plain = dataclasses.replace(base, rs_warp_specialized=False, ag_warp_specialized=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_parts = split_tail.MAX_TAIL_SPLIT

    def setting(parts):
        split_tail.MAX_TAIL_SPLIT = parts

    rows = []
    for spec in args.shapes:
        m, n, k = parse_shape(spec)
        fns, checks, plans = {}, {}, {}
        fused, cublas, check, err = _rs_runner(m, n, k, args.tp, base, torch.bfloat16)
        fns["cublas"], fns["nosplit"], checks["nosplit"] = cublas, fused, check
        for parts in args.parts:
            values = parts
            name = f"split{parts}"
            setting(values)
            plans[name] = split_tail.split_tail_plan(args.tp, m // args.tp, n, k, split, sms)
            fn, _, chk, _ = _rs_runner(m, n, k, args.tp, split, torch.bfloat16)

            def run(fn=fn, values=values):
                setting(values)
                fn()

            fns[name], checks[name] = run, chk
        setting(default_parts)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        launch, out = ag_on_one_gpu(a, w, 1, plain, err)
        fns["plain_ws"] = launch
        checks["plain_ws"] = lambda: (out.float(), a.float() @ w.t().float())
        times, ratios = _time_alternating(fns, args.trials, args.rounds, args.warmup, 0, 5.0)
        setting(default_parts)
        row = {"m": m, "n": n, "k": k, "tp": args.tp, "cublas_ms": statistics.median(times["cublas"]),
               "plans": plans, "methods": {}}
        for name in fns:
            if name == "cublas":
                continue
            e = rel_err(*checks[name]())
            row["methods"][name] = {"ms": statistics.median(times[name]),
                                    "ratio": statistics.median(ratios[name]),
                                    "trials_ratio": ratios[name], "rel_err": e}
        if int(err[0]):
            row["error_flag"] = int(err[0])
        rows.append(row)
        shown = "  ".join(f"{name} {r['ratio']:.3f}{'' if r['rel_err'] < 2e-2 else ' WRONG'}"
                          for name, r in row["methods"].items())
        print(f"{spec} cublas {row['cublas_ms']:.4f} ms  {shown}  plans {plans}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"what": __doc__.splitlines()[0], "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "triton": __import__("triton").__version__,
                           "config": dataclasses.asdict(split), "default_max_tail_split": default_parts,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
