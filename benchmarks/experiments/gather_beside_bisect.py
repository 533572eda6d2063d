"""Experiment: which earlier checks of ``tests/gpu/test_flux_gpu.py`` make its
``_check_gather_beside_rs`` time out at TP 4. Each variant runs a subset of the test's checks on
a fresh ``FluxBackend`` (options from the environment, as the test's), then the gather check;
the record says which variants passed.

    MEGATRON_FLUX_MAX_SPINS=16777216 torchrun --nproc-per-node 4 \
        benchmarks/experiments/gather_beside_bisect.py --json out.json
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from gpu import test_flux_gpu as t  # noqa: E402
from rs_beside_gather import Provider, no_pingpong  # noqa: E402  (this script's folder)

from megatron_flux.backends.flux import FluxBackend  # noqa: E402


def dtypes_and_layouts(flux, group, rank, world, gen, dtypes=(torch.bfloat16, torch.float16)):
    for dtype in dtypes:
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
        for layout in ("nk", "kn"):
            for (m_local, k, n) in t.SHAPES:
                t._check_ag(flux, group, rank, world, m_local, k, n, dtype, layout, tol, gen)
                t._check_rs(flux, group, rank, world, m_local, k, n, dtype, layout, tol, gen,
                            with_bias=(m_local % 2 == 0))


def rs_only(flux, group, rank, world, gen):
    for dtype in (torch.bfloat16, torch.float16):
        for (m_local, k, n) in t.SHAPES:
            t._check_rs(flux, group, rank, world, m_local, k, n, dtype, "nk", 2e-2, gen, False)


def ag_only(flux, group, rank, world, gen):
    for (m_local, k, n) in t.SHAPES:
        t._check_ag(flux, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen)


def changing_shapes(flux, group, rank, world, gen):
    for i in range(60):
        m_local, k, n = t.SHAPES[i % len(t.SHAPES)]
        t._check_ag(flux, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen)
        t._check_rs(flux, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen, False)


def bound_backends(flux, group, rank, world, gen):
    """The test's bound-launch stage: three other backends, each its own workspaces."""
    for provider in t.BOUND_LAUNCH_PROVIDERS:
        t._check_bound_launches(FluxBackend(config_provider=provider), group, rank, world, gen)


def alternating_backends(flux, group, rank, world, gen):
    """The test's back-to-back stage on four other backends."""
    for provider in t.ALTERNATING_PROVIDERS:
        other = FluxBackend(config_provider=provider)
        t._check_back_to_back(other, group, rank, world, gen)
        other.check_errors()


VARIANTS = {
    "after bound launches (other backends)": [bound_backends],
    "after back-to-back (other backends)": [alternating_backends],
    "gather check alone": [],
    "after dtypes and layouts": [dtypes_and_layouts],
    "after GEMM+RS only (both dtypes)": [rs_only],
    "after AG+GEMM only": [ag_only],
    "after 60 changing shapes": [changing_shapes],
    "gather check twice": ["gather"],
    "after the test's whole sequence": [dtypes_and_layouts, bound_backends, changing_shapes,
                                        alternating_backends],
    "after the test's whole sequence, no ping-pong": [dtypes_and_layouts, bound_backends,
                                                      changing_shapes, alternating_backends],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1000 + rank)
    records = []
    for name in args.variants:
        flux = FluxBackend(config_provider=Provider(no_pingpong) if "no ping-pong" in name else None)
        t0 = time.perf_counter()
        status, where = "ok", "before"
        try:
            for step in VARIANTS[name]:
                if step == "gather":
                    t._check_gather_beside_rs(flux, group, rank, world, gen)
                else:
                    step(flux, group, rank, world, gen)
            flux.check_errors()
            where = "gather check"
            t._check_gather_beside_rs(flux, group, rank, world, gen)
        except Exception as exc:
            torch.cuda.synchronize()
            status = f"{where}: {type(exc).__name__}: {exc}"[:400]
        rec = {"variant": name, "rank": rank, "status": status,
               "seconds": round(time.perf_counter() - t0, 2)}
        records.append(rec)
        dist.barrier()
        if rank == 0:
            print(f"{name:36s} {rec['seconds']:7.2f}s  {status[:200]}", flush=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "world": world,
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "max_spins_env": os.environ.get("MEGATRON_FLUX_MAX_SPINS"),
                       "records": gathered}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
