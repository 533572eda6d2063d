"""GEMM + ReduceScatter: ``out = ReduceScatter_rows(A @ B) (+ bias)`` as one persistent TMA GEMM.

Tile and signal schedule (rank ``r`` of ``W``; see :mod:`.tile_order`):

* The partial product's rows are split in ``W`` segments of ``m_local`` rows; segment ``s`` is
  owned by rank ``s``. Program ``p`` of the persistent grid takes flat tiles
  ``p, p + NUM_SMS, ...``.
* Steps ``0..W-2`` visit the peers' segments ``r+1, r+2, ...`` (each rank hits a different owner
  at each step). Epilogue = the *write* of ReduceScatter: the tile is rounded to the output dtype
  and stored straight into the owner's symmetric buffer, slot ``r``
  (``data[owner][r, rows, cols]``), then the tile's signal ``flags[owner][r, tile] = epoch``
  is released (system scope).
* Step ``W-1`` is the own segment. Epilogue = the *reduction*: the fp32 accumulator is summed
  with the peers' pushed partials in fixed rank order ``0..W-1`` (each after an acquire wait on
  its signal, bounded), bias is added once, and the tile is TMA-stored to ``out``. The fixed
  order makes results bitwise identical run to run. Because every rank computes the others'
  rows first, a peer's partial normally landed long before the owner reaches that tile.

Workspace slots alternate between two parities from call to call (chosen by the host), so a
rank racing one call ahead never overwrites partials its owner has not consumed yet; signals
hold epochs and are never reset.
"""

import triton
import triton.language as tl

from megatron_flux.kernels.config import launch_geometry
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.mainloop import tile_mainloop
from megatron_flux.kernels.signals import set_signal, wait_signal
from megatron_flux.kernels.tile_order import first_tile_at_or_after, grouped_tile, segment_of_step


