"""Experiment: two persistent programs per SM, so one program's epilogue overlaps the other's
K loop (comm off).

Triton 3.6's persistent GEMM on Hopper is not warp-specialized: while a program rounds and
stores a tile, its SM's tensor cores idle. At short K (AG llama3-8b, K = 4096: 64 K-steps of
a 128x128 tile) that idle time is a few per cent of the tile. A 128x128 tile with 4 warps and
2 stages needs 80-96 KB of shared memory and 154-168 registers per thread (ptxas, sm_90a;
``ptxas_report.py``), so two programs fit on one SM; with a grid of 2 x SMs the hardware runs
them side by side.

Per shape, in one interleaved loop: cuBLAS, and for every ``--config`` and every programs-per-SM
count in ``--per-sm``: the plain yardstick and the fused kernel of ``--op`` (wired as rank 0 of
``--tp`` by ``kernel_vs_cublas``, every signal pre-set). Prints time / cuBLAS.

    python benchmarks/experiments/occupancy.py --op ag --shapes 1024x14336x4096 \\
        --config '{"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 2, "num_warps": 4}'

(run as a script, with the repository root on ``PYTHONPATH``: it imports ``common`` beside it)
"""

import argparse
import json

import torch

from common import add_timing_args, parse_shape, problem, time_and_check, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import ag_on_one_gpu, rs_on_one_gpu
from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm
from megatron_flux.kernels.config import GemmConfig
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["ag", "rs"], required=True)
    p.add_argument("--shapes", nargs="+", required=True, help="MxNxK, per-rank N (AG) / K (RS)")
    p.add_argument("--config", action="append", required=True, help="GemmConfig JSON (repeatable)")
    p.add_argument("--per-sm", nargs="+", type=int, default=[1, 2])
    p.add_argument("--tp", type=int, default=2)
    add_timing_args(p)
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ensure_descriptor_allocator()
    rows = []
    for shape in args.shapes:
        m, n, k = parse_shape(shape)
        a, w, full = problem(m, n, k)
        err = torch.zeros(4, dtype=torch.int32, device="cuda")
        fns = {"cublas": lambda: torch.matmul(a, w.t())}
        outs = {}
        for ci, cj in enumerate(args.config):
            cfg = GemmConfig.from_dict(json.loads(cj))
            for per_sm in args.per_sm:
                grid = per_sm * sms
                tag = f"c{ci}x{per_sm}"
                plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                fns[f"plain-{tag}"] = (lambda c=cfg, o=plain_out, g=grid:
                                       launch_plain_gemm(a, w, o, c, g))
                outs[f"plain-{tag}"] = (plain_out, lambda: full)
                if args.op == "ag":
                    launch, out = ag_on_one_gpu(a, w, args.tp, cfg, err, num_sms=grid)
                    fns[f"fused-{tag}"] = launch
                    outs[f"fused-{tag}"] = (out, lambda: full)
                else:
                    launch, out, data = rs_on_one_gpu(a, w, args.tp, err, num_sms=grid)
                    fns[f"fused-{tag}"] = lambda c=cfg, launch=launch: launch(c)
                    m_local = m // args.tp
                    outs[f"fused-{tag}"] = (out, lambda data=data, m_local=m_local:
                                            full[:m_local] + data[1:].float().sum(0))
        print(f"{args.op} {shape}: " + "  ".join(f"c{i}={c}" for i, c in enumerate(args.config)),
              flush=True)
        rows += time_and_check(fns, outs, args, f"{args.op} {shape}",
                               {"op": args.op, "m": m, "n": n, "k": k, "configs": args.config,
                                "num_sms": sms})
        assert err.tolist() == [0, 0, 0, 0], err.tolist()
    write_record(args.json, rows, tp=args.tp)


if __name__ == "__main__":
    main()
