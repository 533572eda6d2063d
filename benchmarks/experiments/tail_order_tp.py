"""Experiment: with communication on, do the split tail's K-parts of the warp-specialized
GEMM+RS run faster as their programs' first work item or as their last?

On one GPU, with every peer signal pre-set, first ran 0.88-1.00x the time of last at TP 2
(``kernel_ab.py``; ``split_tail.split_tail_first``), since a part's epilogue and its share of
the sum then run beside the whole tiles' MMAs. With communication on, parts run last may pay
instead: they run while the whole tiles' pushes drain and the peers' signals travel, which
parts run first cannot hide. This script asks the registered ``flux`` backend exactly as a
layer does, under torchrun, with the shape's config forced to the ping-pong with its split tail
(``--override``, default ``estimate.PINGPONG_RS``) and ``split_tail_first`` forced per block.
Per trial both orders run once, in a shuffled order: the backend's cached configs and call
plans dropped (``clear_config_cache``, so the next call launches, and binds, the forced order),
``--warmup`` calls, a barrier, then ``--iters`` calls back to back timed by CUDA events (behind a
``--queue-ahead-ms`` sleep, so the host's issue time is not timed). Per shape and order: every
rank's per-trial times; the record's ratio is the median over trials of the slower rank's first
/ last. Shapes whose plan does not split are skipped with a line.

    torchrun --nproc-per-node 2 benchmarks/experiments/tail_order_tp.py \\
        --model-shapes minicpm-2b:2304:11520:5760 phi-2:2560:10240:10240 \\
        starcoder2-7b:4608:18432:18432 --ms 1024 2048 --json tail-order.json

(run as a script, with the repository root on ``PYTHONPATH``: it imports ``common`` beside it)
"""

import argparse
import functools
import json
import random
import statistics

import torch
import torch.distributed as dist

from common import flux_backend_under_torchrun, write_record
from megatron_flux.kernels import split_tail
from megatron_flux.kernels.config import launch_tiles
from megatron_flux.tools.diagnostics.kernel_vs_cublas import add_model_args, mean_ms, model_shapes
from megatron_flux.tuning.estimate import PINGPONG_RS


def main(argv=None):
    p = argparse.ArgumentParser()
    add_model_args(p, ["minicpm-2b"])
    p.add_argument("--ms", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--override", type=json.loads, default=dict(PINGPONG_RS),
                   help="GemmConfig fields (JSON) replaced in every config the backend picks")
    p.add_argument("--trials", type=int, default=11)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--queue-ahead-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)

    group, rank, world, dev, backend = flux_backend_under_torchrun(args.override)
    args.tp = world  # model_shapes gives per-rank widths at args.tp
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shuffle = random.Random(args.seed)  # the same order on every rank
    real_first = split_tail.split_tail_first
    rows = []
    try:
        for model, n, k in model_shapes(args, "rs"):
            for m in args.ms:
                cfg = backend.config("rs", m, n, k, dtype=torch.bfloat16, tp=world, device=dev)
                m_local = m // world
                grid = min(sms, launch_tiles(m_local, n, world, cfg))
                tail, parts = split_tail.split_tail_plan(world, m_local, n, k, cfg, grid)
                if parts < 2:
                    if rank == 0:
                        print(f"{model} m={m}: no split tail planned, skipped", flush=True)
                    continue
                torch.manual_seed(1234 + rank)
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                b = torch.randn(n, k, device=dev, dtype=torch.bfloat16).t()  # a layer's [K, N] view
                out = torch.empty(m_local, n, device=dev, dtype=torch.bfloat16)

                call = functools.partial(backend.matmul_reduce_scatter, a, b, group, out=out)

                times = {"first": [], "last": []}
                for _ in range(args.trials):
                    for order in shuffle.sample(["first", "last"], 2):
                        split_tail.split_tail_first = lambda *_, f=(order == "first"): f
                        backend.clear_config_cache()
                        for _ in range(args.warmup):
                            call()
                        dist.barrier()
                        times[order].append(mean_ms(call, args.iters, args.queue_ahead_ms))
                every = [None] * world
                dist.all_gather_object(every, {"rank": rank, "ms": times})
                slower = {o: [max(r["ms"][o][t] for r in every) for t in range(args.trials)]
                          for o in times}
                ratio = statistics.median(f / s for f, s in zip(slower["first"], slower["last"]))
                row = {"model": model, "m": m, "n": n, "k": k, "tp": world, "cfg": cfg.to_dict(),
                       "tail": tail, "parts": parts, "ranks": every,
                       "median_ms": {o: statistics.median(v) for o, v in slower.items()},
                       "first_over_last": ratio}
                rows.append(row)
                if rank == 0:
                    print(f"{model} m={m} (tail {tail}x{parts}): first "
                          f"{row['median_ms']['first']:.4f} ms, last {row['median_ms']['last']:.4f}"
                          f" ms, first/last {ratio:.3f} (median of {args.trials} paired trials)",
                          flush=True)
                del call, a, b, out
    finally:
        split_tail.split_tail_first = real_first
    dist.barrier()
    if rank == 0:
        write_record(args.json, rows, what="split tail parts first against last, communication on "
                     "(the slower rank's time per trial; first_over_last: median of per-trial ratios)",
                     override=args.override, trials=args.trials, iters=args.iters)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
