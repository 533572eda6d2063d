"""The K loop shared by the fused kernels (one output tile's fp32 accumulator), and the tile
helpers around it."""

import triton
import triton.language as tl

from megatron_flux.kernels.tile_order import grouped_tile


@triton.jit
def tile_mainloop(a_desc, b_desc, a_seg, a_row, off_n, k_tiles,
                  RAGGED_A: tl.constexpr, B_KN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``A[a_row : a_row + BLOCK_M, :] @ B[:, off_n : off_n + BLOCK_N]`` in fp32.

    A is a 2-D ``[rows, K]`` descriptor, or with RAGGED_A a 3-D ``[world, m_local, K]`` one read
    at segment ``a_seg`` (TMA then clips the tile at the segment end). B is ``[K, N]`` (B_KN) or
    ``[N, K]`` (transposed on load)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        a, b = _load_ab(a_desc, b_desc, a_seg, a_row, off_n, ki * BLOCK_K, RAGGED_A, B_KN,
                        BLOCK_M, BLOCK_K)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def tile_mainloop_k(a_desc, b_desc, a_seg, a_row, off_n, k_lo, k_hi,
                    RAGGED_A: tl.constexpr, B_KN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`tile_mainloop` over K-tiles ``[k_lo, k_hi)`` only (a stream-K part of a tile).

    Pipelined 2 deep, whatever the kernel's ``num_stages``: Triton gives this loop buffers of
    its own beside the main loop's, and with 3 stages a 128x256x64 tile's kernel would need
    more shared memory than Hopper has (measured by compiling for sm_90: 224 KiB at 2)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in tl.range(k_lo, k_hi, num_stages=2):
        a, b = _load_ab(a_desc, b_desc, a_seg, a_row, off_n, ki * BLOCK_K, RAGGED_A, B_KN,
                        BLOCK_M, BLOCK_K)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load_ab(a_desc, b_desc, a_seg, a_row, off_n, off_k, RAGGED_A: tl.constexpr, B_KN: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K-step's A ``[BLOCK_M, BLOCK_K]`` and B ``[BLOCK_K, BLOCK_N]`` blocks."""
    if RAGGED_A:
        a = a_desc.load([a_seg, a_row, off_k]).reshape(BLOCK_M, BLOCK_K)
    else:
        a = a_desc.load([a_row, off_k])
    if B_KN:
        b = b_desc.load([off_k, off_n])
    else:
        b = b_desc.load([off_n, off_k]).T
    return a, b


@triton.jit
def split_columns(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """A ``[BLOCK_M, 2 * HALF]`` tile as its left and right ``[BLOCK_M, HALF]`` halves (the split
    epilogue stores each half on its own, with half the shared-memory staging)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def segment_tile(a_desc, b_desc, t_in_seg, seg, m_local, k_tiles, num_pid_m, num_pid_n,
                 RAGGED_A: tl.constexpr, B_KN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``t_in_seg`` of segment ``seg`` (GROUP_M-grouped order): ``(acc, off_m, off_n)``,
    with ``off_m`` relative to the segment's first row."""
    pid_m, pid_n = grouped_tile(t_in_seg, num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    row = off_m if RAGGED_A else seg * m_local + off_m
    acc = tile_mainloop(a_desc, b_desc, seg, row, off_n, k_tiles, RAGGED_A, B_KN,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    return acc, off_m, off_n
