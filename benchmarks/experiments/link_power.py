"""Experiment: does NVLink traffic beside a power-capped GEMM slow it, and by the bytes or at all?

On 2xH200, ``phase_trace_tp.py --comm off`` vs ``on`` (both GPUs busy) found the
GEMM+RS kernel 2-14 % slower with communication on, including in phases where this rank moves
no data, and nvidia-smi showed both GPUs at the 700 W cap with the SM clock 2-5 % lower in the
runs with communication. This separates the bytes from the link being busy at all, with
cuBLAS only (no fused kernel): every rank runs ``a @ w.T`` split in ``--pieces`` row blocks,
back to back on the current stream; after each piece a side stream (waiting for that piece)
copies into the peer's symmetric buffer by the copy engine:

* ``none``: no copy;
* ``touch``: ``--touch-kib`` KiB per piece (the link wakes, next to no bytes);
* ``bulk``: the shape's ReduceScatter volume (``(W-1)/W`` of the output, bf16) spread over
  the pieces, as the fused GEMM+RS moves it;
* ``burst``: the same volume in one copy after the first piece (the link busy for a short
  stretch of each GEMM, as a copy-engine AllGather's is);
* ``local-touch``, ``local-bulk``: as ``touch`` and ``bulk``, into a buffer on this GPU (the
  same streams, events and copy engine; no NVLink);
* ``serial-touch``: ``--touch-kib`` KiB to the peer once per GEMM, after it on the same stream
  (the link used between GEMMs, not beside them, as NCCL-then-cuBLAS uses it).

Modes rotate in that order for ``--rounds`` rounds; each block is a number of GEMMs timed by
CUDA events on the main stream (whose end waits for the side stream), about ``--block-ms``
long, both ranks starting each block together. Reports per mode the median ms per GEMM and its
ratio to ``none``.

    torchrun --nproc-per-node 2 benchmarks/experiments/link_power.py --json link-power.json
"""

import argparse
import statistics

import torch
import torch.distributed as dist

from common import next_rank_buffer, write_record

SHAPES = {"llama3-70b-rs-8192": (8192, 8192, 14336), "llama3-8b-rs-4096": (4096, 4096, 7168)}
MODES = ("none", "touch", "bulk", "burst", "local-touch", "local-bulk", "serial-touch")


def copy_elems(mode, piece, pieces, touch_elems, bulk_elems):
    """Elements the side stream copies after piece ``piece`` of a GEMM in ``mode``."""
    if mode == "burst":
        return bulk_elems * pieces if piece == 0 else 0
    if mode == "serial-touch":
        return 0  # on the main stream after the GEMM (run_block)
    return {"none": 0, "touch": touch_elems, "bulk": bulk_elems}[mode.replace("local-", "")]


def run_block(mode, a_pieces, w, peer, src, touch_elems, bulk_elems, iters, side, local=None):
    if mode.startswith("local-"):
        peer = local
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for i, a in enumerate(a_pieces):
            torch.matmul(a, w.t())
            n_copy = copy_elems(mode, i, len(a_pieces), touch_elems, bulk_elems)
            if n_copy:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    peer[:n_copy].copy_(src[:n_copy], non_blocking=True)
        if mode == "serial-touch":
            peer[:touch_elems].copy_(src[:touch_elems], non_blocking=True)
    main.wait_stream(side)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--pieces", type=int, default=8)
    p.add_argument("--touch-kib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block-ms", type=float, default=500.0)
    p.add_argument("--json")
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    rows = []
    for name in args.shapes:
        m, n, k = SHAPES[name]
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a_pieces = list(a.chunk(args.pieces))
        bulk_elems = (m * n * (world - 1) // world) // args.pieces
        touch_elems = args.touch_kib * 1024 // 2
        total = bulk_elems * args.pieces
        buf, handle, peer = next_rank_buffer(total, dist.group.WORLD, dev)
        src = torch.randn(total, device=dev, dtype=torch.bfloat16)
        local = torch.empty(total, device=dev, dtype=torch.bfloat16)
        for mode in MODES:  # warm-up, untimed
            run_block(mode, a_pieces, w, peer, src, touch_elems, bulk_elems, 3, side, local)
        # blocks of about --block-ms (the clock follows power over milliseconds), the same
        # count on every rank
        est = torch.tensor(run_block("none", a_pieces, w, peer, src, 0, 0, 5, side), device=dev)
        dist.all_reduce(est, op=dist.ReduceOp.MAX)
        iters = max(5, round(args.block_ms / est.item()))
        times = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                dist.barrier()
                torch.cuda.synchronize()
                times[mode].append(run_block(mode, a_pieces, w, peer, src, touch_elems,
                                             bulk_elems, iters, side, local))
        base = statistics.median(times["none"])
        line = [f"{name} rank {rank}: none {base:.4f} ms"]
        for mode in MODES:
            med = statistics.median(times[mode])
            rows.append({"shape": name, "m": m, "n": n, "k": k, "rank": rank, "mode": mode,
                         "pieces": args.pieces, "gemms_per_block": iters,
                         "copy_bytes_per_gemm": 2 * (touch_elems if mode == "serial-touch" else sum(
                             copy_elems(mode, i, args.pieces, touch_elems, bulk_elems)
                             for i in range(args.pieces))),
                         "median_ms": med, "times_ms": times[mode]})
            if mode != "none":
                line.append(f"{mode} x{med / base:.4f} ({min(times[mode]) / base:.3f}.."
                            f"{max(times[mode]) / base:.3f})")
        print("  ".join(line), flush=True)
        torch.cuda.synchronize()
        dist.barrier()  # the peer's last copies into this buffer are done
        del handle, buf, peer
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        write_record(args.json, [r for part in gathered for r in part], tp=world,
                     what="cuBLAS GEMM per mode of side-stream NVLink copies (link_power.py)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
