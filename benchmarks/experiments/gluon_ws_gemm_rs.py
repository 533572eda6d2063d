"""Experiment: GEMM+ReduceScatter on the warp-specialized Gluon GEMM (``gluon_ws_gemm.py``).

Why: with communication off, the package's GEMM+RS runs 1.08-1.14x cuBLAS on the training
step's short-K shapes (proj k = 2048, qkv dgrad k = 3072 per rank, m = 8192; session 19), while
a plain GEMM of the same tile runs 1.01-1.03x. Most of the loss is the reduction epilogue of
the own tiles (reading the peers' partials costs 6-7 %: the ``noread`` diagnostic), which a
non-warp-specialized kernel cannot overlap with MMAs: flattening the loop, an L2 prefetch of the
partials and starting the accumulator from them were all measured level or slower. The Gluon
ping-pong GEMM runs 0.98-1.02x cuBLAS on those shapes (session 19), and in it one MMA
partition's epilogue runs while the other's MMAs do. This puts the package's GEMM+RS schedule
on it, and times it with communication off.

Tile and signal schedule (rank ``r`` of ``W``; the package's, :mod:`megatron_flux.kernels.gemm_rs`):

* Flat tile ``t`` over ``W * tiles_per_segment``: step ``t // tiles_per_segment``; steps
  ``0..W-2`` are the peers' segments ``r+1, r+2, ...`` (producer), step ``W-1`` the own segment
  (consumer); odd steps walk their segment backwards (``serpentine``), GROUP_M-grouped inside.
  Program ``p`` owns ``t = p, p + G, ...``; its ``j``-th tile goes to MMA partition ``j % 2``.
* **Load partition** (1 warp): every K-step of every tile of the program, in order, through a
  ring of ``STAGES`` shared-memory slots (``ready`` / ``empty`` barriers; the ``handoff``
  protocol of ``gluon_ws_gemm.py``).
* **MMA partitions** (one warpgroup each). Producer tile: round the accumulator to bf16, TMA-store
  it into the owner's slot ``r`` (``data_ptrs[owner] + r * m_local * N``). Before its first own
  tile (or at its end, if it has none) a partition drains its stores and counts itself in at
  ``flags[r][W]``; the last of the grid's ``2 G`` partitions resets the counter and raises
  ``flags[owner][r] = epoch`` for every peer owner (one ``fence.acq_rel.sys``, relaxed writes).
  Own tile: after its MMAs, the partition's first own tile waits (acquire, bounded) for every
  peer's signal; then the peers' partials are read straight into registers in rank order
  ``0..W-1`` and added to the fp32 accumulator (+ bias once), the sum rounded and TMA-stored
  to ``out``. The reads and adds of one partition run while the other partition's MMAs run.
* The scalar atomics run on a ``[1]`` tensor whose one element a single thread owns, with
  masks instead of branches; the partition's threads meet at a barrier (Triton makes it a
  named barrier of the partition's 128 threads) between the store drain and the arrival.

Not in the package (one GPU, communication off): ``python benchmarks/experiments/gluon_ws_gemm_rs.py
--model-shapes l8proj:4096:4096:4096 --rs-k ffn --m 8192``, or ``--compile-only`` (no GPU).
``m_local`` must be a multiple of BLOCK_M.
"""

import argparse

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from megatron_flux.kernels.signals import fence_async_proxy, wait_signal
from megatron_flux.kernels.tile_order import grouped_tile, segment_of_step, serpentine

