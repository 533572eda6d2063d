"""The fused kernels compile for Hopper (sm_90) on the CPU, with the integer specializations
Triton applies at launch. Triton turns an integer argument equal to 1 into a compile-time
constant: a decode-sized GEMM+RS call has ``m_local == 1``, and an expression that is a tensor
for every other ``m_local`` becomes a Python int there (the spread reduction's
``(src * m_local).to(...)`` once failed to compile on GPUs that way, never under the
interpreter, which does not specialize)."""

import inspect

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# the Gluon kernels' sm_90 build, as benchmarks/experiments/ptxas_report.py makes it
from ptxas_report import compile_gluon as _compile_gluon  # noqa: E402
from ptxas_report import gluon_desc as _gluon_desc  # noqa: E402

_POINTERS = {"own_ptr": "*bf16", "slots_ptr": "*bf16", "x_ptr": "*bf16", "ag_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16",
             "a_ptr": "*bf16", "out_ptr": "*bf16", "data_ptr": "*bf16", "bias_ptr": "*bf16",
             "data_ptrs": "*i64", "flag_ptrs": "*i64", "flags_ptr": "*i32", "err_ptr": "*i32",
             "sk_partials_ptr": "*fp32", "sk_counters_ptr": "*i32", "trace_ptr": "*i64",
             "parts_ptr": "*fp32", "counters_ptr": "*i32", "out_hd": "*bf16", "slots_hd": "*bf16"}
_SMALL = dict(B_KN=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, NUM_SMS=4,
              FLATTEN=True, WARP_SPECIALIZE=False, ASYNC_FENCE=True)


