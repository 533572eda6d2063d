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
* ``one-branch``: ``one-inwait`` whose tiles branch between a K loop on the shard's descriptor
  (step 0) and one on the workspace's: needs two K loops' shared memory, does not fit;
* ``one-segdesc``: ``one-inwait`` with A's descriptor made per tile on its segment's rows (the
  shard or the workspace segment), so no copy of the shard into the workspace is needed.

    python benchmarks/experiments/ag_loops.py --shapes 4096x14336x4096 ... [--json PATH]
"""

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from megatron_flux.bench.kernel_vs_cublas import _time
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
    if VARIANT == 4:  # two-static: the step loop unrolled (WORLD constexpr), every loop top-level
        for t in tl.range(pid, tps, NUM_SMS, flatten=FLATTEN):
            pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
            _ag_tile(x_desc, b_desc, c_desc, pid_m * BLOCK_M, 0, pid_m * BLOCK_M,
                     pid_n * BLOCK_N, k_tiles, False, False, False, EPI_SPLIT,
                     BLOCK_M, BLOCK_N, BLOCK_K)
        for step in tl.static_range(1, WORLD):
            wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
            first = first_tile_at_or_after(pid, step * tps, NUM_SMS)
            for t in tl.range(first, (step + 1) * tps, NUM_SMS, flatten=FLATTEN):
                pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
                row = step * m_local + pid_m * BLOCK_M
                _ag_tile(ag_desc, b_desc, c_desc, row, step, row, pid_n * BLOCK_N, k_tiles,
                         False, False, False, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    elif VARIANT == 5:  # one loop, one descriptor, a wait inside it when the step changes
        waited = 0
        for t in tl.range(pid, world * tps, NUM_SMS, flatten=FLATTEN):
            step = t // tps
            if step != waited:
                wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
                waited = step
            pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
            row = step * m_local + pid_m * BLOCK_M
            _ag_tile(ag_desc, b_desc, c_desc, row, step, row, pid_n * BLOCK_N, k_tiles,
                     False, False, False, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    elif VARIANT == 6:  # local loop, wait for every peer, one loop over all peer tiles
        for t in tl.range(pid, tps, NUM_SMS, flatten=FLATTEN):
            pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
            _ag_tile(x_desc, b_desc, c_desc, pid_m * BLOCK_M, 0, pid_m * BLOCK_M,
                     pid_n * BLOCK_N, k_tiles, False, False, False, EPI_SPLIT,
                     BLOCK_M, BLOCK_N, BLOCK_K)
        for s in range(1, world):
            wait_signal(flags_ptr + s, epoch, max_spins, err_ptr, 1, rank, s)
        for t in tl.range(first_tile_at_or_after(pid, tps, NUM_SMS), world * tps, NUM_SMS,
                          flatten=FLATTEN):
            step = t // tps
            pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
            row = step * m_local + pid_m * BLOCK_M
            _ag_tile(ag_desc, b_desc, c_desc, row, step, row, pid_n * BLOCK_N, k_tiles,
                     False, False, False, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    elif VARIANT == 7:  # one loop, in-loop wait, the K loop on the shard's or the workspace's desc
        waited = 0
        for t in tl.range(pid, world * tps, NUM_SMS, flatten=FLATTEN):
            step = t // tps
            if step != waited:
                wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
                waited = step
            pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            row = step * m_local + off_m
            if step == 0:
                acc = tile_mainloop(x_desc, b_desc, 0, off_m, pid_n * BLOCK_N, k_tiles, False,
                                    False, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                acc = tile_mainloop(ag_desc, b_desc, 0, row, pid_n * BLOCK_N, k_tiles, False,
                                    False, BLOCK_M, BLOCK_N, BLOCK_K)
            _epilogue(c_desc, step, row, pid_n * BLOCK_N, acc, False, EPI_SPLIT, BLOCK_M, BLOCK_N)
    elif VARIANT == 8:  # one loop, in-loop wait, A's descriptor made per tile on its segment
        waited = 0
        for t in tl.range(pid, world * tps, NUM_SMS, flatten=FLATTEN):
            step = t // tps
            if step != waited:
                wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
                waited = step
            pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            seg_ptr = tl.where(step == 0, x_ptr, ag_ptr + (step * m_local).to(tl.int64) * K)
            seg_desc = tl.make_tensor_descriptor(seg_ptr, [m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
            acc = tile_mainloop(seg_desc, b_desc, 0, off_m, pid_n * BLOCK_N, k_tiles, False,
                                False, BLOCK_M, BLOCK_N, BLOCK_K)
            _epilogue(c_desc, step, step * m_local + off_m, pid_n * BLOCK_N, acc, False, EPI_SPLIT,
                      BLOCK_M, BLOCK_N)
    elif VARIANT == 3:  # one loop over everything, one descriptor
        for t in tl.range(pid, world * tps, NUM_SMS, flatten=FLATTEN):
            step = t // tps
            pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
            row = step * m_local + pid_m * BLOCK_M
            _ag_tile(ag_desc, b_desc, c_desc, row, step, row, pid_n * BLOCK_N, k_tiles,
                     False, False, False, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        for t in tl.range(pid, tps, NUM_SMS, flatten=FLATTEN):
            pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
            if VARIANT == 2:
                _ag_tile(ag_desc, b_desc, c_desc, pid_m * BLOCK_M, 0, pid_m * BLOCK_M,
                         pid_n * BLOCK_N, k_tiles, False, False, False, EPI_SPLIT,
                         BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                _ag_tile(x_desc, b_desc, c_desc, pid_m * BLOCK_M, 0, pid_m * BLOCK_M,
                         pid_n * BLOCK_N, k_tiles, False, False, False, EPI_SPLIT,
                         BLOCK_M, BLOCK_N, BLOCK_K)
        for step in range(1, world):
            if VARIANT == 0:
                wait_signal(flags_ptr + step, epoch, max_spins, err_ptr, 1, rank, step)
            first = first_tile_at_or_after(pid, step * tps, NUM_SMS)
            for t in tl.range(first, (step + 1) * tps, NUM_SMS, flatten=FLATTEN):
                pid_m, pid_n = grouped_tile(t - step * tps, num_pid_m, num_pid_n, GROUP_M)
                row = step * m_local + pid_m * BLOCK_M
                _ag_tile(ag_desc, b_desc, c_desc, row, step, row, pid_n * BLOCK_N, k_tiles,
                         False, False, False, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


VARIANTS = {"two": 0, "two-nowait": 1, "two-onedesc": 2, "one": 3, "two-static": 4,
            "one-inwait": 5, "two-waitall": 6, "one-segdesc": 8}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, help="MxNxK")
    p.add_argument("--config", action="append", default=[], help="GemmConfig JSON (repeatable)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--prev", default=None, help="a copy of an earlier kernels/ag_gemm.py: its "
                   "launch_ag_gemm is timed too, beside the current one")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import dataclasses
    import importlib.util

    from megatron_flux.kernels import ag_gemm
    real = {"real": ag_gemm}
    if args.prev:
        spec = importlib.util.spec_from_file_location("ag_gemm_prev", args.prev)
        real["real-prev"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(real["real-prev"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ensure_descriptor_allocator()
    rows = []
    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.t().float()
        flags = torch.full((args.world,), 1 << 30, dtype=torch.int32, device="cuda")
        err = torch.zeros(4, dtype=torch.int32, device="cuda")
        for cj in args.config:
            cfg = GemmConfig.from_dict(json.loads(cj))
            m_local = m // args.world
            tiles = args.world * triton.cdiv(m_local, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            grid = min(sms, tiles)
            fns, outs = {"cublas": lambda: torch.matmul(a, w.t())}, {}
            outs["plain"] = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns["plain"] = lambda o=outs["plain"], c=cfg: launch_plain_gemm(a, w, o, c, sms)
            for name, v in VARIANTS.items():
                o = outs[name] = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                fns[name] = lambda o=o, v=v, c=cfg: ag_loops_kernel[(grid,)](
                    a, a, w, o, flags, err, m_local, n, k, 0, args.world, 1, 1 << 20,
                    VARIANT=v, EPI_SPLIT=c.epilogue_split, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                    BLOCK_K=c.block_k, GROUP_M=c.group_m, NUM_SMS=grid, FLATTEN=c.flatten,
                    WORLD=args.world, num_warps=c.num_warps, num_stages=c.num_stages)
            rcfg = dataclasses.replace(cfg, chunk_rows=m_local, stream_k=0)
            for name, mod in real.items():
                o = outs[name] = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                fns[name] = lambda o=o, mod=mod, c=rcfg: mod.launch_ag_gemm(
                    a[:m_local], a, w.t(), o, flags, err, rank=0, world=args.world, epoch=1,
                    cfg=c, num_sms=sms, max_spins=1 << 20)
            times = _time(fns, args.trials, args.iters)
            base = statistics.median(times["cublas"])
            line = [f"{m}x{n}x{k} {cfg.block_m}x{cfg.block_n}/{cfg.num_stages}/{cfg.num_warps}"
                    f"/epi{cfg.epilogue_split} cublas {base:.4f}"]
            for name, ts in times.items():
                med = statistics.median(ts)
                e = None
                if name in outs:
                    e = float((outs[name].float() - ref).norm() / ref.norm())
                    if not e < 1e-2:
                        line.append(f"{name} WRONG({e:.3g})")
                rows.append({"m": m, "n": n, "k": k, "config": cfg.to_dict(), "method": name,
                             "median_ms": med, "spread_ms": max(ts) - min(ts), "rel_err": e})
                if name != "cublas":
                    line.append(f"{name} x{med / base:.3f}")
            print("  ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
