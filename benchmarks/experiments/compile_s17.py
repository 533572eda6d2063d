"""Session 17's compile-only facts about the banded copy-engine GEMM+RS (``rs_ce_bands``),
recorded (no GPU needed; Triton compiles for sm_90a). Uses ``compile_s13``'s helpers.

    PYTHONPATH=.:tests:benchmarks/experiments python benchmarks/experiments/compile_s17.py --json out.json

Run from a git checkout (it reads the kernel at ``REV`` with ``git show``). For the copy-engine
GEMM+RS at TP 2 (128x256x64, 3 stages, 8 warps, split epilogue) it records each variant's TMA
load sites in the TTGIR (a software-pipelined K loop issues its first stages' loads ahead of the
loop, so it has more sites) and its shared memory:

* ``unbanded, flattened`` / ``unbanded, unflattened``: ``rs_copy_engine`` alone;
* ``banded (producer loop unflattened)``: ``rs_ce_bands`` as shipped;
* ``banded, flattened (patch)``: the same kernel with ``raw/s17/bands_flattened.patch``, which
  keeps the producer loop flattened with the band count inside it (the version session 17
  first compiled, with predicated atomics).
"""

from compile_s13 import _compile, _emit, _rs, _start, _version

REV = "9fb72aa"
PATH = "megatron_flux/kernels/gemm_rs.py"


def _facts(kernel):
    return {"tma_load_sites": kernel.asm["ttgir"].count("async_tma_copy_global_to_local"),
            "shared_bytes": kernel.metadata.shared}


def main(argv=None):
    args, out = _start(__doc__, argv)
    shipped = _version(REV, PATH).gemm_rs_kernel
    patched = _version(REV, PATH, "benchmarks/results/raw/s17/bands_flattened.patch").gemm_rs_kernel
    out["rev"] = REV
    out["variants"] = {
        label: _facts(_compile(fn, dict(_rs(), FLATTEN=flatten, CE_PUSH=True, CE_BANDS=bands), 8, 3))
        for label, fn, flatten, bands in (
            ("unbanded, flattened", shipped, True, False),
            ("unbanded, unflattened", shipped, False, False),
            ("banded (producer loop unflattened)", shipped, True, True),
            ("banded, flattened (patch)", patched, True, True))}
    _emit(out, args.json)


if __name__ == "__main__":
    main()
