"""Experiment: a warp-specialized persistent Hopper GEMM in Gluon, ``C = A @ B^T`` (bf16), in
the AllGather+GEMM form (``WORLD = 1`` is the plain GEMM).

Why: Triton 3.6's persistent TMA GEMM is not warp-specialized on Hopper. While a program rounds
and stores a tile, its SM's tensor cores idle, and at short K that is several per cent of the
tile (the plain yardstick runs 1.07-1.10x cuBLAS at AG llama3-8b m = 1024, K = 4096). cuBLAS's
Hopper kernels hide the epilogue behind the next tile's MMAs with warp specialization. Gluon
(``triton.experimental.gluon``, in Triton 3.6) exposes shared memory, mbarriers, TMA and
``warp_specialize`` directly, so the same schedule can be written without leaving Triton.
If this kernel reaches cuBLAS where the plain one does not, the fused kernels' tile loops
move onto it (their prologue waits and epilogue pushes/reductions are per tile, as here).

Tile and barrier schedule (one program per SM, ``G`` programs; program ``p`` owns tiles
``p, p + G, ...`` in GROUP_M-grouped order, local index ``j = 0, 1, ...``):

* **AllGather order** (as ``kernels/ag_gemm.py``): flat tile ``t`` is step ``t //
  tiles_per_segment``; step 0 is the local rows, read from the caller's shard, steps 1.. the
  peers' segments in ring order, read from the gathered workspace. The *load warp* waits
  (acquire, bounded, per chunk signal) for a peer segment before issuing its first TMA read
  of it, then fences the async proxy; the MMA warps never spin on communication. The two A
  descriptors cost nothing here: the shared-memory ring is explicit, so both feed one ring
  (in Triton's ``tl.range`` loops two K loops needed two pipelines' buffers).
* **Load partition** (1 warp, 24 registers): walks every K-step of every tile of its program
  in order, position ``pos = j * k_tiles + kk`` in a ring of ``STAGES`` shared-memory slots
  (A ``[BLOCK_M, BLOCK_K]`` and B ``[BLOCK_N, BLOCK_K]`` per slot). Per step: wait the slot's
  ``empty`` barrier (phase ``pos // STAGES + 1``, so the first round passes), ``expect`` both
  boxes' bytes on its ``ready`` barrier, issue the two TMA loads onto it.
* **Two MMA partitions** (one warpgroup each, the default one and a worker): MMA partition
  ``c`` computes the tiles with ``j % 2 == c`` into a 128-register fp32 accumulator. Per K-step:
  wait ``ready`` (phase ``pos // STAGES``), issue an async ``wgmma`` on the slot, wait until
  only it is in flight, arrive on the *previous* slot's ``empty``. After the last step: wait
  for all, release the last slot, round to bf16 into its own epilogue buffer (after its
  previous TMA store has read it out), TMA store.
* Because the ring is filled in tile order, partition ``1 - c`` starts tile ``j + 1``'s MMAs
  as soon as the loader reaches it, which is while partition ``c`` finishes tile ``j``'s last
  steps and its epilogue: the epilogue of one tile runs beside the MMAs of the next (the
  "ping-pong" of CUTLASS's Hopper kernels).
* **Handoff.** A parity wait is only sound when the waiter is at most one phase ahead of the
  barrier. An MMA partition that finished tile ``j - 2`` early would wait on tile ``j``'s
  first slot while the slot may still be two phases behind (tile ``j - 1``'s loads not landed)
  and pass on stale data. So partition ``c`` arrives on ``handoff[1 - c]`` once the last slot
  of its tile has landed, and waits on ``handoff[c]`` (phase = the index of tile ``j - 1``
  among the other partition's tiles) before tile ``j``. Then every load of positions before
  tile ``j`` has completed, each ready wait is at most one phase ahead, and ``handoff`` itself
  cannot run two phases ahead (the other partition's next arrival needs tile ``j``'s slots to
  be consumed first). This needs ``k_tiles >= STAGES`` (the launcher checks). A randomized
  model of the protocol (``ws_protocol_model.py``) reads stale data without the handoff and
  finds no stale read, overwrite or deadlock with it.

Shared memory: ``STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * 2`` + two ``BLOCK_M x BLOCK_N`` bf16
epilogue buffers (4 stages of 128x128x64: 192 KB). Registers: 12 warps (4 + 4 + 1, rounded up
to warpgroups) under ``maxnreg`` 168; the worker MMA partition gets ``CONSUMER_REGS``, the
default one what is left.

Not run on a GPU yet (session 10 had no device): ``--compile-only`` builds it for sm_90a and
reports shared memory, registers and spills through ``ptxas``; the GPU run checks every
output against ``torch.matmul`` before timing it beside cuBLAS and the plain yardstick.

    python benchmarks/experiments/gluon_ws_gemm.py --shapes 1024x14336x4096 [--json PATH]
    python benchmarks/experiments/gluon_ws_gemm.py --compile-only --ptxas /usr/local/cuda/bin/ptxas

The GPU run also times the AG form as rank 0 of ``--ag-world`` with every signal pre-set, beside
the package's AG kernel wired the same way (``kernel_vs_cublas.ag_on_one_gpu``). Run as a script
with the repository root on ``PYTHONPATH`` (it imports ``common`` beside it).
"""

