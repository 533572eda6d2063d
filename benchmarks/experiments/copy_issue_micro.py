"""Host issue time of one device-to-device copy, the ways the copy-engine collectives can make it.

Session 30's sections (``host_sections.py``) put a fused column layer call's ``Tensor.copy_``
at about 27 µs of host time each on the 2xH100 box, against 9 µs for a same-device
``copy_`` of 2 MB in the same process. The fused copies write into a symmetric workspace's peer
view. This times, alternating in one process (order shuffled per trial, seeded; loops of
``--iters`` back-to-back calls, no sync inside), per call:

* ``copy_ local``: ``Tensor.copy_`` between two ordinary tensors of this GPU;
* ``copy_ peer``: ``Tensor.copy_`` into the peer's symmetric buffer (its view on this GPU);
* ``driver local`` / ``driver peer``: the same through :func:`megatron_flux.comm.driver_copy.copy_on_stream`
  (``cuMemcpyDtoDAsync``);
* ``current_stream``: ``torch.cuda.current_stream()``, which the fused path calls per op;
* ``write_signal``: one ``stream_write_value32`` into the peer's signal word.

Each rank first checks that a driver copy into its peer's buffer arrives (after a barrier the
peer compares its buffer with what was sent), so the timed path is also a correct one.

``torchrun --nproc-per-node 2 benchmarks/experiments/copy_issue_micro.py --out copy.json``
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from megatron_flux.comm.driver_copy import copy_on_stream
from megatron_flux.comm.signals import write_signal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from host_overhead import run_record  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=2.0, help="bytes per copy, MiB")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    n = int(args.mib * (1 << 20)) // 2
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
    flags = symm_mem.empty(16, dtype=torch.uint32, device=dev)
    flags.zero_()
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    fhandle = symm_mem.rendezvous(flags, dist.group.WORLD.group_name)
    peer = (rank + 1) % world
    peer_view = handle.get_buffer(peer, (n,), torch.bfloat16)
    peer_flags = fhandle.get_buffer(peer, (16,), torch.uint32)
    src = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(rank))
    local = torch.empty_like(src)
    stream = torch.cuda.current_stream()

    # correctness: the driver's copy lands in the peer's buffer
    buf.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    copy_on_stream(peer_view, src, stream, True)
    torch.cuda.synchronize()
    dist.barrier()
    sender = (rank - 1) % world
    expect = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(sender))
    ok = bool(torch.equal(buf, expect))
    dist.barrier()

    cases = {
        "copy_ local": lambda: local.copy_(src),
        "copy_ peer": lambda: peer_view.copy_(src),
        "driver local": lambda: copy_on_stream(local, src, stream, True),
        "driver peer": lambda: copy_on_stream(peer_view, src, stream, True),
        "current_stream": lambda: torch.cuda.current_stream(),
        "write_signal": lambda: write_signal(peer_flags, rank, 1),
    }
    for fn in cases.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    rng = random.Random(args.seed)
    samples = {k: [] for k in cases}
    for _ in range(args.trials):
        order = list(cases)
        rng.shuffle(order)
        for k in order:
            fn = cases[k]
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(args.iters):
                fn()
            samples[k].append((time.perf_counter_ns() - t0) / args.iters / 1e3)
            torch.cuda.synchronize()  # the queue drains between loops, never inside one
    rows = []
    for k, xs in samples.items():
        q = statistics.quantiles(xs, n=4)
        rows.append({"case": k, "host_us": statistics.median(xs), "host_q1_us": q[0],
                     "host_q3_us": q[2], "host_trials_us": xs, "rank": rank})
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rows": rows, "driver_copy_arrived": ok})
    if rank == 0:
        for r in range(world):
            print(f"rank {r}: driver copy into the peer arrived: {gathered[r]['driver_copy_arrived']}")
            for row in gathered[r]["rows"]:
                print(f"rank {r} {row['case']:15s} {row['host_us']:7.2f} us "
                      f"(IQR {row['host_q1_us']:.2f}-{row['host_q3_us']:.2f})")
        record = run_record("benchmarks/experiments/copy_issue_micro.py", world, __doc__,
                            [row for g in gathered for row in g["rows"]], ("CUDA_DEVICE_MAX_CONNECTIONS",))
        record["driver_copy_arrived"] = [g["driver_copy_arrived"] for g in gathered]
        record["bytes_per_copy"] = 2 * n
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
