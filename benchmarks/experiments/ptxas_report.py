"""Shared memory, registers, spills and ptxas performance warnings of the fused kernels, compiled
for sm_90a without a GPU (e.g. whether a change makes ptxas serialize wgmma: warning C7515).

    python benchmarks/experiments/ptxas_report.py --ptxas /usr/local/cuda/bin/ptxas --out report.json
    python benchmarks/experiments/ptxas_report.py --ptxas /usr/local/cuda/bin/ptxas --gluon --out ws.json

``--gluon``: instead, the warp-specialized Gluon kernels' product forms as the launchers build
them (host-encoded descriptors, a 132-program grid): GEMM+RS ping-pong (with bias, the split
tail first and last, copy-engine pushes) and cooperative at TP 2 and 4, AG+GEMM ping-pong.
Register spills there depend on the Triton version (``PYTHONPATH`` another Triton to compare).

Triton compiles each kernel variant to PTX for ``GPUTarget("cuda", 90, 32)``; the given ptxas
(``-v``) assembles it. A ptxas older than the PTX Triton emits is handled by lowering the PTX
``.version`` line to ``--ptx-version`` (9.0 for CUDA 13.0's ptxas; the kernels use nothing newer).
Run it with the Triton the GPU box has (3.6) for numbers that match it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: (block_m, block_n, block_k, num_stages, num_warps, epilogue_split, warp_specialize)
CONFIGS = [(128, 256, 64, 3, 8, 2, False), (128, 256, 64, 3, 8, 1, True), (128, 128, 64, 4, 4, 1, False),
           (64, 256, 64, 4, 4, 1, False)]
_TYPES = {"x_ptr": "*bf16", "ag_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "a_ptr": "*bf16",
          "out_ptr": "*bf16", "data_ptr": "*bf16", "bias_ptr": "*bf16", "data_ptrs": "*i64",
          "flag_ptrs": "*i64", "flags_ptr": "*i32", "err_ptr": "*i32", "sk_partials_ptr": "*fp32",
          "sk_counters_ptr": "*i32", "trace_ptr": "*i64", "parts_ptr": "*fp32",
          "counters_ptr": "*i32"}


def _compile(fn, constexprs, num_warps, num_stages, ptxas, ptx_version):
    # constexpr parameters left out take their defaults, as in a launch (compiled as runtime
    # integers they would keep both sides of every branch on them)
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in constexprs else _TYPES.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    info, _ = run_ptxas(kernel, ptxas, ptx_version)
    return {**resources(kernel, info), "ptx_lines": len(kernel.asm["ptx"].splitlines()),
            "performance_warnings": [ln.strip() for ln in info.splitlines() if "Performance" in ln]}


def run_ptxas(kernel, ptxas, ptx_version):
    """Assemble a compiled kernel's PTX for sm_90a with ``ptxas -v``: ``(its stderr, which
    carries the resource lines and warnings; exit code 0)``. The PTX ``.version`` is lowered to
    ``ptx_version`` (see the module docstring), or to the newest this ptxas names when it
    refuses that one; any other failure raises."""
    def assemble(version):
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {version}", kernel.asm["ptx"], flags=re.M)
        with tempfile.TemporaryDirectory() as tmp:
            with open(f"{tmp}/k.ptx", "w") as f:
                f.write(ptx)
            return subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o",
                                   f"{tmp}/k.cubin"], capture_output=True, text=True)

    done = assemble(ptx_version)
    newest = re.search(r"current version is '([\d.]+)'", done.stderr)
    if done.returncode != 0 and newest:
        done = assemble(newest.group(1))
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed ({done.returncode}): {done.stderr[-500:]}")
    return done.stderr, done.returncode


def resources(kernel, info):
    """Shared memory (Triton's), registers and spill-store bytes (ptxas ``info``) of a kernel."""
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return {"shared_bytes": kernel.metadata.shared, "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else None}


def gluon_desc(*block, dtype: str = "bf16"):
    """The type of a host-encoded TMA descriptor argument of a Gluon kernel with a ``block``
    box, in the NVMMA shared layout the kernels' buffers use."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, {"bf16": "bfloat16",
                                                                        "fp16": "float16"}[dtype]))
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"


def compile_gluon(fn, cfg, constexprs, ptr_types, dtype="bf16"):
    """A warp-specialized Gluon kernel compiled for sm_90 (no GPU needed) with ``cfg``'s tile,
    a 132-program grid and ``cfg``'s launch options: its pointer arguments are ``dtype`` unless
    ``ptr_types`` names them, every other argument i32."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from megatron_flux.kernels.gluon_ws import launch_options, mma_partitions

    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "STAGES": cfg.num_stages,
                  "NUM_PROGRAMS": 132, "PARTITIONS": mma_partitions(cfg)}
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in constexprs else
           ptr_types.get(n, f"*{dtype}" if n.endswith("_ptr") else "i32") for n in names}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch_options(cfg))


