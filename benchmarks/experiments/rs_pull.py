"""Experiment: GEMM then ReduceScatter by pulling (``rs_pull_kernel`` below: cuBLAS writes the
partial into this rank's symmetric slot, one kernel sums this rank's rows from every rank's
slot) against cuBLAS + NCCL's reduce-scatter and the fused GEMM+RS with the table's
config, on the GEMM+RS shapes where the fused kernel loses at m = 1024 (TP 4).

Per trial every method runs ``--iters`` calls back to back, timed by CUDA events, methods in a
shuffled order, every rank in step (a barrier between blocks). Each method's output is checked
against fp32 math (rel. error < 2e-2).

    torchrun --nproc-per-node 4 benchmarks/experiments/rs_pull.py --json out.json
"""

import argparse
import json
import os
import random
import statistics
import sys

import torch
import torch.distributed as dist

import triton
import triton.language as tl

from megatron_flux.backends.flux import FluxBackend
from megatron_flux.comm.workspace import SymmetricWorkspace
from megatron_flux.kernels.launch import KernelLauncher
from megatron_flux.kernels.signals import OP_GEMM_RS, set_signal, wait_signal


# ReduceScatter by pulling: every rank's full partial ``[m, n]`` already sits in its own
# symmetric slot (cuBLAS wrote it there); each rank reads its ``m_local`` rows from every rank's
# slot over NVLink, sums them and writes its output. No overlap with the GEMM: what it saves is
# the collective's own time at the sizes where NCCL's ring is far from the link's bandwidth.
#
# Tile and signal schedule (rank ``r`` of ``W``, call epoch ``e``, one ``[BLOCK_M, BLOCK_N]`` tile
# of the ``[m_local, n]`` output per program, grid = the tiles):
#
# * program 0 first publishes ``flags[p][r] = e`` for every peer ``p`` (release, system scope):
#   this rank's partial, written by the kernels before this one on its stream, is readable;
# * every program waits (acquire, system scope, bounded: ``signals.wait_signal``) until
#   ``flags[r][src] >= e`` for every peer ``src``;
# * it then loads rows ``r * m_local + i`` of every rank's slot, sums them in rank order
#   ``0..W-1`` in fp32 (bias once), rounds and stores its tile. Fixed order, no atomics on data:
#   the result is bitwise the same on every run and on every rank's view of it.
#
# A slot of parity ``e & 1`` is written again two calls later, after its owner passed the next
# call's wait, which needs every peer's signal of that call, raised only after the peer's pull of
# this call finished (stream order): no peer still reads it.
#
# ``SIGNAL``/``WAIT`` split the halves for simulated ranks under the interpreter, where programs
# run one after another.


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def rs_pull_kernel(data_ptrs, flag_ptrs, bias_ptr, out_ptr, err_ptr, m_local, N, rank, epoch,
                   max_spins, WORLD: tl.constexpr, HAS_BIAS: tl.constexpr, SIGNAL: tl.constexpr,
                   WAIT: tl.constexpr, OP_CODE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    if SIGNAL:
        if pid == 0:
            for p in range(0, WORLD):
                if p != rank:
                    peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
                    set_signal(peer + rank, epoch)
    if WAIT:
        mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        for p in range(0, WORLD):
            if p != rank:
                wait_signal(mine + p, epoch, max_spins, err_ptr, OP_CODE, rank, p)
        tl.debug_barrier()
    num_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < m_local) & (cols[None, :] < N)
    offs = (rank * m_local + rows).to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for src in tl.static_range(0, WORLD):
        base = tl.load(data_ptrs + src).to(tl.pointer_type(out_ptr.dtype.element_ty))
        acc += tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_rs_pull(data_ptrs, flag_ptrs, out, bias, err, *, rank: int, world: int, epoch: int,
                   max_spins: int, block_m: int = 16, block_n: int = 256, num_warps: int = 4,
                   signal: bool = True, wait: bool = True, direct: bool = True):
    """Queue the pull on the current stream, after the kernels that wrote this rank's partial
    into its slot. ``data_ptrs``/``flag_ptrs``: int64 tables of every rank's slot ``[m, n]`` and
    signal region of this call's parity; ``out`` ``[m_local, n]`` (contiguous); ``err`` the
    op's int32[4] error word."""
    m_local, n = out.shape
    grid = -(-m_local // block_m) * -(-n // block_n)
    _LAUNCH(grid, (data_ptrs, flag_ptrs, bias if bias is not None else out, out, err, m_local, n,
                   rank, epoch, max_spins),
            dict(WORLD=world, HAS_BIAS=bias is not None, SIGNAL=signal, WAIT=wait,
                 OP_CODE=OP_GEMM_RS, BLOCK_M=block_m, BLOCK_N=block_n),
            num_warps=num_warps, num_stages=1, direct=direct)


_LAUNCH = KernelLauncher(rs_pull_kernel)


# per-rank (m, n, k) of GEMM+RS: m = every rank's rows, k = this rank's shard of K
SHAPES = [(1024, 5120, 6848), (1024, 4608, 18432), (1024, 5120, 13696), (1024, 8192, 7168),
          (2048, 5120, 6848), (4096, 4096, 3584), (512, 5120, 6848), (256, 4096, 3584)]
PULL_TILES = [(16, 256, 4), (32, 256, 8)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    flux = FluxBackend()
    ws = SymmetricWorkspace("rs-pull", group, dev, torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device=dev)
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    rows = []
    for (m, n, k) in SHAPES:
        m_local = m // world
        a = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, generator=gen, device=dev, dtype=torch.bfloat16) / k ** 0.5
        full = a.float() @ b.float()
        dist.all_reduce(full)
        ref = full[rank * m_local:(rank + 1) * m_local]
        ws.reserve(m * n, world)
        partial = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m_local, n, device=dev, dtype=torch.bfloat16)

        def cublas():
            torch.matmul(a, b, out=partial)
            return partial

        def nccl():
            torch.matmul(a, b, out=partial)
            dist.reduce_scatter_tensor(out, partial)
            return out

        def nccl_comm():
            dist.reduce_scatter_tensor(out, partial)
            return out

        def pull(tile):
            bm, bn, warps = tile

            def run():
                epoch = ws.next_epoch()
                parity = epoch & 1
                slot = ws.data(rank, parity, m * n).view(m, n)
                torch.matmul(a, b, out=slot)
                launch_rs_pull(ws.data_ptrs(parity), ws.flag_ptrs(parity), out, None, err,
                               rank=rank, world=world, epoch=epoch, max_spins=1 << 26,
                               block_m=bm, block_n=bn, num_warps=warps)
                return out
            return run

        def fused():
            return flux.matmul_reduce_scatter(a, b, group)

        methods = {"cublas": cublas, "nccl": nccl, "nccl_comm": nccl_comm, "flux": fused}
        for tile in PULL_TILES:
            methods[f"pull_{tile[0]}x{tile[1]}w{tile[2]}"] = pull(tile)
        checks = {}
        for name, fn in methods.items():
            if name in ("cublas", "nccl_comm"):
                continue
            got = fn()
            torch.cuda.synchronize()
            checks[name] = float((got.float() - ref).norm() / ref.norm())
        times = {name: [] for name in methods}
        order = list(methods)
        rnd = random.Random(11)
        for _ in range(2):  # warm-up blocks
            for fn in methods.values():
                fn()
        for _ in range(args.trials):
            rnd.shuffle(order)
            for name in order:
                dist.barrier()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    methods[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / args.iters)
        if err.any():
            raise RuntimeError(f"rank {rank}: a pull wait timed out: {err.tolist()}")
        med = {name: statistics.median(v) for name, v in times.items()}
        row = {"m": m, "n": n, "k": k, "median_ms": med, "trials_ms": times, "rel_err": checks,
               "flux_config": flux.config("rs", m, n, k, dtype=torch.bfloat16, tp=world,
                                          device=dev).to_dict()}
        rows.append(row)
        if rank == 0:
            best = min((v, name) for name, v in med.items() if name.startswith("pull"))
            print(f"m={m:5d} n={n:5d} k={k:5d}  cublas {med['cublas']*1e3:7.1f}  nccl "
                  f"{med['nccl']*1e3:7.1f} (comm {med['nccl_comm']*1e3:6.1f})  flux "
                  f"{med['flux']*1e3:7.1f}  {best[1]} {best[0]*1e3:7.1f}  "
                  f"x nccl: flux {med['nccl']/med['flux']:.3f} pull {med['nccl']/best[0]:.3f}  "
                  f"err {max(checks.values()):.1e}", flush=True)
    all_rows = [None] * world
    dist.all_gather_object(all_rows, rows)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"command": "torchrun --nproc-per-node %d benchmarks/experiments/rs_pull.py %s"
                       % (world, " ".join(sys.argv[1:])), "gpu": torch.cuda.get_device_name(),
                       "world": world, "torch": torch.__version__,
                       "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                       "ranks": all_rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
