"""CPU tests of ``megatron_flux.tools.bench``: metric math, grid shapes, JSON schema, timing protocol,
cross-rank failure agreement and an end-to-end torchrun smoke run on gloo.

The distributed parts run two real processes (gloo over a FileStore) because what they guard —
max-over-ranks timing and every rank dropping the same methods — only exists with several ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_flux.tools import cli
from megatron_flux.tools.bench import grid as G
from megatron_flux.tools.bench import methods as M
from megatron_flux.tools.bench import report as R
from megatron_flux.tools.bench import timing as T
from megatron_flux.tools.bench.__main__ import build_parser, describe_command, main as bench_main, resolve_args, run_case

from helpers.paths import DATA, REPO
# the (model, op, m, n, k) rows of the reference anchor measurement (2xH200, TP 2)
ANCHORS = DATA / "anchor_grid_tp2.json"
HAVE_NCCL_BACKEND = importlib.util.find_spec("megatron_flux.backends.nccl") is not None
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


# ------------------------------------------------------------------------------ metric math


def test_ect_efficiency_speedup_from_synthetic_times():
    assert R.ect(3.5, 3.0) == pytest.approx(0.5)
    assert R.overlap_efficiency(0.25, 1.0) == pytest.approx(0.75)
    assert R.overlap_efficiency(0.0, 1.0) == pytest.approx(1.0)  # perfect overlap
    assert R.overlap_efficiency(1.0, 1.0) == pytest.approx(0.0)  # no better than nccl
    assert R.overlap_efficiency(1.5, 1.0) == pytest.approx(-0.5)  # slower than nccl
    assert R.overlap_efficiency(-0.1, 1.0) == pytest.approx(1.1)  # faster than the bare GEMM
    assert R.speedup(2.0, 3.0) == pytest.approx(1.5)


@pytest.mark.parametrize("ect_nccl", [0.0, -0.2, None, float("nan")])
def test_efficiency_is_undefined_not_an_exception_when_nccl_exposes_nothing(ect_nccl):
    assert R.overlap_efficiency(0.1, ect_nccl) is None


def test_missing_or_nonpositive_times_give_none():
    assert R.ect(None, 1.0) is None and R.ect(1.0, None) is None
    assert R.overlap_efficiency(None, 1.0) is None
    assert R.speedup(0.0, 1.0) is None and R.speedup(-1.0, 1.0) is None
    assert R.speedup(None, 1.0) is None and R.speedup(1.0, None) is None


def _r(op, model, m, method, ms, status="ok", **extra):
    row = {"op": op, "model": model, "m": m, "n": 64, "k": 32, "method": method, "status": status,
           "reason": None if status == "ok" else "because", "median_ms": ms, "spread_ms": 0.0 if ms is not None else None,
           "trials_ms": [ms] if ms is not None else [], "max_rel_err": None, "check": None}
    row.update(extra)
    return row


def test_add_metrics_uses_cublas_and_nccl_of_the_same_case():
    ag = G.AG_GEMM
    rows = [
        _r(ag, "x", 1024, "cublas_gemm", 1.0), _r(ag, "x", 1024, "comm", 0.4), _r(ag, "x", 1024, "nccl", 1.5),
        _r(ag, "x", 1024, "flux", 1.1), _r(ag, "x", 1024, "torch_async_tp", 1.6),
        # same model, other m: nccl exposes nothing -> efficiency undefined, speedup still defined
        _r(ag, "x", 2048, "cublas_gemm", 2.0), _r(ag, "x", 2048, "nccl", 2.0), _r(ag, "x", 2048, "flux", 2.5),
        # no GEMM time -> no ECT
        _r(ag, "y", 1024, "cublas_gemm", None, status="error"), _r(ag, "y", 1024, "nccl", 1.0),
        _r(ag, "y", 1024, "flux", None, status="skipped"),
    ]
    R.add_metrics(rows)
    by = {(r["model"], r["m"], r["method"]): r for r in rows}
    assert by["x", 1024, "flux"]["ect_ms"] == pytest.approx(0.1)
    assert by["x", 1024, "flux"]["overlap_eff"] == pytest.approx(0.8)
    assert by["x", 1024, "flux"]["speedup_vs_nccl"] == pytest.approx(1.5 / 1.1)
    assert by["x", 1024, "torch_async_tp"]["overlap_eff"] == pytest.approx(-0.2)
    assert by["x", 1024, "nccl"]["overlap_eff"] == pytest.approx(0.0)
    assert by["x", 1024, "comm"]["ect_ms"] is None and by["x", 1024, "cublas_gemm"]["overlap_eff"] is None
    assert by["x", 2048, "flux"]["overlap_eff"] is None
    assert by["x", 2048, "flux"]["speedup_vs_nccl"] == pytest.approx(0.8)
    assert by["y", 1024, "nccl"]["ect_ms"] is None
    assert by["y", 1024, "flux"]["speedup_vs_nccl"] is None


def test_summary_splits_m_ranges_and_counts_slower_cases():
    ag, rs = G.AG_GEMM, G.GEMM_RS
    rows = []
    for m, flux_ms in ((1024, 1.1), (2048, 1.6), (4096, 1.2), (256, 3.0)):
        rows += [_r(ag, "x", m, "cublas_gemm", 1.0), _r(ag, "x", m, "nccl", 1.5), _r(ag, "x", m, "flux", flux_ms)]
    rows += [_r(rs, "x", 1024, "cublas_gemm", 1.0), _r(rs, "x", 1024, "nccl", 1.5),
             _r(rs, "x", 1024, "flux", None, status="error"), _r(rs, "x", 1024, "torch_async_tp", 1.2, check="FAIL")]
    R.add_metrics(rows)
    s = R.summarize(rows)
    large = s[ag]["m>=1024"]["flux"]
    assert large["cases"] == 3
    assert large["overlap_eff"]["median"] == pytest.approx(0.6)  # effs 0.8, -0.2, 0.6
    assert large["overlap_eff"]["min"] == pytest.approx(-0.2)
    assert large["slower_than_nccl"] == 1
    assert large["geomean_speedup_vs_nccl"] == pytest.approx((1.5 / 1.1 * 1.5 / 1.6 * 1.5 / 1.2) ** (1 / 3))
    assert s[ag]["m<1024"]["flux"]["cases"] == 1 and s[ag]["m<1024"]["flux"]["slower_than_nccl"] == 1
    assert s[rs]["m>=1024"]["flux"]["cases"] == 0 and s[rs]["m>=1024"]["flux"]["errors"] == 1
    assert s[rs]["m>=1024"]["torch_async_tp"]["check_failed"] == 1
    assert "m<1024" not in s[rs]


def test_summary_says_when_a_slower_auto_ran_nccl_itself():
    ag = G.AG_GEMM
    rows = []
    for m, auto_ms, resolved in ((1024, 1.6, "nccl"), (2048, 1.7, "flux"), (4096, 1.4, "flux")):
        rows += [_r(ag, "x", m, "cublas_gemm", 1.0), _r(ag, "x", m, "nccl", 1.5),
                 dict(_r(ag, "x", m, "auto", auto_ms), resolved_backend=resolved)]
    R.add_metrics(rows)
    s = R.summarize(rows)[ag]["m>=1024"]["auto"]
    assert (s["slower_than_nccl"], s["slower_on_nccl"]) == (2, 1)
    assert "slower than nccl=2 (1 ran nccl itself)" in R.format_summary(R.summarize(rows))


def test_paired_speedup_pairs_trials_and_drift_cancels():
    """Trial i of every method ran back to back: the paired speedup divides within a trial, so
    a drift that slows every method alike from trial 3 on cancels, where the ratio of medians
    takes whichever trials the medians fall on."""
    import statistics

    ag = G.AG_GEMM

    def timed(method, trials, **extra):
        return dict(_r(ag, "x", 1024, method, statistics.median(trials)), trials_ms=trials, **extra)

    nccl = timed("nccl", [1.0, 1.0, 1.5, 1.5, 1.5])
    faster = timed("flux", [0.8, 0.8, 1.2, 1.2, 1.2])
    # the very NCCL code, timed again; one slow trial in the fast part, one fast in the slow part
    same = timed("auto", [1.0, 1.5, 1.5, 1.5, 1.0], resolved_backend="nccl")
    drifted = timed("torch_async_tp", [0.9, 1.35, 1.35, 1.35, 1.35])
    short = timed("flux_control", [1.0, 1.0])
    rows = [_r(ag, "x", 1024, "cublas_gemm", 0.5), nccl, faster, same, drifted, short]
    R.add_metrics(rows)
    assert faster["paired_speedup_vs_nccl"] == pytest.approx(1.25)
    assert faster["speedup_vs_nccl"] == pytest.approx(1.25)
    assert same["paired_speedup_vs_nccl"] == pytest.approx(1.0)
    # ratios 1.111, 0.741, 1.111, 1.111, 1.111: paired 1.111; medians 1.5 / 1.35 also 1.111
    assert drifted["paired_speedup_vs_nccl"] == pytest.approx(1.0 / 0.9)
    assert short["paired_speedup_vs_nccl"] is None, "unequal trial counts are not paired"
    assert R.paired_speedup([], []) is None and R.paired_speedup([1.0, 0.0], [1.0, 1.0]) is None
    # where the medians fall on different regimes the two statistics part
    assert R.speedup(statistics.median([1.0, 1.0, 1.0, 1.6, 1.6]),
                     statistics.median([1.0, 1.0, 1.5, 1.5, 1.5])) == pytest.approx(1.5)
    assert R.paired_speedup([1.0, 1.0, 1.0, 1.6, 1.6], [1.0, 1.0, 1.5, 1.5, 1.5]) == pytest.approx(1.0)
    s = R.summarize(rows)[ag]["m>=1024"]
    assert s["flux"]["slower_than_nccl_paired"] == 0
    assert s["flux"]["geomean_paired_speedup_vs_nccl"] == pytest.approx(1.25)
    assert s["auto"]["min_paired_speedup_vs_nccl"] == pytest.approx(1.0)
    assert "paired: 0, worst 1.250x" in R.format_summary(R.summarize(rows))
    assert "1.250x" in R.format_table(rows)


def test_median_and_spread_over_trials():
    assert T.median([5.0, 1.0, 3.0]) == 3.0
    assert T.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert T.spread([1.0, 2.0, 3.0, 10.0]) == 9.0
    with pytest.raises(ValueError):
        T.median([])
    with pytest.raises(ValueError):
        T.spread([])


def test_trial_order_rotates_the_first_method_and_varies_predecessors():
    names = ["a", "b", "c", "d", "e"]
    orders = [T.trial_order(names, t) for t in range(20)]
    assert all(sorted(o) == names for o in orders)
    assert [o[0] for o in orders[:5]] == names
    assert orders == [T.trial_order(names, t) for t in range(20)]  # deterministic (same on every rank)
    preceded = {n: {o[i - 1] for o in orders for i in range(1, len(o)) if o[i] == n} for n in names}
    assert all(len(p) >= 3 for p in preceded.values()), preceded


# ------------------------------------------------------------------------------ grid


def test_local_shapes_at_tp2_and_tp4():
    llama70 = G.MODELS["llama3-70b"]
    ag = G.case_for(G.AG_GEMM, llama70, 4096)
    rs = G.case_for(G.GEMM_RS, llama70, 4096, rs_k="ffn")
    assert (ag.n, ag.k, rs.n, rs.k) == (57344, 8192, 8192, 28672)
    assert G.case_for(G.GEMM_RS, llama70, 4096).k == 57344  # default: the anchors' convention
    assert ag.local_shapes(2) == {"a": (2048, 8192), "b": (8192, 28672), "out": (4096, 28672), "gemm_a": (4096, 8192),
                                  "gemm_b": (8192, 28672), "comm_in": (2048, 8192), "comm_out": (4096, 8192)}
    assert ag.local_shapes(4)["a"] == (1024, 8192) and ag.local_shapes(4)["out"] == (4096, 14336)
    assert rs.local_shapes(2) == {"a": (4096, 14336), "b": (14336, 8192), "out": (2048, 8192), "gemm_a": (4096, 14336),
                                  "gemm_b": (14336, 8192), "comm_in": (4096, 8192), "comm_out": (2048, 8192)}
    assert rs.local_shapes(4)["a"] == (4096, 7168) and rs.local_shapes(4)["out"] == (1024, 8192)
    gpt = G.case_for(G.AG_GEMM, G.MODELS["gpt3-175b"], 1024)
    assert (gpt.n, gpt.k) == (4 * 12288, 12288)  # GeLU MLP: fc1 = 4h, no gate


@pytest.mark.parametrize("rs_k", G.RS_K_CHOICES)
@pytest.mark.parametrize("tp", [2, 4])
def test_local_shapes_are_consistent_over_the_default_grid(tp, rs_k):
    cases = G.build_grid(G.OPS, G.MODELS.values(), G.LARGE_M + G.SMALL_M, tp, rs_k)
    assert len(cases) == 2 * 3 * 8
    for c in cases:
        s = c.local_shapes(tp)
        assert s["gemm_a"][1] == s["gemm_b"][0] == s["b"][0]
        assert c.gemm_flops(tp) == 2 * s["gemm_a"][0] * s["gemm_a"][1] * s["gemm_b"][1]
        if c.op == G.AG_GEMM:
            assert s["a"] == s["comm_in"] == (c.m // tp, c.k)
            assert s["out"] == (c.m, c.n // tp) and s["comm_out"] == s["gemm_a"] == (c.m, c.k)
        else:
            assert s["a"] == s["gemm_a"] == (c.m, c.k // tp) and s["b"] == (c.k // tp, c.n)
            assert s["out"] == s["comm_out"] == (c.m // tp, c.n) and s["comm_in"] == (c.m, c.n)


def test_default_grid_matches_the_anchor_file():
    anchors = {(r["model"], r["op"], r["m"], r["n"], r["k"]) for r in json.loads(ANCHORS.read_text())["rows"]}
    ours = {(c.model, c.op, c.m, c.n, c.k) for c in G.build_grid(G.OPS, G.MODELS.values(), G.LARGE_M, 2)}
    assert ours == anchors
    # the true-fc2 convention differs exactly in the GEMM+RS rows of the gated models
    true_fc2 = {(c.model, c.op, c.m, c.n, c.k) for c in G.build_grid(G.OPS, G.MODELS.values(), G.LARGE_M, 2, "ffn")}
    assert {(r[0], r[1]) for r in anchors ^ true_fc2} == {("llama3-70b", G.GEMM_RS), ("llama3-8b", G.GEMM_RS)}


def test_grid_rejects_indivisible_shapes_and_bad_model_specs():
    tiny = G.parse_model_shape("tiny:64:256:128")
    assert tiny == G.ModelShape("tiny", 64, 256, 128)
    with pytest.raises(ValueError, match="divisible"):
        G.build_grid([G.AG_GEMM], [tiny], [63], 2)
    with pytest.raises(ValueError, match="divisible"):
        G.build_grid([G.GEMM_RS], [G.ModelShape("odd", 64, 64, 130)], [64], 4, rs_k="ffn")
    for bad in ("tiny:64:256", "tiny:a:b:c", ":1:2:3", "t:0:1:1"):
        with pytest.raises(ValueError):
            G.parse_model_shape(bad)
    with pytest.raises(ValueError, match="unknown model"):
        G.select_models(["nope"], [])


def test_command_line_lists_and_defaults():
    args = resolve_args(build_parser().parse_args(["--ops", "rs,ag", "--ms", "128,64", "256", "--model-shapes", "tiny:64:256:128",
                                                   "--methods", "nccl", "cublas_gemm", "auto"]), tp=2)
    assert args.op_list == [G.GEMM_RS, G.AG_GEMM]
    assert [m.name for m in args.model_list] == ["tiny"] and args.ms == [128, 64, 256]
    assert args.method_list == ["cublas_gemm", "nccl", "auto"]  # canonical order
    assert len(args.cases) == 6 and args.threshold == 2e-2
    args = resolve_args(build_parser().parse_args(["--m-set", "small", "--dtype", "fp32"]), tp=2)
    assert args.ms == list(G.SMALL_M) and [m.name for m in args.model_list] == list(G.MODELS)
    assert args.threshold == M.default_max_rel_err(torch.float32)
    assert args.trials >= 5 and args.iters >= 20 and args.warmup >= 1
    for bad in (["--methods", "cublas"], ["--ops", "ar"], ["--ms", "x"], ["--trials", "0"]):
        with pytest.raises(ValueError):
            resolve_args(build_parser().parse_args(bad), tp=2)


def test_flux_variant_needs_valid_fields_and_changes_only_them():
    args = resolve_args(build_parser().parse_args(
        ["--methods", "flux", "flux_variant", "--flux-variant", '{"rs_copy_engine": true}']), tp=2)
    assert args.method_list == ["flux", "flux_variant"]
    from megatron_flux.backends.flux import FluxBackend
    from megatron_flux.tuning.provider import TableConfigProvider

    backend = M._variant_backend(FluxBackend)
    table = TableConfigProvider()
    for op, m, n, k in (("rs", 8192, 8192, 28672), ("ag", 1024, 14336, 4096)):
        want = dataclasses.replace(table(op, m, n, k, dtype=torch.bfloat16, tp=2,
                                         device=("NVIDIA H200", 132)), rs_copy_engine=True)
        got = backend.config(op, m, n, k, dtype=torch.bfloat16, tp=2, device=("NVIDIA H200", 132))
        assert got == want
    M._VARIANT.clear()
    for bad in (["--methods", "flux_variant"],  # no fields
                ["--methods", "flux_variant", "--flux-variant", '{"no_such_knob": 1}'],
                ["--methods", "flux_variant", "--flux-variant", '{"rs_copy_engine": 1}'],
                ["--methods", "flux", "--flux-variant", '{"rs_copy_engine": true}']):  # unused
        with pytest.raises(ValueError):
            resolve_args(build_parser().parse_args(bad), tp=2)
    M._VARIANT.clear()


def test_a_bad_user_table_fails_before_any_timing(tmp_path, monkeypatch):
    """$MEGATRON_FLUX_CONFIG naming a missing or malformed file stops a run that would look
    the tables up (flux, flux_variant, flux_control, auto) at argument time, naming the file; runs without
    those methods do not read the tables."""
    from megatron_flux.tuning.schema import TuningFileError

    missing = tmp_path / "no-such-table.json"
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "megatron-flux-tuning"}')
    for path in (missing, broken):
        monkeypatch.setenv("MEGATRON_FLUX_CONFIG", str(path))
        for methods in (["flux"], ["auto"], ["nccl", "flux_variant"], ["flux_control"]):
            extra = ["--flux-variant", '{"rs_copy_engine": true}'] if "flux_variant" in methods else []
            with pytest.raises(TuningFileError, match=path.name):
                resolve_args(build_parser().parse_args(["--methods", *methods, *extra]), tp=2)
        M._VARIANT.clear()
        args = resolve_args(build_parser().parse_args(["--methods", "nccl", "flux_default"]), tp=2)
        assert args.method_list == ["nccl", "flux_default"]
    # and the plugin's settings are recorded with the results
    assert {"MEGATRON_FLUX_CONFIG", "MEGATRON_FLUX_SHIPPED_TABLES",
            "MEGATRON_FLUX_HOST_DESCRIPTORS"} <= set(R.ENV_VARS)


def test_the_table_names_the_local_gemm_by_what_runs():
    """``cublas_gemm`` is torch.mm: cuBLAS on CUDA only. Off CUDA the table prints what ran;
    the JSON keeps the method name reports key on."""
    assert M.method_label("cublas_gemm", "cuda") == "cublas_gemm"
    assert M.method_label("cublas_gemm", "cpu") == "local_gemm (torch.mm, cpu)"
    assert M.method_label("nccl", "cpu") == "nccl"
    row = dict(_r(G.AG_GEMM, "x", 64, "cublas_gemm", 1.0), label=M.method_label("cublas_gemm", "cpu"))
    table = R.format_table([row])
    assert "local_gemm (torch.mm, cpu)" in table and "cublas" not in table


def test_describe_command_reconstructs_the_launcher(monkeypatch):
    main_py = str(REPO / "megatron_flux" / "tools" / "bench" / "__main__.py")
    monkeypatch.setattr(sys, "argv", [main_py, "--ms", "64"])
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert describe_command(["--ms", "64"]) == "python -m megatron_flux.tools.bench --ms 64"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert describe_command(["--ms", "64"]) == "torchrun --nproc-per-node=2 --nnodes=2 -m megatron_flux.tools.bench --ms 64"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/megatron-flux", "bench", "--out-json", "a b.json"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert describe_command(["--out-json", "a b.json"]) == "torchrun --nproc-per-node=2 --no-python megatron-flux bench --out-json 'a b.json'"
    # python -m megatron_flux.tools.cli bench (benchmarks/device.sh): the subcommand is kept
    monkeypatch.setattr(sys, "argv", [str(REPO / "megatron_flux" / "tools" / "cli.py"), "--ms", "64"])
    assert describe_command(["--ms", "64"]) == "torchrun --nproc-per-node=2 -m megatron_flux.tools.cli bench --ms 64"


def test_every_option_survives_torchruns_own_parser():
    """torchrun parses the whole command line and rejects (or steals) any option of ours that
    abbreviates one of its own (``--m`` did): each primary spelling must reach the script."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    for action in build_parser()._actions:
        opt = next(o for o in action.option_strings if o.startswith("--"))
        ns = torchrun.parse_args(["--nproc-per-node", "2", "-m", "megatron_flux.tools.bench", opt, "1"])
        assert ns.training_script_args == [opt, "1"], opt


