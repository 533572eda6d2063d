"""AllGather + GEMM on a warp-specialized Hopper GEMM, written in Gluon (``ag_warp_specialized``).

Same inputs, outputs, workspace and chunk signals as :mod:`.ag_gemm`'s per-segment schedule;
what differs is how an SM runs its tiles. Two MMA warpgroups take alternate tiles
("ping-pong", ``num_warps=4``), so one's epilogue (round, store) runs beside the other's MMAs,
or one partition of two warpgroups takes every tile of up to 128x256 (cooperative,
``num_warps=8``; :mod:`.gluon_ws`); a single load warp does every TMA read and every wait for
a peer's rows, so the MMA warps never spin on communication. With communication off on one H200 it ran 0.95-0.99x the shipped table's
config on the training step's AG+GEMMs and on the grid's m <= 2048 shapes (llama3-8b
m = 1024: 1.08x cuBLAS against 1.17x), and lost to the table's 128x256 tiles on the largest
ones. Its standalone model (the AllGather+GEMM form on one GPU, no communication) is
``benchmarks/experiments/gluon_ws_gemm.py``.

Tile and signal schedule (rank ``r`` of ``W``, ``G`` programs, one per SM):

* Flat tile ``t`` over ``W * tiles_per_segment``: step ``t // tiles_per_segment`` visits
  segment ``(r + step) % W`` (:mod:`.tile_order`: local rows first, then ring order),
  GROUP_M-grouped inside the segment; odd steps walk their segment backwards
  (``serpentine``), so a step starts on the B columns the previous one ended on. Program ``p`` owns ``t = p, p + G, ...``; its ``j``-th
  tile belongs to MMA partition ``j % P`` (``P`` = 2 in ping-pong, 1 cooperative).
* **Load partition** (1 warp, 24 registers): every K-step of every tile of the program, in
  order, into a ring of ``num_stages`` shared-memory slots. Step 0's A rows come from the
  caller's shard ``x`` (no wait). Before the first load of a peer segment it waits (acquire,
  system scope, bounded: ``signals.wait_signal``, op AG+GEMM) for each of the segment's
  ``cdiv(m_local, chunk_rows)`` chunk signals ``flags[seg * chunks + c] >= epoch``, then
  fences the async proxy, so its TMA reads of the gathered workspace ``ag`` follow the
  acquire.
* **MMA partitions** (two of one warpgroup each, or one of two): per K-step wait ``ready``,
  issue an async ``wgmma``, keep one in flight, release the previous slot; after the tile,
  round to the output dtype into the partition's epilogue buffer and TMA-store it. In
  ping-pong the ``handoff`` barriers keep every ``ready`` wait at most one phase ahead (the argument and a randomized
  model: ``benchmarks/experiments/gluon_ws_gemm.py``, ``ws_protocol_model.py``); this needs
  ``k_tiles >= num_stages``.

Limits (the launcher runs :mod:`.ag_gemm` instead, with one warning naming why): ``m_local``
a multiple of ``block_m``; at least ``num_stages`` K-steps; bf16 or fp16; a Triton with Gluon;
not under the interpreter or phase traces. ``ag_merge_local`` and stream-K are the Triton
kernel's (stream-K is ignored here; ``GemmConfig`` refuses ``ag_merge_local`` with this
kernel).
"""

from typing import Optional

# (no `from __future__ import annotations`: Triton 3.6 checks an aggregate's attribute types
# against its class annotations, which that import would turn into strings)

from megatron_flux.kernels import gluon_ws
from megatron_flux.kernels.config import interpreting
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.launch import KernelLauncher
from megatron_flux.kernels.gluon_ws import (CONSUMER_REGS, GLUON_ERROR, aggregate,
                                            fence_async_shared, gl, gluon, tma)
from megatron_flux.kernels.signals import OP_AG_GEMM, fence_async_proxy, wait_signal
from megatron_flux.kernels.tile_order import grouped_tile, segment_of_step, serpentine