MAXNREG = 168
#: a barrier of the calling partition's threads (Triton 3.6 ``thread_barrier``, 3.9 ``barrier``)
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@aggregate
class _Args:
    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    out_desc: tma.tensor_descriptor
    slots_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    c_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    handoff: gl.shared_memory_descriptor
    pload: gl.shared_memory_descriptor
    data_ptr: gl.tensor
    data_ptrs: gl.tensor
    flag_ptrs: gl.tensor
    bias_ptr: gl.tensor
    err_ptr: gl.tensor
    m_local: gl.tensor
    N: gl.tensor
    K: gl.tensor
    rank: gl.tensor
    epoch: gl.tensor
    max_spins: gl.tensor
    WORLD: gl.constexpr
    B_KN: gl.constexpr
    HAS_BIAS: gl.constexpr
    GROUP_M: gl.constexpr
    NUM_PROGRAMS: gl.constexpr
    ASYNC_FENCE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, b_desc, out_desc, slots_desc, a_bufs, b_bufs, c_bufs, ready, empty,
                 handoff, pload, data_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr, m_local, N, K, rank,
                 epoch, max_spins, WORLD, B_KN, HAS_BIAS, GROUP_M, NUM_PROGRAMS, ASYNC_FENCE):
        self.a_desc = a_desc
        self.b_desc = b_desc
        self.out_desc = out_desc
        self.slots_desc = slots_desc
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.c_bufs = c_bufs
        self.ready = ready
        self.empty = empty
        self.handoff = handoff
        self.pload = pload
        self.data_ptr = data_ptr
        self.data_ptrs = data_ptrs
        self.flag_ptrs = flag_ptrs
        self.bias_ptr = bias_ptr
        self.err_ptr = err_ptr
        self.m_local = m_local
        self.N = N
        self.K = K
        self.rank = rank
        self.epoch = epoch
        self.max_spins = max_spins
        self.WORLD = gl.constexpr(WORLD)
        self.B_KN = gl.constexpr(B_KN)
        self.HAS_BIAS = gl.constexpr(HAS_BIAS)
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.NUM_PROGRAMS = gl.constexpr(NUM_PROGRAMS)
        self.ASYNC_FENCE = gl.constexpr(ASYNC_FENCE)


@gluon.jit
def _tiles_per_segment(p):
    BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
    return gl.cdiv(p.m_local, BLOCK_M) * gl.cdiv(p.N, BLOCK_N)


@gluon.jit
def _tile(p, j):
    """This program's ``j``-th tile: ``(step, seg, a_row, off_m, off_n)``, ``off_m`` inside the
    segment, ``a_row`` in ``A``."""
    BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
    tps = _tiles_per_segment(p)
    t = gl.program_id(0) + j * p.NUM_PROGRAMS
    step = t // tps
    seg = segment_of_step(step, p.rank, p.WORLD, True)
    pid_m, pid_n = grouped_tile(serpentine(t, step, tps), gl.cdiv(p.m_local, BLOCK_M),
                                gl.cdiv(p.N, BLOCK_N), p.GROUP_M)
    off_m = pid_m * BLOCK_M
    return step, seg, seg * p.m_local + off_m, off_m, pid_n * BLOCK_N


@gluon.jit
def _num_tiles(p):
    return gl.cdiv(p.WORLD * _tiles_per_segment(p) - gl.program_id(0), p.NUM_PROGRAMS)


@gluon.jit
def _load_partition(p):
    BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.type.shape[0]
    nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
    k_tiles = gl.cdiv(p.K, BLOCK_K)
    pos = 0
    for j in range(_num_tiles(p)):
        step, seg, a_row, off_m, off_n = _tile(p, j)
        for kk in range(k_tiles):
            s = pos % STAGES
            mbarrier.wait(p.empty.index(s), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(p.ready.index(s), nbytes)
            tma.async_copy_global_to_shared(p.a_desc, [a_row, kk * BLOCK_K], p.ready.index(s),
                                            p.a_bufs.index(s))
            if p.B_KN:
                tma.async_copy_global_to_shared(p.b_desc, [kk * BLOCK_K, off_n], p.ready.index(s),
                                                p.b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(p.b_desc, [off_n, kk * BLOCK_K], p.ready.index(s),
                                                p.b_bufs.index(s))
            pos += 1


@gluon.jit
def _one(p, layout: gl.constexpr):
    """A ``[1]`` int32 tensor (one owning thread does its atomics; masks replace branches)."""
    return gl.arange(0, 1, layout)


@gluon.jit
def _arrive(p, layout: gl.constexpr):
    """Drain this partition's TMA stores, meet the partition's other threads, count it in at
    the grid counter; the last of the grid's ``2 G`` partitions resets the counter and raises
    every peer owner's signal ``flags[owner][rank]`` (release pattern: one system fence, then
    relaxed writes, all masked to the last)."""
    zero = _one(p, layout)
    # every thread waits for its own bulk groups (the issuing thread's are the stores)
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;",
                              "=r,r", [zero], dtype=gl.int32, is_pure=False, pack=1)
    _partition_barrier()  # the partition's threads (a named barrier inside the partition)
    my_flags = gl.load(p.flag_ptrs + p.rank + zero).to(gl.pointer_type(gl.int32))
    counter = my_flags + p.WORLD
    arrived = gl.atomic_add(counter, 1 + zero, sem="acq_rel", scope="sys")
    last = arrived == 2 * p.NUM_PROGRAMS - 1
    gl.atomic_xchg(counter, zero, mask=last, sem="relaxed", scope="gpu")
    gl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, $1;", "=r,r", [zero],
                              dtype=gl.int32, is_pure=False, pack=1)
    for owner_step in gl.static_range(p.WORLD - 1):
        seg = segment_of_step(owner_step, p.rank, p.WORLD, True)
        owner_flags = gl.load(p.flag_ptrs + seg + zero).to(gl.pointer_type(gl.int32))
        gl.atomic_xchg(owner_flags + p.rank, p.epoch + zero, mask=last, sem="relaxed", scope="sys")