# ------------------------------------------------------------------------------ report


def _doc(rows):
    return {"command": "torchrun x", "gpu": "cpu", "tp": 2, "torch": torch.__version__, "triton": "3", "rows": rows}


def test_schema_accepts_good_rows_and_rejects_each_violation(tmp_path):
    good = [_r(G.AG_GEMM, "x", 64, "nccl", 1.0, max_rel_err=1e-3), _r(G.AG_GEMM, "x", 64, "flux", None, status="skipped")]
    R.validate_result(_doc(good))
    mutations = [
        lambda d: d.pop("command"),
        lambda d: d.update(tp="2"),
        lambda d: d.update(tp=True),
        lambda d: d["rows"][0].update(method="cublas"),
        lambda d: d["rows"][0].update(op="AG"),
        lambda d: d["rows"][0].update(m=0),
        lambda d: d["rows"][0].update(median_ms=None),
        lambda d: d["rows"][0].update(median_ms=float("nan")),
        lambda d: d["rows"][0].update(spread_ms=1),
        lambda d: d["rows"][0].update(trials_ms=[]),
        lambda d: d["rows"][0].update(max_rel_err=-1.0),
        lambda d: d["rows"][0].update(status="fine"),
        lambda d: d["rows"][1].update(reason=None),
        lambda d: d["rows"][1].update(median_ms=1.0),
    ]
    for i, mutate in enumerate(mutations):
        doc = json.loads(json.dumps(_doc(good)))
        mutate(doc)
        with pytest.raises(ValueError):
            R.validate_result(doc)
            pytest.fail(f"mutation {i} was accepted")
    path = tmp_path / "sub" / "r.json"
    R.write_json(str(path), _doc(good))
    assert json.loads(path.read_text())["rows"][0]["method"] == "nccl"