if gluon is not None:
    from megatron_flux.kernels.gluon_ws import b_operand, load_ab, mma_tile, ring_barriers, \
        tiles_of_program, tiles_per_segment, tma_descriptor, tma_store

    _OP_AG_GEMM = gl.constexpr(OP_AG_GEMM)

    @aggregate
    class _Args:
        x_desc: tma.tensor_descriptor
        ag_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        c_desc: tma.tensor_descriptor
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        c_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        handoff: gl.shared_memory_descriptor
        flags_ptr: gl.tensor
        err_ptr: gl.tensor
        m_local: gl.tensor
        N: gl.tensor
        K: gl.tensor
        rank: gl.tensor
        epoch: gl.tensor
        chunk_rows: gl.tensor
        max_spins: gl.tensor
        WORLD: gl.constexpr
        B_KN: gl.constexpr
        GROUP_M: gl.constexpr
        NUM_PROGRAMS: gl.constexpr
        PARTITIONS: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, x_desc, ag_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty,
                     handoff, flags_ptr, err_ptr, m_local, N, K, rank, epoch, chunk_rows,
                     max_spins, WORLD, B_KN, GROUP_M, NUM_PROGRAMS, PARTITIONS):
            self.x_desc = x_desc
            self.ag_desc = ag_desc
            self.b_desc = b_desc
            self.c_desc = c_desc
            self.a_bufs = a_bufs
            self.b_bufs = b_bufs
            self.c_bufs = c_bufs
            self.ready = ready
            self.empty = empty
            self.handoff = handoff
            self.flags_ptr = flags_ptr
            self.err_ptr = err_ptr
            self.m_local = m_local
            self.N = N
            self.K = K
            self.rank = rank
            self.epoch = epoch
            self.chunk_rows = chunk_rows
            self.max_spins = max_spins
            self.WORLD = gl.constexpr(WORLD)
            self.B_KN = gl.constexpr(B_KN)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.NUM_PROGRAMS = gl.constexpr(NUM_PROGRAMS)
            self.PARTITIONS = gl.constexpr(PARTITIONS)

    @gluon.jit
    def _tile(p, j):
        """This program's ``j``-th tile: ``(step, seg, a_row, c_row, off_n)``; ``a_row`` is
        relative to the shard at step 0 and to the workspace after it."""
        BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        tps = tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N)
        t = gl.program_id(0) + j * p.NUM_PROGRAMS
        step = t // tps
        seg = segment_of_step(step, p.rank, p.WORLD, False)
        pid_m, pid_n = grouped_tile(serpentine(t, step, tps), gl.cdiv(p.m_local, BLOCK_M),
                                    gl.cdiv(p.N, BLOCK_N), p.GROUP_M)
        c_row = seg * p.m_local + pid_m * BLOCK_M
        a_row = gl.where(step == 0, pid_m * BLOCK_M, c_row)
        return step, seg, a_row, c_row, pid_n * BLOCK_N

    @gluon.jit
    def _num_tiles(p):
        BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        return tiles_of_program(tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N), p.WORLD,
                                p.NUM_PROGRAMS)

    @gluon.jit
    def _wait_segment(p, seg):
        """Bounded acquire wait on every chunk signal of ``seg``, then the proxy fence."""
        chunks = gl.cdiv(p.m_local, p.chunk_rows)
        for c in range(chunks):
            idx = seg * chunks + c
            wait_signal(p.flags_ptr + idx, p.epoch, p.max_spins, p.err_ptr, _OP_AG_GEMM, p.rank, idx)
        fence_async_proxy(p.epoch, True)

    @gluon.jit
    def _load_partition(p):
        BLOCK_K: gl.constexpr = p.x_desc.block_type.shape[1]
        k_tiles = gl.cdiv(p.K, BLOCK_K)
        pos = 0
        waited = 0  # the last step whose segment has landed (step 0 is the local shard)
        for j in range(_num_tiles(p)):
            step, seg, a_row, c_row, off_n = _tile(p, j)
            if step > waited:  # a peer's segment: its chunks must have landed before any read
                _wait_segment(p, seg)
                waited = step
            for kk in range(k_tiles):
                if step == 0:
                    load_ab(p.x_desc, a_row, p.b_desc, off_n, p.a_bufs, p.b_bufs, p.ready,
                            p.empty, pos, kk, p.B_KN)
                else:
                    load_ab(p.ag_desc, a_row, p.b_desc, off_n, p.a_bufs, p.b_bufs, p.ready,
                            p.empty, pos, kk, p.B_KN)
                pos += 1

    @gluon.jit
    def _mma_partition(p, C: gl.constexpr):
        BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = p.x_desc.block_type.shape[1]
        # one warpgroup (ping-pong) or two stacked along M (cooperative)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8 // p.PARTITIONS, 1], instr_shape=[16, BLOCK_N, 16])
        k_tiles = gl.cdiv(p.K, BLOCK_K)
        c_buf = p.c_bufs.index(C)
        for j in range(C, _num_tiles(p), p.PARTITIONS):
            step, seg, a_row, c_row, off_n = _tile(p, j)
            acc = mma_tile(p.a_bufs, p.b_bufs, p.ready, p.empty, p.handoff, j, k_tiles, C,
                           p.PARTITIONS, p.B_KN, BLOCK_M, BLOCK_N, acc_layout)
            tma.store_wait(0)  # this partition's previous store has read its buffer out
            c_buf.store(acc.to(p.c_desc.dtype))
            fence_async_shared()
            tma_store(p.c_desc, [c_row, off_n], c_buf)
        tma.store_wait(0)

    @gluon.jit
    def _mma_partition_1(p):
        _mma_partition(p, 1)

    @gluon.jit(do_not_specialize=["rank", "epoch", "max_spins"])
    def ag_gemm_ws_kernel(x_ptr, ag_ptr, b_ptr, c_ptr, flags_ptr, err_ptr, x_hd, ag_hd, b_hd, c_hd,
                          m_local, N, K, ldb, rank,
                          epoch, chunk_rows, max_spins, WORLD: gl.constexpr, B_KN: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                          PARTITIONS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          HOST_DESC: gl.constexpr = False):
        """``c = AllGather_rows(x) @ b``: ``x`` ``[m_local, K]`` this rank's shard; ``ag``
        ``[WORLD * m_local, K]`` the gathered workspace, whose segment ``s`` is valid once its
        chunk signals ``flags[s * cdiv(m_local, chunk_rows) + c]`` hold ``epoch``; ``b``
        ``[K, N]`` row-major (B_KN) or a transposed row-major ``[N, K]`` (leading stride
        ``ldb``); ``c`` ``[WORLD * m_local, N]``; ``PARTITIONS`` MMA partitions (2: ping-pong,
        1: cooperative). Launch with :func:`.gluon_ws.launch_options`; descriptors are built on
        the device, or with HOST_DESC are ``x_hd`` / ``ag_hd`` / ``b_hd`` / ``c_hd``, encoded on
        the host with the same views and layouts (:func:`_host_descriptors`)."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        b_desc, b_bufs = b_operand(b_ptr, b_hd, K, N, ldb, B_KN, BLOCK_N, BLOCK_K, STAGES,
                                   HOST_DESC)
        x_desc = tma_descriptor(x_ptr, x_hd, [m_local, K], [K, 1], [BLOCK_M, BLOCK_K], a_layout,
                                HOST_DESC)
        ag_desc = tma_descriptor(ag_ptr, ag_hd, [WORLD * m_local, K], [K, 1], [BLOCK_M, BLOCK_K],
                                 a_layout, HOST_DESC)
        c_desc = tma_descriptor(c_ptr, c_hd, [WORLD * m_local, N], [N, 1], [BLOCK_M, BLOCK_N],
                                c_layout, HOST_DESC)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        c_bufs = gl.allocate_shared_memory(dtype, [PARTITIONS, BLOCK_M, BLOCK_N], c_layout)
        ready, empty, handoff = ring_barriers(STAGES)
        p = _Args(x_desc, ag_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, handoff,
                  flags_ptr, err_ptr, m_local, N, K, rank, epoch, chunk_rows, max_spins, WORLD,
                  B_KN, GROUP_M, NUM_PROGRAMS, PARTITIONS)
        if PARTITIONS == 2:
            gl.warp_specialize([(_mma_partition, (p, 0)), (_mma_partition_1, (p, )),
                                (_load_partition, (p, ))], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([(_mma_partition, (p, 0)), (_load_partition, (p, ))], [1], [24])
else:  # pragma: no cover
    ag_gemm_ws_kernel = None


smem_bytes = gluon_ws.smem_bytes
warn_fallback = gluon_ws.FallbackWarning("AG+GEMM", "ag_warp_specialized")


def unsupported_reason(x, cfg, *, trace=None) -> Optional[str]:
    """Why this call (``x`` this rank's ``[m_local, K]`` rows) cannot run
    :func:`ag_gemm_ws_kernel` (None: it can)."""
    if GLUON_ERROR is None and not interpreting() and trace is not None:
        return "phase traces exist only in the Triton kernel"
    return gluon_ws.unsupported_reason(x, x.shape[0], cfg)


def _host_descriptors(x, ag, b, out, world, m_local, n, k, ldb, b_kn, cfg):
    """``(x, ag, b, c)`` host descriptors of the views :func:`ag_gemm_ws_kernel` builds on the
    device without HOST_DESC."""
    hd = gluon_ws.host_descriptor
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    return (hd(x, [m_local, k], [k, 1], [bm, bk]),
            hd(ag, [world * m_local, k], [k, 1], [bm, bk]),
            gluon_ws.b_host_descriptor(b, n, k, ldb, b_kn, cfg),
            hd(out, [world * m_local, n], [n, 1], [bm, bn]))


def launch_ag_gemm_ws(x, ag, b, out, flags, err, *, rank, world, epoch, cfg, num_sms, max_spins,
                      host_descriptors=True, direct=True):
    """:func:`ag_gemm_ws_kernel` on the current stream, with :func:`.ag_gemm.launch_ag_gemm`'s
    arguments (the caller has checked :func:`unsupported_reason`). ``cfg`` gives block_m/n/k,
    num_stages, group_m and chunk_rows, and its num_warps the form (4: ping-pong, 8:
    cooperative; :func:`.gluon_ws.launch_options`). ``host_descriptors`` and
    ``direct``: as :func:`.ag_gemm.launch_ag_gemm`."""
    m_local, k = x.shape
    n, b_kn, ldb, grid = gluon_ws.launch_geometry(b, m_local, world, cfg, num_sms)
    host_desc = bool(host_descriptors)
    descs = (_host_descriptors(x, ag, b, out, world, m_local, n, k, ldb, b_kn, cfg)
             if host_desc else (err, err, err, err))  # unused without HOST_DESC
    ensure_descriptor_allocator()
    _LAUNCH(grid, (x, ag, b, out, flags, err, *descs, m_local, n, k, ldb, rank, epoch,
                   cfg.chunk_rows, max_spins),
            dict(HOST_DESC=host_desc, WORLD=world, B_KN=b_kn, BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 STAGES=cfg.num_stages, NUM_PROGRAMS=grid, PARTITIONS=gluon_ws.mma_partitions(cfg),
                 CONSUMER_REGS=CONSUMER_REGS),
            num_stages=None, direct=direct, **gluon_ws.launch_options(cfg))


_LAUNCH = KernelLauncher(ag_gemm_ws_kernel) if ag_gemm_ws_kernel is not None else None
