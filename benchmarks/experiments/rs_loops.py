"""Experiment: which part of the GEMM+RS kernel's structure costs time (comm off), and whether
one tile loop at TP = 2 recovers it.

A stripped copy of ``gemm_rs_kernel`` for ``WORLD`` = 2 (no ragged segments, B as [N, K], TMA
pushes and TMA reduction reads), timed beside cuBLAS, the plain yardstick and the package's
kernel in one interleaved loop on one GPU. Every variant runs in
``kernel_vs_cublas.rs_on_one_gpu``'s wiring (through :func:`launcher`): rank 0 pushes the peer
segment's partial into the local slot 0 and reduces its own rows with slot 1 (random, written
once), every peer signal is pre-set. Every variant computes
``out = a[:m_local] @ w.T + slot1`` and ``slot0 = a[m_local:] @ w.T``:

* ``steps``: the package's structure (the producer loop over the peer's segment, the
  grid-done publish, the first own tile peeled before the wait, then the reduction loop);
* ``steps-nopeel``: the wait before an unpeeled reduction loop;
* ``steps-nosync``: no publish, no wait (the signals of a real run gone);
* ``steps-noread``: own tiles store the accumulator without reading slot 1 (the output is
  then checked against the product alone);
* ``steps-bare``: no peel, no signals, no reads: two loops of a plain GEMM whose first one
  stores into the slot;
* ``one``: one flattened loop over both segments' tiles, each tile's epilogue pushing (peer
  segment) or reducing (own segment); no signals, so an upper bound of what one loop could win;
* ``one-publish``: ``one`` with the package's grid-done publish before the first own tile's K
  loop and the wait after it. Triton 3.6 does not pipeline that loop: compiled for sm_90a it
  has 80 KB of shared memory against 213 KB for ``one``, i.e. one stage (``compile_s10.py``,
  ``results/raw/s10/compile-sm90a.json``). The publish brings a CTA barrier and the store
  drain's inline assembly into the loop; probes that kept only one of the two were not
  pipelined either (session 10, no file kept). Timed to show what that costs;
* ``one-noread``: ``one`` whose own tiles store without reading slot 1;
* ``one-prefetch``: ``one`` whose own tiles load slot 1's tile with plain loads *before* the
  K loop (their latency hidden behind it) instead of by TMA after it.

    python benchmarks/experiments/rs_loops.py --shapes 8192x4096x14336 ... [--json PATH]

(run as a script, with the repository root on ``PYTHONPATH``: it imports ``common`` beside it)
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from common import add_timing_args, parse_shape, problem, time_and_check, write_record
from megatron_flux.bench.kernel_vs_cublas import rs_on_one_gpu
from megatron_flux.bench.plain_gemm import launch_plain_gemm
from megatron_flux.kernels.config import GemmConfig, default_config, interpreting
from megatron_flux.kernels.ag_gemm import _epilogue
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.gemm_rs import _push_tile, _reduce_tile
from megatron_flux.kernels.mainloop import segment_tile
from megatron_flux.kernels.signals import fence_async_proxy, publish_when_grid_done, wait_signal
from megatron_flux.kernels.tile_order import first_tile_at_or_after, grouped_tile

#: name -> the kernel's constexpr switches
_STEPS = dict(ONE_LOOP=False, PEEL=True, SYNC=True, READ=1)
_ONE = dict(ONE_LOOP=True, PEEL=False, SYNC=False, READ=1)
VARIANTS = {"steps": _STEPS, "steps-nopeel": {**_STEPS, "PEEL": False},
            "steps-nosync": {**_STEPS, "SYNC": False},
            "steps-noread": {**_STEPS, "READ": 0},
            "steps-bare": {**_STEPS, "PEEL": False, "SYNC": False, "READ": 0},
            "one": _ONE, "one-noread": {**_ONE, "READ": 0}, "one-prefetch": {**_ONE, "READ": 2},
            "one-publish": {**_ONE, "SYNC": True}}


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def rs_loops_kernel(a_ptr, b_ptr, out_ptr, data_ptr, data_ptrs, flag_ptrs, err_ptr,
                    m_local, N, K, rank, epoch, max_spins,
                    ONE_LOOP: tl.constexpr, PEEL: tl.constexpr, SYNC: tl.constexpr,
                    READ: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    NUM_SMS: tl.constexpr, ASYNC: tl.constexpr):
    """READ: 0 own tiles store the accumulator, 1 add slot 1 read by TMA after the K loop, 2 add
    slot 1 loaded by plain loads before the K loop (ONE_LOOP only)."""
    WORLD: tl.constexpr = 2
    a_desc = tl.make_tensor_descriptor(a_ptr, [WORLD * m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    out_desc = tl.make_tensor_descriptor(out_ptr, [m_local, N], [N, 1], [BLOCK_M, HALF])
    slots_desc = tl.make_tensor_descriptor(data_ptr, [WORLD, m_local, N], [m_local * N, N, 1],
                                           [1, BLOCK_M, HALF])
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tps = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    slot_base = (rank * m_local).to(tl.int64) * N
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    peer = (rank + 1) % WORLD
    dst = tl.load(data_ptrs + peer).to(tl.pointer_type(data_ptr.dtype.element_ty))
    dst_desc = tl.make_tensor_descriptor(dst + slot_base, [m_local, N], [N, 1], [BLOCK_M, HALF])
    owner_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
    first_own = first_tile_at_or_after(pid, tps, NUM_SMS)

    if not ONE_LOOP:  # the package's structure: producer loop, publish, reduction loop
        for t in tl.range(pid, tps, NUM_SMS, flatten=True):
            acc, off_m, off_n = segment_tile(a_desc, b_desc, t, peer, m_local, k_tiles, num_pid_m,
                                             num_pid_n, False, False, BLOCK_M, BLOCK_N, BLOCK_K,
                                             GROUP_M)
            _push_tile(acc, dst, dst_desc, slot_base, off_m, off_n, m_local, N, True, EPI_SPLIT,
                       BLOCK_M, BLOCK_N)
        if SYNC:
            publish_when_grid_done(my_flags + WORLD, NUM_SMS, owner_flags + rank, epoch, ASYNC)
        loop_start = first_own
        if PEEL:  # first own tile peeled, the wait after its GEMM
            loop_start = first_own + NUM_SMS
            if first_own < WORLD * tps:
                acc, off_m, off_n = segment_tile(a_desc, b_desc, first_own - tps, rank, m_local,
                                                 k_tiles, num_pid_m, num_pid_n, False, False,
                                                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
                if SYNC:
                    wait_signal(my_flags + peer, epoch, max_spins, err_ptr, 2, rank, peer)
                    fence_async_proxy(epoch, ASYNC)
                _own_epilogue(acc, None, data_ptr, slots_desc, out_desc, off_m, off_n, m_local, N,
                              rank, READ, EPI_SPLIT, BLOCK_M, BLOCK_N)
        elif SYNC:
            wait_signal(my_flags + peer, epoch, max_spins, err_ptr, 2, rank, peer)
            fence_async_proxy(epoch, ASYNC)
        for t in tl.range(loop_start, WORLD * tps, NUM_SMS, flatten=True):
            acc, off_m, off_n = segment_tile(a_desc, b_desc, t - tps, rank, m_local, k_tiles,
                                             num_pid_m, num_pid_n, False, False, BLOCK_M, BLOCK_N,
                                             BLOCK_K, GROUP_M)
            _own_epilogue(acc, None, data_ptr, slots_desc, out_desc, off_m, off_n, m_local, N,
                          rank, READ, EPI_SPLIT, BLOCK_M, BLOCK_N)
    else:  # one loop over both segments (with SYNC: the package's publish and wait inside it)
        for t in tl.range(pid, WORLD * tps, NUM_SMS, flatten=True):
            own = t >= tps
            if SYNC:
                if t == first_own:  # this program's pushes are done: count it in
                    publish_when_grid_done(my_flags + WORLD, NUM_SMS, owner_flags + rank, epoch,
                                           ASYNC)
            pre = None
            if READ == 2:
                pre = _prefetch(data_ptr, t - tps, own, peer, m_local, N, num_pid_m, num_pid_n,
                                BLOCK_M, BLOCK_N, GROUP_M)
            seg = tl.where(own, rank, peer)
            acc, off_m, off_n = segment_tile(a_desc, b_desc, t - own.to(tl.int32) * tps, seg,
                                             m_local, k_tiles, num_pid_m, num_pid_n, False, False,
                                             BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
            if own:
                if SYNC:
                    if t == first_own:
                        wait_signal(my_flags + peer, epoch, max_spins, err_ptr, 2, rank, peer)
                        fence_async_proxy(epoch, ASYNC)
                _own_epilogue(acc, pre, data_ptr, slots_desc, out_desc, off_m, off_n, m_local, N,
                              rank, READ, EPI_SPLIT, BLOCK_M, BLOCK_N)
            else:
                _push_tile(acc, dst, dst_desc, slot_base, off_m, off_n, m_local, N, True,
                           EPI_SPLIT, BLOCK_M, BLOCK_N)
        if SYNC:
            if first_own >= WORLD * tps:  # a program with no own tile counts in after its pushes
                publish_when_grid_done(my_flags + WORLD, NUM_SMS, owner_flags + rank, epoch, ASYNC)


@triton.jit
def _own_epilogue(acc, pre, data_ptr, slots_desc, out_desc, off_m, off_n, m_local, N, rank,
                  READ: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    if READ == 1:
        _reduce_tile(acc, data_ptr, slots_desc, data_ptr, out_desc, off_m, off_n, m_local, N,
                     rank, 2, True, False, EPI_SPLIT, BLOCK_M, BLOCK_N)
    elif READ == 2:
        _epilogue(out_desc, 0, off_m, off_n, acc + pre.to(tl.float32), False, EPI_SPLIT, BLOCK_M,
                  BLOCK_N)
    else:
        _epilogue(out_desc, 0, off_m, off_n, acc, False, EPI_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _prefetch(data_ptr, t_in_seg, own, peer, m_local, N, num_pid_m, num_pid_n,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Slot ``peer``'s tile ``t_in_seg`` (plain loads, masked off entirely unless ``own``)."""
    pid_m, pid_n = grouped_tile(t_in_seg, num_pid_m, num_pid_n, GROUP_M)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    base = data_ptr + (peer * m_local + pid_m * BLOCK_M).to(tl.int64) * N
    row_end = tl.where(own, m_local, 0)  # no row when not own
    mask = ((pid_m * BLOCK_M + rows)[:, None] < row_end) & (cols[None, :] < N)
    return tl.load(base + (rows[:, None] * N + cols[None, :]), mask=mask, other=0.0)


