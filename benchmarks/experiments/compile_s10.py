"""The sm_90a compile numbers behind session 10's notes, without a GPU: shared memory,
registers, spills and ptxas performance warnings of

* every ``rs_loops.py`` variant with the default GEMM+RS config (128x256x64, 3 stages, 8 warps,
  split epilogue);
* the plain yardstick, ``ag_gemm_kernel`` and ``gemm_rs_kernel`` at the 128x128 / 4-warp configs
  ``occupancy.py`` runs two or three per SM (and the 4-stage one that does not fit twice);
* the production ``gemm_rs_kernel`` at the default config.

    PYTHONPATH=. python benchmarks/experiments/compile_s10.py --ptxas /usr/local/cuda/bin/ptxas \\
        --json benchmarks/results/raw/s10/compile-sm90a.json

Run it with the Triton the GPU box has (3.6), as ``benchmarks/ptxas_report.py``, whose
compile helper it uses.
"""

import argparse
import json
import os
import subprocess
import sys

import triton

from common import load_module
from megatron_flux.bench.plain_gemm import plain_gemm_kernel
from megatron_flux.kernels.ag_gemm import ag_gemm_kernel
from megatron_flux.kernels.gemm_rs import gemm_rs_kernel

import rs_loops

#: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, epilogue split)
DEFAULT_RS = (128, 256, 64, 3, 8, 2)
OCCUPANCY = [(128, 128, 64, 2, 4, 1), (128, 128, 64, 2, 4, 2), (128, 128, 64, 3, 4, 2),
             (128, 128, 32, 4, 4, 2), (128, 128, 32, 3, 4, 2), (128, 128, 64, 4, 4, 1)]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ptxas", required=True)
    p.add_argument("--ptx-version", default="9.0")
    p.add_argument("--json")
    args = p.parse_args(argv)
    report = load_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                      "ptxas_report.py"), "ptxas_report")

    def build(kind, fn, cfg, consts, label):
        bm, bn, bk, stages, warps, epi = cfg
        row = {"kernel": kind, "label": label, "config": list(cfg),
               **report._compile(fn, consts, warps, stages, args.ptxas, args.ptx_version)}
        print(json.dumps(row), flush=True)
        return row

    rows = []
    bm, bn, bk, stages, warps, epi = DEFAULT_RS
    for name, v in rs_loops.VARIANTS.items():
        rows.append(build("rs_loops", rs_loops.rs_loops_kernel, DEFAULT_RS,
                          dict(**v, EPI_SPLIT=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                               NUM_SMS=132, ASYNC=True), name))
    for cfg in OCCUPANCY + [DEFAULT_RS]:
        bm, bn, bk, stages, warps, epi = cfg
        common = dict(RAGGED=False, B_KN=False, EPI_SPLIT=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      GROUP_M=8, NUM_SMS=264, FLATTEN=True, WARP_SPECIALIZE=False, WORLD=2)
        rows.append(build("gemm_rs", gemm_rs_kernel, cfg,
                          dict(common, HAS_BIAS=False, FLATTEN_CONSUME=True, TMA_PUSH=True,
                               ASYNC_FENCE=True, PRODUCE=True, CONSUME=True, TMA_REDUCE=True),
                          "default" if cfg == DEFAULT_RS else "occupancy"))
        if cfg == DEFAULT_RS:
            continue
        rows.append(build("ag_gemm", ag_gemm_kernel, cfg,
                          dict(common, STREAM_K=False, SK_LOCAL=False, ASYNC_FENCE=True),
                          "occupancy"))
        rows.append(build("plain", plain_gemm_kernel, cfg,
                          dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, NUM_SMS=264,
                               FLATTEN=True), "occupancy"))
    if args.json:
        version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True)
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv), "triton": triton.__version__,
                       "target": "sm_90a", "ptxas": version.stdout.strip().splitlines()[-1],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
