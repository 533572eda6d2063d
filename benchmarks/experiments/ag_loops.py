"""Experiment: which part of the AG+GEMM kernel's two-loop structure costs time (comm off).

A stripped copy of ``ag_gemm_kernel``'s data-parallel part (no stream-K, no ragged segments,
B as [N, K]) with switches, timed beside cuBLAS and the plain yardstick in one interleaved
loop on one GPU. ``a`` is the whole gathered A and every signal is pre-set, so every variant
computes ``a @ w.T``:

* ``two``: step-0 loop over the local shard's descriptor, then per step a wait and a loop over
  the workspace's descriptor (the kernel's structure);
* ``two-nowait``: the same without the waits;
* ``two-onedesc``: both loops read one descriptor over all of ``a``, no waits;
* ``one``: one loop over every tile, one descriptor (what ``world == 1`` compiles to);
* ``two-static``: ``two`` with the step loop unrolled at compile time (every loop top-level);
* ``one-inwait``: ``one`` with a wait inside the loop whenever the step changes;
* ``two-waitall``: the local loop, then waits for every peer, then one loop over all peer tiles;
* (tried, removed: ``one-inwait`` whose tiles branch between a K loop on the shard's
  descriptor and one on the workspace's needs two K loops' shared memory and does not fit;
  ``raw/s9`` has no run of it)
* ``one-segdesc``: ``one-inwait`` with A's descriptor made per tile on its segment's rows (the
  shard or the workspace segment), so no copy of the shard into the workspace is needed.

    python benchmarks/experiments/ag_loops.py --shapes 4096x14336x4096 ... [--prev OLD.py] [--json PATH]
"""

import argparse
import dataclasses
import json

import torch
import triton
import triton.language as tl

