"""A plain persistent TMA GEMM, ``C = A @ B^T``: the yardstick for the fused kernels' tile loop.

Not used by any layer. The benchmarks time it beside the fused kernels (with their
communication disabled) to separate what the fused schedule costs from what Triton's persistent
GEMM costs at a shape.

Tile schedule: one flat tile space over the *whole* ``[M, N]`` output (no per-rank segments),
grouped GROUP_M row-tiles at a time for L2 reuse (:func:`~megatron_flux.kernels.tile_order.
grouped_tile`); program ``p`` of the persistent grid takes tiles ``p, p + NUM_SMS, ...`` in one
``tl.range`` loop (flattened with FLATTEN), K loop inside, TMA loads of A ``[BLOCK_M, BLOCK_K]``
and B ``[BLOCK_N, BLOCK_K]``, one TMA store per tile. No signals, no waits. Two entry points:
descriptors built on the device or encoded on the host (as the fused Triton kernels do by
default).
"""

import triton
import triton.language as tl

from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.phase_trace import stamp
from megatron_flux.kernels.tile_order import grouped_tile


#: what ``trace[program, slot]`` holds with TRACE (:mod:`~megatron_flux.kernels.phase_trace`)
PLAIN_PHASES = ("start", "descriptors", "end")


@triton.jit
def plain_gemm_kernel(a_ptr, b_ptr, c_ptr, trace_ptr, M, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                      TRACE: tl.constexpr = False):
    """``a`` ``[M, K]``, ``b`` ``[N, K]``, ``c`` ``[M, N]``, all contiguous; TMA descriptors
    built on the device (the fused kernels' ``MEGATRON_FLUX_HOST_DESCRIPTORS=0``). TRACE: stamp
    :data:`PLAIN_PHASES`."""
    stamp(trace_ptr, 0, TRACE)
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    stamp(trace_ptr, 1, TRACE)
    _tiles(a_desc, b_desc, c_desc, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN)
    stamp(trace_ptr, 2, TRACE)


@triton.jit
def plain_gemm_host_desc_kernel(a_desc, b_desc, c_desc, M, N, K,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr):
    """The same with host-encoded TMA descriptors (kernel parameters), as Triton's tutorial
    persistent GEMM can: tells whether building descriptors on the device costs anything."""
    _tiles(a_desc, b_desc, c_desc, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN)


@triton.jit
def _tiles(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
           FLATTEN: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def launch_plain_gemm(a, b_nk, c, cfg, num_sms, host_descriptors=False, trace=None):
    """``c = a @ b_nk.T`` with ``cfg``'s tile, stages, warps, GROUP_M and ``flatten``; the TMA
    descriptors are built on the device unless ``host_descriptors``. ``trace``: stamp
    :data:`PLAIN_PHASES` into it (device descriptors only)."""
    m, k = a.shape
    n = b_nk.shape[0]
    if not (a.is_contiguous() and b_nk.is_contiguous() and c.is_contiguous()):
        raise ValueError("plain_gemm: a, b_nk and c must be contiguous")
    if b_nk.shape[1] != k or tuple(c.shape) != (m, n):
        raise ValueError(f"plain_gemm: shapes {tuple(a.shape)} @ {tuple(b_nk.shape)}^T -> {tuple(c.shape)}")
    align = 16 // a.element_size()
    if k % align or n % align:
        raise ValueError(f"plain_gemm: TMA needs k and n to be multiples of {align} (got {k}, {n})")
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = min(num_sms, tiles)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, NUM_SMS=grid, FLATTEN=cfg.flatten, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    if host_descriptors:
        from triton.tools.tensor_descriptor import TensorDescriptor

        plain_gemm_host_desc_kernel[(grid,)](
            TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(b_nk, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(c, [cfg.block_m, cfg.block_n]), m, n, k, **meta)
    else:
        ensure_descriptor_allocator()
        plain_gemm_kernel[(grid,)](a, b_nk, c, trace if trace is not None else c, m, n, k,
                                   TRACE=trace is not None, **meta)
