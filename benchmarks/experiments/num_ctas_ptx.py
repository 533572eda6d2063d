"""Experiment (CPU, no GPU): does ``num_ctas=2`` give the plain yardstick GEMM TMA multicast?

cuBLAS runs clusters of 2 CTAs on the grid's GEMMs, likely sharing operand loads by TMA
multicast. This compiles ``bench.plain_gemm.plain_gemm_kernel`` (128x256x64, 3 stages, 8
warps) for sm_90 with ``num_ctas`` 1 and 2 and records, from the PTX, whether it asks for a
cluster and how many TMA loads are multicast.

    PYTHONPATH=/path/to/triton-3.6:. python benchmarks/experiments/num_ctas_ptx.py --json OUT
"""

import argparse
import inspect
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_flux.tools.diagnostics.plain_gemm import plain_gemm_kernel


def compile_ptx(num_ctas: int) -> str:
    fn = plain_gemm_kernel
    constexprs = {p.name: p.default for p in fn.params
                  if p.is_constexpr and p.default is not inspect.Parameter.empty}
    constexprs.update(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, NUM_SMS=132, FLATTEN=True)
    names = [p.name for p in fn.params]
    ptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "trace_ptr": "*i64"}
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=8, num_stages=3, num_ctas=num_ctas))
    return kernel.asm["ptx"]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for num_ctas in (1, 2):
        ptx = compile_ptx(num_ctas)
        # a TMA load completes on an mbarrier; a TMA store is a bulk group
        loads = [line for line in ptx.splitlines()
                 if "cp.async.bulk.tensor" in line and "mbarrier" in line]
        rows.append({"num_ctas": num_ctas, "cluster": ".reqnctapercluster" in ptx,
                     "tma_loads": len(loads),
                     "multicast_loads": sum("multicast" in line for line in loads)})
        print(rows[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": __doc__.splitlines()[0], "triton": triton.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
