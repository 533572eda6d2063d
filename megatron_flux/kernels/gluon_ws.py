"""What the warp-specialized Gluon kernels (:mod:`.ag_gemm_ws`, :mod:`.gemm_rs_ws`) share: the
Gluon imports (names moved between Triton 3.6 and 3.9), their register and shared-memory
budget, the K loop of one tile, and the fallback rule of their launchers.

A program is one CTA per SM: one load warp (24 registers) fills a ring of shared-memory slots
with every K-step of every tile of the program, in order. The MMA warps come in one of two
forms, chosen by the config's ``num_warps``:

* ``num_warps=4``, **ping-pong**: two MMA partitions of one warpgroup each (``CONSUMER_REGS``
  registers) take alternate tiles, so one's epilogue runs beside the other's MMAs; tiles of
  at most 128x128 (one warpgroup's accumulator). The ``handoff`` barriers keep every
  ``ready`` wait at most one phase ahead (the argument, and a randomized model of the
  protocol: ``benchmarks/experiments/gluon_ws_gemm.py`` and ``ws_protocol_model.py``); this
  needs ``k_tiles >= stages``.
* ``num_warps=8``, **cooperative**: one MMA partition of two warpgroups takes every tile, each
  warpgroup 64 of its 128 rows, so a tile can be 128x256 (less shared-memory and L2 traffic
  per FLOP, which long K needs); the epilogue does not overlap the MMAs, only the load warp's
  next loads. No handoff: one partition consumes the ring in order.
"""

import functools
import warnings
from typing import Optional

import torch
import triton

try:  # Gluon: Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from triton.language.core import _aggregate as aggregate
    GLUON_ERROR: Optional[str] = None
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    aggregate = GluonTensorDescriptor = None
    GLUON_ERROR = f"this Triton has no Gluon ({exc})"

from megatron_flux.kernels.config import interpreting, mma_partitions  # noqa: F401 (re-exported)
from megatron_flux.kernels.descriptors import bind_descriptor

#: registers per thread of the whole CTA (65536 / 384 threads, a multiple of 8). Triton pads a
#: warp-specialized CTA to whole warpgroups, so both forms launch 12 warps (4 + 4 + 1, or 8 + 1,
#: plus idle ones); ``setmaxnreg`` then gives the load warp 24, a ping-pong MMA partition
#: CONSUMER_REGS and the cooperative one 240 (Triton 3.6's sm_90 PTX; a 224 cap was refused at
#: launch: 384 threads required, 256 allowed)
MAXNREG = 168
CONSUMER_REGS = 232
#: Hopper's dynamic shared memory per block
SMEM_LIMIT = 232448

