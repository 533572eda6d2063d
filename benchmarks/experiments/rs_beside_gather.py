"""Experiment: which fused GEMM+RS calls time out when queued beside the copy-engine all-gather
(the GPU test ``_check_gather_beside_rs``'s order: ``all_gather_start``, ``matmul_reduce_scatter``,
``wait``, rounds back to back with no collective between them).

Each variant runs on a fresh ``FluxBackend`` (fresh workspaces and epochs) with a short
``max_spins``, so a timeout costs seconds; the result says, per variant, whether every rank's
outputs matched NCCL + fp32 matmul, or which error the backend raised, and the configs it ran.

    torchrun --nproc-per-node 4 benchmarks/experiments/rs_beside_gather.py --json out.json
"""

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

from megatron_flux.backends.flux import FluxBackend
from megatron_flux.options import get_options
from megatron_flux.tuning.provider import TableConfigProvider

# (m_local, k, n), the GPU test's shapes
SHAPES = [(256, 512, 1024), (100, 264, 520), (1, 64, 64), (777, 1024, 392), (1024, 2048, 3072)]


class Provider:
    """The tables' config, changed by ``change(cfg) -> cfg``."""

    accepts_context = True

    def __init__(self, change=None):
        self._table = TableConfigProvider()
        self._change = change or (lambda cfg: cfg)
        self.seen = {}

    def __call__(self, op, m_total, n, k, **ctx):
        cfg = self._change(self._table(op, m_total, n, k, **ctx))
        self.seen[f"{op} m={m_total} n={n} k={k}"] = {
            f: getattr(cfg, f) for f in ("block_m", "block_n", "num_warps", "rs_warp_specialized",
                                         "ag_warp_specialized", "rs_copy_engine", "rs_merge_rows")}
        return cfg


def no_pingpong(cfg):
    if cfg.rs_warp_specialized and not cfg.rs_merge_rows:
        return dataclasses.replace(cfg, rs_warp_specialized=False)
    return cfg


def cases(rank, world, shapes, rounds, gen, test_inputs):
    """``test_inputs``: the gathered input as the GPU test makes it (3-D in odd rounds, fp32 in
    round 3), else 2-D bf16 always."""
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for i in range(rounds):
        m_local, k, n = shapes[i % len(shapes)]
        dtype = torch.float32 if (test_inputs and i == 3) else torch.bfloat16
        shape = (m_local, 2, k // 2) if (test_inputs and i % 2) else (m_local, k)
        x = torch.randn(*shape, generator=gen, device=dev).to(dtype)
        g_ref = torch.empty((world * m_local, *shape[1:]), dtype=x.dtype, device=dev)
        dist.all_gather_into_tensor(g_ref, x)
        a = torch.randn(world * m_local, k, generator=gen, device=dev).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen, device=dev).to(torch.bfloat16)
        full = a.float() @ w.t().float()
        dist.all_reduce(full)
        out.append((x, g_ref, a, w.t(), full[rank * m_local:(rank + 1) * m_local]))
    return out


def run_variant(name, flux, provider, gather, shapes, rounds, rank, world, gen, test_inputs):
    flux.set_options(flux.options.replace(
        column_regather="copy_engine" if gather == "copy_engine" else "nccl"))
    cs = cases(rank, world, shapes, rounds, gen, test_inputs)
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = []
    host = []  # per round: wall-clock seconds (time.time) after the gather start, the GEMM+RS
    #            call and the wait: where one rank's host fell behind the others
    status = "ok"
    try:
        for x, _, a, b, _ in cs:
            pending = flux.all_gather_start(x, dist.group.WORLD) if gather != "none" else None
            t_g = time.time()
            rs_out = flux.matmul_reduce_scatter(a, b, dist.group.WORLD)
            t_rs = time.time()
            g = pending.wait().clone() if pending is not None else None
            host.append((t_g, t_rs, time.time()))
            results.append((g, rs_out))
        torch.cuda.synchronize()
        flux.check_errors()
        worst = 0.0
        for (g, rs_out), (_, g_ref, _, _, ref) in zip(results, cs):
            if g is not None and not torch.equal(g, g_ref):
                status = "gather differs"
            err = float((rs_out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            worst = max(worst, err)
        if worst > 2e-2:
            status = f"GEMM+RS rel err {worst:.3g}"
    except Exception as exc:  # the timeout is what we are looking for
        torch.cuda.synchronize()
        status = f"{type(exc).__name__}: {exc}"[:300]
    dt = time.perf_counter() - t0
    return {"variant": name, "gather": gather, "test_inputs": test_inputs, "rank": rank,
            "status": status, "host_times": host,
            "seconds": round(dt, 2), "shapes": [list(s) for s in shapes], "rounds": rounds,
            "configs": getattr(provider, "seen", {})}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--max-spins", type=int, default=1 << 22)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    opts = get_options().replace(max_spins=args.max_spins)
    # (name, provider change, gather, shapes, test inputs, same backend as the previous variant)
    variants = [
        ("table", None, "copy_engine", SHAPES, False, False),
        ("table, again", None, "copy_engine", SHAPES, False, False),
        ("table, test inputs", None, "copy_engine", SHAPES, True, False),
        ("no ping-pong, test inputs", no_pingpong, "copy_engine", SHAPES, True, False),
        ("table, RS alone", None, "none", SHAPES, True, False),
        ("  then gather beside, test inputs", None, "copy_engine", SHAPES, True, True),
        ("table, NCCL gather, test inputs", None, "nccl", SHAPES, True, False),
    ] + [(f"table, shape {s}, test inputs", None, "copy_engine", [s], True, False)
         for s in SHAPES]
    records = []
    flux = provider = None
    for name, change, gather, shapes, test_inputs, same in variants:
        if not same:
            provider = Provider(change)
            flux = FluxBackend(config_provider=provider, options=opts)
        rec = run_variant(name, flux, provider, gather, shapes, args.rounds, rank, world, gen,
                          test_inputs)
        records.append(rec)
        if rank == 0:
            print(f"{name:36s} gather={gather:12s} {rec['seconds']:7.2f}s  {rec['status']}",
                  flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"command": "torchrun benchmarks/experiments/rs_beside_gather.py",
                       "world": world, "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "records": gathered}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
