"""The owner's reduction of a copy-engine ReduceScatter: ``out = Σ_src part[src] (+ bias)``.

Used by the column backward's input gradient with ``column_dgrad="copy_engine"``
(:meth:`~megatron_flux.backends.flux.FluxBackend.matmul_reduce_scatter_start`): cuBLAS computes
the full partial ``[m, n]`` on every rank, the copy engine moves each peer's rows into the
peer's symmetric slot (:func:`~megatron_flux.comm.rs_copies.rs_copy_plan`) beside the caller's
next GEMM, and once every peer's signal has arrived this kernel sums the ``W`` partials of this
rank's rows.

Tile schedule: one ``[BLOCK_M, BLOCK_N]`` tile of the ``[m_local, n]`` output per program
(grid = the tiles), no signals (the caller waits for the peers first). The sources, this rank's
own rows of its partial and the slots the peers filled, are summed in rank order ``0..W-1`` in
fp32, so the result is bitwise the same on every run, and equal to the fused GEMM+RS's spread
reduction (which also sums rounded partials in rank order).
"""

import triton
import triton.language as tl

from megatron_flux.kernels.launch import KernelLauncher


@triton.jit(do_not_specialize=["rank"])
def rs_reduce_kernel(own_ptr, slots_ptr, bias_ptr, out_ptr, m_local, N, rank, WORLD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < m_local) & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for src in tl.static_range(0, WORLD):
        if src == rank:
            acc += tl.load(own_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            slot = slots_ptr + tl.cast(src * m_local, tl.int64) * N
            acc += tl.load(slot + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_rs_reduce(own, slots, out, bias, *, rank: int, world: int, block_m: int = 32,
                     block_n: int = 256, direct: bool = True):
    """Queue the reduction on the current stream: ``out`` ``[m_local, n]`` (contiguous) = the
    ``world`` partials of these rows summed in rank order (``own``, this rank's rows of its
    partial, for ``rank``; slot ``src`` of ``slots``, this rank's ``[world, m_local, n]`` slot
    region, for the others), plus ``bias`` ``[n]`` if given."""
    m_local, n = out.shape
    grid = -(-m_local // block_m) * -(-n // block_n)  # (triton.cdiv is slow on the host)
    _LAUNCH(grid, (own, slots, bias if bias is not None else out, out, m_local, n, rank),
            dict(WORLD=world, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n),
            num_warps=4, num_stages=1, direct=direct)


_LAUNCH = KernelLauncher(rs_reduce_kernel)
