"""The sm_90 PTX of ``gemm_rs_kernel`` in two source trees, and the lines that differ.

Where ``ptx_fingerprint.py`` shows a refactor leaves the code alone (equal hashes), this shows
what a change that adds a kernel parameter did to the variants that do not use it: each tree's
kernel is compiled in its own process (no GPU; Triton 3.6 for the box's code), the debug lines
dropped as ``ptx_fingerprint.fingerprint`` drops them, and the rest diffed. For example the tree
before the GEMM+RS stream-K tail against the tree with it (``STREAM_K=False``)::

    git worktree add /tmp/before <commit>
    PYTHONPATH=<a Triton 3.6 install> python benchmarks/experiments/ptx_diff.py /tmp/before . out.json
"""

import difflib
import json
import os
import re
import subprocess
import sys

#: (block_m, block_n, block_k, num_stages, num_warps, epilogue_split): the 128x256 table tile
#: and the 128x128 one
CONFIGS = [(128, 256, 64, 3, 8, 2), (128, 128, 64, 4, 4, 1)]

_COMPILE = r"""
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_flux.kernels.gemm_rs import gemm_rs_kernel as fn
bm, bn, bk, stages, warps, epi = json.loads(sys.argv[1])
cx = dict(RAGGED=False, B_KN=False, EPI_SPLIT=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
          NUM_SMS=132, FLATTEN=True, WARP_SPECIALIZE=False, WORLD=2, HAS_BIAS=False,
          FLATTEN_CONSUME=True, TMA_PUSH=True, ASYNC_FENCE=True, PRODUCE=True, CONSUME=True,
          SPREAD_REDUCE=False)
cx = {**{p.name: p.default for p in fn.params if p.is_constexpr
         and p.default is not inspect.Parameter.empty}, **cx}
ptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "data_ptr": "*bf16",
        "bias_ptr": "*bf16", "data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32",
        "trace_ptr": "*i64", "parts_ptr": "*fp32", "counters_ptr": "*i32"}
names = [p.name for p in fn.params]
sig = {n: "constexpr" if n in cx else ptrs.get(n, "i32") for n in names}
src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in cx.items()}, attrs={})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
sys.stdout.write(k.asm["ptx"])
"""


def code_lines(ptx):
    """The PTX without its debug information (as ``ptx_fingerprint.fingerprint``)."""
    lines = ptx.splitlines()
    cut = next((i for i, l in enumerate(lines) if re.match(r"\s*\.section\s+\.debug", l)), len(lines))
    return [l for l in lines[:cut] if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", l)]


def compile_in(tree, cfg):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    # run from the tree: ``python -c`` puts the working directory first on sys.path
    return subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cfg)], env=env, check=True,
                          capture_output=True, text=True, cwd=tree).stdout


def main(before, after, path):
    import triton

    rows = []
    for cfg in CONFIGS:
        a, b = (code_lines(compile_in(tree, cfg)) for tree in (before, after))
        diff = [l for l in difflib.unified_diff(a, b, lineterm="", n=0)
                if not l.startswith(("---", "+++", "@@"))]
        rows.append({"config": dict(zip(("block_m", "block_n", "block_k", "num_stages",
                                          "num_warps", "epilogue_split"), cfg)),
                     "lines_before": len(a), "lines_after": len(b), "diff_lines": len(diff),
                     "diff": diff})
        print(cfg, len(a), len(b), len(diff), flush=True)
    out = {"command": " ".join([sys.executable] + sys.argv), "triton": triton.__version__,
           "target": "sm_90", "kernel": "gemm_rs_kernel", "before": before, "after": after,
           "rows": rows}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