import argparse
import json

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from megatron_flux.kernels.signals import fence_async_proxy, wait_signal
from megatron_flux.kernels.tile_order import grouped_tile, segment_of_step

MAXNREG = 168  # 65536 registers / 384 threads, rounded down to a multiple of 8


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
    GROUP_M: gl.constexpr
    NUM_PROGRAMS: gl.constexpr
    ASYNC_FENCE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, x_desc, ag_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty,
                 handoff, flags_ptr, err_ptr, m_local, N, K, rank, epoch, chunk_rows, max_spins,
                 WORLD, GROUP_M, NUM_PROGRAMS, ASYNC_FENCE):
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
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.NUM_PROGRAMS = gl.constexpr(NUM_PROGRAMS)
        self.ASYNC_FENCE = gl.constexpr(ASYNC_FENCE)


@gluon.jit
def _tiles_per_segment(p):
    BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
    return gl.cdiv(p.m_local, BLOCK_M) * gl.cdiv(p.N, BLOCK_N)


@gluon.jit
def _tile(p, j):
    """This program's ``j``-th tile: ``(step, seg, a_row, c_row, off_n)``. Flat tile ``t`` is
    step ``t // tiles_per_segment`` of the AllGather order (own segment first, then ring
    order), GROUP_M-grouped inside the segment; ``a_row`` is relative to the shard at step 0
    and to the workspace after it."""
    BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
    tps = _tiles_per_segment(p)
    t = gl.program_id(0) + j * p.NUM_PROGRAMS
    step = t // tps
    seg = segment_of_step(step, p.rank, p.WORLD, False)
    pid_m, pid_n = grouped_tile(t - step * tps, gl.cdiv(p.m_local, BLOCK_M), gl.cdiv(p.N, BLOCK_N),
                                p.GROUP_M)
    c_row = seg * p.m_local + pid_m * BLOCK_M
    a_row = gl.where(step == 0, pid_m * BLOCK_M, c_row)
    return step, seg, a_row, c_row, pid_n * BLOCK_N


@gluon.jit
def _num_tiles(p):
    """How many tiles this program owns."""
    return gl.cdiv(p.WORLD * _tiles_per_segment(p) - gl.program_id(0), p.NUM_PROGRAMS)


@gluon.jit
def _wait_segment(p, seg):
    """The package's bounded acquire wait (``signals.wait_signal``, op 1 = AG+GEMM) on every
    chunk signal of ``seg``, then its proxy fence, so the TMA loads that follow are ordered
    after the acquire."""
    chunks = gl.cdiv(p.m_local, p.chunk_rows)
    for c in range(chunks):
        idx = seg * chunks + c
        wait_signal(p.flags_ptr + idx, p.epoch, p.max_spins, p.err_ptr, 1, p.rank, idx)
    fence_async_proxy(p.epoch, p.ASYNC_FENCE)


