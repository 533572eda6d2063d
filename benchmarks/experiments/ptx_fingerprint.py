"""Fingerprints of the fused Triton kernels' sm_90 PTX, to show a refactor leaves the code alone.

Compiles ``gemm_rs_kernel`` and ``ag_gemm_kernel`` (no GPU needed; the target is sm_90) over
the descriptor variants: host-encoded or device-built, ragged segments or one operand, B as
``[N, K]`` or ``[K, N]``, at TP 2 with small blocks, and hashes each PTX without its debug
information (``.loc``/``.file`` lines, ``$L__tmp`` line labels, comments and the
``.section .debug_*`` tail), which moves with source line numbers. Also the warp-specialized
Gluon kernels (``gemm_rs_ws_kernel``, ``ag_gemm_ws_kernel``) at TP 2: descriptors host-encoded
or device-built, both B layouts, ping-pong (two MMA partitions, 128x128 tiles) or cooperative
(one, 128x256), and for GEMM+RS per-rank or merged rows, compiled as
``tests/unit/test_kernels_compile.py`` does (``_compile_gluon``). Run it before and after a change
and compare the JSON files::

    PYTHONPATH=/work/t36:. python benchmarks/experiments/ptx_fingerprint.py before.json
"""

import hashlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "unit"))
from test_kernels_compile import _COOP, _PINGPONG5, _SMALL, _compile, _compile_gluon, \
    _gluon_desc  # noqa: E402

from megatron_flux.kernels.ag_gemm import ag_gemm_kernel  # noqa: E402
from megatron_flux.kernels.config import unroll_steps  # noqa: E402
from megatron_flux.kernels.gemm_rs import gemm_rs_kernel  # noqa: E402


def fingerprint(ptx: str) -> str:
    lines = ptx.splitlines()
    cut = next((i for i, l in enumerate(lines) if re.match(r"\s*\.section\s+\.debug", l)), len(lines))
    code = [l for l in lines[:cut] if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp)", l)]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def desc(*block):
    return f"tensordesc<bf16[{','.join(map(str, block))}]>"


def gluon_kernels(world):
    """``{name: fingerprint}`` of the two Gluon kernels' variants (empty without Gluon)."""
    from megatron_flux.kernels import ag_gemm_ws as AG
    from megatron_flux.kernels import gemm_rs_ws as RS
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gluon_ws import mma_partitions

    if RS.gemm_rs_ws_kernel is None or AG.ag_gemm_ws_kernel is None:
        return {}
    out = {}
    for host in (False, True):
        for b_kn in (False, True):
            for tile in (_PINGPONG5, _COOP):
                for merged in (False, True):
                    cfg = GemmConfig(*tile, rs_warp_specialized=True, rs_merge_rows=merged,
                                     rs_spread_reduce=merged, rs_tma_push=not merged)
                    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
                    b = _gluon_desc(bk, bn) if b_kn else _gluon_desc(bn, bk)
                    types = {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32"}
                    if host:
                        types.update(a_hd=_gluon_desc(bm, bk), b_hd=b, out_hd=_gluon_desc(bm, bn),
                                     slots_hd=_gluon_desc(bm, bn))
                    k = _compile_gluon(RS.gemm_rs_ws_kernel, cfg, dict(
                        WORLD=world, B_KN=b_kn, HAS_BIAS=True, CE_PUSH=False,
                        CONSUMER_REGS=RS.CONSUMER_REGS, MERGE_ROWS=merged, HOST_DESC=host),
                        types, "bf16")
                    out[f"rs_ws host={host} b_kn={b_kn} partitions={mma_partitions(cfg)} "
                        f"merge_rows={merged}"] = fingerprint(k.asm["ptx"])
                cfg = GemmConfig(*tile, ag_warp_specialized=True)
                bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
                types = {"flags_ptr": "*i32", "err_ptr": "*i32"}
                if host:
                    types.update(x_hd=_gluon_desc(bm, bk), ag_hd=_gluon_desc(bm, bk),
                                 b_hd=_gluon_desc(bk, bn) if b_kn else _gluon_desc(bn, bk),
                                 c_hd=_gluon_desc(bm, bn))
                k = _compile_gluon(AG.ag_gemm_ws_kernel, cfg, dict(
                    WORLD=world, B_KN=b_kn, CONSUMER_REGS=AG.CONSUMER_REGS, HOST_DESC=host),
                    types, "bf16")
                out[f"ag_ws host={host} b_kn={b_kn} partitions={mma_partitions(cfg)}"] = \
                    fingerprint(k.asm["ptx"])
    return out


def main(path):
    import triton

    out, world = {"triton": triton.__version__, "kernels": {}}, 2
    for host in (False, True):
        for ragged in (True, False):
            for b_kn in (False, True):
                a = desc(1, 64, 64) if ragged else desc(64, 64)
                types = ({"a_ptr": a, "b_ptr": desc(64, 64), "out_hd": desc(64, 64),
                          "slots_hd": desc(1, 64, 64)} if host else {})
                k = _compile(gemm_rs_kernel, dict(
                    _SMALL, WORLD=world, RAGGED=ragged, B_KN=b_kn, EPI_SPLIT=1, HAS_BIAS=True,
                    TMA_PUSH=True, UNROLL_STEPS=unroll_steps(world),
                    HOST_DESC=host), ones=(), types=types)
                out["kernels"][f"rs host={host} ragged={ragged} b_kn={b_kn}"] = fingerprint(k.asm["ptx"])
                c = desc(1, 64, 32) if ragged else desc(64, 32)
                types = ({"x_ptr": desc(64, 64), "ag_ptr": a, "b_ptr": desc(64, 64), "c_ptr": c}
                         if host else {})
                k = _compile(ag_gemm_kernel, dict(
                    _SMALL, WORLD=world, RAGGED=ragged, B_KN=b_kn, EPI_SPLIT=2, SK_LOCAL=False,
                    STREAM_K=not ragged, UNROLL_STEPS=unroll_steps(world), HOST_DESC=host),
                    ones=(), types=types)
                out["kernels"][f"ag host={host} ragged={ragged} b_kn={b_kn}"] = fingerprint(k.asm["ptx"])
    out["kernels"].update(gluon_kernels(world))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