def test_table_shows_metrics_failures_and_footnoted_reasons():
    rows = [_r(G.GEMM_RS, "x", 64, "cublas_gemm", 1.0), _r(G.GEMM_RS, "x", 64, "nccl", 2.0),
            _r(G.GEMM_RS, "x", 64, "flux", 1.5, check="FAIL", max_rel_err=0.5, max_rel_err_threshold=0.02),
            _r(G.GEMM_RS, "x", 64, "torch_async_tp", None, status="skipped", reason="needs CUDA"),
            _r(G.GEMM_RS, "y", 64, "torch_async_tp", None, status="skipped", reason="needs CUDA")]
    R.add_metrics(rows)
    text = R.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["op", "model", "m", "n", "k", "method"]
    flux = next(line for line in lines if " flux " in line)
    assert "+50.0%" in flux and "1.333x" in flux and "CHECK FAILED" in flux and "5.0e-01" in flux
    assert text.count("skipped [1]") == 2 and lines[-1] == "[1] skipped: needs CUDA"


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed (optional)")
def test_png_is_written(tmp_path):
    rows = [_r(op, mod, m, meth, ms) for op in G.OPS for mod in ("x", "y") for m in (64, 1024)
            for meth, ms in (("cublas_gemm", 1.0), ("nccl", 1.5), ("torch_async_tp", 1.3), ("flux", 1.1))]
    R.add_metrics(rows)
    path = tmp_path / "p.png"
    assert R.plot_png(str(path), rows, R.summarize(rows), "title") is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ CLI


