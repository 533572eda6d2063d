"""Experiment: what the AG+GEMM kernel's segment structure costs, communication disabled.

One GPU. Per shape, in one interleaved loop (``kernel_vs_cublas._time``): cuBLAS, the plain
persistent yardstick (``bench/plain_gemm.py``) and ``ag_gemm_kernel`` with every signal
pre-set, as rank 0 of ``world`` = 1 (one segment: the whole A is the local shard) and of 2
(local shard + one "peer" segment), each with the config's epilogue split and the other one
(stream-K off). Prints time / cuBLAS.

    python benchmarks/experiments/ag_structure.py --shapes 1024x14336x4096 ... [--json PATH]
"""

import argparse
import dataclasses
import json

import torch

from common import add_timing_args, parse_shape, problem, time_and_check, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import ag_on_one_gpu
from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm
from megatron_flux.kernels.config import GemmConfig, default_config


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, help="MxNxK (N, K per rank)")
    p.add_argument("--config", action="append", default=[], help="GemmConfig JSON (repeatable); "
                   "none: the AG default")
    add_timing_args(p)
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = []
    for shape in args.shapes:
        m, n, k = parse_shape(shape)
        cfgs = [GemmConfig.from_dict(json.loads(c)) for c in args.config] or \
            [default_config("ag", m, n, k)]
        a, w, ref = problem(m, n, k)
        for ci, cfg in enumerate(cfgs):
            cfg = dataclasses.replace(cfg, stream_k=0)
            other = dataclasses.replace(cfg, epilogue_split=3 - cfg.epilogue_split)
            plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns = {"cublas": lambda: torch.matmul(a, w.t()),
                   "plain": lambda cfg=cfg: launch_plain_gemm(a, w, plain_out, cfg, sms)}
            outs = {"plain": (plain_out, lambda: ref)}
            for world in (1, 2):
                for name, c in ((f"w{world}", cfg), (f"w{world}-epi{other.epilogue_split}", other)):
                    c = dataclasses.replace(c, chunk_rows=m // world)  # one chunk per segment
                    fns[name], out = ag_on_one_gpu(a, w, world, c, err)
                    outs[name] = (out, lambda: ref)
            rows += time_and_check(fns, outs, args, f"{m}x{n}x{k} cfg{ci}",
                                   {"m": m, "n": n, "k": k, "config": cfg.to_dict()})
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