@gluon.jit
def _mma_partition(p, C: gl.constexpr):
    BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    one_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    k_tiles = gl.cdiv(p.K, BLOCK_K)
    c_buf = p.c_bufs.index(C)
    slot = (p.rank * p.m_local).to(gl.int64) * p.N
    # the one peer's slot at TP 2 (the partition builds its push descriptors per tile above)
    peer = segment_of_step(0, p.rank, p.WORLD, True)
    dst0 = gl.load(p.data_ptrs + peer).to(gl.pointer_type(gl.bfloat16)) + slot
    push0 = tma.make_tensor_descriptor(dst0, [p.m_local, p.N], [p.N, 1], [BLOCK_M, BLOCK_N],
                                       p.out_desc.layout)
    src0 = (p.rank == 0).to(gl.int32)  # the first peer in rank order
    nbytes: gl.constexpr = p.slots_desc.block_type.nbytes
    arrived = 0
    waited = 0
    nload = 0
    for j in range(C, _num_tiles(p), 2):
        mbarrier.wait(p.handoff.index(C), ((j - 2 + C) // 2) & 1, pred=j > 0)
        step, seg, a_row, off_m, off_n = _tile(p, j)
        own = step == p.WORLD - 1
        if own and arrived == 0:
            _arrive(p, one_layout)
            arrived = 1
        prefetched = 0
        if own and waited == 1:
            # the peers' signals were acquired at an earlier own tile: read the first peer's
            # partial into the epilogue buffer now, beside this tile's MMAs
            tma.store_wait(0)
            mbarrier.expect(p.pload.index(C), nbytes)
            tma.async_copy_global_to_shared(p.slots_desc, [src0 * p.m_local + off_m, off_n],
                                            p.pload.index(C), c_buf)
            prefetched = 1
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        prev = 0
        for kk in range(k_tiles):
            pos = j * k_tiles + kk
            s = pos % STAGES
            mbarrier.wait(p.ready.index(s), (pos // STAGES) & 1)
            mbarrier.arrive(p.handoff.index(1 - C), count=1, pred=kk == k_tiles - 1)
            a_s = p.a_bufs.index(s)
            if p.B_KN:
                b_s = p.b_bufs.index(s)
            else:
                b_s = p.b_bufs.index(s).permute((1, 0))
            acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
            acc, a_s, b_s = warpgroup_mma_wait(1, deps=(acc, a_s, b_s))
            mbarrier.arrive(p.empty.index(prev), count=1, pred=kk > 0)
            prev = s
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(p.empty.index(prev), count=1)
        if own:
            if waited == 0:
                my_flags = gl.load(p.flag_ptrs + p.rank).to(gl.pointer_type(gl.int32))
                for src in range(p.WORLD):
                    if src != p.rank:
                        wait_signal(my_flags + src, p.epoch, p.max_spins, p.err_ptr, 2, p.rank, src)
                fence_async_proxy(p.epoch, p.ASYNC_FENCE)  # TMA reads after the acquire
                waited = 1
            for src in gl.static_range(p.WORLD):  # rank order; the own partial is acc
                if src != p.rank:
                    if (prefetched == 0) | (src != src0):
                        tma.store_wait(0)
                        mbarrier.expect(p.pload.index(C), nbytes)
                        tma.async_copy_global_to_shared(p.slots_desc, [src * p.m_local + off_m, off_n],
                                                        p.pload.index(C), c_buf)
                    mbarrier.wait(p.pload.index(C), nload & 1)
                    nload += 1
                    acc += c_buf.load(acc_layout).to(gl.float32)
                    _partition_barrier()  # every thread has read the buffer before it is reused
                    fence_async_shared()
            if p.HAS_BIAS:
                c = off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, acc_layout))
                acc += gl.load(p.bias_ptr + c, mask=c < p.N, other=0.0).to(gl.float32)[None, :]
            tma.store_wait(0)
            c_buf.store(acc.to(p.out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(p.out_desc, [off_m, off_n], c_buf)
        else:
            tma.store_wait(0)
            c_buf.store(acc.to(p.out_desc.dtype))
            fence_async_shared()
            if p.WORLD == 2:
                tma.async_copy_shared_to_global(push0, [off_m, off_n], c_buf)
            else:
                dst = gl.load(p.data_ptrs + seg).to(gl.pointer_type(gl.bfloat16)) + slot
                push = tma.make_tensor_descriptor(dst, [p.m_local, p.N], [p.N, 1],
                                                  [BLOCK_M, BLOCK_N], p.out_desc.layout)
                tma.async_copy_shared_to_global(push, [off_m, off_n], c_buf)
    if arrived == 0:
        _arrive(p, one_layout)
    tma.store_wait(0)


@gluon.jit
def _mma_partition_1(p):
    _mma_partition(p, 1)


@gluon.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def ws_gemm_rs_kernel(a_ptr, b_ptr, out_ptr, data_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr,
                      m_local, N, K, ldb, rank, epoch, max_spins, WORLD: gl.constexpr,
                      B_KN: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, ASYNC_FENCE: gl.constexpr):
    """``out = ReduceScatter_rows(a @ b) (+ bias)``: ``a`` [WORLD * m_local, K], ``b`` [K, N]
    row-major (B_KN) or a transposed row-major [N, K] (leading stride ``ldb``), ``out``
    [m_local, N]; ``data_ptr`` this rank's ``[WORLD, m_local, N]`` slot region, ``data_ptrs`` /
    ``flag_ptrs`` every rank's (as :func:`megatron_flux.kernels.gemm_rs.gemm_rs_kernel`).
    Launch with ``num_warps=4`` and ``maxnreg=MAXNREG``."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    a_desc = tma.make_tensor_descriptor(a_ptr, [WORLD * m_local, K], [K, 1], [BLOCK_M, BLOCK_K],
                                        a_layout)
    if B_KN:
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
        b_desc = tma.make_tensor_descriptor(b_ptr, [K, N], [ldb, 1], [BLOCK_K, BLOCK_N], b_layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, BLOCK_N], b_layout)
    else:
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
        b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [ldb, 1], [BLOCK_N, BLOCK_K], b_layout)
        b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    out_desc = tma.make_tensor_descriptor(out_ptr, [m_local, N], [N, 1], [BLOCK_M, BLOCK_N], c_layout)
    # this rank's slots as one [WORLD * m_local, N] matrix (m_local % BLOCK_M == 0: no tile
    # crosses a slot)
    slots_desc = tma.make_tensor_descriptor(data_ptr, [WORLD * m_local, N], [N, 1],
                                            [BLOCK_M, BLOCK_N], c_layout)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_N], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    handoff = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pload = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(handoff.index(i), count=1)
        mbarrier.init(pload.index(i), count=1)
    p = _Args(a_desc, b_desc, out_desc, slots_desc, a_bufs, b_bufs, c_bufs, ready, empty, handoff, pload,
              data_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr, m_local, N, K, rank, epoch,
              max_spins, WORLD, B_KN, HAS_BIAS, GROUP_M, NUM_PROGRAMS, ASYNC_FENCE)
    gl.warp_specialize([(_mma_partition, (p, 0)), (_mma_partition_1, (p, )),
                        (_load_partition, (p, ))], [4, 1], [CONSUMER_REGS, 24])


#: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)
CONFIGS = [(128, 128, 64, 5, 232), (128, 128, 64, 4, 232)]


def launch_ws_gemm_rs(a, b, out, data, data_ptrs, flag_ptrs, bias, err, *, rank, world, epoch,
                      cfg, num_sms, max_spins, ws_cfg=CONFIGS[0], **_ignored):
    """:func:`ws_gemm_rs_kernel` with ``launch_gemm_rs``'s arguments (its ``cfg`` is ignored:
    ``ws_cfg`` = ``(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)``)."""
    from megatron_flux.kernels.descriptors import ensure_descriptor_allocator

    bm, bn, bk, stages, regs = ws_cfg
    m, k = a.shape
    m_local = m // world
    n = b.shape[1]
    b_kn = b.stride(1) == 1
    if m_local % bm:
        raise ValueError(f"ws_gemm_rs: m_local = {m_local} is not a multiple of BLOCK_M = {bm}")
    if triton.cdiv(k, bk) < stages:
        raise ValueError(f"ws_gemm_rs: K = {k} has fewer than STAGES = {stages} K-steps of {bk}")
    grid = min(num_sms, world * (m_local // bm) * triton.cdiv(n, bn))
    ensure_descriptor_allocator()
    ws_gemm_rs_kernel[(grid,)](a, b, out, data, data_ptrs, flag_ptrs,
                               bias if bias is not None else data, err, m_local, n, k,
                               b.stride(0) if b_kn else b.stride(1), rank, epoch, max_spins,
                               WORLD=world, B_KN=b_kn, HAS_BIAS=bias is not None, BLOCK_M=bm,
                               BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages, NUM_PROGRAMS=grid,
                               CONSUMER_REGS=regs, ASYNC_FENCE=True, num_warps=4, maxnreg=MAXNREG)


def compile_only():
    """Build the kernel for sm_90a (no GPU): shared memory, and the barrier instructions of the
    partitions (``bar.sync`` ids and thread counts)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [q.name for q in ws_gemm_rs_kernel.params]
    types = {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32"}
    for world, b_kn, bias in ((2, False, False), (2, True, True), (4, False, False)):
        for bm, bn, bk, stages, regs in CONFIGS:
            consts = dict(WORLD=world, B_KN=b_kn, HAS_BIAS=bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          GROUP_M=8, STAGES=stages, NUM_PROGRAMS=132, CONSUMER_REGS=regs,
                          ASYNC_FENCE=True)
            sig = {q: "constexpr" if q in consts else types.get(q, "*bf16" if q.endswith("_ptr") else "i32")
                   for q in names}
            src = GluonASTSource(ws_gemm_rs_kernel, sig,
                                 constexprs={(names.index(k),): v for k, v in consts.items()}, attrs={})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=4, maxnreg=MAXNREG))
            ptx = kernel.asm["ptx"]
            bars = sorted(set(re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+[^;]*;", ptx)))
            print(f"world={world} b_kn={b_kn} bias={bias} {bm}x{bn}x{bk}/{stages}: "
                  f"shared {kernel.metadata.shared} B; barriers {bars}", flush=True)


def main(argv=None):
    import torch

    from common import add_timing_args, named_configs, problem, time_and_check, write_record
    from megatron_flux.bench.kernel_vs_cublas import add_model_args, model_shapes, rs_on_one_gpu
    from megatron_flux.bench.plain_gemm import launch_plain_gemm
    from megatron_flux.tuning.provider import TableConfigProvider

    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p, ["gpt3-175b", "llama3-70b", "llama3-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[8192])
    p.add_argument("--compile-only", action="store_true")
    add_timing_args(p)
    args = p.parse_args(argv)
    if args.compile_only:
        compile_only()
        return
    table = TableConfigProvider()
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for model, n, k in model_shapes(args, "rs"):
        for m in args.m:
            a, w, full = problem(m, n, k)
            cfg = named_configs(table, "rs", m, n, k, args.tp)["table"]
            m_local = m // args.tp
            fns = {"cublas": lambda: torch.matmul(a, w.t())}
            outs = {}
            plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns["plain"] = lambda: launch_plain_gemm(a, w, plain_out, cfg, sms)
            outs["plain"] = (plain_out, lambda: full)
            launch, out, data = rs_on_one_gpu(a, w, args.tp, err)
            fns["fused"] = lambda: launch(cfg)
            outs["fused"] = (out, lambda: full[:m_local] + sum(data[s].float() for s in range(1, args.tp)))
            for ws_cfg in CONFIGS:
                name = "ws-" + "x".join(map(str, ws_cfg[:4]))
                wl, wout, wdata = rs_on_one_gpu(
                    a, w, args.tp, err,
                    lambda *x, ws_cfg=ws_cfg, **kw: launch_ws_gemm_rs(*x, ws_cfg=ws_cfg, **kw))
                fns[name] = lambda wl=wl: wl(cfg)
                outs[name] = (wout, lambda wdata=wdata: full[:m_local]
                              + sum(wdata[s].float() for s in range(1, args.tp)))
            title = f"RS {model:10s} m={m:5d} n={n:5d} k={k:5d}"
            rows += time_and_check(fns, outs, args, title,
                                   {"op": "rs", "model": model, "m": m, "n": n, "k": k,
                                    "config": cfg.to_dict()})
            assert err.tolist() == [0, 0, 0, 0], err.tolist()
    write_record(args.json, rows, tp=args.tp)


if __name__ == "__main__":
    main()