def test_cli_tune_dispatches_to_the_tuner(capsys):
    # outside torchrun (and on CPU) the tuner refuses with a reason; tests/unit/test_tuning_search.py
    # covers its options
    assert cli.main(["tune"]) == 2
    assert "megatron-flux tune: " in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert cli.main([]) == 2


def test_cli_bench_passes_argv_through(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.main(["bench", "--list-grid", "--models", "llama3-8b", "--ms", "1024", "--ops", "ag"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "tp=4" in out[0] and "a=256x4096" in out[0] and "out=1024x7168" in out[0]


def test_bench_without_a_launcher_explains_how_to_run(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert bench_main(["--ms", "64"]) == 2
    assert "torchrun" in capsys.readouterr().err


# ------------------------------------------------------------------------------ two ranks (gloo)


def _sleeper(log, name, ms):
    def fn():
        log.append(name)
        time.sleep(ms / 1e3)
    return fn


def _fake_build(real):
    """build_method with planted one-rank failures (the real one for the other methods)."""

    def build(name, inp, group):
        rank = dist.get_rank()
        if name == "torch_async_tp":
            if rank == 1:
                raise RuntimeError("build boom")
            return (lambda: None), {}
        if name == "flux":
            if rank == 0:
                raise M.MethodSkipped("no flux on rank 0")
            return (lambda: None), {}
        if name == "auto":
            def first_call_fails_on_rank0():
                if rank == 0:
                    raise RuntimeError("probe boom")
            return first_call_fails_on_rank0, {}
        return real(name, inp, group)

    return build


def _wrong_flux_build(real):
    """build_method whose ``flux`` returns zeros of the right shape: a numerically wrong method."""

    def build(name, inp, group):
        if name == "flux":
            zeros = torch.zeros(inp.case.local_shapes(inp.tp)["out"], dtype=inp.a.dtype)
            return (lambda: zeros), {}
        return real(name, inp, group)

    return build


def _worker(rank, world, store_path, out_dir):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    cpu = torch.device("cpu")
    res = {}
    log = []
    # rank 1 is slower at "a": the reported time must be rank 1's on both ranks
    fns = {"a": _sleeper(log, "a", 1 if rank == 0 else 8), "b": _sleeper(log, "b", 2)}
    r = T.time_interleaved(fns, trials=3, iters=4, warmup=1, group=None, device=cpu)
    res["timing"] = {"trials_ms": r.trials_ms, "errors": r.errors, "log": log}

    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:  # warm-up is call 1; fails inside the first timed block
            raise RuntimeError("boom")

    r = T.time_interleaved({"fine": lambda: None, "flaky": flaky}, trials=3, iters=2, warmup=1, group=None, device=cpu)
    res["flaky"] = {"trials_ms": r.trials_ms, "errors": r.errors, "calls": calls["n"]}

    real_build = M.build_method
    M.build_method = _fake_build(real_build)
    args = resolve_args(build_parser().parse_args(
        ["--model-shapes", "tiny:8:16:16", "--ms", "4", "--ops", "ag", "--dtype", "fp32", "--trials", "2", "--iters", "1",
         "--warmup", "0", "--methods", "cublas_gemm", "comm", "torch_async_tp", "flux", "auto"]), tp=world)
    res["rows"] = run_case(args.cases[0], args, dist.group.WORLD, rank, world, cpu, say=lambda msg: None)

    if HAVE_NCCL_BACKEND:  # the numerical check needs the reference backend
        M.build_method = _wrong_flux_build(real_build)
        said = []
        args = resolve_args(build_parser().parse_args(
            ["--model-shapes", "tiny:16:32:32", "--ms", "8", "--ops", "rs", "--trials", "1", "--iters", "1",
             "--warmup", "0", "--methods", "nccl", "flux", "auto"]), tp=world)
        res["check_rows"] = run_case(args.cases[0], args, dist.group.WORLD, rank, world, cpu, say=said.append)
        res["said"] = said
    M.build_method = real_build
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench2")
    ctx = mp.start_processes(_worker, args=(2, str(tmp / "store"), str(tmp)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("two-rank worker did not finish in 120 s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_trial_time_is_the_max_over_ranks(two_ranks):
    t0, t1 = (r["timing"]["trials_ms"] for r in two_ranks)
    assert t0 == t1  # every rank reports the same numbers
    # per iteration (4 per block): rank 1's 8 ms, not rank 0's 1 ms, and not the 32 ms block
    assert len(t0["a"]) == 3 and all(7.5 <= v < 20 for v in t0["a"])
    assert all(1.5 <= v < 6 for v in t0["b"])


def test_trials_are_interleaved_round_robin(two_ranks):
    log = two_ranks[0]["timing"]["log"]
    assert log[:2] == ["a", "b"]  # warm-up, one call each
    blocks = [log[i:i + 4] for i in range(2, len(log), 4)]
    assert all(len(set(b)) == 1 for b in blocks)  # a block is one method's iterations
    assert [b[0] for b in blocks] == ["a", "b", "b", "a", "a", "b"]  # first method rotates per trial


def test_a_method_failing_on_one_rank_is_dropped_on_all(two_ranks):
    f0, f1 = (r["flaky"] for r in two_ranks)
    assert list(f0["trials_ms"]) == list(f1["trials_ms"]) == ["fine"]
    assert f0["errors"] == f1["errors"] and "rank 1: RuntimeError: boom" in f0["errors"]["flaky"]
    assert f0["calls"] == 3 and f1["calls"] == 3  # nobody called it again after the failure


def test_run_case_takes_the_same_decisions_on_every_rank(two_ranks):
    rows0, rows1 = (r["rows"] for r in two_ranks)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("median_ms", "spread_ms", "trials_ms")} for r in rows]
    assert strip(rows0) == strip(rows1)
    by = {r["method"]: r for r in rows0}
    assert by["cublas_gemm"]["status"] == by["comm"]["status"] == "ok"
    assert by["cublas_gemm"]["median_ms"] > 0 and len(by["comm"]["trials_ms"]) == 2
    assert by["cublas_gemm"]["label"] == "local_gemm (torch.mm, cpu)" and "label" not in by["comm"]
    assert by["torch_async_tp"]["status"] == "error" and "rank 1" in by["torch_async_tp"]["reason"]
    assert "build boom" in by["torch_async_tp"]["reason"]
    assert by["flux"]["status"] == "skipped" and by["flux"]["reason"] == "rank 0: no flux on rank 0"
    assert by["auto"]["status"] == "error" and "first call: rank 0: RuntimeError: probe boom" in by["auto"]["reason"]


@pytest.mark.skipif(not HAVE_NCCL_BACKEND, reason="megatron_flux.backends.nccl not written yet")
def test_wrong_outputs_are_flagged_loudly(two_ranks):
    by = {r["method"]: r for r in two_ranks[0]["check_rows"]}
    assert by["flux"]["status"] == "ok" and by["flux"]["check"] == "FAIL"
    assert by["flux"]["max_rel_err"] == pytest.approx(1.0)  # zeros vs the reference
    assert by["nccl"]["check"] == by["auto"]["check"] == "ok" and by["nccl"]["max_rel_err"] < 2e-2
    warnings = [m for m in two_ranks[0]["said"] if "WARNING" in m]
    assert len(warnings) == 1 and "flux" in warnings[0]
    assert "CHECK FAILED" in R.format_table(two_ranks[0]["check_rows"])


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NCCL_BACKEND, reason="megatron_flux.backends.nccl not written yet")
def test_torchrun_smoke_run_on_gloo(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_flux.tools.bench", "--device", "cpu", "--model-shapes", "tiny:64:256:128", "--ms", "64",
           "--methods", "cublas_gemm", "comm", "nccl", "torch_async_tp", "flux", "auto",
           "--trials", "2", "--iters", "2", "--warmup", "1", "--timeout-s", "60", "--out-json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "median_ms" in proc.stdout and "ECT_ms" in proc.stdout  # the table, printed once (rank 0)
    assert "local_gemm (torch.mm, cpu)" in proc.stdout and "cublas" not in proc.stdout  # what ran
    assert proc.stdout.count("op  ") == 1
    doc = json.loads(out.read_text())
    R.validate_result(doc)
    assert doc["tp"] == 2 and doc["command"].startswith("torchrun --nproc-per-node=2 -m megatron_flux.tools.bench")
    assert set(doc["env"]["env_vars"]) >= {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                           "NVSHMEM_DISABLE_NVLS", "CUDA_DEVICE_MAX_CONNECTIONS"}
    rows = {(r["op"], r["method"]): r for r in doc["rows"]}
    assert len(doc["rows"]) == 2 * 6
    for op in G.OPS:
        for meth in ("cublas_gemm", "comm", "nccl", "auto"):
            assert rows[op, meth]["status"] == "ok", rows[op, meth]
            assert len(rows[op, meth]["trials_ms"]) == 2
        for meth in ("torch_async_tp", "flux"):
            assert rows[op, meth]["status"] == "skipped" and "cpu" in rows[op, meth]["reason"]
        nccl = rows[op, "nccl"]
        assert nccl["check"] == "ok" and 0 < nccl["max_rel_err"] < 2e-2  # bf16 vs the fp32 reference
        assert nccl["overlap_eff"] == 0.0 and rows[op, "auto"]["resolved_backend"] == "nccl"
    assert set(doc["summary"]) == set(G.OPS)
    png = out.with_suffix(".png")
    assert png.exists() == HAVE_MPL


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_NCCL_BACKEND, reason="megatron_flux.backends.nccl not written yet")
def test_torchrun_model_config_run_on_gloo(tmp_path):
    """`bench --model-config` end to end: a training config's TP GEMMs, as cases, timed."""
    out = tmp_path / "bench.json"
    config = str(REPO / "configs" / "tiny_smoke.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_flux.tools.bench", "--device", "cpu", "--model-config", config, "--ms", "64",
           "--methods", "cublas_gemm", "nccl", "--trials", "1", "--iters", "1", "--warmup", "1",
           "--timeout-s", "60", "--out-json", str(out), "--out-png", "none"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    R.validate_result(doc)
    got = {(r["op"], r["n"], r["k"]) for r in doc["rows"] if r["method"] == "nccl" and r["status"] == "ok"}
    # tiny_smoke, in the rows' global weight shapes: hidden 512, QKV 512 + 2 * 4 groups * 64 = 1024,
    # fc1 2 * 1536 (SwiGLU), fc2 1536, vocabulary 4096
    want = {(G.AG_GEMM, 1024, 512), (G.GEMM_RS, 512, 1024),    # QKV forward, its data gradient
            (G.GEMM_RS, 512, 512), (G.AG_GEMM, 512, 512),      # proj
            (G.AG_GEMM, 3072, 512), (G.GEMM_RS, 512, 3072),    # fc1
            (G.GEMM_RS, 512, 1536), (G.AG_GEMM, 1536, 512),    # fc2
            (G.AG_GEMM, 4096, 512), (G.GEMM_RS, 512, 4096)}    # the output layer
    assert got == want and all(r["m"] == 64 for r in doc["rows"])


def test_timing_disables_gc_during_the_trials_and_restores_it():
    import gc

    import torch

    from megatron_flux.tools.bench.timing import time_interleaved

    seen = []
    fns = {"a": lambda: seen.append(gc.isenabled()), "b": lambda: seen.append(gc.isenabled())}
    assert gc.isenabled()
    from helpers.dist_harness import gloo_world_of_one

    with gloo_world_of_one():  # the sync points are collectives
        res = time_interleaved(fns, trials=2, iters=2, warmup=1, group=None, device=torch.device("cpu"))
    assert seen and not any(seen)  # every timed call ran with the collector off
    assert gc.isenabled() and set(res.trials_ms) == {"a", "b"}


def test_single_gpu_rs_wiring_owns_every_buffer_its_pointer_tables_name():
    """``rs_on_one_gpu`` hands the kernel slots and signals as raw addresses; a buffer only the
    pointer table names is freed on return and reused (every timed call then spins out its
    waits). Every address must belong to a tensor the returned launcher holds."""
    import gc

    from megatron_flux.tools.diagnostics.kernel_vs_cublas import rs_on_one_gpu

    for world in (1, 2, 4):
        a, w = torch.randn(8 * world, 16), torch.randn(32, 16)
        launch, out, data = rs_on_one_gpu(a, w, world, torch.zeros(4, dtype=torch.int32))
        gc.collect()
        held = {t.data_ptr() for t in launch.buffers}
        flags, data_ptrs, flag_ptrs = launch.buffers[-3:]
        assert set(data_ptrs.tolist()) | set(flag_ptrs.tolist()) <= held, world
        # peers' signals pre-set; the own one (rank 0) and the arrival counter start at zero,
        # so a spread reduction waits for its own grid's barrier
        assert (flags[1:world] >= 1 << 30).all() and int(flags[0]) == 0
        assert int(flags[world:].abs().sum()) == 0
        assert out.isnan().all() and tuple(data.shape) == (world, 8, 32)
        assert set(launch.buffers[-4].tolist()) <= held, world  # rs_row_turns' table


def test_single_gpu_rs_wiring_feeds_row_turns_counters_from_its_own_pushes():
    """With ``rs_row_turns`` the one-GPU wiring points peer ``s``'s signal region at this
    rank's, moved by ``s`` counter blocks: rank 0's count for owner ``s`` (the kernel's word
    ``WORLD + 2 + 0 * ROW_GROUPS + g`` of owner ``s``'s region) must be the word its own tiles
    wait on for peer ``s`` (``WORLD + 2 + s * ROW_GROUPS + g`` of its own), and the epoch raised
    for owner ``s`` (word 0 there) must miss every counter a permitted call waits on."""
    from megatron_flux.kernels.config import ROW_GROUPS, GemmConfig
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import rs_on_one_gpu

    for world in (2, 4, 8):
        a, w = torch.randn(8 * world, 16), torch.randn(32, 16)
        launch, _, _ = rs_on_one_gpu(a, w, world, torch.zeros(4, dtype=torch.int32))
        flags, turn_ptrs = launch.buffers[-3], launch.buffers[-4].tolist()
        base, word = flags.data_ptr(), flags.element_size()
        max_groups = ROW_GROUPS - 2 - world
        waited = {base + word * (world + 2 + s * ROW_GROUPS + g)
                  for s in range(1, world) for g in range(max_groups)}
        for s in range(1, world):
            for g in range(max_groups):
                counted = turn_ptrs[s] + word * (world + 2 + 0 * ROW_GROUPS + g)
                assert counted == base + word * (world + 2 + s * ROW_GROUPS + g), (world, s, g)
            raised = turn_ptrs[s] + word * 0  # the epoch raised for owner s
            assert raised not in waited and base <= raised < base + word * flags.numel()
        # more row groups than that: refused before any launch
        cfg = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4,
                         group_m=1, epilogue_split=1, rs_warp_specialized=True,
                         rs_row_turns=True)
        big = torch.randn((max_groups + 1) * 128 * world, 16)
        launch, _, _ = rs_on_one_gpu(big, w, world, torch.zeros(4, dtype=torch.int32))
        with pytest.raises(ValueError, match="row groups"):
            launch(cfg)


def test_sample_warmup_runs_before_every_timed_block():
    import itertools

    from megatron_flux.tools.bench.timing import time_interleaved

    from helpers.dist_harness import gloo_world_of_one

    log = []
    fns = {name: (lambda name=name: log.append(name)) for name in ("a", "b")}
    with gloo_world_of_one():  # the sync points are collectives
        res = time_interleaved(fns, trials=3, iters=2, warmup=1, group=None,
                               device=torch.device("cpu"), sample_warmup=4)
    assert log.count("a") == log.count("b") == 1 + 3 * (4 + 2)
    runs = [len(list(g)) for _, g in itertools.groupby(log[2:])]
    assert sum(runs) == 36 and all(r % 6 == 0 for r in runs)  # 4 untimed + 2 timed, unbroken
    assert all(len(v) == 3 for v in res.trials_ms.values())
    with pytest.raises(ValueError, match="sample_warmup"):
        time_interleaved(fns, trials=1, iters=1, warmup=0, group=None, device=torch.device("cpu"),
                         sample_warmup=-1)


def test_alternating_timing_cancels_clock_steps(monkeypatch):
    """``--alternate``: methods take turns launch by launch, and a ratio is the median of
    per-round ratios, so a clock step between (or inside) blocks cancels. Simulated GPU: a
    launch takes its method's cost times the clock factor in force, which steps between 1 and
    1.25 every 37 launches; ``fused`` costs 1.04 cuBLAS. Block timing (``_time``) compares
    blocks at different clocks and misreports the ratio; the alternating one gives 1.04."""
    from megatron_flux.tools.diagnostics import kernel_vs_cublas as K

    clock = {"now": 0.0, "launches": 0}

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["now"]

        def elapsed_time(self, other):
            return other.t - self.t

        def synchronize(self):
            pass

    def launcher(cost):
        def fn():
            clock["launches"] += 1
            clock["now"] += cost * (1.0 + 0.25 * ((clock["launches"] // 37) % 2))
        return fn

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    fns = {"cublas": launcher(1.0), "fused": launcher(1.04)}
    times, ratios = K._time_alternating(fns, trials=5, rounds=20, warmup=2, shuffle_seed=0)
    assert len(times["fused"]) == len(ratios["fused"]) == 5
    assert all(abs(r - 1.04) < 1e-9 for r in ratios["fused"])
    assert all(r == 1.0 for r in ratios["cublas"])
    clock.update(now=0.0, launches=0)
    blocks = K._time(fns, trials=5, iters=20, warmup=2, shuffle_seed=0)
    import statistics
    block_ratio = statistics.median(blocks["fused"]) / statistics.median(blocks["cublas"])
    assert abs(block_ratio - 1.04) > 0.01  # what the steps do to block-wise timing


def test_kernel_vs_cublas_config_families(monkeypatch):
    """``--configs`` families per op: ``spread`` flips where GEMM+RS reduces (RS only; not of a
    warp-specialized config without merged rows), ``sk`` flips the stream-K tail (not of a
    warp-specialized config, whose Gluon kernel has none); twins equal to a config already
    listed are dropped."""
    import argparse

    from megatron_flux.tools.diagnostics import kernel_vs_cublas as K
    from megatron_flux.kernels.config import default_config
    from megatron_flux.tuning import provider

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(provider.TableConfigProvider, "__call__",
                        lambda self, op, m, n, k, **kw: default_config(op, m, n, k, tp=kw["tp"]))
    for tp, spread_default in ((2, False), (8, True)):
        args = argparse.Namespace(configs=["default", "table", "spread", "sk"], tp=tp)
        cfgs, labels = K._configs("GEMM+RS", 4096, 4096, 14336 // tp, args)
        twin = "default+spread" if not spread_default else "default-spread"
        sk_default = int(not spread_default)  # the spread reduction has no own tiles to split
        # the table's entry is the default here: dropped, with its twins
        assert labels == ["default", "default-sk" if sk_default else "default+sk", twin]
        assert [c.rs_spread_reduce for c in cfgs] == [spread_default, spread_default,
                                                      not spread_default]
        assert [c.stream_k for c in cfgs] == [sk_default, 1 - sk_default, sk_default]
        cfgs, labels = K._configs("AG+GEMM", 4096, 14336 // tp, 4096, args)
        assert not any("spread" in lab for lab in labels) and any("sk" in lab for lab in labels)
    # a warp-specialized table entry has no stream-K twin (the default, 128x256, has one)
    monkeypatch.setattr(provider.TableConfigProvider, "__call__",
                        lambda self, op, m, n, k, **kw: dataclasses.replace(
                            default_config(op, m, n, k, tp=2), block_n=128, num_warps=4,
                            rs_warp_specialized=True))
    args = argparse.Namespace(configs=["table", "sk"], tp=2)
    assert K._configs("GEMM+RS", 4096, 4096, 7168, args)[1] == ["table", "default-sk"]
    # nor a spread twin: its Gluon kernel reduces spread only with merged rows (GemmConfig
    # refuses the twin, which would stop a run of `--configs spread`)
    args = argparse.Namespace(configs=["table", "spread"], tp=2)
    assert K._configs("GEMM+RS", 4096, 4096, 7168, args)[1] == ["table", "default+spread"]
    # --extra: the default with fields changed, fused or (runner "plain") the yardstick
    args = argparse.Namespace(configs=["default"], tp=2,
                              extra=[{"block_n": 256, "num_warps": 8},
                                     {"runner": "plain", "block_n": 256, "num_warps": 8}])
    cfgs, labels = K._configs("AG+GEMM", 1024, 14336, 4096, args)
    base = default_config("ag", 1024, 14336, 4096, tp=2)
    assert labels == ["default", "extra0", "plain-extra1"]
    assert cfgs[1] == cfgs[2] != base and (cfgs[1].block_n, cfgs[1].num_warps) == (256, 8)
    assert cfgs[1].block_k == base.block_k and K._runner_kind("plain-extra1") == "plain"


def test_kernel_vs_cublas_grid_shapes():
    """The comm-off benchmark's per-rank ``(n, k)`` are the main grid's: the default grid as
    :func:`grid_shape` states it, and ``--model-shapes`` with ``--rs-k ffn`` giving a training
    config's projections (llama3_8b_16l at TP 2: proj k = 2048, qkv-dgrad k = 3072 per rank)."""
    import argparse

    from megatron_flux.tools.diagnostics import kernel_vs_cublas as K

    args = argparse.Namespace(models=None, model_shapes=[], rs_k="fc1", m=[1024], tp=2,
                              ops=["AG+GEMM", "GEMM+RS"])
    cases = list(K._grid(args))
    assert len(cases) == 6
    for op, model, m, n, k in cases:
        assert (n, k) == K.grid_shape("ag" if op == "AG+GEMM" else "rs", model, 2)
    args = argparse.Namespace(models=None, rs_k="ffn", m=[8192], tp=2, ops=["GEMM+RS"],
                              model_shapes=["l8proj:4096:4096:4096", "l8qkv:4096:6144:6144"])
    assert list(K._grid(args)) == [("GEMM+RS", "l8proj", 8192, 4096, 2048),
                                   ("GEMM+RS", "l8qkv", 8192, 4096, 3072)]
    args.ops, args.models = ["AG+GEMM"], ["l8qkv"]
    assert list(K._grid(args)) == [("AG+GEMM", "l8qkv", 8192, 3072, 4096)]


def test_model_args_fall_back_to_the_tools_default_only_without_model_shapes():
    """An experiment's own default models give way to ``--model-shapes`` (else a kernel_ab run
    given the training shapes times the grid's models instead)."""
    import argparse

    from megatron_flux.tools.diagnostics.kernel_vs_cublas import add_model_args, model_shapes

    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p, ["llama3-70b"])
    assert [x[0] for x in model_shapes(p.parse_args([]), "ag")] == ["llama3-70b"]
    args = p.parse_args(["--model-shapes", "l8proj:4096:4096:4096", "--rs-k", "ffn"])
    assert list(model_shapes(args, "rs")) == [("l8proj", 4096, 2048)]
    args = p.parse_args(["--model-shapes", "l8proj:4096:4096:4096", "--models", "llama3-8b", "l8proj"])
    assert [x[0] for x in model_shapes(args, "ag")] == ["llama3-8b", "l8proj"]


def test_flux_control_is_a_second_backend_built_like_the_registered_one():
    """``flux_control`` times the tables' configs in another backend object, built with no
    arguments as the registry builds ``flux`` (so the same table provider), once per process;
    it computes the op, overlaps, and comes after flux_variant in the canonical order."""
    from megatron_flux.tools.bench import methods

    built = []

    class Backend:
        def __init__(self, **kwargs):
            built.append(kwargs)

    methods._CONTROL_BACKEND.clear()
    try:
        first = methods._control_backend(Backend)
        assert methods._control_backend(Backend) is first and built == [{}]
    finally:
        methods._CONTROL_BACKEND.clear()
    assert "flux_control" in methods.COMPUTES_OP and "flux_control" in methods.OVERLAPPING
    args = resolve_args(build_parser().parse_args(
        ["--methods", "flux_control", "flux", "flux_variant", "--flux-variant", '{"stream_k": 0}']), tp=2)
    assert args.method_list == ["flux", "flux_variant", "flux_control"]
    M._VARIANT.clear()


def test_flux_default_method_takes_the_default_at_the_groups_tp():
    """``flux_default`` runs ``default_config`` at the group's TP (the backend passes it), so
    the small-m defaults that depend on TP (gathered AG rows, merged GEMM+RS rows) are what it
    times."""
    from megatron_flux.tools.bench import methods
    from megatron_flux.kernels.config import default_config

    class Backend:
        def __init__(self, config_provider):
            self.provider = config_provider

    methods._DEFAULT_CONFIG_BACKEND.clear()
    try:
        provider = methods._default_config_backend(Backend, default_config).provider
        assert provider.accepts_context
        assert provider("ag", 64, 14336, 4096, tp=2, dtype=None, device=None).ag_merge_local
        assert provider("rs", 64, 4096, 14336, tp=2, dtype=None, device=None).rs_merge_rows
        assert provider("ag", 64, 14336, 4096) == default_config("ag", 64, 14336, 4096)
    finally:
        methods._DEFAULT_CONFIG_BACKEND.clear()


def test_rescore_recomputes_a_stored_result_without_changing_it(capsys, tmp_path):
    """An older result has no paired speedups; rescoring derives them from its trial times and
    lists the auto/flux cases below NCCL by either statistic, leaving the file as it was."""
    import json

    from megatron_flux.tools.bench import rescore

    ag = G.AG_GEMM
    rows = [_r(ag, "x", 1024, "cublas_gemm", 0.5),
            dict(_r(ag, "x", 1024, "nccl", 1.0), trials_ms=[1.0, 1.0, 1.0, 1.6, 1.6]),
            dict(_r(ag, "x", 1024, "auto", 1.5), trials_ms=[1.0, 1.0, 1.5, 1.5, 1.5],
                 resolved_backend="nccl"),
            dict(_r(ag, "x", 1024, "flux", 0.8), trials_ms=[0.8, 0.8, 0.8, 1.3, 1.3])]
    doc = {"tp": 2, "gpu": "G", "trials": 5, "rows": rows}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    res = rescore.rescore(doc)
    by = {r["method"]: r for r in res["rows"]}
    assert by["auto"]["paired_speedup_vs_nccl"] == pytest.approx(1.0)
    assert by["auto"]["speedup_vs_nccl"] == pytest.approx(1.0 / 1.5)
    assert "paired_speedup_vs_nccl" not in rows[2], "the input rows are not changed"
    lines = rescore.slower_cases(res["rows"])
    assert len(lines) == 1 and "auto" in lines[0] and "-> nccl" in lines[0]
    assert rescore.main([str(path), "--min-m", "2048"]) == 0
    out = capsys.readouterr().out
    assert "no auto/flux case slower" in out and "(1 ran nccl itself) (paired: 0" in out
    assert json.loads(path.read_text()) == doc


def test_rescore_lists_a_case_whose_medians_give_no_speedup():
    """A row with a paired speedup but no ratio of medians (no nccl median) still prints."""
    from megatron_flux.tools.bench import rescore

    row = dict(_r(G.AG_GEMM, "x", 1024, "flux", 1.0), speedup_vs_nccl=None,
               paired_speedup_vs_nccl=0.9)
    lines = rescore.slower_cases([row])
    assert len(lines) == 1 and "medians -  paired 0.900x" in lines[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_model_config_benchmarks_exactly_the_configs_tp_gemms(tp):
    """--model-config: the cases, in per-rank shapes, are the config's ten TP GEMMs (forward and
    data gradient of QKV, proj, fc1, fc2 and the output layer), as the tuning tables key them,
    at the config's seq-length x micro-batch unless --ms says otherwise."""
    from megatron_flux.tools.model_shapes import tp_gemms
    from megatron_flux.tools.tune.from_bench import local_nk

    config = str(Path(__file__).resolve().parents[2] / "configs" / "llama3_8b_16l.json")
    args = resolve_args(build_parser().parse_args(["--model-config", config]), tp=tp)
    assert args.ms == [4096]
    got = {(c.op, *local_nk("ag" if c.op == G.AG_GEMM else "rs", c.n, c.k, tp)) for c in args.cases}
    want = {(G.AG_GEMM if g.op == "ag" else G.GEMM_RS, g.n, g.k) for g in tp_gemms(config, tp, backward=True)}
    assert got == want and len(args.cases) == 10
    assert {c.model for c in args.cases} == {f"llama3_8b_16l.{x}" for x in ("qkv", "proj", "fc1", "fc2", "output")}
    args = resolve_args(build_parser().parse_args(["--model-config", config, "--ms", "8192", "--ops", "rs"]), tp=tp)
    assert args.ms == [8192] and len(args.cases) == 5
    with pytest.raises(ValueError, match="--model-config nope.json: no such file"):
        resolve_args(build_parser().parse_args(["--model-config", "nope.json"]), tp=tp)


def test_a_fused_rows_notes_name_the_config_it_ran_and_the_rule_that_chose_it(monkeypatch):
    """``config_notes``: the config a fused method's backend runs on the case (its global rows,
    per-rank n and k, as the backend asks for them) and, for a tables-configured backend, which
    rule of ``provider.kernel_config`` chose it."""
    from megatron_flux.kernels.config import GemmConfig, default_config
    from megatron_flux.tuning import provider

    asked = []

    class Backend:
        def config(self, op, m_total, n, k, *, dtype=None, tp=None, device=None):
            asked.append((op, m_total, n, k, dtype, tp))
            return default_config(op, m_total, n, k, tp=tp)

    monkeypatch.setattr(provider, "kernel_config",
                        lambda op, m, n, k, dtype, tp, device: (GemmConfig(), f"rule for {op} m={m}"))
    model = G.ModelShape("tiny", 64, 512, 256)  # hidden, fc1, ffn
    for op, m_total, n, k in ((G.AG_GEMM, 256, 128, 64), (G.GEMM_RS, 256, 64, 128)):  # TP 4
        inp = M.make_inputs(G.case_for(op, model, m_total), 4, 0, dtype=torch.float32,
                            device=torch.device("cpu"), seed=0)
        short = "ag" if op == G.AG_GEMM else "rs"
        notes = M.config_notes(Backend(), inp, with_source=True)
        assert asked[-1] == (short, m_total, n, k, torch.float32, 4)
        assert notes["kernel_config"] == default_config(short, m_total, n, k, tp=4).to_dict()
        assert notes["config_from"] == f"rule for {short} m={m_total}"
        assert "config_from" not in M.config_notes(Backend(), inp, with_source=False)
