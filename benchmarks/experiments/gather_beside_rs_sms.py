"""Experiment: does an all-gather running beside the fused GEMM+RS deadlock for want of SMs?

The column backward starts the input's re-gather, queues the input-gradient GEMM+RS, then
waits for the gather (``_check_gather_beside_rs`` in the GPU test, which timed out at TP 4).
With ``column_regather="nccl"`` the gather is an NCCL kernel on NCCL's stream, beside a
persistent grid of one program per SM whose programs spin on the peers' signals. If on one rank
the grid takes every SM first and on another NCCL's kernel does, a cycle of waits can form at
TP >= 3. This runs one variant per process (a timeout leaves the workspaces unusable):
``--rounds`` calls of gather start, GEMM+RS, wait, back to back, then checks every output
against NCCL's gather and an fp32 matmul + all-reduce.

    PYTHONPATH=.:benchmarks/experiments env -u CUDA_DEVICE_MAX_CONNECTIONS torchrun --nproc-per-node 4 \
        benchmarks/experiments/gather_beside_rs_sms.py --gather nccl --reserved-sms 0 --json x.json
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from rs_beside_gather import Provider, cases as make_cases, no_pingpong  # this script's folder

from megatron_flux.backends.flux import FluxBackend
from megatron_flux.options import get_options


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--gather", choices=("nccl", "copy_engine"), default="nccl")
    p.add_argument("--reserved-sms", type=int, default=0)
    p.add_argument("--triton-rs", action="store_true",
                   help="the Triton GEMM+RS, not the Gluon one (rs_beside_gather.no_pingpong)")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--shape", default="1024,2048,3072", help="m_local,k,n")
    p.add_argument("--max-spins", type=int, default=1 << 22)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    dev = torch.device("cuda", torch.cuda.current_device())
    m_local, k, n = (int(v) for v in args.shape.split(","))
    provider = Provider(no_pingpong if args.triton_rs else None)
    # several hardware queues allowed: the case this looks at (the backend refuses it otherwise)
    opts = get_options().replace(max_spins=args.max_spins, reserved_sms=args.reserved_sms,
                                 column_regather=args.gather, allow_several_queues=True)
    flux = FluxBackend(config_provider=provider, options=opts)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    cases = make_cases(rank, world, [(m_local, k, n)], 4, gen, False)  # cycled over the rounds
    cfg = provider("rs", world * m_local, n, k)
    # one warm-up call of each op (compiles), then the rounds
    flux.matmul_reduce_scatter(cases[0][2], cases[0][3], dist.group.WORLD)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    status, worst, results = "ok", 0.0, []
    try:
        for i in range(args.rounds):
            x, _, a, b, _ = cases[i % 4]
            pending = flux.all_gather_start(x, dist.group.WORLD)
            rs_out = flux.matmul_reduce_scatter(a, b, dist.group.WORLD)
            results.append((pending.wait().clone(), rs_out))
        torch.cuda.synchronize()
        flux.check_errors()
        for i, (g, rs_out) in enumerate(results):
            _, g_ref, _, _, ref = cases[i % 4]
            if not torch.equal(g, g_ref):
                status = f"gather differs in round {i}"
            worst = max(worst, float((rs_out.float() - ref).norm() / ref.norm()))
        if worst > 2e-2:
            status = f"GEMM+RS rel err {worst:.3g}"
    except Exception as exc:  # a timeout is what we look for
        torch.cuda.synchronize()
        status = f"{type(exc).__name__}: {exc}"[:600]
    rec = {"rank": rank, "status": status, "seconds": round(time.perf_counter() - t0, 2),
           "worst_rel_err": worst}
    gathered = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        summary = {"command": "torchrun benchmarks/experiments/gather_beside_rs_sms.py "
                              + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                         if k != "json"),
                   "cuda_device_max_connections": conn, "world": world,
                   "gpu": torch.cuda.get_device_name(), "num_sms":
                   torch.cuda.get_device_properties(dev).multi_processor_count,
                   "torch": torch.__version__, "rs_config": {
                       f: getattr(cfg, f) for f in ("block_m", "block_n", "num_warps",
                                                    "rs_warp_specialized", "rs_copy_engine")},
                   "records": gathered}
        with open(args.json, "w") as f:
            json.dump(summary, f)
        print(f"gather={args.gather} reserved={args.reserved_sms} triton_rs={args.triton_rs} "
              f"conn={conn!r}: " + "; ".join(f"r{r['rank']} {r['status'][:160]}" for r in gathered),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
