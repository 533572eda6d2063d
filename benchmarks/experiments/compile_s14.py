"""Session 14's compile-only facts about ``ag_merge_local``, recorded (no GPU needed; Triton
compiles for sm_90a). Uses ``compile_s13``'s helpers.

    PYTHONPATH=.:tests python benchmarks/experiments/compile_s14.py --json out.json

Run from a git checkout (it reads 73a0d7b's kernel with ``git show``). Records:

* ``same_code``: the package's AG+GEMM kernel with ``MERGE_LOCAL`` off against 73a0d7b's (before
  the merged schedule and the helpers it brought), as the count of differing PTX lines outside
  debug sections, for the per-segment schedule at TP 2 (stream-K, 128x128 warp-specialized),
  TP 8 (runtime step loop) and peer groups at TP 4 (unrolled) and TP 8 (runtime);
* ``merged``: shared memory of the merged kernel against the per-segment one at TP 2 for the
  llama3-8b table tile (128x128x64, 4 stages, 4 warps, warp-specialized) and the 128x256
  split-epilogue default.
"""

from compile_s13 import _compile, _emit, _resources, _same_code, _start, _version
from megatron_flux.kernels.ag_gemm import ag_gemm_kernel

_TILE_128 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EPI_SPLIT=1, WARP_SPECIALIZE=True)
_TILE_256 = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, EPI_SPLIT=2, WARP_SPECIALIZE=False)


def _ag(tile, world, **kw):
    return dict(tile, RAGGED=False, B_KN=False, GROUP_M=8, NUM_SMS=132, FLATTEN=True,
                WORLD=world, SK_LOCAL=False, ASYNC_FENCE=True, UNROLL_STEPS=world <= 4,
                **{"STREAM_K": False, "PEER_GROUP": 1, **kw})


def main(argv=None):
    args, out = _start(__doc__, argv)
    before = _version("73a0d7b", "megatron_flux/kernels/ag_gemm.py").ag_gemm_kernel
    same = {}
    for label, tile, warps, stages, constexprs in (
            ("TP 2 per segment, stream-K, 128x128 ws", _TILE_128, 4, 4,
             _ag(_TILE_128, 2, STREAM_K=True)),
            ("TP 8 per segment, stream-K, runtime steps", _TILE_256, 8, 3,
             _ag(_TILE_256, 8, STREAM_K=True)),
            ("TP 4 peer groups of 3, unrolled", _TILE_256, 8, 3, _ag(_TILE_256, 4, PEER_GROUP=3)),
            ("TP 8 peer groups of 2, runtime", _TILE_256, 8, 3, _ag(_TILE_256, 8, PEER_GROUP=2))):
        same[label] = _same_code(("73a0d7b", "package"), (before, ag_gemm_kernel), constexprs,
                                 warps, stages, args.ptxas)
    out["same_code"] = same
    out["merged"] = {
        f"{name} {label}": _resources(_compile(ag_gemm_kernel, constexprs, warps, stages),
                                      args.ptxas)
        for name, tile, warps, stages in (("128x128x64/4/4 ws", _TILE_128, 4, 4),
                                          ("128x256x64/3/8 split", _TILE_256, 8, 3))
        for label, constexprs in (("per segment (stream-K)", _ag(tile, 2, STREAM_K=True)),
                                  ("merged, lead 1", _ag(tile, 2, MERGE_LOCAL=True,
                                                         MERGE_LEAD=1)))}
    _emit(out, args.json)


if __name__ == "__main__":
    main()