def launcher(variant):
    """A launcher of ``rs_loops_kernel`` with ``variant``'s switches (a ``VARIANTS`` value) in
    the shape of ``gemm_rs.launch_gemm_rs``, for ``kernel_vs_cublas.rs_on_one_gpu``'s wiring.
    TP = 2, no bias, both phases."""
    def launch(a, b, out, data, data_ptrs, flag_ptrs, bias, err, *, rank, world, epoch, cfg,
               num_sms, max_spins, produce=True, consume=True):
        if world != 2 or bias is not None or not (produce and consume):
            raise ValueError("rs_loops: TP = 2, no bias, both phases only")
        w = b.t()  # the [N, K] weight the wiring passes transposed
        m_local, n, k = a.shape[0] // 2, w.shape[0], a.shape[1]
        grid = min(num_sms, 2 * triton.cdiv(m_local, cfg.block_m) * triton.cdiv(n, cfg.block_n))
        rs_loops_kernel[(grid,)](a, w, out, data, data_ptrs, flag_ptrs, err, m_local, n, k, rank,
                                 epoch, max_spins, **variant, EPI_SPLIT=cfg.epilogue_split,
                                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                 GROUP_M=cfg.group_m, NUM_SMS=grid, ASYNC=not interpreting(),
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    return launch


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, help="MxNxK (K per rank)")
    p.add_argument("--config", action="append", default=[], help="GemmConfig JSON (repeatable); "
                   "default: the heuristic default per shape")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_timing_args(p)
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ensure_descriptor_allocator()
    launchers = {"real": None, **{name: launcher(VARIANTS[name]) for name in args.variants}}
    rows = []
    for shape in args.shapes:
        m, n, k = parse_shape(shape)
        m_local = m // 2
        a, w, full = problem(m, n, k)
        slot1 = (torch.randn(m_local, n, device="cuda") * full[:m_local].std()).to(a.dtype)
        cfgs = [GemmConfig.from_dict(json.loads(c)) for c in args.config] or \
            [default_config("rs", m, n, k)]
        for cfg in cfgs:
            plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns = {"cublas": lambda: torch.matmul(a, w.t()),
                   "plain": lambda c=cfg: launch_plain_gemm(a, w, plain_out, c, sms)}
            outs = {"plain": (plain_out, lambda: full)}
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            with_slot = lambda: full[:m_local] + slot1.float()  # noqa: E731
            pushes = {}
            for name, launch_fn in launchers.items():
                launch, out, data = rs_on_one_gpu(a, w, 2, err, launch_fn, num_sms=sms)
                data[1].copy_(slot1)
                fns[name] = lambda c=cfg, launch=launch: launch(c)
                reads = launch_fn is None or VARIANTS[name]["READ"] != 0
                outs[name] = (out, with_slot if reads else (lambda: full[:m_local]))
                pushes[name] = data
            title = (f"{m}x{n}x{k} {cfg.block_m}x{cfg.block_n}/{cfg.num_stages}/{cfg.num_warps}"
                     f"/epi{cfg.epilogue_split}")
            rows += time_and_check(fns, outs, args, title,
                                   {"m": m, "n": n, "k": k, "config": cfg.to_dict()})
            for name, data in pushes.items():  # every variant's pushed partial
                e = float((data[0].float() - full[m_local:]).norm() / full[m_local:].norm())
                if not e < 1e-2:
                    print(f"  {name}: pushed partial WRONG ({e:.3g})", flush=True)
            assert err.tolist() == [0, 0, 0, 0], err.tolist()
    write_record(args.json, rows, tp=2)


if __name__ == "__main__":
    main()
