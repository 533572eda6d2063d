"""Session 18's compile-only fact: on Hopper (sm_90a), Triton's ``warp_specialize`` loop
attribute changes nothing in the fused kernels. Uses ``compile_s13``'s helpers; no GPU needed.

    PYTHONPATH=.:tests:benchmarks/experiments python benchmarks/experiments/compile_s18.py --json out.json

For every distinct kernel the shipped tables and defaults select
(``tests/test_kernels_compile._table_kernels``) it compiles the kernel with
``WARP_SPECIALIZE`` off and on and counts the PTX lines that differ (debug sections, ``.loc``
lines and comments left out, :func:`compile_s13._code`). With Triton 3.6 (the GPU box's) every
count is 0: the tuner's ``warp_specialize`` knob, and every table entry that chose it, timed
the same kernel twice.
"""

from compile_s13 import _code, _compile, _differing_lines, _emit, _start
from test_kernels_compile import _table_kernels


def main(argv=None):
    args, out = _start(__doc__, argv)
    rows = []
    for label, kernel, constexprs, num_warps, num_stages in _table_kernels():
        compiled = [_compile(kernel, dict(constexprs, WARP_SPECIALIZE=ws), num_warps, num_stages)
                    for ws in (False, True)]
        code = [_code(c) for c in compiled]
        rows.append({"label": label, "kernel": kernel.__name__, "num_warps": num_warps,
                     "num_stages": num_stages,
                     "block": [constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"]],
                     "ptx_lines": len(code[0]), "differing_lines_ws_off_on": _differing_lines(*code)})
    out["warp_specialize_sm90"] = rows
    out["all_identical"] = all(r["differing_lines_ws_off_on"] == 0 for r in rows)
    _emit(out, args.json)


if __name__ == "__main__":
    main()