def _gluon_report(fn, cfg, constexprs, types, ptxas, ptx_version):
    """:func:`compile_gluon` with host descriptors, bf16, assembled: its resources."""
    kernel = compile_gluon(fn, cfg, {**constexprs, "HOST_DESC": True}, types)
    info, _ = run_ptxas(kernel, ptxas, ptx_version)
    loads = re.search(r"(\d+) bytes spill loads", info)
    return {**resources(kernel, info), "spill_load_bytes": int(loads.group(1)) if loads else None}


def gluon_rows(ptxas, ptx_version):
    """``--gluon``: the warp-specialized kernels' product forms (see the module docstring)."""
    from megatron_flux.kernels import ag_gemm_ws, gemm_rs_ws
    from megatron_flux.kernels.config import GemmConfig

    pingpong = dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, group_m=8)
    coop = dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, group_m=8)
    rs_forms = (("ping-pong", pingpong, {}, {}),
                ("ping-pong, bias", pingpong, {}, {"HAS_BIAS": True}),
                ("ping-pong, split tail first", pingpong, {"stream_k": 1},
                 {"SPLIT_TAIL": True, "TAIL_FIRST": True}),
                ("ping-pong, split tail last", pingpong, {"stream_k": 1},
                 {"SPLIT_TAIL": True, "TAIL_FIRST": False}),
                ("ping-pong, copy-engine pushes", pingpong, {"rs_copy_engine": True},
                 {"CE_PUSH": True}),
                ("cooperative", coop, {}, {}),
                ("ping-pong, row turns", pingpong, {"rs_row_turns": True}, {"ROW_TURNS": True}),
                ("cooperative, row turns", coop, {"rs_row_turns": True}, {"ROW_TURNS": True}))
    rows = []
    for world in (2, 4):
        for label, tile, extra, consts in rs_forms:
            cfg = GemmConfig(**tile, rs_warp_specialized=True, **extra)
            bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
            types = {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32",
                     "parts_ptr": "*fp32", "counters_ptr": "*i32", "a_hd": gluon_desc(bm, bk),
                     "b_hd": gluon_desc(bn, bk), "out_hd": gluon_desc(bm, bn),
                     "slots_hd": gluon_desc(bm, bn)}
            r = _gluon_report(gemm_rs_ws.gemm_rs_ws_kernel, cfg,
                               {**dict(WORLD=world, B_KN=False, HAS_BIAS=False, CE_PUSH=False,
                                       CONSUMER_REGS=gemm_rs_ws.CONSUMER_REGS, MERGE_ROWS=False),
                                **consts}, types, ptxas, ptx_version)
            rows.append({"kernel": "gemm_rs_ws", "form": label, "world": world, **r})
            print(json.dumps(rows[-1]), flush=True)
        cfg = GemmConfig(**pingpong, ag_warp_specialized=True)
        types = {"flags_ptr": "*i32", "err_ptr": "*i32", "x_hd": gluon_desc(128, 64),
                 "ag_hd": gluon_desc(128, 64), "b_hd": gluon_desc(128, 64),
                 "c_hd": gluon_desc(128, 128)}
        r = _gluon_report(ag_gemm_ws.ag_gemm_ws_kernel, cfg,
                           dict(WORLD=world, B_KN=False, CONSUMER_REGS=ag_gemm_ws.CONSUMER_REGS),
                           types, ptxas, ptx_version)
        rows.append({"kernel": "ag_gemm_ws", "form": "ping-pong", "world": world, **r})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ptxas", required=True)
    p.add_argument("--ptx-version", default="9.0")
    p.add_argument("--gluon", action="store_true",
                   help="the warp-specialized Gluon kernels' product forms instead")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.gluon:
        return _write(args, gluon_rows(args.ptxas, args.ptx_version))
    from megatron_flux.kernels.ag_gemm import ag_gemm_kernel
    from megatron_flux.kernels.gemm_rs import gemm_rs_kernel

    rows = []
    for bm, bn, bk, stages, warps, epi, ws in CONFIGS:
        cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps,
                   epilogue_split=epi, warp_specialize=ws)
        common = dict(RAGGED=False, B_KN=False, EPI_SPLIT=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      GROUP_M=8, NUM_SMS=132, FLATTEN=True, WARP_SPECIALIZE=ws, WORLD=2)
        for sk in (False, True):
            r = _compile(ag_gemm_kernel, dict(common, STREAM_K=sk, SK_LOCAL=False, ASYNC_FENCE=True),
                         warps, stages, args.ptxas, args.ptx_version)
            rows.append({"kernel": "ag_gemm", "config": cfg, "stream_k": sk, **r})
        for push, spread, sk in ((True, False, False), (False, False, False), (True, True, False),
                                 (True, False, True)):
            r = _compile(gemm_rs_kernel, dict(common, HAS_BIAS=False, FLATTEN_CONSUME=True,
                                              TMA_PUSH=push, ASYNC_FENCE=True, PRODUCE=True,
                                              CONSUME=True, SPREAD_REDUCE=spread, STREAM_K=sk),
                         warps, stages, args.ptxas, args.ptx_version)
            rows.append({"kernel": "gemm_rs", "config": cfg, "rs_tma_push": push,
                         "rs_spread_reduce": spread, "stream_k": sk, **r})
        for row in rows[-6:]:
            print(json.dumps({k: v for k, v in row.items() if k != "config"}), cfg, flush=True)
    # the step loop unrolled or a runtime loop at TP 8 (config.unroll_steps): code size, 128x128
    bm, bn, bk, stages, warps, epi, ws = CONFIGS[2]
    cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps,
               epilogue_split=epi, warp_specialize=ws)
    for unroll in (True, False):
        common = dict(RAGGED=False, B_KN=False, EPI_SPLIT=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      GROUP_M=8, NUM_SMS=132, FLATTEN=True, WARP_SPECIALIZE=ws, WORLD=8,
                      UNROLL_STEPS=unroll)
        r = _compile(ag_gemm_kernel, dict(common, STREAM_K=False, SK_LOCAL=False, ASYNC_FENCE=True),
                     warps, stages, args.ptxas, args.ptx_version)
        rows.append({"kernel": "ag_gemm", "config": cfg, "world": 8, "unroll_steps": unroll, **r})
        r = _compile(gemm_rs_kernel, dict(common, HAS_BIAS=False, FLATTEN_CONSUME=True,
                                          TMA_PUSH=True, ASYNC_FENCE=True, PRODUCE=True,
                                          CONSUME=True, SPREAD_REDUCE=False),
                     warps, stages, args.ptxas, args.ptx_version)
        rows.append({"kernel": "gemm_rs", "config": cfg, "world": 8, "unroll_steps": unroll, **r})
        for row in rows[-2:]:
            print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    return _write(args, rows)


def _write(args, rows):
    version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout
    result = {"command": " ".join([sys.executable] + sys.argv), "triton": triton.__version__,
              "ptxas": version.strip().splitlines()[-1], "target": "sm_90a", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