from common import add_timing_args, load_module, parse_shape, problem, time_and_check, write_record
from megatron_flux.bench.kernel_vs_cublas import ag_on_one_gpu
from megatron_flux.bench.plain_gemm import launch_plain_gemm
from megatron_flux.kernels.ag_gemm import _ag_tile, _epilogue
from megatron_flux.kernels.mainloop import tile_mainloop
from megatron_flux.kernels.config import GemmConfig
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.signals import wait_signal
from megatron_flux.kernels.tile_order import first_tile_at_or_after, grouped_tile


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def ag_loops_kernel(x_ptr, ag_ptr, b_ptr, c_ptr, flags_ptr, err_ptr, m_local, N, K, rank, world,
                    epoch, max_spins, VARIANT: tl.constexpr, EPI_SPLIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                    WORLD: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(x_ptr, [m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
    ag_desc = tl.make_tensor_descriptor(ag_ptr, [world * m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, [world * m_local, N], [N, 1],
                                       [BLOCK_M, BLOCK_N // EPI_SPLIT])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tps = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    if VARIANT == 3:  # one loop over everything, one descriptor
        for t in tl.range(pid, world * tps, NUM_SMS, flatten=FLATTEN):
            _ws_tile(ag_desc, b_desc, c_desc, t, t // tps, tps, m_local, k_tiles, num_pid_m,
                     num_pid_n, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    elif VARIANT == 5 or VARIANT == 8:  # one loop, a wait inside it when the step changes
        waited = 0
        for t in tl.range(pid, world * tps, NUM_SMS, flatten=FLATTEN):
            step = t // tps
            if step != waited:
                wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
                waited = step
            if VARIANT == 5:  # one descriptor
                _ws_tile(ag_desc, b_desc, c_desc, t, step, tps, m_local, k_tiles, num_pid_m,
                         num_pid_n, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
            else:  # A's descriptor made per tile on its segment (the shard or the workspace)
                pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
                off_m = pid_m * BLOCK_M
                seg_ptr = tl.where(step == 0, x_ptr, ag_ptr + (step * m_local).to(tl.int64) * K)
                seg_desc = tl.make_tensor_descriptor(seg_ptr, [m_local, K], [K, 1],
                                                     [BLOCK_M, BLOCK_K])
                acc = tile_mainloop(seg_desc, b_desc, 0, off_m, pid_n * BLOCK_N, k_tiles, False,
                                    False, BLOCK_M, BLOCK_N, BLOCK_K)
                _epilogue(c_desc, step, step * m_local + off_m, pid_n * BLOCK_N, acc, False,
                          EPI_SPLIT, BLOCK_M, BLOCK_N)
    else:  # two or more loops: the local segment's, then the peers'
        local_desc = ag_desc if VARIANT == 2 else x_desc
        for t in tl.range(pid, tps, NUM_SMS, flatten=FLATTEN):
            _ws_tile(local_desc, b_desc, c_desc, t, 0, tps, m_local, k_tiles, num_pid_m,
                     num_pid_n, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        if VARIANT == 4:  # two-static: the step loop unrolled (WORLD constexpr), all top-level
            for step in tl.static_range(1, WORLD):
                wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
                for t in tl.range(first_tile_at_or_after(pid, step * tps, NUM_SMS),
                                  (step + 1) * tps, NUM_SMS, flatten=FLATTEN):
                    _ws_tile(ag_desc, b_desc, c_desc, t, step, tps, m_local, k_tiles, num_pid_m,
                             num_pid_n, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        elif VARIANT == 6:  # wait for every peer, then one loop over all peer tiles
            for s in range(1, world):
                wait_signal(flags_ptr + s, epoch, max_spins, err_ptr, 1, rank, s)
            for t in tl.range(first_tile_at_or_after(pid, tps, NUM_SMS), world * tps, NUM_SMS,
                              flatten=FLATTEN):
                _ws_tile(ag_desc, b_desc, c_desc, t, t // tps, tps, m_local, k_tiles, num_pid_m,
                         num_pid_n, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        else:  # 0, 1, 2: a runtime step loop around the peers' tile loops
            for step in range(1, world):
                if VARIANT == 0:
                    wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
                for t in tl.range(first_tile_at_or_after(pid, step * tps, NUM_SMS),
                                  (step + 1) * tps, NUM_SMS, flatten=FLATTEN):
                    _ws_tile(ag_desc, b_desc, c_desc, t, step, tps, m_local, k_tiles, num_pid_m,
                             num_pid_n, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _ws_tile(a_desc, b_desc, c_desc, t, step, tps, m_local, k_tiles, num_pid_m, num_pid_n,
             EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Flat tile ``t`` of ``step``'s segment: A rows from ``a_desc`` (``step * m_local +`` the
    tile's row, or the tile's row alone at step 0 for the shard's descriptor), stored at the
    same output rows."""
    pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
    row = step * m_local + pid_m * BLOCK_M
    _ag_tile(a_desc, b_desc, c_desc, row, step, row, pid_n * BLOCK_N, k_tiles,
             False, False, False, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


VARIANTS = {"two": 0, "two-nowait": 1, "two-onedesc": 2, "one": 3, "two-static": 4,
            "one-inwait": 5, "two-waitall": 6, "one-segdesc": 8}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, help="MxNxK")
    p.add_argument("--config", action="append", default=[], help="GemmConfig JSON (repeatable)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--prev", default=None, help="a copy of an earlier kernels/ag_gemm.py: its "
                   "launch_ag_gemm is timed too, beside the current one")
    add_timing_args(p)
    args = p.parse_args(argv)
    real = {"real": None}  # None: the package's launcher
    if args.prev:
        real["real-prev"] = load_module(args.prev, "ag_gemm_prev").launch_ag_gemm
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ensure_descriptor_allocator()
    rows = []
    for shape in args.shapes:
        m, n, k = parse_shape(shape)
        a, w, ref = problem(m, n, k)
        flags = torch.full((args.world,), 1 << 30, dtype=torch.int32, device="cuda")
        err = torch.zeros(4, dtype=torch.int32, device="cuda")
        for cj in args.config:
            cfg = GemmConfig.from_dict(json.loads(cj))
            m_local = m // args.world
            tiles = args.world * triton.cdiv(m_local, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            grid = min(sms, tiles)
            plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns = {"cublas": lambda: torch.matmul(a, w.t()),
                   "plain": lambda c=cfg: launch_plain_gemm(a, w, plain_out, c, sms)}
            outs = {"plain": (plain_out, lambda: ref)}
            for name, v in VARIANTS.items():
                o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                outs[name] = (o, lambda: ref)
                fns[name] = lambda o=o, v=v, c=cfg: ag_loops_kernel[(grid,)](
                    a, a, w, o, flags, err, m_local, n, k, 0, args.world, 1, 1 << 20,
                    VARIANT=v, EPI_SPLIT=c.epilogue_split, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                    BLOCK_K=c.block_k, GROUP_M=c.group_m, NUM_SMS=grid, FLATTEN=c.flatten,
                    WORLD=args.world, num_warps=c.num_warps, num_stages=c.num_stages)
            rcfg = dataclasses.replace(cfg, chunk_rows=m_local, stream_k=0)
            for name, launcher in real.items():
                fns[name], out = ag_on_one_gpu(a, w, args.world, rcfg, err, launcher)
                outs[name] = (out, lambda: ref)
            title = (f"{m}x{n}x{k} {cfg.block_m}x{cfg.block_n}/{cfg.num_stages}/{cfg.num_warps}"
                     f"/epi{cfg.epilogue_split}")
            rows += time_and_check(fns, outs, args, title,
                                   {"m": m, "n": n, "k": k, "config": cfg.to_dict()})
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
