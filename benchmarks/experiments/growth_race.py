"""Does a workspace growth survive a rank whose GPU is still busy when it allocates?

Rank ``--late`` queues ``--sleep-cycles`` of GPU sleep on its current stream, then every rank
grows one symmetric workspace (``SymmetricWorkspace.reserve``) and waits for its device. The
growth's barrier is bounded (``--barrier-timeout-ms``): where a rank's barrier never completes,
the device traps and that rank reports the CUDA error. ``--no-drain`` removes the device drain
that the growth does before the rendezvous (``megatron_flux.comm.workspace``), which shows why
it is there: the late rank's allocator memset then runs after the peers' barrier signals have
landed in its pad, and erases them.

One growth per process (after a trap the peers would wait for the late rank in the next
rendezvous); run each mode under ``timeout``::

    torchrun --nproc-per-node 4 benchmarks/experiments/growth_race.py --out race-drain.json
    torchrun --nproc-per-node 4 benchmarks/experiments/growth_race.py --no-drain --out race-nodrain.json

Each rank appends one JSON line ``{"rank", "late", "drain", "ok", "seconds", "error"}`` to
``--out`` and leaves with ``os._exit`` (a trapped context cannot tear down NCCL).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--late", type=int, default=0, help="the rank whose GPU is busy at the growth")
    p.add_argument("--sleep-cycles", type=int, default=12_000_000_000,
                   help="its GPU sleep (clock cycles; the default is about 6 s, longer than a rendezvous)")
    p.add_argument("--barrier-timeout-ms", type=int, default=20_000)
    p.add_argument("--no-drain", action="store_true", help="grow without draining the device first")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    from megatron_flux.comm import workspace

    workspace.BARRIER_TIMEOUT_MS = args.barrier_timeout_ms
    if args.no_drain:
        workspace._drain_before_sharing = lambda buf: None
    ws = workspace.SymmetricWorkspace("ag", dist.group.WORLD, torch.device("cuda", rank), torch.bfloat16)
    dist.barrier()
    torch.cuda.synchronize()
    if rank == args.late:
        torch.cuda._sleep(args.sleep_cycles)
    t0 = time.perf_counter()
    record = {"rank": rank, "world": world, "late": args.late, "drain": not args.no_drain,
              "ok": False, "seconds": None, "error": None, "gpu": torch.cuda.get_device_name(rank),
              "torch": torch.__version__}
    try:
        ws.reserve(1 << 20, 64)
        torch.cuda.synchronize()
        record["ok"] = True
    except Exception as exc:  # the trapped barrier surfaces here as a CUDA error
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    record["seconds"] = round(time.perf_counter() - t0, 3)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    os._exit(0 if record["ok"] else 1)


if __name__ == "__main__":
    main()
