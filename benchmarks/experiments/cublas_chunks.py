"""Experiment: what cuBLAS loses when a TP op's GEMM is cut into per-rank row chunks.

Why: with communication off, the fused GEMM+RS runs 1.08-1.14x cuBLAS on the training step's
short-K shapes (proj k = 2048, qkv dgrad k = 3072 per rank at m = 8192, one H200), and the
loss is its structure (the plain Triton GEMM of the same tile runs 1.01-1.03x). A decomposed
form keeps cuBLAS for the math: the peers' rows first, in ``c`` chunks per segment, each
chunk's partial handed to the copy engine while the next computes; then the own rows, each
chunk as ``addmm(received partial, A, W^T)`` so cuBLAS's epilogue does the reduction (fp32
accumulator plus the peer's bf16 partial, rounded once: the fused kernel's numerics). Whether
that can pay depends first on what the chunking costs cuBLAS, which one GPU measures.

One GPU, no communication. Per shape, interleaved (``kernel_vs_cublas``'s timing):

* ``cublas``: one ``A @ W^T`` over all rows (the floor);
* ``fused``: the package's kernel, shipped table config (``rs_on_one_gpu`` / ``ag_on_one_gpu``);
* ``chunks-c``: the decomposed sequence as rank 0 of ``--tp`` with ``c`` chunks per segment.
  GEMM+RS: ``mm`` into a staging buffer for every peer row chunk, then ``addmm`` of the own row
  chunks onto a stand-in received partial; AG+GEMM: ``mm`` per segment and chunk into the rows
  of one output.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/cublas_chunks.py --op rs \
        --model-shapes l8proj:4096:4096:4096 --rs-k ffn --m 8192 --chunks 1 2 4
"""

import argparse

import torch

from common import add_timing_args, named_configs, problem, time_and_check, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import add_model_args, ag_on_one_gpu, model_shapes, rs_on_one_gpu
from megatron_flux.tuning.provider import TableConfigProvider


def rs_chunked(a, w, world, chunks):
    """``(fn, out, ref_fn)``: the decomposed GEMM+RS of rank 0 (see the module docstring)."""
    m_local = a.shape[0] // world
    n = w.shape[0]
    staging = torch.empty(a.shape[0] - m_local, n, device=a.device, dtype=a.dtype)
    recv = torch.randn(m_local, n, device=a.device, dtype=a.dtype)
    out = torch.full((m_local, n), float("nan"), device=a.device, dtype=a.dtype)
    step = -(-m_local // chunks)
    wt = w.t()

    def fn():
        for lo in range(0, a.shape[0] - m_local, step):
            hi = min(lo + step, a.shape[0] - m_local)
            torch.mm(a[m_local + lo:m_local + hi], wt, out=staging[lo:hi])
        for lo in range(0, m_local, step):
            hi = min(lo + step, m_local)
            torch.addmm(recv[lo:hi], a[lo:hi], wt, out=out[lo:hi])

    return fn, out, lambda: a[:m_local].float() @ wt.float() + recv.float()


def ag_chunked(a, w, world, chunks):
    """``(fn, out, ref_fn)``: the decomposed AG+GEMM (every segment in ``chunks`` pieces)."""
    m = a.shape[0]
    m_local = m // world
    out = torch.full((m, w.shape[0]), float("nan"), device=a.device, dtype=a.dtype)
    step = -(-m_local // chunks)
    wt = w.t()

    def fn():
        for seg in range(world):
            for lo in range(seg * m_local, (seg + 1) * m_local, step):
                hi = min(lo + step, (seg + 1) * m_local)
                torch.mm(a[lo:hi], wt, out=out[lo:hi])

    return fn, out, lambda: a.float() @ wt.float()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["ag", "rs"], default="rs")
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p, ["gpt3-175b", "llama3-70b", "llama3-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[8192])
    p.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4])
    add_timing_args(p)
    args = p.parse_args(argv)
    table = TableConfigProvider()
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = []
    for model, n, k in model_shapes(args, args.op):
        for m in args.m:
            a, w, full = problem(m, n, k)
            cfg = named_configs(table, args.op, m, n, k, args.tp)["table"]
            fns = {"cublas": lambda: torch.matmul(a, w.t())}
            outs = {}
            if args.op == "rs":
                launch, out, data = rs_on_one_gpu(a, w, args.tp, err)
                m_local = m // args.tp
                fns["fused"] = lambda: launch(cfg)
                outs["fused"] = (out, lambda: full[:m_local] + sum(data[s].float() for s in range(1, args.tp)))
            else:
                launch, out = ag_on_one_gpu(a, w, args.tp, cfg, err)
                fns["fused"] = launch
                outs["fused"] = (out, lambda: full)
            for c in args.chunks:
                fn, out_c, ref = (rs_chunked if args.op == "rs" else ag_chunked)(a, w, args.tp, c)
                fns[f"chunks-{c}"] = fn
                outs[f"chunks-{c}"] = (out_c, ref)
            title = f"{args.op.upper()} {model:10s} m={m:5d} n={n:5d} k={k:5d}"
            rows += time_and_check(fns, outs, args, title,
                                   {"op": args.op, "model": model, "m": m, "n": n, "k": k,
                                    "config": cfg.to_dict()})
            assert err.tolist() == [0, 0, 0, 0], err.tolist()
    write_record(args.json, rows, tp=args.tp)


if __name__ == "__main__":
    main()
