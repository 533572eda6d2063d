"""Experiment: a warp-specialized persistent Hopper GEMM in Gluon, ``C = A @ B^T`` (bf16).

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
"""

import argparse
import json

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

MAXNREG = 168  # 65536 registers / 384 threads, rounded down to a multiple of 8


@aggregate
class _Args:
    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    c_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    c_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    handoff: gl.shared_memory_descriptor
    M: gl.tensor
    N: gl.tensor
    K: gl.tensor
    GROUP_M: gl.constexpr
    NUM_PROGRAMS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, handoff, M,
                 N, K, GROUP_M, NUM_PROGRAMS):
        self.a_desc = a_desc
        self.b_desc = b_desc
        self.c_desc = c_desc
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.c_bufs = c_bufs
        self.ready = ready
        self.empty = empty
        self.handoff = handoff
        self.M = M
        self.N = N
        self.K = K
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.NUM_PROGRAMS = gl.constexpr(NUM_PROGRAMS)


@gluon.jit
def _tile(p, j):
    """``(off_m, off_n)`` of this program's ``j``-th tile (GROUP_M-grouped order)."""
    BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
    t = gl.program_id(0) + j * p.NUM_PROGRAMS
    num_pid_m = gl.cdiv(p.M, BLOCK_M)
    num_pid_n = gl.cdiv(p.N, BLOCK_N)
    in_group = p.GROUP_M * num_pid_n
    first_m = (t // in_group) * p.GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, p.GROUP_M)
    return (first_m + t % group_m) * BLOCK_M, ((t % in_group) // group_m) * BLOCK_N


@gluon.jit
def _num_tiles(p):
    """How many tiles this program owns."""
    BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
    total = gl.cdiv(p.M, BLOCK_M) * gl.cdiv(p.N, BLOCK_N)
    return gl.cdiv(total - gl.program_id(0), p.NUM_PROGRAMS)


@gluon.jit
def _load_partition(p):
    BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.type.shape[0]
    nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
    k_tiles = gl.cdiv(p.K, BLOCK_K)
    pos = 0
    for j in range(_num_tiles(p)):
        off_m, off_n = _tile(p, j)
        for kk in range(k_tiles):
            s = pos % STAGES
            mbarrier.wait(p.empty.index(s), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(p.ready.index(s), nbytes)
            tma.async_copy_global_to_shared(p.a_desc, [off_m, kk * BLOCK_K], p.ready.index(s),
                                            p.a_bufs.index(s))
            tma.async_copy_global_to_shared(p.b_desc, [off_n, kk * BLOCK_K], p.ready.index(s),
                                            p.b_bufs.index(s))
            pos += 1


@gluon.jit
def _mma_partition(p, C: gl.constexpr):
    BLOCK_M: gl.constexpr = p.c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = p.c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    k_tiles = gl.cdiv(p.K, BLOCK_K)
    c_buf = p.c_bufs.index(C)
    for j in range(C, _num_tiles(p), 2):
        # wait until every load of tile j - 1 (the other partition's) has landed: see the
        # docstring; (j - 1 - (1 - C)) // 2 is that tile's index among the other's tiles
        mbarrier.wait(p.handoff.index(C), ((j - 2 + C) // 2) & 1, pred=j > 0)
        off_m, off_n = _tile(p, j)
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
        tma.async_copy_shared_to_global(p.c_desc, [off_m, off_n], c_buf)
    tma.store_wait(0)


@gluon.jit
def _mma_partition_1(p):
    _mma_partition(p, 1)


@gluon.jit
def ws_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   NUM_PROGRAMS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """``a`` [M, K], ``b`` [N, K], ``c`` [M, N], contiguous bf16; descriptors built on the
    device. Launch with ``num_warps=4`` (the default MMA partition) and ``maxnreg=MAXNREG``."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K], a_layout)
    b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BLOCK_N, BLOCK_K], b_layout)
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N], c_layout)
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
    p = _Args(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, handoff, M, N, K,
              GROUP_M, NUM_PROGRAMS)
    gl.warp_specialize([(_mma_partition, (p, 0)), (_mma_partition_1, (p, )),
                        (_load_partition, (p, ))], [4, 1], [CONSUMER_REGS, 24])


#: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)
CONFIGS = [(128, 128, 64, 4, 232), (128, 128, 64, 5, 232), (128, 128, 64, 3, 232)]


def launch_ws_gemm(a, b_nk, c, cfg, num_sms):
    """``c = a @ b_nk.T`` with ``cfg`` = ``(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)``."""
    from megatron_flux.kernels.descriptors import ensure_descriptor_allocator

    bm, bn, bk, stages, regs = cfg
    m, k = a.shape
    n = b_nk.shape[0]
    if triton.cdiv(k, bk) < stages:  # the handoff argument in the docstring needs it
        raise ValueError(f"ws_gemm: K = {k} has fewer than STAGES = {stages} K-steps of {bk}")
    grid = min(num_sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    ensure_descriptor_allocator()
    ws_gemm_kernel[(grid,)](a, b_nk, c, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                            STAGES=stages, NUM_PROGRAMS=grid, CONSUMER_REGS=regs, num_warps=4,
                            maxnreg=MAXNREG)


def compile_report(ptxas, ptx_version="9.0"):
    """Build every ``CONFIGS`` entry for sm_90a (no GPU) and run ``ptxas -v`` on it."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [q.name for q in ws_gemm_kernel.params]
    rows = []
    for bm, bn, bk, stages, regs in CONFIGS:
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages, NUM_PROGRAMS=132,
                      CONSUMER_REGS=regs)
        sig = {n: "constexpr" if n in consts else ("*bf16" if n.endswith("_ptr") else "i32")
               for n in names}
        src = GluonASTSource(ws_gemm_kernel, sig, constexprs={(names.index(k),): v
                                                              for k, v in consts.items()}, attrs={})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, maxnreg=MAXNREG))
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {ptx_version}", kernel.asm["ptx"], flags=re.M)
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.ptx", "w") as f:
                f.write(ptx)
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                  capture_output=True, text=True)
        text = info.stderr + info.stdout
        regs_used = re.search(r"Used (\d+) registers", text)
        spills = re.search(r"(\d+) bytes spill stores", text)
        rows.append({"config": [bm, bn, bk, stages, regs], "shared_bytes": kernel.metadata.shared,
                     "registers": int(regs_used.group(1)) if regs_used else None,
                     "spill_store_bytes": int(spills.group(1)) if spills else None,
                     "ptxas_rc": info.returncode,
                     "ptxas_messages": [ln.strip() for ln in text.splitlines()
                                        if "rror" in ln or "arning" in ln or "Performance" in ln]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1024x14336x4096"], help="MxNxK")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
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

    from common import time_and_check, write_record
    from megatron_flux.bench.plain_gemm import launch_plain_gemm
    from megatron_flux.kernels.config import GemmConfig

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plain_cfgs = {"plain-128x128": GemmConfig(128, 128, 64, 4, 4, 8),
                  "plain-128x256": GemmConfig(128, 256, 64, 3, 8, 8)}
    rows = []
    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        full = a.float() @ w.t().float()
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
        rows += time_and_check(fns, outs, args.trials, args.iters, shape,
                               {"m": m, "n": n, "k": k})
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
