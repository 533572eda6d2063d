"""A persistent TMA GEMM whose tile is ``BLOCK_M x (N0 + N1 + N2)`` wide: Triton tensors must be
powers of two, so a 224-wide tile is three accumulators (128 + 64 + 32 columns), three B boxes
and three ``tl.dot`` per K-step on the same A block.

Why: AG+GEMM llama3-8b m = 1024 at TP 2 is ``1024 x 14336 x 4096``. A 128x256 tile
gives 448 tiles, 3.39 waves on 132 SMs (the fourth wave 39 % full); 128x128 gives 6.79 waves
but a smaller tile's lower efficiency; both end 7-16 % behind cuBLAS, which runs this shape at
the same TFLOP/s as the largest ones (686 on H200). 14336 = 64 x 224, so a 128x224 tile gives
512 tiles, 3.88 waves. The question this file answers before any fused kernel changes: does a
Triton tile split into three dots keep a 128x256 tile's efficiency?

Tile schedule: one flat tile space over ``[M, N]``, GROUP_M-grouped row tiles
(:func:`~megatron_flux.kernels.tile_order.grouped_tile`), program ``p`` takes tiles
``p, p + NUM_SMS, ...``; per K-step one TMA load of A ``[BLOCK_M, BLOCK_K]`` and one of each B
part ``[N_i, BLOCK_K]`` (B is ``[N, K]``); per tile one TMA store per part. No signals.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/split_n_gemm.py \
        --trials 11 --iters 20 --warmup 10 --shuffle-seed 0 --json out.json      (one GPU)
    PYTHONPATH=.:benchmarks:benchmarks/experiments:<Triton 3.6> python \
        benchmarks/experiments/split_n_gemm.py --json out.json \
        --ptxas <Triton 3.6's ptxas> --ptx-version 8.7                           (compile only)

Timing and checks are the experiments' shared ones (:mod:`common`: ``problem``,
``time_and_check``, ``write_record``).

Measured (one H100, ``benchmarks/results/split-n-gemm-h100-2026-11-26.json``, 11 trials of 20
launches): the 128x224 tile ran 1.55x cuBLAS at llama3-8b m = 1024 against 1.24x for 128x256
and 1.14x for 128x128, and 1.43-1.47x on the other two shapes. Refuted. The likely cause, not
measured here: its 64- and 32-column wgmmas read the same A block from shared memory again
for a fraction of the work (128x256 as two 128-column dots cost only 0.2-0.7 % against one dot,
both nested).
"""

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from common import add_timing_args, problem, time_and_check, write_record
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.tile_order import grouped_tile


@triton.jit
def split_n_gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, N0: tl.constexpr, N1: tl.constexpr,
                        N2: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr = True):
    """``c = a @ b.T``; ``a`` ``[M, K]``, ``b`` ``[N, K]``, ``c`` ``[M, N]``, contiguous. N1 or N2
    may be 0 (that part is absent)."""
    BLOCK_N: tl.constexpr = N0 + N1 + N2
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    b0_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [N0, BLOCK_K])
    c0_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, N0])
    if N1 > 0:
        b1_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [N1, BLOCK_K])
        c1_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, N1])
    if N2 > 0:
        b2_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [N2, BLOCK_K])
        c2_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BLOCK_M, N2])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc0 = tl.zeros((BLOCK_M, N0), dtype=tl.float32)
        if N1 > 0:
            acc1 = tl.zeros((BLOCK_M, N1), dtype=tl.float32)
        if N2 > 0:
            acc2 = tl.zeros((BLOCK_M, N2), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            acc0 = tl.dot(a, b0_desc.load([off_n, off_k]).T, acc0)
            if N1 > 0:
                acc1 = tl.dot(a, b1_desc.load([off_n + N0, off_k]).T, acc1)
            if N2 > 0:
                acc2 = tl.dot(a, b2_desc.load([off_n + N0 + N1, off_k]).T, acc2)
        c0_desc.store([off_m, off_n], acc0.to(c0_desc.dtype))
        if N1 > 0:
            c1_desc.store([off_m, off_n + N0], acc1.to(c1_desc.dtype))
        if N2 > 0:
            c2_desc.store([off_m, off_n + N0 + N1], acc2.to(c2_desc.dtype))


def launch_split_n_gemm(a, b, c, block_m, parts, block_k, group_m, num_stages, num_warps, num_sms,
                        flatten=True):
    """``c = a @ b.T`` with a ``block_m x sum(parts)`` tile; ``parts`` = (N0, N1, N2)."""
    m, k = a.shape
    n = b.shape[0]
    n0, n1, n2 = parts
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, n0 + n1 + n2)
    grid = min(num_sms, tiles)
    ensure_descriptor_allocator()
    split_n_gemm_kernel[(grid,)](a, b, c, m, n, k, BLOCK_M=block_m, N0=n0, N1=n1, N2=n2,
                                 BLOCK_K=block_k, GROUP_M=group_m, NUM_SMS=grid, FLATTEN=flatten,
                                 num_warps=num_warps, num_stages=num_stages)


