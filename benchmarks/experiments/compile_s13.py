"""Session 13's compile-only facts, recorded (no GPU needed; Triton compiles for sm_90a).

    PYTHONPATH=.:tests python benchmarks/experiments/compile_s13.py --json out.json

Run from a git checkout (it reads earlier kernel versions with ``git show``). Records:

* ``flat``: shared memory of GEMM+RS with its reduction loop really flattened (the variant in
  ``results/raw/s13/flat_gemm_rs.patch``, applied to 8d11048's kernel) against the unflattened
  kernel, for the 128x256 split-epilogue default and the 128x256 one-store warp-specialized
  config of the TP 2 table;
* ``whole_tile_reads``: registers (ptxas, if ``--ptxas`` is given) and shared memory of GEMM+RS
  128x256 split epilogue, with and without a bias, before (13e916d) and after (b6f2f4d) the
  whole-tile TMA reads;
* ``same_code``: whether two kernel versions compile to the same PTX outside debug sections
  and ``.loc`` lines, and their resources (TRACE off against the kernels before it; ``ag_peer_group`` 1 against the
  kernel before it; the spread bias through ``_add_bias``), as the count of differing lines;
* ``shipped``: ``[label, shared memory]`` of every distinct kernel the shipped tables and
  defaults select (``tests/test_kernels_compile._table_kernels``; a label names the first
  entry that selects it), for comparing Triton versions.
"""

import argparse
import difflib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import ptxas_report  # noqa: E402
from test_kernels_compile import _table_kernels  # noqa: E402

_TMP = tempfile.mkdtemp()


def _version(rev, path, patch=None):
    """The kernel module at ``rev`` (optionally patched), loaded from a temporary file."""
    src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    name = f"{os.path.basename(path)[:-3]}_{rev}{'_patched' if patch else ''}"
    file = os.path.join(_TMP, name + ".py")
    with open(file, "w") as f:
        f.write(src)
    if patch:
        subprocess.run(["patch", "-s", file, os.path.join(ROOT, patch)], check=True)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(fn, constexprs, num_warps, num_stages):
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in constexprs else ptxas_report._TYPES.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _code(kernel):
    """PTX without debug sections, ``.loc``/``.file`` lines and comments."""
    ptx = kernel.asm["ptx"]
    ptx = ptx[:ptx.find(".section")] if ".section" in ptx else ptx
    return [ln for ln in ptx.splitlines()
            if not ln.strip().startswith((".loc", ".file", "$L__tmp", "//"))]


def _differing_lines(a, b):
    return sum(1 for ln in difflib.unified_diff(a, b, lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---")))


def _rs(world=2, epi=2, ws=False, bias=False, flat_consume=True, spread=False):
    return dict(RAGGED=False, B_KN=False, EPI_SPLIT=epi, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                GROUP_M=8, NUM_SMS=132, FLATTEN=True, WARP_SPECIALIZE=ws, WORLD=world,
                HAS_BIAS=bias, FLATTEN_CONSUME=flat_consume, TMA_PUSH=True, ASYNC_FENCE=True,
                SPREAD_REDUCE=spread, UNROLL_STEPS=world <= 4)


def _ag(world=2, stream_k=False):
    return dict(RAGGED=False, B_KN=False, EPI_SPLIT=2, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
                GROUP_M=8, NUM_SMS=132, FLATTEN=True, WARP_SPECIALIZE=False, WORLD=world,
                STREAM_K=stream_k, SK_LOCAL=False, ASYNC_FENCE=True, UNROLL_STEPS=world <= 4)


def _resources(kernel, ptxas):
    row = {"shared_bytes": kernel.metadata.shared}
    if ptxas:
        info, _ = ptxas_report.run_ptxas(kernel, ptxas, "9.0")
        row.update(ptxas_report.resources(kernel, info))
    return row


def _same_code(revisions, fns, constexprs, num_warps, num_stages, ptxas):
    """Compile two revisions ``fns`` of one kernel alike and compare them: their PTX line
    counts, differing lines (:func:`_differing_lines`) and resources, labelled ``revisions``."""
    compiled = [_compile(fn, constexprs, num_warps, num_stages) for fn in fns]
    code = [_code(c) for c in compiled]
    return {"revisions": list(revisions), "code_lines": [len(c) for c in code],
            "differing_lines": _differing_lines(*code),
            "resources": [_resources(c, ptxas) for c in compiled]}


def _emit(record, path):
    """Print the record as JSON, and write it to ``path`` if given."""
    text = json.dumps(record, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def _start(doc, argv):
    """``(args, record)``: the compile scripts' command line (``--ptxas``, ``--json``) and the
    record's header (command, Triton version, target)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ptxas", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    return args, {"command": " ".join([sys.executable] + sys.argv), "triton": triton.__version__,
                  "target": "sm_90a"}


def main(argv=None):
    args, out = _start(__doc__, argv)
    rs_path, ag_path = "megatron_flux/kernels/gemm_rs.py", "megatron_flux/kernels/ag_gemm.py"

    base = _version("8d11048", rs_path).gemm_rs_kernel
    flat = _version("8d11048", rs_path, "benchmarks/results/raw/s13/flat_gemm_rs.patch").gemm_rs_kernel
    out["flat"] = {
        f"{label} 128x256x64/3/8 {name}": _compile(fn, constexprs, 8, 3).metadata.shared
        for name, constexprs in (("split epilogue", _rs()),
                                 ("one store, warp-specialized", _rs(epi=1, ws=True)))
        for label, fn in (("unflattened (8d11048)", base), ("flattened (patch)", flat))}

    out["whole_tile_reads"] = {
        f"{rev} bias={bias}": _resources(_compile(_version(rev, rs_path).gemm_rs_kernel,
                                                  _rs(bias=bias), 8, 3), args.ptxas)
        for rev in ("13e916d", "b6f2f4d") for bias in (False, True)}

    same = {}
    for label, rev_a, rev_b, path, kernel, constexprs in (
            ("TRACE off vs before it: GEMM+RS", "8280bce", "8d11048", rs_path, "gemm_rs_kernel",
             _rs()),
            ("TRACE off vs before it: AG+GEMM (stream-K)", "8280bce", "8d11048", ag_path,
             "ag_gemm_kernel", _ag(stream_k=True)),
            ("ag_peer_group 1 vs before it (stream-K)", "db66343", "87e5a6c", ag_path,
             "ag_gemm_kernel", _ag(stream_k=True)),
            ("ag_peer_group 1 vs before it, TP 8", "db66343", "87e5a6c", ag_path,
             "ag_gemm_kernel", _ag(world=8)),
            ("spread bias via _add_bias, TP 8", "6e51ced", "e216c35", rs_path, "gemm_rs_kernel",
             _rs(world=8, bias=True, spread=True))):
        same[label] = _same_code((rev_a, rev_b),
                                 [getattr(_version(rev, path), kernel) for rev in (rev_a, rev_b)],
                                 constexprs, 8, 3, args.ptxas)
    out["same_code"] = same

    out["shipped"] = [[label, _compile(kernel, constexprs, warps, stages).metadata.shared]
                      for label, kernel, constexprs, warps, stages in _table_kernels()]
    _emit(out, args.json)


if __name__ == "__main__":
    main()