@gluon.jit
def _load_partition(p):
    BLOCK_K: gl.constexpr = p.x_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.type.shape[0]
    nbytes: gl.constexpr = p.x_desc.block_type.nbytes + p.b_desc.block_type.nbytes
    k_tiles = gl.cdiv(p.K, BLOCK_K)
    pos = 0
    waited = 0  # the last step whose segment has landed (step 0 is the local shard)
    for j in range(_num_tiles(p)):
        step, seg, a_row, c_row, off_n = _tile(p, j)
        if step > waited:  # a peer's segment: its chunks must have landed before any TMA read
            _wait_segment(p, seg)
            waited = step
        for kk in range(k_tiles):
            s = pos % STAGES
            mbarrier.wait(p.empty.index(s), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(p.ready.index(s), nbytes)
            if step == 0:
                tma.async_copy_global_to_shared(p.x_desc, [a_row, kk * BLOCK_K], p.ready.index(s),
                                                p.a_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(p.ag_desc, [a_row, kk * BLOCK_K],
                                                p.ready.index(s), p.a_bufs.index(s))
            tma.async_copy_global_to_shared(p.b_desc, [off_n, kk * BLOCK_K], p.ready.index(s),
                                            p.b_bufs.index(s))
            pos += 1


@gluon.jit
def _mma_partition(p, C: gl.constexpr):
    BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = p.x_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    k_tiles = gl.cdiv(p.K, BLOCK_K)
    c_buf = p.c_bufs.index(C)
    for j in range(C, _num_tiles(p), 2):
        # wait until every load of tile j - 1 (the other partition's) has landed: see the
        # docstring; (j - 2 + C) // 2 is that tile's index among the other's tiles
        mbarrier.wait(p.handoff.index(C), ((j - 2 + C) // 2) & 1, pred=j > 0)
        step, seg, a_row, c_row, off_n = _tile(p, j)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
        prev = 0
        for kk in range(k_tiles):
            pos = j * k_tiles + kk
            s = pos % STAGES
            mbarrier.wait(p.ready.index(s), (pos // STAGES) & 1)
            # the tile's last slot is loaded: the other partition may start its next tile
            mbarrier.arrive(p.handoff.index(1 - C), count=1, pred=kk == k_tiles - 1)
            a_s = p.a_bufs.index(s)
            b_s = p.b_bufs.index(s).permute((1, 0))
            acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
            acc, a_s, b_s = warpgroup_mma_wait(1, deps=(acc, a_s, b_s))
            # only this step's MMA is in flight: step kk - 1's has read its slot
            mbarrier.arrive(p.empty.index(prev), count=1, pred=kk > 0)
            prev = s
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(p.empty.index(prev), count=1)
        tma.store_wait(0)  # this partition's previous store has read its buffer out
        c_buf.store(acc.to(p.c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(p.c_desc, [c_row, off_n], c_buf)
    tma.store_wait(0)


@gluon.jit
def _mma_partition_1(p):
    _mma_partition(p, 1)


@gluon.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def ws_ag_gemm_kernel(x_ptr, ag_ptr, b_ptr, c_ptr, flags_ptr, err_ptr, m_local, N, K, rank, epoch,
                      chunk_rows, max_spins, WORLD: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, ASYNC_FENCE: gl.constexpr):
    """AllGather+GEMM ``c = AllGather_rows(x) @ b^T`` (bf16): ``x`` [m_local, K] this rank's
    shard, ``ag`` [WORLD * m_local, K] the gathered workspace whose segment ``s`` is valid
    once the ``cdiv(m_local, chunk_rows)`` chunk signals ``flags[s * chunks + c]`` hold
    ``epoch``, ``b`` [N, K], ``c`` [WORLD * m_local, N]. ``m_local % BLOCK_M == 0``. With
    ``WORLD = 1`` (and ``x`` = ``ag``) it is a plain GEMM. Descriptors are built on the device.
    Launch with ``num_warps=4`` (the default MMA partition) and ``maxnreg=MAXNREG``."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    x_desc = tma.make_tensor_descriptor(x_ptr, [m_local, K], [K, 1], [BLOCK_M, BLOCK_K], a_layout)
    ag_desc = tma.make_tensor_descriptor(ag_ptr, [WORLD * m_local, K], [K, 1], [BLOCK_M, BLOCK_K],
                                         a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K], b_layout)
    c_desc = tma.make_tensor_descriptor(c_ptr, [WORLD * m_local, N], [N, 1], [BLOCK_M, BLOCK_N],
                                        c_layout)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K], b_layout)
    c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_N], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    handoff = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(handoff.index(i), count=1)
    p = _Args(x_desc, ag_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, handoff,
              flags_ptr, err_ptr, m_local, N, K, rank, epoch, chunk_rows, max_spins, WORLD,
              GROUP_M, NUM_PROGRAMS, ASYNC_FENCE)
    gl.warp_specialize([(_mma_partition, (p, 0)), (_mma_partition_1, (p, )),
                        (_load_partition, (p, ))], [4, 1], [CONSUMER_REGS, 24])


#: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)
CONFIGS = [(128, 128, 64, 4, 232), (128, 128, 64, 5, 232), (128, 128, 64, 3, 232)]


def launch_ws_ag_gemm(x, ag, b_nk, c, flags, err, *, rank, world, epoch, chunk_rows, cfg,
                      num_sms, max_spins=1 << 20):
    """``c = AllGather_rows(x) @ b_nk.T`` as rank ``rank`` of ``world`` (see the kernel), with
    ``cfg`` = ``(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)``."""
    from megatron_flux.kernels.descriptors import ensure_descriptor_allocator

    bm, bn, bk, stages, regs = cfg
    m_local, k = x.shape
    n = b_nk.shape[0]
    if m_local % bm:
        raise ValueError(f"ws_ag_gemm: m_local = {m_local} is not a multiple of BLOCK_M = {bm}")
    if triton.cdiv(k, bk) < stages:  # the handoff argument in the docstring needs it
        raise ValueError(f"ws_ag_gemm: K = {k} has fewer than STAGES = {stages} K-steps of {bk}")
    grid = min(num_sms, world * (m_local // bm) * triton.cdiv(n, bn))
    ensure_descriptor_allocator()
    ws_ag_gemm_kernel[(grid,)](x, ag, b_nk, c, flags, err, m_local, n, k, rank, epoch, chunk_rows,
                               max_spins, WORLD=world, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               GROUP_M=8, STAGES=stages, NUM_PROGRAMS=grid, CONSUMER_REGS=regs,
                               ASYNC_FENCE=True, num_warps=4, maxnreg=MAXNREG)


def launch_ws_gemm(a, b_nk, c, cfg, num_sms, _scratch={}):
    """The plain GEMM ``c = a @ b_nk.T``: the kernel at ``world = 1`` (no signal is read)."""
    key = a.device
    if key not in _scratch:
        import torch

        _scratch[key] = (torch.zeros(1, dtype=torch.int32, device=a.device),
                         torch.zeros(4, dtype=torch.int32, device=a.device))
    flags, err = _scratch[key]
    launch_ws_ag_gemm(a, a, b_nk, c, flags, err, rank=0, world=1, epoch=1, chunk_rows=a.shape[0],
                      cfg=cfg, num_sms=num_sms)


def compile_report(ptxas, ptx_version="9.0"):
    """Build every ``CONFIGS`` entry at ``WORLD`` 1 and 2 for sm_90a (no GPU) and run ``ptxas
    -v`` on it, with ``benchmarks/ptxas_report.py``'s helpers."""
    import os
    import re

    from common import load_module
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    report = load_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                      "ptxas_report.py"), "ptxas_report")
    names = [q.name for q in ws_ag_gemm_kernel.params]
    types = {"flags_ptr": "*i32", "err_ptr": "*i32"}
    rows = []
    for (bm, bn, bk, stages, regs), world in [(c, w) for c in CONFIGS for w in (1, 2)]:
        consts = dict(WORLD=world, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages,
                      NUM_PROGRAMS=132, CONSUMER_REGS=regs, ASYNC_FENCE=True)
        sig = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
               for n in names}
        src = GluonASTSource(ws_ag_gemm_kernel, sig, constexprs={(names.index(k),): v
                                                                 for k, v in consts.items()},
                             attrs={})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, maxnreg=MAXNREG))
        info, rc = report.run_ptxas(kernel, ptxas, ptx_version)
        rows.append({"config": [bm, bn, bk, stages, regs], "world": world,
                     **report.resources(kernel, info), "ptxas_rc": rc,
                     # per-partition register budgets the warp specialization sets
                     "setmaxnreg": sorted({int(r) for r in re.findall(
                         r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])}),
                     "ptxas_messages": [ln.strip() for ln in info.splitlines()
                                        if "rror" in ln or "arning" in ln or "Performance" in ln]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    from common import add_timing_args

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1024x14336x4096"], help="MxNxK")
    p.add_argument("--ag-world", type=int, default=2, help="also time the AG+GEMM form as rank 0 "
                   "of this many (one-GPU wiring, signals pre-set), beside the package's AG kernel")
    add_timing_args(p)
    p.add_argument("--ag-config", type=int, default=0,
                   help="index into CONFIGS of the AG form's config (0: 4 stages, 1: 5 stages)")
    p.add_argument("--ag-table", action="store_true",
                   help="time the package's AG kernel with the shipped table's config (else the "
                        "heuristic default without stream-K)")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--ptxas", default="ptxas")
    args = p.parse_args(argv)
    if args.compile_only:
        rows = compile_report(args.ptxas)
        if args.json:
            import subprocess
            import sys

            version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True)
            with open(args.json, "w") as f:
                json.dump({"command": " ".join([sys.executable] + sys.argv),
                           "triton": triton.__version__, "target": "sm_90a",
                           "ptxas": version.stdout.strip().splitlines()[-1], "rows": rows}, f,
                          indent=1)
        return
    import torch

    from common import parse_shape, problem, time_and_check, write_record
    from megatron_flux.bench.kernel_vs_cublas import ag_on_one_gpu
    from megatron_flux.bench.plain_gemm import launch_plain_gemm
    from megatron_flux.kernels.config import GemmConfig, default_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plain_cfgs = {"plain-128x128": GemmConfig(128, 128, 64, 4, 4, 8),
                  "plain-128x256": GemmConfig(128, 256, 64, 3, 8, 8)}
    rows = []
    for shape in args.shapes:
        m, n, k = parse_shape(shape)
        a, w, full = problem(m, n, k)
        fns = {"cublas": lambda: torch.matmul(a, w.t())}
        outs = {}
        for name, cfg in plain_cfgs.items():
            o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns[name] = lambda o=o, cfg=cfg: launch_plain_gemm(a, w, o, cfg, sms)
            outs[name] = (o, lambda: full)
        for cfg in CONFIGS:
            name = "ws-" + "x".join(map(str, cfg))
            o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            try:  # a config that does not build or run is reported and skipped
                launch_ws_gemm(a, w, o, cfg, sms)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"{shape} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            fns[name] = lambda o=o, cfg=cfg: launch_ws_gemm(a, w, o, cfg, sms)
            outs[name] = (o, lambda: full)
        world = args.ag_world
        ag_cfg = CONFIGS[args.ag_config]
        if world > 1 and (m // world) % ag_cfg[0] == 0:  # the AG form, one config
            m_local = m // world
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            flags = torch.full((world,), 1 << 30, dtype=torch.int32, device="cuda")
            o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns["ws-ag"] = lambda o=o: launch_ws_ag_gemm(
                a[:m_local], a, w, o, flags, err, rank=0, world=world, epoch=1,
                chunk_rows=m_local, cfg=ag_cfg, num_sms=sms)
            outs["ws-ag"] = (o, lambda: full)
            if args.ag_table:
                from megatron_flux.tuning.provider import TableConfigProvider

                tcfg = TableConfigProvider()("ag", m, n, k, dtype=a.dtype, tp=world,
                                             device=torch.device("cuda", 0))
            else:
                tcfg = GemmConfig.from_dict(dict(default_config("ag", m, n, k).to_dict(), stream_k=0))
            fns["triton-ag"], ag_out = ag_on_one_gpu(a, w, world, tcfg, err)
            outs["triton-ag"] = (ag_out, lambda: full)
        rows += time_and_check(fns, outs, args, shape,
                               {"m": m, "n": n, "k": k})
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