@triton.jit
def _tile_offsets(slot_base, off_m, off_n, m_local, N, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Element offsets and mask of a ``[BLOCK_M, WIDTH]`` tile of a ``[m_local, N]`` slot."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, WIDTH)
    offs = slot_base + rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = (rows[:, None] < m_local) & (cols[None, :] < N)
    return offs, mask


@triton.jit
def _push_part(dst_ptr, slot_base, part, off_m, off_n, m_local, N,
               BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    offs, mask = _tile_offsets(slot_base, off_m, off_n, m_local, N, BLOCK_M, WIDTH)
    tl.store(dst_ptr + offs, part.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_part(part, data_ptr, bias_ptr, out_desc, off_m, off_n, m_local, N, rank, world,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """``part`` (fp32, own partial) + peers' partials in rank order (+ bias) -> ``out``."""
    for src in range(world):
        if src != rank:
            offs, mask = _tile_offsets((src * m_local).to(tl.int64) * N, off_m, off_n, m_local, N, BLOCK_M, WIDTH)
            part += tl.load(data_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        cols = off_n + tl.arange(0, WIDTH)
        part += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_desc.store([off_m, off_n], part.to(out_desc.dtype))


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def gemm_rs_kernel(
    a_ptr, b_ptr, out_ptr,
    data_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr,
    m_local, N, K, ldb, rank, world, epoch, max_spins,
    RAGGED: tl.constexpr, B_KN: tl.constexpr, HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    FLATTEN: tl.constexpr, FLATTEN_CONSUME: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    PRODUCE: tl.constexpr = True, CONSUME: tl.constexpr = True,
):
    """``data_ptr``: this rank's slot region (``[world, m_local, N]``, output dtype) for this
    call's parity; ``data_ptrs``/``flag_ptrs``: int64 tables of every rank's slot region and
    int32 signal region (``[world, tiles_per_seg]``). PRODUCE/CONSUME select the phases (both in
    production; the CPU tests run all ranks' producers before their consumers). TMA descriptors
    are built on the device, once per program."""
    if RAGGED:
        a_desc = tl.make_tensor_descriptor(a_ptr, [world, m_local, K], [m_local * K, K, 1],
                                           [1, BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [world * m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
    if B_KN:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [ldb, 1], [BLOCK_K, BLOCK_N])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [ldb, 1], [BLOCK_N, BLOCK_K])
    out_desc = tl.make_tensor_descriptor(out_ptr, [m_local, N], [N, 1], [BLOCK_M, BLOCK_N // EPI_SPLIT])
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_seg = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_remote = (world - 1) * tiles_per_seg
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT

    if PRODUCE:
        for t in tl.range(pid, n_remote, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            seg = segment_of_step(t // tiles_per_seg, rank, world, True)
            t_in_seg = t % tiles_per_seg
            pid_m, pid_n = grouped_tile(t_in_seg, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            row = off_m if RAGGED else seg * m_local + off_m
            acc = tile_mainloop(a_desc, b_desc, seg, row, off_n, k_tiles, RAGGED, B_KN,
                            BLOCK_M, BLOCK_N, BLOCK_K)
            dst = tl.load(data_ptrs + seg).to(tl.pointer_type(data_ptr.dtype.element_ty))
            slot_base = (rank * m_local).to(tl.int64) * N
            if EPI_SPLIT == 2:
                acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
                _push_part(dst, slot_base, acc0, off_m, off_n, m_local, N, BLOCK_M, HALF)
                _push_part(dst, slot_base, acc1, off_m, off_n + HALF, m_local, N, BLOCK_M, HALF)
            else:
                _push_part(dst, slot_base, acc, off_m, off_n, m_local, N, BLOCK_M, BLOCK_N)
            flag = tl.load(flag_ptrs + seg).to(tl.pointer_type(tl.int32))
            set_signal(flag + rank * tiles_per_seg + t_in_seg, epoch)

    if CONSUME:
        my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        total = world * tiles_per_seg
        for t in tl.range(first_tile_at_or_after(pid, n_remote, NUM_SMS), total, NUM_SMS,
                          flatten=FLATTEN_CONSUME):
            t_in_seg = t % tiles_per_seg
            pid_m, pid_n = grouped_tile(t_in_seg, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            row = off_m if RAGGED else rank * m_local + off_m
            acc = tile_mainloop(a_desc, b_desc, rank, row, off_n, k_tiles, RAGGED, B_KN,
                            BLOCK_M, BLOCK_N, BLOCK_K)
            for src in range(world):
                if src != rank:
                    idx = src * tiles_per_seg + t_in_seg
                    wait_signal(my_flags + idx, epoch, max_spins, err_ptr, 2, rank, idx)  # op code OP_GEMM_RS
            if EPI_SPLIT == 2:
                acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
                _reduce_part(acc0, data_ptr, bias_ptr, out_desc, off_m, off_n, m_local, N, rank,
                             world, HAS_BIAS, BLOCK_M, HALF)
                _reduce_part(acc1, data_ptr, bias_ptr, out_desc, off_m, off_n + HALF, m_local, N,
                             rank, world, HAS_BIAS, BLOCK_M, HALF)
            else:
                _reduce_part(acc, data_ptr, bias_ptr, out_desc, off_m, off_n, m_local, N, rank,
                             world, HAS_BIAS, BLOCK_M, BLOCK_N)


def launch_gemm_rs(a, b, out, data, data_ptrs, flag_ptrs, bias, err, *, rank, world, epoch, cfg,
                   num_sms, max_spins, produce=True, consume=True):
    """Launch :func:`gemm_rs_kernel` on the current stream.

    ``a`` ``[world * m_local, K]``; ``b`` ``[K, N]`` row-major or a transposed row-major
    ``[N, K]``; ``out`` ``[m_local, N]``; ``data`` this rank's ``[world, m_local, N]`` slot
    region of this call's parity (the address ``data_ptrs[rank]`` points at)."""
    m, k = a.shape
    m_local = m // world
    n = b.shape[1]
    geo = launch_geometry(m_local, n, b, world, cfg, num_sms)
    ensure_descriptor_allocator()
    gemm_rs_kernel[(geo.grid,)](
        a, b, out, data, data_ptrs, flag_ptrs, bias if bias is not None else data, err,
        m_local, n, k, geo.ldb, rank, world, epoch, max_spins,
        RAGGED=geo.ragged, B_KN=geo.b_kn, HAS_BIAS=bias is not None,
        EPI_SPLIT=cfg.epilogue_split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, NUM_SMS=geo.grid, FLATTEN=cfg.flatten, FLATTEN_CONSUME=cfg.flatten_consume,
        WARP_SPECIALIZE=cfg.warp_specialize, PRODUCE=produce, CONSUME=consume,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )
