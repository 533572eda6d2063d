"""AllGather + GEMM: ``C = AllGather_rows(x) @ B`` as one persistent TMA GEMM.

Tile and signal schedule (rank ``r`` of ``W``; see :mod:`.tile_order`):

* Output rows are split in ``W`` segments of ``m_local`` rows; segment ``s`` holds rank ``s``'s
  rows. Program ``p`` of the persistent grid takes flat tiles ``p, p + NUM_SMS, ...``.
* Step 0 is the local segment: its A tiles are read straight from the caller's shard ``x``
  (no copy, no wait), so the GEMM starts at once.
* Steps ``1..W-1`` visit segments ``r+1, r+2, ...``. Their rows live in this rank's gathered
  workspace ``ag``, filled chunk by chunk (``chunk_rows`` rows, independent of ``BLOCK_M``) by
  the peers' copy engines, each chunk followed by a signal ``flags[s * chunks_per_seg + c] =
  epoch``. Before a step's tiles each program waits (acquire, bounded) on that segment's
  chunks; the wait sits between the persistent tile loops so they stay flattened/pipelined.
* Epilogue: TMA store of the tile (clipped to the segment when ``m_local % BLOCK_M != 0``).

Nothing here issues communication: the host side (:mod:`megatron_flux.backends.flux`) queues
the chunk copies and signal writes on a side stream *after* this kernel, so the kernel never
waits on work queued behind it, also with ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
"""

import triton
import triton.language as tl

from megatron_flux.kernels.config import launch_geometry
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.launch import KernelLauncher
from megatron_flux.kernels.mainloop import split_columns, tile_mainloop
from megatron_flux.kernels.signals import wait_signal
from megatron_flux.kernels.tile_order import first_tile_at_or_after, grouped_tile, segment_of_step


@triton.jit
def _ag_tile(a_desc, b_desc, c_desc, a_row, c_seg, c_row, off_n, k_tiles,
             RAGGED_A: tl.constexpr, RAGGED_C: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile: K loop over A rows ``a_row`` (segment-relative when RAGGED_A) and store."""
    acc = tile_mainloop(a_desc, b_desc, c_seg, a_row, off_n, k_tiles, RAGGED_A, B_KN,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    if EPI_SPLIT == 2:
        acc0, acc1 = split_columns(acc, BLOCK_M, HALF)
        _store(c_desc, c_seg, c_row, off_n, acc0.to(c_desc.dtype), RAGGED_C, BLOCK_M, HALF)
        _store(c_desc, c_seg, c_row, off_n + HALF, acc1.to(c_desc.dtype), RAGGED_C, BLOCK_M, HALF)
    else:
        _store(c_desc, c_seg, c_row, off_n, acc.to(c_desc.dtype), RAGGED_C, BLOCK_M, BLOCK_N)


@triton.jit
def _store(c_desc, c_seg, c_row, off_n, c, RAGGED_C: tl.constexpr, BLOCK_M: tl.constexpr,
           WIDTH: tl.constexpr):
    if RAGGED_C:
        c_desc.store([c_seg, c_row, off_n], c.reshape(1, BLOCK_M, WIDTH))
    else:
        c_desc.store([c_row, off_n], c)


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def ag_gemm_kernel(
    x_ptr, ag_ptr, b_ptr, c_ptr,
    flags_ptr, err_ptr,
    m_local, N, K, ldb, rank, world, epoch, chunk_rows, max_spins,
    RAGGED: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Pointers: ``x`` [m_local, K], ``ag`` / ``c`` [world * m_local, K / N] contiguous; ``b``
    [K, N] (B_KN) or [N, K], row stride ``ldb``. TMA descriptors are built on the device, once
    per program, so a launch passes only pointers and integers."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
    if RAGGED:
        ag_desc = tl.make_tensor_descriptor(ag_ptr, [world, m_local, K], [m_local * K, K, 1],
                                            [1, BLOCK_M, BLOCK_K])
        c_desc = tl.make_tensor_descriptor(c_ptr, [world, m_local, N], [m_local * N, N, 1],
                                           [1, BLOCK_M, BLOCK_N // EPI_SPLIT])
    else:
        ag_desc = tl.make_tensor_descriptor(ag_ptr, [world * m_local, K], [K, 1], [BLOCK_M, BLOCK_K])
        c_desc = tl.make_tensor_descriptor(c_ptr, [world * m_local, N], [N, 1],
                                           [BLOCK_M, BLOCK_N // EPI_SPLIT])
    if B_KN:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [ldb, 1], [BLOCK_K, BLOCK_N])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [ldb, 1], [BLOCK_N, BLOCK_K])
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_seg = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    chunks_per_seg = tl.cdiv(m_local, chunk_rows)

    # Step 0: local rows, read from the caller's shard.
    for t in tl.range(pid, tiles_per_seg, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        if RAGGED:
            c_row = off_m
        else:
            c_row = rank * m_local + off_m
        _ag_tile(x_desc, b_desc, c_desc, off_m, rank, c_row, pid_n * BLOCK_N, k_tiles,
                 False, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)

    # Steps 1..world-1: peers' rows in ring order. Each program waits once per step for the
    # step's segment (outside the tile loop, which stays a clean pipelined persistent loop):
    # with every peer pushing from time zero, a segment lands long before a program reaches it.
    for step in range(1, world):
        seg = segment_of_step(step, rank, world, False)
        for c in range(chunks_per_seg):
            idx = seg * chunks_per_seg + c
            wait_signal(flags_ptr + idx, epoch, max_spins, err_ptr, 1, rank, idx)  # op code OP_AG_GEMM
        first = first_tile_at_or_after(pid, step * tiles_per_seg, NUM_SMS)
        for t in tl.range(first, (step + 1) * tiles_per_seg, NUM_SMS, flatten=FLATTEN,
                          warp_specialize=WARP_SPECIALIZE):
            pid_m, pid_n = grouped_tile(t - step * tiles_per_seg, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            if RAGGED:
                row = off_m
            else:
                row = seg * m_local + off_m
            _ag_tile(ag_desc, b_desc, c_desc, row, seg, row, pid_n * BLOCK_N, k_tiles,
                     RAGGED, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


def launch_ag_gemm(x, ag, b, out, flags, err, *, rank, world, epoch, cfg, num_sms, max_spins):
    """Launch :func:`ag_gemm_kernel` on the current stream.

    ``x`` ``[m_local, K]`` this rank's rows; ``ag`` ``[world * m_local, K]`` the gathered
    workspace (peers' rows land there); ``b`` ``[K, N]`` row-major or a transposed row-major
    ``[N, K]``; ``out`` ``[world * m_local, N]``; ``flags`` int32 chunk signals; ``err`` int32[4].
    """
    m_local, k = x.shape
    n = b.shape[1]
    geo = launch_geometry(m_local, n, b, world, cfg, num_sms)
    ensure_descriptor_allocator()
    _LAUNCH(
        geo.grid,
        (x, ag, b, out, flags, err, m_local, n, k, geo.ldb, rank, world, epoch, cfg.chunk_rows,
         max_spins),
        dict(RAGGED=geo.ragged, B_KN=geo.b_kn, EPI_SPLIT=cfg.epilogue_split, BLOCK_M=cfg.block_m,
             BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_SMS=geo.grid,
             FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


_LAUNCH = KernelLauncher(ag_gemm_kernel)