def _compile(fn, constexprs, ones, num_warps=4, num_stages=2, types=None):
    """``fn`` compiled for sm_90 (no GPU needed) with ``constexprs`` and the integer arguments
    in ``ones`` specialized to 1, as Triton does at launch; ``types`` overrides arguments'
    types (host TMA descriptors: ``"tensordesc<bf16[64,64]>"``)."""
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs, **{name: 1 for name in ones}}
    names = [p.name for p in fn.params]
    kinds = {**_POINTERS, **(types or {})}
    sig = {n: "constexpr" if n in constexprs else kinds.get(n, "i32") for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("copy_engine", [False, True])
def test_gemm_rs_compiles_with_one_row_per_rank(world, spread, copy_engine):
    from megatron_flux.kernels.config import unroll_steps
    from megatron_flux.kernels.gemm_rs import gemm_rs_kernel

    for bias in (True, False):
        _compile(gemm_rs_kernel, dict(_SMALL, WORLD=world, RAGGED=True, EPI_SPLIT=1,
                                      HAS_BIAS=bias, TMA_PUSH=True,
                                      SPREAD_REDUCE=spread, UNROLL_STEPS=unroll_steps(world),
                                      CE_PUSH=copy_engine),
                 ones=("m_local",))


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("split", [1, 2])
def test_gemm_rs_merged_rows_compiles_with_one_row_per_rank(world, split):
    """``rs_merge_rows``: one tile loop over every rank's rows, pushes by owner."""
    from megatron_flux.kernels.config import unroll_steps
    from megatron_flux.kernels.gemm_rs import gemm_rs_kernel

    _compile(gemm_rs_kernel, dict(_SMALL, WORLD=world, RAGGED=False, EPI_SPLIT=split,
                                  HAS_BIAS=True, TMA_PUSH=False, SPREAD_REDUCE=True,
                                  UNROLL_STEPS=unroll_steps(world), MERGE_ROWS=True),
             ones=("m_local",))


@pytest.mark.parametrize("world", [2, 8])
def test_rs_reduce_compiles_with_one_row_per_rank(world):
    from megatron_flux.kernels.rs_reduce import rs_reduce_kernel

    for bias in (False, True):
        _compile(rs_reduce_kernel, dict(WORLD=world, HAS_BIAS=bias, BLOCK_M=32, BLOCK_N=256),
                 ones=("m_local",), num_stages=1)


@pytest.mark.parametrize("world", [2, 8])
def test_kernels_compile_with_host_descriptors(world):
    """HOST_DESC: A and B (and AG+GEMM's gathered rows and output) arrive as host-encoded TMA
    descriptors (kernel parameters) of the views the kernels otherwise build on the device:
    2-D and, for ragged segments, 3-D; B as [N, K] or [K, N]."""
    from megatron_flux.kernels.ag_gemm import ag_gemm_kernel
    from megatron_flux.kernels.config import unroll_steps
    from megatron_flux.kernels.gemm_rs import gemm_rs_kernel

    desc = lambda *block: f"tensordesc<bf16[{','.join(map(str, block))}]>"  # noqa: E731
    for ragged, b_kn in ((True, False), (False, True)):
        a = desc(1, 64, 64) if ragged else desc(64, 64)
        b = desc(64, 64)
        _compile(gemm_rs_kernel, dict(_SMALL, WORLD=world, RAGGED=ragged, B_KN=b_kn, EPI_SPLIT=1,
                                      HAS_BIAS=True, TMA_PUSH=True,
                                      UNROLL_STEPS=unroll_steps(world), HOST_DESC=True),
                 ones=(), types={"a_ptr": a, "b_ptr": b, "out_hd": desc(64, 64),
                                 "slots_hd": desc(1, 64, 64)})
        c = desc(1, 64, 32) if ragged else desc(64, 32)
        _compile(ag_gemm_kernel, dict(_SMALL, WORLD=world, RAGGED=ragged, B_KN=b_kn, EPI_SPLIT=2,
                                      SK_LOCAL=False, STREAM_K=not ragged,
                                      UNROLL_STEPS=unroll_steps(world), HOST_DESC=True),
                 ones=(), types={"x_ptr": desc(64, 64), "ag_ptr": a, "b_ptr": b, "c_ptr": c})
    # merged GEMM+RS rows (one 2-D A over every rank's rows) and gathered AG+GEMM rows
    _compile(gemm_rs_kernel, dict(_SMALL, WORLD=world, RAGGED=False, EPI_SPLIT=1, HAS_BIAS=False,
                                  TMA_PUSH=False, SPREAD_REDUCE=True, MERGE_ROWS=True,
                                  UNROLL_STEPS=unroll_steps(world), HOST_DESC=True),
             ones=(), types={"a_ptr": desc(64, 64), "b_ptr": desc(64, 64), "out_hd": desc(64, 64),
                             "slots_hd": desc(1, 64, 64)})
    _compile(ag_gemm_kernel, dict(_SMALL, WORLD=world, RAGGED=False, EPI_SPLIT=1, SK_LOCAL=False,
                                  STREAM_K=False, MERGE_LOCAL=True, MERGE_LEAD=0, GATHERED=True,
                                  UNROLL_STEPS=unroll_steps(world), HOST_DESC=True),
             ones=(), types={"x_ptr": desc(64, 64), "ag_ptr": desc(64, 64),
                             "b_ptr": desc(64, 64), "c_ptr": desc(64, 64)})


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ag_gemm_compiles_with_one_row_per_rank(world):
    """Every step schedule: per segment (with and without stream-K) and the local rows merged
    with the first peer's (``ag_merge_local`` with a lead of 1, the later peers after it above
    TP 2: unrolled at TP 4, a runtime loop at TP 8), or with a lead of 0 the gathered rows as
    one operand (``GATHERED``, 2-D descriptors)."""
    from megatron_flux.kernels.ag_gemm import ag_gemm_kernel
    from megatron_flux.kernels.config import unroll_steps

    variants = [dict(STREAM_K=False), dict(STREAM_K=True)]
    variants.append(dict(STREAM_K=False, MERGE_LOCAL=True, MERGE_LEAD=1))
    variants.append(dict(STREAM_K=False, MERGE_LOCAL=True, MERGE_LEAD=0, GATHERED=True,
                         RAGGED=False))
    for variant in variants:
        constexprs = dict(_SMALL, WORLD=world, RAGGED=True, EPI_SPLIT=1, SK_LOCAL=False,
                          UNROLL_STEPS=unroll_steps(world))
        constexprs.update(variant)
        _compile(ag_gemm_kernel, constexprs, ones=("m_local", "chunk_rows"))


#: (block_m, block_n, block_k, num_stages, num_warps, group_m) of the warp-specialized kernels'
#: two forms: ping-pong (4 warps per MMA partition) and cooperative (one 8-warp partition)
_PINGPONG5 = (128, 128, 64, 5, 4, 8)
_PINGPONG4 = (128, 128, 64, 4, 4, 8)
_COOP = (128, 256, 64, 3, 8, 8)
_PINGPONG64 = (64, 128, 64, 8, 4, 8)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gemm_rs_ws_compiles_for_hopper_within_its_shared_memory_bound(world):
    """The warp-specialized Gluon GEMM+RS builds for sm_90 (both B layouts, bias, the copy
    engine's "produced" signal, bf16 and fp16, ping-pong with 4 and 5 stages and 64-row tiles,
    cooperative 128x256 with 3; every rank's rows in one tile space with the spread reduction,
    also with the owners' row tiles in turn; the per-segment schedule with its row groups in
    turn) and uses no more shared memory
    than ``gemm_rs_ws.smem_bytes`` says, which the launcher checks against Hopper's limit."""
    from megatron_flux.kernels import gemm_rs_ws as W
    from megatron_flux.kernels.config import GemmConfig

    if W.gemm_rs_ws_kernel is None:
        pytest.skip(W.GLUON_ERROR)
    merged = dict(rs_merge_rows=True, rs_spread_reduce=True, rs_tma_push=False)
    for b_kn, bias, ce, dtype, tile, more in (
            (False, False, False, "bf16", _PINGPONG5, {}),
            (True, True, True, "fp16", _PINGPONG4, {}),
            (False, True, False, "bf16", _COOP, {}),
            (True, False, True, "fp16", _COOP, {}),
            (False, True, False, "bf16", _PINGPONG64, merged),
            (True, False, False, "fp16", _COOP, merged),
            (False, False, False, "bf16", _PINGPONG5, dict(merged, rs_interleave_owners=True)),
            (False, True, False, "bf16", _PINGPONG5, dict(rs_row_turns=True)),
            (True, False, False, "fp16", _COOP, dict(rs_row_turns=True))):
        cfg = GemmConfig(*tile, rs_warp_specialized=True, rs_copy_engine=ce, **more)
        consts = dict(WORLD=world, B_KN=b_kn, HAS_BIAS=bias, CE_PUSH=ce,
                      CONSUMER_REGS=W.CONSUMER_REGS, MERGE_ROWS=cfg.rs_merge_rows,
                      INTERLEAVE=cfg.rs_interleave_owners, ROW_TURNS=cfg.rs_row_turns)
        kernel = _compile_gluon(W.gemm_rs_ws_kernel, cfg, consts,
                                {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32"}, dtype)
        assert kernel.metadata.shared <= W.smem_bytes(cfg) <= _HOPPER_SMEM, \
            (kernel.metadata.shared, W.smem_bytes(cfg))


@pytest.mark.parametrize("tail_first", [True, False], ids=["part_first", "part_last"])
@pytest.mark.parametrize("tile", [_PINGPONG5, _COOP], ids=["pingpong", "coop"])
def test_gemm_rs_ws_split_tail_compiles_without_serialised_wgmma(tile, tail_first):
    """The warp-specialized GEMM+RS with its split tail (SPLIT_TAIL), the parts run first or
    last (TAIL_FIRST), builds for sm_90 within its
    shared-memory bound, and ptxas pipelines its wgmma: a form that ran the tail after the tile
    loop, through a second wgmma site, made ptxas serialise every wgmma of the kernel (warning
    C7515), and the kernel ran 1.94-2.21x cuBLAS's time on an H200 where it split, against
    1.12-1.37x unsplit (``kernel-vs-cublas-h200-2026-11-28-split-tail-c7515.json``; this test
    fails on that form). Skipped without a ptxas that takes sm_90a."""
    import os
    import re
    import subprocess
    import tempfile

    from megatron_flux.kernels import gemm_rs_ws as W
    from megatron_flux.kernels.config import GemmConfig

    if W.gemm_rs_ws_kernel is None:
        pytest.skip(W.GLUON_ERROR)
    cfg = GemmConfig(*tile, rs_warp_specialized=True, stream_k=1)
    consts = dict(WORLD=4, B_KN=False, HAS_BIAS=True, CE_PUSH=False,
                  CONSUMER_REGS=W.CONSUMER_REGS, MERGE_ROWS=False, SPLIT_TAIL=True,
                  TAIL_FIRST=tail_first)
    kernel = _compile_gluon(W.gemm_rs_ws_kernel, cfg, consts,
                            {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32",
                             "parts_ptr": "*fp32", "counters_ptr": "*i32"}, "bf16")
    assert kernel.metadata.shared <= W.smem_bytes(cfg) <= _HOPPER_SMEM
    import triton.backends.nvidia as nvidia

    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("no ptxas in this Triton")
    def assemble(ptx):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.ptx"), "w") as f:
                f.write(ptx)
            return subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"),
                                   "-o", os.path.join(tmp, "k.cubin")], capture_output=True,
                                  text=True)

    ptx = kernel.asm["ptx"]
    done = assemble(ptx)
    older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", done.stderr)
    if done.returncode != 0 and older:  # a ptxas older than this Triton's PTX: the kernel uses
        # nothing newer than sm_90a's instructions, so the lower version assembles it the same
        done = assemble(re.sub(r"^\.version \d+\.\d+", f".version {older.group(1)}", ptx,
                               flags=re.M))
    if done.returncode != 0 and re.search(r"not supported|Unsupported", done.stderr):
        pytest.skip(f"this ptxas does not take the PTX: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "C7515" not in done.stderr, done.stderr


def test_gemm_rs_ws_phase_stamps_exist_only_in_a_trace_build():
    """TRACE (``gemm_rs_ws.WS_RS_PHASES``, read by ``benchmarks/experiments/phase_trace_ws.py``):
    the warp-specialized GEMM+RS with its split tail builds with the stamps, which read
    ``%globaltimer``; without TRACE (every production launch) the kernel reads no timer."""
    from megatron_flux.kernels import gemm_rs_ws as W, split_tail
    from megatron_flux.kernels.config import GemmConfig

    if W.gemm_rs_ws_kernel is None:
        pytest.skip(W.GLUON_ERROR)
    cfg = GemmConfig(*_PINGPONG5, rs_warp_specialized=True, stream_k=1)
    ptx = {}
    for trace in (False, True):
        consts = dict(WORLD=2, B_KN=False, HAS_BIAS=False, CE_PUSH=False,
                      CONSUMER_REGS=W.CONSUMER_REGS, MERGE_ROWS=False, SPLIT_TAIL=True,
                      TAIL_ROWS=split_tail.tail_sum_rows(cfg, 4), TRACE=trace)
        ptx[trace] = _compile_gluon(W.gemm_rs_ws_kernel, cfg, consts,
                                    {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32",
                                     "parts_ptr": "*fp32", "counters_ptr": "*i32",
                                     "trace_ptr": "*i64"}, "bf16").asm["ptx"]
    assert "%globaltimer" not in ptx[False]
    # every partition's stamps: two MMA partitions' six phases and their grid-barrier count-in
    # (two sites) and peers' signals acquired (WS_RS_SYNC), the loader's two, the split's one
    assert ptx[True].count("%globaltimer") >= 2 * (len(W.WS_RS_PHASES) + len(W.WS_RS_SYNC) + 1) + 3


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ag_gemm_ws_compiles_for_hopper_within_its_shared_memory_bound(world):
    """The warp-specialized Gluon AG+GEMM builds for sm_90 (both B layouts, bf16 and fp16,
    ping-pong with 4 and 5 stages, cooperative 128x256 with 3) within ``ag_gemm_ws.smem_bytes``."""
    from megatron_flux.kernels import ag_gemm_ws as W
    from megatron_flux.kernels.config import GemmConfig

    if W.ag_gemm_ws_kernel is None:
        pytest.skip(W.GLUON_ERROR)
    for b_kn, dtype, tile in ((False, "bf16", _PINGPONG5), (True, "fp16", _PINGPONG4),
                              (False, "bf16", _COOP), (True, "fp16", _COOP)):
        cfg = GemmConfig(*tile, ag_warp_specialized=True)
        consts = dict(WORLD=world, B_KN=b_kn, CONSUMER_REGS=W.CONSUMER_REGS)
        kernel = _compile_gluon(W.ag_gemm_ws_kernel, cfg, consts,
                                {"flags_ptr": "*i32", "err_ptr": "*i32"}, dtype)
        assert kernel.metadata.shared <= W.smem_bytes(cfg) <= _HOPPER_SMEM, \
            (kernel.metadata.shared, W.smem_bytes(cfg))


@pytest.mark.parametrize("world", [2, 8])
def test_gluon_kernels_compile_with_host_descriptors(world):
    """HOST_DESC: both Gluon kernels take their A/B/output (and GEMM+RS's slot) descriptors
    encoded on the host, with the layouts their shared-memory buffers use
    (``gluon_ws.host_descriptor``), both forms and both B layouts."""
    from megatron_flux.kernels import ag_gemm_ws as AG
    from megatron_flux.kernels import gemm_rs_ws as RS
    from megatron_flux.kernels.config import GemmConfig

    if RS.gemm_rs_ws_kernel is None:
        pytest.skip(RS.GLUON_ERROR)
    desc = _gluon_desc
    for tile, b_kn, merged in ((_PINGPONG5, False, False), (_COOP, True, False),
                               (_PINGPONG64, False, True)):
        cfg = GemmConfig(*tile, rs_warp_specialized=True, rs_merge_rows=merged,
                         rs_spread_reduce=merged, rs_tma_push=not merged)
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        b = desc(bk, bn) if b_kn else desc(bn, bk)
        consts = dict(WORLD=world, B_KN=b_kn, HAS_BIAS=True, CE_PUSH=False,
                      CONSUMER_REGS=RS.CONSUMER_REGS, MERGE_ROWS=merged, HOST_DESC=True)
        _compile_gluon(RS.gemm_rs_ws_kernel, cfg, consts,
                       {"data_ptrs": "*i64", "flag_ptrs": "*i64", "err_ptr": "*i32",
                        "a_hd": desc(bm, bk), "b_hd": b, "out_hd": desc(bm, bn),
                        "slots_hd": desc(bm, bn)}, "bf16")
        if merged:
            continue
        cfg = GemmConfig(*tile, ag_warp_specialized=True)
        consts = dict(WORLD=world, B_KN=b_kn, CONSUMER_REGS=AG.CONSUMER_REGS, HOST_DESC=True)
        _compile_gluon(AG.ag_gemm_ws_kernel, cfg, consts,
                       {"flags_ptr": "*i32", "err_ptr": "*i32", "x_hd": desc(bm, bk),
                        "ag_hd": desc(bm, bk), "b_hd": b, "c_hd": desc(bm, bn)}, "bf16")


#: dynamic shared memory one block may use on H100 / H200 (sm_90)
_HOPPER_SMEM = 232448


def _shipped_configs():
    """``(label, op, tp, GemmConfig)``: every entry of the shipped tuning tables, and the
    heuristic default for the grid's shapes at TP 2, 4 and 8 (what runs without an entry)."""
    import json
    import pathlib

    from megatron_flux.tools.bench.grid import MODELS
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import grid_shape
    from megatron_flux.kernels.config import GemmConfig, default_config

    from helpers.paths import REPO

    tables = REPO / "megatron_flux" / "tuning" / "tables"
    for path in sorted(tables.glob("*.json")):
        table = json.loads(path.read_text())
        for entry in table["entries"]:
            yield (f"{path.stem}:{entry['op']}:m{entry['m']}", entry["op"], table["tp"],
                   GemmConfig.from_dict(entry["config"]))
    for tp in (2, 4, 8):
        for name in MODELS:
            for m in (256, 1024, 8192):
                for op in ("ag", "rs"):
                    yield (f"default:tp{tp}:{name}:{op}:m{m}", op, tp,
                           default_config(op, m, *grid_shape(op, name, tp), tp=tp))


def _table_kernels():
    """``(label, kernel, constexprs, num_warps, num_stages)`` for every distinct compiled
    kernel the shipped configs select (full-size segments, no bias: the variants launches
    pick most)."""
    from megatron_flux.kernels.ag_gemm import ag_gemm_kernel
    from megatron_flux.kernels.config import unroll_steps
    from megatron_flux.kernels.gemm_rs import gemm_rs_kernel

    seen = {}
    for label, op, tp, cfg in _shipped_configs():
        common = dict(B_KN=False, RAGGED=False, WORLD=tp, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      NUM_SMS=132, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
                      EPI_SPLIT=cfg.epilogue_split, ASYNC_FENCE=True,
                      UNROLL_STEPS=unroll_steps(tp))
        if op == "rs":
            kernel = gemm_rs_kernel
            constexprs = dict(common, HAS_BIAS=False, TMA_PUSH=cfg.rs_tma_push,
                              SPREAD_REDUCE=cfg.rs_spread_reduce,
                              FLATTEN_CONSUME=cfg.flatten_consume, CE_PUSH=cfg.rs_copy_engine)
        else:
            kernel = ag_gemm_kernel
            constexprs = dict(common, STREAM_K=bool(cfg.stream_k), SK_LOCAL=False)
        key = (op, tuple(sorted(constexprs.items())), cfg.num_warps, cfg.num_stages)
        seen.setdefault(key, (label, kernel, constexprs, cfg.num_warps, cfg.num_stages))
    return list(seen.values())


def test_every_shipped_config_compiles_and_fits_hopper_shared_memory():
    """A kernel change must not break a tuned config or a default: every distinct kernel the
    shipped tables and the heuristic defaults select compiles for sm_90 and needs at most the
    227 KiB of shared memory a Hopper block may have (a flattened reduction loop would need
    279 576 bytes for one table entry). Triton 3.6 and 3.9 report the same sizes for all of
    them."""
    kernels = _table_kernels()
    assert len(kernels) >= 10
    too_big = []
    for label, kernel, constexprs, num_warps, num_stages in kernels:
        compiled = _compile(kernel, constexprs, (), num_warps, num_stages)
        if compiled.metadata.shared > _HOPPER_SMEM:
            too_big.append((label, compiled.metadata.shared))
    assert not too_big, too_big