#: (label, block_m, parts, block_k, group_m, stages, warps, flatten). Flattened tile and K
#: loops with more than one dot compile (Triton 3.6, sm_90a) to wgmmas that ptxas serializes
#: (C7515: the accumulators are zeroed by moves at each tile's start instead of the first
#: wgmma's scale-d predicate), so the split tiles run nested loops, beside a nested 128x256
#: control
CONFIGS = [
    ("128x256 one dot", 128, (256, 0, 0), 64, 8, 3, 8, True),
    ("128x256 one dot, nested", 128, (256, 0, 0), 64, 8, 3, 8, False),
    ("128x256 as 128+128, nested", 128, (128, 128, 0), 64, 8, 3, 8, False),
    ("128x224 as 128+64+32, nested", 128, (128, 64, 32), 64, 8, 3, 8, False),
    ("128x224 as 128+64+32, nested, group 4", 128, (128, 64, 32), 64, 4, 3, 8, False),
    ("128x128 one dot", 128, (128, 0, 0), 64, 8, 4, 4, True),
]

#: (label, M, N, K): local AG+GEMM GEMMs at TP 2 whose N 224 divides: the gap (llama3-8b
#: m = 1024) and two controls
SHAPES = [
    ("AG llama3-8b m=1024", 1024, 14336, 4096),
    ("AG llama3-8b m=2048", 2048, 14336, 4096),
    ("AG llama3-70b m=1024", 1024, 28672, 8192),
]


def compile_only(ptxas, ptx_version):
    """Each config (and its flattened twin) compiled for sm_90a: shared memory, registers,
    spills and ptxas's performance warnings (:mod:`ptxas_report`)."""
    import ptxas_report

    rows = []
    for label, bm, parts, bk, gm, st, nw, flat in CONFIGS:
        for flatten in sorted({flat, True}):
            constexprs = dict(BLOCK_M=bm, N0=parts[0], N1=parts[1], N2=parts[2], BLOCK_K=bk,
                              GROUP_M=gm, NUM_SMS=132, FLATTEN=flatten)
            res = ptxas_report._compile(split_n_gemm_kernel, constexprs, nw, st, ptxas, ptx_version)
            rows.append({"config": label, "flatten": flatten, **res})
            print(label, "flatten" if flatten else "nested", res["registers"], "registers",
                  res["shared_bytes"], "B shared", len(res["performance_warnings"]), "warnings")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(p)
    p.add_argument("--ptxas", help="compile only, for sm_90a, with this ptxas (no GPU needed)")
    p.add_argument("--ptx-version", default="8.7")
    args = p.parse_args(argv)
    if args.ptxas:
        import subprocess
        version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout
        out = {"command": " ".join(sys.argv), "triton": triton.__version__, "target": "sm_90a",
               "ptxas": version.strip().splitlines()[-1],
               "rows": compile_only(args.ptxas, args.ptx_version)}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        return
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    rows, failed = [], {}
    for label, m, n, k in SHAPES:
        a, b, ref = problem(m, n, k)
        fns, outs = {"cublas": lambda a=a, b=b: torch.mm(a, b.T)}, {}
        for name, bm, parts, bk, gm, st, nw, flat in CONFIGS:
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            fn = (lambda a=a, b=b, c=c, bm=bm, parts=parts, bk=bk, gm=gm, st=st, nw=nw, flat=flat:
                  launch_split_n_gemm(a, b, c, bm, parts, bk, gm, st, nw, num_sms, flat))
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # recorded: a config that does not compile or fit
                failed[f"{label}: {name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            fns[name] = fn
            outs[name] = (c, lambda ref=ref: ref)
        rows += time_and_check(fns, outs, args, label, {"shape": label, "M": m, "N": n, "K": k})
    write_record(args.json, rows, num_sms=num_sms, configs=[c[0] for c in CONFIGS],
                 failed=failed)


if __name__ == "__main__":
    main()