if gluon is not None:
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # a barrier of the calling partition's threads (a named barrier inside a partition)
    partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

    @gluon.jit
    def tiles_per_segment(m_local, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Output tiles in one rank's ``m_local`` rows."""
        return gl.cdiv(m_local, BLOCK_M) * gl.cdiv(N, BLOCK_N)

    @gluon.jit
    def tiles_of_program(tiles_per_seg, WORLD: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        """How many of the ``WORLD * tiles_per_seg`` flat tiles this program owns (``t = p,
        p + G, ...``)."""
        return gl.cdiv(WORLD * tiles_per_seg - gl.program_id(0), NUM_PROGRAMS)

    @gluon.jit
    def mma_tile(a_bufs, b_bufs, ready, empty, handoff, j, k_tiles, C: gl.constexpr,
                 PARTITIONS: gl.constexpr, B_KN: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, acc_layout: gl.constexpr):
        """MMA partition ``C``'s tile ``j`` (the program's ``j``-th, every tile ``k_tiles``
        K-steps): :func:`mma_steps` from ring position ``j * k_tiles``."""
        return mma_steps(a_bufs, b_bufs, ready, empty, handoff, j, j * k_tiles, k_tiles, C,
                         PARTITIONS, B_KN, BLOCK_M, BLOCK_N, acc_layout)

    @gluon.jit
    def mma_steps(a_bufs, b_bufs, ready, empty, handoff, j, pos0, n_steps, C: gl.constexpr,
                  PARTITIONS: gl.constexpr, B_KN: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, acc_layout: gl.constexpr):
        """MMA partition ``C``'s tile ``j`` (the program's ``j``-th), ``n_steps`` K-steps from
        ring position ``pos0`` (at least ``STAGES`` of them in ping-pong): in ping-pong
        (``PARTITIONS == 2``) first wait until the other partition's tile ``j - 1`` has all its
        slots; then per K-step wait ``ready``, issue an async ``wgmma``, keep one in flight and
        release the previous step's slot; returns the fp32 accumulator, every slot released."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        if PARTITIONS == 2:
            # (j - 2 + C) // 2 is tile j - 1's index among the other partition's tiles
            mbarrier.wait(handoff.index(C), ((j - 2 + C) // 2) & 1, pred=j > 0)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        prev = 0
        for kk in range(n_steps):
            pos = pos0 + kk
            s = pos % STAGES
            mbarrier.wait(ready.index(s), (pos // STAGES) & 1)
            if PARTITIONS == 2:
                # the tile's last slot has landed: the other partition may start its next tile
                mbarrier.arrive(handoff.index(1 - C), count=1, pred=kk == n_steps - 1)
            a_s = a_bufs.index(s)
            if B_KN:
                b_s = b_bufs.index(s)
            else:
                b_s = b_bufs.index(s).permute((1, 0))
            acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
            acc, a_s, b_s = warpgroup_mma_wait(1, deps=(acc, a_s, b_s))
            # only this step's MMA is in flight: the previous step's slot has been read
            mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)
            prev = s
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(prev), count=1)
        return acc

    @gluon.jit
    def tma_descriptor(ptr, host_desc, shape, strides, block_shape, layout: gl.constexpr,
                       HOST_DESC: gl.constexpr):
        """A TMA descriptor of ``ptr``'s memory seen as ``shape`` / ``strides`` (elements) with
        ``block_shape`` boxes in shared-memory ``layout``: ``host_desc`` itself when it arrived
        host-encoded with that view and layout (HOST_DESC, :func:`host_descriptor`), else built
        on the device."""
        if HOST_DESC:
            desc = host_desc
        else:
            desc = tma.make_tensor_descriptor(ptr, shape, strides, block_shape, layout)
        return desc

    @gluon.jit
    def b_operand(b_ptr, b_hd, K, N, ldb, B_KN: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr, HOST_DESC: gl.constexpr):
        """B's TMA descriptor and its ring of ``STAGES`` shared-memory slots: ``b`` ``[K, N]``
        row-major (B_KN, boxes ``[BK, BN]``) or a transposed row-major ``[N, K]`` (boxes
        ``[BN, BK]``), leading stride ``ldb``; with HOST_DESC the descriptor is ``b_hd``,
        encoded on the host with the same view and layout (:func:`host_descriptor`)."""
        dtype: gl.constexpr = b_ptr.dtype.element_ty
        if B_KN:
            b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
            b_desc = tma_descriptor(b_ptr, b_hd, [K, N], [ldb, 1], [BLOCK_K, BLOCK_N], b_layout,
                                    HOST_DESC)
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_layout)
        else:
            b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
            b_desc = tma_descriptor(b_ptr, b_hd, [N, K], [ldb, 1], [BLOCK_N, BLOCK_K], b_layout,
                                    HOST_DESC)
            b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
        return b_desc, b_bufs

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr):
        """The ring's ``ready`` and ``empty`` barriers (one per slot) and the two ping-pong
        ``handoff`` barriers, each initialized with count 1."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        handoff = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(handoff.index(i), count=1)
        return ready, empty, handoff

    @gluon.jit
    def load_ab(a_desc, a_row, b_desc, off_n, a_bufs, b_bufs, ready, empty, pos, kk,
                B_KN: gl.constexpr):
        """The load warp's K-step ``kk`` of a tile into ring slot ``pos % STAGES``: wait until
        the slot is free, expect both boxes, issue the two TMA loads."""
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        s = pos % STAGES
        mbarrier.wait(empty.index(s), ((pos // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma_load(a_desc, [a_row, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
        if B_KN:
            tma_load(b_desc, [kk * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
        else:
            tma_load(b_desc, [off_n, kk * BLOCK_K], ready.index(s), b_bufs.index(s))


def launch_options(cfg) -> dict:
    """``num_warps`` (the default MMA partition's) and ``maxnreg`` of a launch for ``cfg``."""
    return dict(num_warps=4 if mma_partitions(cfg) == 2 else 8, maxnreg=MAXNREG)


def launch_geometry(b, m_local: int, world: int, cfg, num_sms: int):
    """``(n, b_kn, ldb, grid)`` of a launch: B's width, layout (``[K, N]`` row-major, else a
    transposed ``[N, K]``) and leading stride, and the persistent grid (one program per SM,
    at most one per output tile: row tiles over every rank's rows, which is ``world`` times a
    segment's where ``m_local`` is a multiple of ``block_m``, and also counts a tile space
    whose tiles span segments, as merged GEMM+RS rows)."""
    n = b.shape[1]
    b_kn = b.stride(1) == 1
    grid = min(num_sms, -(-world * m_local // cfg.block_m) * -(-n // cfg.block_n))
    return n, b_kn, b.stride(0) if b_kn else b.stride(1), grid


@functools.lru_cache(maxsize=None)
def _shared_layout(block_shape: tuple, torch_dtype):
    """``NVMMASharedLayout.get_default_for`` of a box (about 6 µs a call: cached, as a launch
    builds up to four descriptors)."""
    from triton.experimental.gluon import language as gl

    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def host_descriptor(t, shape, strides, block_shape):
    """A host-encoded Gluon TMA descriptor of ``t``'s memory seen as ``shape`` / ``strides``,
    with the shared-memory layout the kernels use for that box
    (``NVMMASharedLayout.get_default_for``), so it matches their buffers."""
    layout = _shared_layout(tuple(block_shape), t.dtype)
    return bind_descriptor(GluonTensorDescriptor, t, shape, strides, block_shape, layout)


def b_host_descriptor(b, n, k, ldb, b_kn, cfg):
    """:func:`host_descriptor` of B as :func:`b_operand` views it."""
    if b_kn:
        return host_descriptor(b, [k, n], [ldb, 1], [cfg.block_k, cfg.block_n])
    return host_descriptor(b, [n, k], [ldb, 1], [cfg.block_n, cfg.block_k])


def smem_bytes(cfg, elem_bytes: int = 2) -> int:
    """Shared memory a kernel takes for ``cfg``, at most: the A/B ring, one epilogue tile per
    MMA partition, and 1 KiB for barriers and alignment (compiled for sm_90a, 128x128x64 with
    5 stages took 229 760 B against 230 400 here; ``tests/unit/test_kernels_compile.py`` checks the
    bound)."""
    ring = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * elem_bytes
    return ring + mma_partitions(cfg) * cfg.block_m * cfg.block_n * elem_bytes + 1024


def unsupported_reason(a, m_local: Optional[int], cfg) -> Optional[str]:
    """Why a call with A ``a`` (``[rows, K]``) and ``m_local`` rows per rank cannot run on a
    warp-specialized kernel with ``cfg`` (None: it can). ``m_local=None``: a tile space over
    every rank's rows, where tiles may span segments, so any row count works."""
    return environment_reason(a) or shape_reason(m_local, a.shape[1], cfg, a.element_size())


def environment_reason(a) -> Optional[str]:
    """The part of :func:`unsupported_reason` that does not depend on the shape: a Triton with
    Gluon, not the CPU interpreter, A in bf16 or fp16."""
    import torch

    if GLUON_ERROR is not None:
        return GLUON_ERROR
    if interpreting():
        return "the CPU interpreter runs no Gluon"
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {a.dtype} (bf16 or fp16 only)"
    return None


def shape_reason(m_local: Optional[int], k: int, cfg, element_size: int = 2) -> Optional[str]:
    """The part of :func:`unsupported_reason` that depends on the shape and the config alone
    (``megatron-flux plan`` asks it without a GPU): rows per rank a multiple of ``block_m``
    (unless ``m_local`` is None), at least ``num_stages`` K-steps, shared memory."""
    if m_local is not None and m_local % cfg.block_m:
        return f"{m_local} rows per rank are not a multiple of block_m={cfg.block_m}"
    if -(-k // cfg.block_k) < cfg.num_stages:  # (triton.cdiv is slow on the host)
        return f"K={k} has fewer than num_stages={cfg.num_stages} steps of block_k={cfg.block_k}"
    if smem_bytes(cfg, element_size) > SMEM_LIMIT:
        return f"needs {smem_bytes(cfg, element_size)} B of shared memory"
    return None


class FallbackWarning:
    """One warning per reason that a ``knob`` config of ``op`` runs the Triton kernel instead."""

    def __init__(self, op: str, knob: str):
        self.op, self.knob, self.seen = op, knob, set()

    def __call__(self, reason: str) -> None:
        if reason not in self.seen:
            self.seen.add(reason)
            warnings.warn(f"megatron-flux {self.op}: {self.knob} config runs the Triton kernel "
                          f"instead ({reason})", stacklevel=3)
