"""The K loop shared by the fused kernels: one output tile's fp32 accumulator."""

import triton
import triton.language as tl


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
        off_k = ki * BLOCK_K
        if RAGGED_A:
            a = a_desc.load([a_seg, a_row, off_k]).reshape(BLOCK_M, BLOCK_K)
        else:
            a = a_desc.load([a_row, off_k])
        if B_KN:
            b = b_desc.load([off_k, off_n])
        else:
            b = b_desc.load([off_n, off_k]).T
        acc = tl.dot(a, b, acc)
    return acc
