"""CPU tests of auto for shapes no table lists (tuning/estimate.py), stale tables and the
kernel version, and the leave-out evaluation (tools/auto_eval.py)."""

import dataclasses
import json
import logging
import math
import os
import warnings

import pytest
import torch

from megatron_flux import tuning as T
from megatron_flux.kernels.config import GemmConfig, default_config
from megatron_flux.kernels.split_tail import SPLIT_PART_COST
from megatron_flux.kernels.version import KERNEL_VERSION
from megatron_flux.tuning import estimate as E
from megatron_flux.tuning import provider, registry, schema

from helpers.paths import REPO as REPO_PATH

REPO = str(REPO_PATH)
GPU = ("NVIDIA Test GPU", 100)
BF16 = torch.bfloat16
CFG = GemmConfig(128, 128, 64, 4, 4, 8)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(registry.ENV_FILES, raising=False)
    monkeypatch.setenv(registry.ENV_SHIPPED, "0")
    monkeypatch.setenv("MEGATRON_FLUX_CACHED_TABLES", "0")
    T.reset()
    yield
    T.reset()


def entry(op, n, k, m, ratio, **cfg):
    return {"op": op, "n": n, "k": k, "m": m, "config": dict(CFG.to_dict(), **cfg), "tuned": True,
            "flux_ms": ratio, "nccl_ms": 1.0}


def table(entries, kernel_version=KERNEL_VERSION, tp=2):
    obj = {"format": "megatron-flux-tuning", "version": 1, "gpu": {"name": GPU[0], "sms": GPU[1]},
           "tp": tp, "dtype": "bf16", "source": "unit test", "entries": entries}
    if kernel_version is not None:
        obj["kernel_version"] = kernel_version
    return obj


def install(tmp_path, *objs):
    paths = []
    for i, obj in enumerate(objs):
        p = tmp_path / f"t{i}.json"
        p.write_text(json.dumps(obj))
        paths.append(str(p))
    T.use_table_files(paths)
    return paths


def P(m, n, k, ratio, config=CFG):
    return E.Point(m, n, k, ratio, config)


# ------------------------------------------------------------------ the shape space
def test_distance_weighs_rows_twice_and_reach_bounds_the_neighbours():
    p = P(1024, 4096, 4096, 1.0)
    assert E.distance(2048, 4096, 4096, p) == pytest.approx(2.0)   # one octave of rows
    assert E.distance(1024, 16384, 4096, p) == pytest.approx(2.0)  # two octaves of n
    assert E.distance(1024, 8192, 8192, p) == pytest.approx(math.sqrt(2))
    pts = [P(1024, 4096, 4096, 1.0), P(4096, 4096, 4096, 1.0), P(1024, 32768, 4096, 1.0)]
    assert [q.m for _, q in E.nearest(pts, 1024, 4096, 4096)] == [1024]  # the others lie beyond
    # equal distances: the smaller n first, the same order on every rank
    a, b = P(1024, 2048, 4096, 1.0), P(1024, 8192, 4096, 1.0)
    assert [q.n for _, q in E.nearest([b, a], 1024, 4096, 4096)] == [2048, 8192]


def test_prediction_comes_from_the_neighbours_at_half_the_rows():
    fam_a = [P(m, 4096, 4096, r) for m, r in ((512, 1.5), (1024, 0.9), (2048, 0.8))]
    est = E.Estimator(fam_a + [P(m, 8192, 8192, r) for m, r in ((512, 1.4), (1024, 0.9), (2048, 0.85))])
    ratio, near = est.predict(1024, 5000, 5000)
    assert {q.m for q in near} == {512}  # m = 1024 is predicted from the m = 512 entries
    assert ratio == pytest.approx(math.sqrt(1.5 * 1.4))
    ratio, near = est.predict(4096, 5000, 5000)
    assert {q.m for q in near} == {2048} and ratio == pytest.approx(math.sqrt(0.8 * 0.85))
    assert est.predict(1024, 1 << 20, 5000) is None  # nothing within reach


def test_below_1024_rows_the_neighbours_must_win_at_the_rows_too():
    """Small m: NCCL's latency floor makes the ratio rise from m = 128 to 256 on the tables, so
    there the prediction is the worse of the one at half the rows and the one at the rows."""
    pts = [P(m, n, 4096, r) for n in (4096, 8192)
           for m, r in ((128, 0.85), (256, 1.10), (512, 0.95), (1024, 0.90))]
    est = E.Estimator(pts)
    ratio, near = est.predict(256, 6000, 4096)
    assert {q.m for q in near} == {256} and ratio == pytest.approx(1.10)  # not 0.85 from m = 128
    ratio, near = est.predict(512, 6000, 4096)
    assert {q.m for q in near} == {256} and ratio == pytest.approx(1.10)  # the shifted one is worse
    ratio, near = est.predict(2048, 6000, 4096)  # from 1024 rows up: half the rows only
    assert {q.m for q in near} == {1024} and ratio == pytest.approx(0.90)
    assert E.MONOTONE_FROM_M == 1024


def test_small_m_errors_do_not_set_the_allowance_from_2048_rows_up():
    """Latency-bound small-m ratios spread widely between models, and m = 1024 is predicted
    from neighbours at 512 (another schedule): a false fused up to 1024 rows widens the
    allowance below 2048 rows only."""
    pts = []
    for n in (2048, 4096, 8192):
        small = 1.5 if n == 4096 else 0.7  # family B loses at m = 256-1024 where the others win
        pts += [P(256, n, 4096, small), P(512, n, 4096, small), P(1024, n, 4096, small),
                P(2048, n, 4096, 0.85), P(4096, n, 4096, 0.85)]
    est = E.Estimator(pts)
    assert est.allowance(0.02) == pytest.approx(0.98 / 0.7)
    assert est.allowance(0.02, large=True) == 1.0
    assert E.LARGE_M == 2048
    big = est.decide(4096, 4096, 4096, 0.02)
    assert big.fused and big.allowance == 1.0
    for m in (512, 1024):
        small = est.decide(m, 3000, 4096, 0.02)
        assert not small.fused and small.allowance == pytest.approx(0.98 / 0.7)


def test_allowance_turns_every_leave_out_false_fused_into_nccl():
    # family B loses at m = 4096 (1.05) where A and C, at half the rows, say 0.90: left out, B's
    # entry is a false fused unless the allowance covers 0.98 / 0.90
    pts = []
    for n, ratios in ((2048, (0.90, 0.90)), (4096, (0.90, 1.05)), (8192, (0.90, 0.90))):
        pts += [P(2048, n, 4096, ratios[0]), P(4096, n, 4096, ratios[1])]
    est = E.Estimator(pts)
    assert est.allowance(0.02) == pytest.approx(0.98 / 0.90)
    got = est.decide(4096, 4096, 4096, 0.02)
    assert not got.fused and got.allowance == pytest.approx(0.98 / 0.90)
    # a margin the loser clears needs no allowance
    assert est.allowance(0.0) == pytest.approx(1.0 / 0.90)
    assert E.Estimator([p for p in pts if p.n != 4096]).allowance(0.02) == 1.0
    # one family: nothing to measure the error with, so no estimate
    only = E.Estimator([p for p in pts if p.n == 2048])
    assert only.allowance(0.02) is None and only.decide(4096, 2048, 4096, 0.02) is None


def test_a_clear_win_is_estimated_fused():
    pts = [P(m, n, 4096, 0.8) for m in (1024, 2048) for n in (2048, 8192)]
    got = E.Estimator(pts).decide(4096, 4096, 4096, 0.02)
    assert got.fused and got.ratio == pytest.approx(0.8) and got.allowance == 1.0
    assert "estimate from 2 nearest (" in got.why(0.98)


def test_size_rule_by_op_and_rows_per_rank():
    assert E.SIZE_RULE_ROWS_PER_RANK == {"ag": 1024, "rs": None}
    assert not E.size_rule("ag", 2047, 2) and E.size_rule("ag", 2048, 2) and E.size_rule("ag", 4096, 4)
    assert not E.size_rule("ag", 2048, 4)
    assert not any(E.size_rule("rs", m, 2) for m in (64, 1024, 8192, 1 << 20))


def test_size_rule_is_no_bolder_than_the_shipped_tables_give():
    """The constants are derive_size_rule of the shipped tables, or more cautious where the
    docs say why (GEMM+RS: the tables' configs win from 512 rows per rank, the default config
    that runs where the estimate abstains did not): when a table is added or re-tuned,
    re-derive them (python -m megatron_flux.tools.auto_eval prints both)."""
    from megatron_flux.tools.auto_eval import derive_size_rule

    tables = [schema.load_table(p) for p in registry.shipped_table_files()]
    derived = derive_size_rule(tables)
    assert derived["ag"] == E.SIZE_RULE_ROWS_PER_RANK["ag"]
    for op, rows in E.SIZE_RULE_ROWS_PER_RANK.items():
        assert rows is None or (derived[op] is not None and rows >= derived[op]), op


# ------------------------------------------------------------------ configs of other shapes
def test_config_problems():
    ws_ag = GemmConfig(128, 128, 64, 5, 4, 8, ag_warp_specialized=True)
    assert E.config_problem("ag", ws_ag, 4096, 4096, 4096, 2) is None
    assert "not a multiple of block_m" in E.config_problem("ag", ws_ag, 2 * 1000, 4096, 4096, 2)
    assert "num_stages" in E.config_problem("ag", ws_ag, 4096, 4096, 256, 2)
    ws_rs = GemmConfig(128, 128, 64, 5, 4, 8, rs_warp_specialized=True)
    assert "not a multiple" in E.config_problem("rs", ws_rs, 2 * 1000, 4096, 4096, 2)
    assert E.config_problem("ag", ws_rs, 2 * 1000, 4096, 4096, 2) is None  # the other op's knob
    merged = GemmConfig(64, 128, 64, 5, 4, 8, rs_warp_specialized=True, rs_merge_rows=True,
                        rs_spread_reduce=True, rs_tma_push=False)
    assert E.config_problem("rs", merged, 2 * 100, 4096, 4096, 2) is None  # tiles span ranks
    tall = GemmConfig(256, 128, 64, 3, 8, 8)
    assert "taller" in E.config_problem("ag", tall, 2 * 64, 4096, 4096, 2)
    assert "larger than" in E.config_problem("ag", GemmConfig(128, 256, 64, 3, 8, 8), 4096, 100, 4096, 2)
    assert E.config_problem("ag", CFG, 4096, 4096, 4096, 2) is None


def test_nearest_config_skips_configs_that_cannot_run_the_shape():
    ws = GemmConfig(128, 128, 64, 5, 4, 8, rs_warp_specialized=True)
    pts = [P(2048, 4096, 4096, 0.9, ws), P(2048, 8192, 4096, 0.9, CFG)]
    assert E.nearest_config("rs", pts, 2048, 4096, 4096, 2).config is ws
    # 1000 rows per rank: the Gluon config cannot run it, the next one can
    assert E.nearest_config("rs", pts, 2000, 4096, 4096, 2).config is CFG
    assert E.nearest_config("rs", pts, 2000, 1 << 20, 4096, 2) is None


# ------------------------------------------------------------------ wired into the provider
def _grid(op, ratios_by_n, ms=(1024, 2048, 4096), k=4096):
    return [entry(op, n, k, m, r) for n, rs in ratios_by_n.items() for m, r in zip(ms, rs)]


def test_decide_says_where_its_answer_came_from(tmp_path):
    install(tmp_path, table(_grid("ag", {2048: (1.2, 0.8, 0.8), 8192: (1.1, 0.8, 0.8)})
                            + [entry("rs", 4096, 4096, 4096, 0.9)]))
    d = provider.decide("ag", 4096, 2048, 4096, BF16, 2, GPU)
    assert d == (True, "table", d.why) and d.why.startswith("table (0.800 at m=4096")
    d = provider.decide("ag", 4096, 4096, 4096, BF16, 2, GPU)  # between the two: from m = 2048
    assert d.fused and d.source == "estimate" and "n=2048 k=4096 m=2048 0.800" in d.why
    d = provider.decide("ag", 2048, 4096, 4096, BF16, 2, GPU)  # from m = 1024: both lose
    assert not d.fused and d.source == "estimate"
    # GEMM+RS has one family: no allowance can be measured, so the size rule (NCCL)
    d = provider.decide("rs", 4096, 4096, 8192, BF16, 2, GPU)
    assert d == (False, "size rule", d.why) and "GEMM+RS runs NCCL" in d.why
    # a GPU without tables (and no table given for it): the size rule
    T.reset()
    assert provider.decide("ag", 4096, 2048, 4096, BF16, 2, GPU) == (
        True, "size rule", "size rule: no estimate for this shape; fused from 1024 rows per rank (m >= 2048)")


def test_a_table_entry_decides_only_within_an_octave_of_its_bucket(tmp_path):
    # tuned at m = 4096 only (as `tune --model-config --ms 4096` leaves it), called at m = 1024
    install(tmp_path, table([entry("ag", 2048, 4096, 4096, 0.8)]
                            + _grid("ag", {1024: (1.3, 1.2, 0.8), 4096: (1.3, 1.2, 0.8)}, ms=(512, 1024, 2048))))
    assert provider.decide("ag", 2048, 2048, 4096, BF16, 2, GPU).source == "table"
    d = provider.decide("ag", 1024, 2048, 4096, BF16, 2, GPU)
    assert d.source == "estimate" and not d.fused
    assert T.prefer_fused("ag", 1024, 2048, 4096, BF16, 2, GPU) is True  # the entry's own answer


def test_kernel_config_from_the_table_the_nearest_entry_or_the_default(tmp_path):
    ws = dict(rs_warp_specialized=True, num_stages=5)
    install(tmp_path, table([entry("rs", 4096, 4096, 4096, 0.9, **ws), entry("rs", 4096, 8192, 4096, 0.9)]))
    cfg, where = provider.kernel_config("rs", 4096, 4096, 4096, BF16, 2, GPU)
    assert where == "table (m=4096)" and cfg.rs_warp_specialized
    cfg, where = provider.kernel_config("rs", 4096, 4096, 5000, BF16, 2, GPU)
    assert where.startswith("nearest entry (n=4096 k=4096 m=4096") and cfg.rs_warp_specialized
    # 1500 rows per rank: not a multiple of 128, so the next entry's config
    cfg, where = provider.kernel_config("rs", 3000, 4096, 5000, BF16, 2, GPU)
    assert where.startswith("nearest entry (n=4096 k=8192") and not cfg.rs_warp_specialized
    cfg, where = provider.kernel_config("rs", 4096, 64, 64, BF16, 2, GPU)
    assert where == "default" and cfg == default_config("rs", 4096, 64, 64, tp=2)
    assert T.TableConfigProvider()("rs", 4096, 4096, 5000, dtype=BF16, tp=2, device=GPU).rs_warp_specialized


# ------------------------------------------------------------------ stale tables
def test_a_stale_table_warns_once_and_its_times_do_not_decide(tmp_path):
    stale = table([entry("ag", 2048, 4096, 4096, 0.5, block_n=64)] + _grid("ag", {8192: (1.3, 1.2, 1.1)}),
                  kernel_version=None)  # no version recorded: 0
    (path,) = install(tmp_path, stale)
    with pytest.warns(registry.StaleTableWarning) as got:
        d = provider.decide("ag", 4096, 2048, 4096, BF16, 2, GPU)
        provider.decide("ag", 2048, 2048, 4096, BF16, 2, GPU)
        cfg, where = provider.kernel_config("ag", 4096, 2048, 4096, BF16, 2, GPU)
    assert len(got) == 1  # one per file
    msg = str(got[0].message)
    assert path in msg and "kernel version 0" in msg and f"are version {KERNEL_VERSION}" in msg
    assert "megatron-flux tune" in msg
    # its 0.5 does not decide; no current table: the size rule
    assert d.source == "size rule" and T.prefer_fused("ag", 4096, 2048, 4096, BF16, 2, GPU) is None
    assert where == "table (m=4096)" and cfg.block_n == 64  # its config still runs


def test_a_current_table_decides_and_does_not_warn(tmp_path):
    install(tmp_path, table([entry("ag", 2048, 4096, 4096, 0.5)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = provider.decide("ag", 4096, 2048, 4096, BF16, 2, GPU)
    assert d.fused and d.source == "table"


def test_stale_and_current_tables_of_one_machine(tmp_path):
    """The current table's entry decides where it has one (its nearest bucket among current
    entries), the stale one only gives configs."""
    stale = table([entry("ag", 2048, 4096, 1024, 0.5)], kernel_version=KERNEL_VERSION + 1)
    current = table([entry("ag", 2048, 4096, 2048, 1.5)])
    install(tmp_path, stale, current)
    with pytest.warns(registry.StaleTableWarning, match="kernel version 2"):
        d = provider.decide("ag", 1024, 2048, 4096, BF16, 2, GPU)
    assert d.source == "table" and not d.fused and "at m=2048" in d.why
    assert provider.kernel_config("ag", 1024, 2048, 4096, BF16, 2, GPU)[1] == "table (m=1024)"


def test_shipped_tables_versions():
    versions = {os.path.basename(p): schema.load_table(p).kernel_version for p in registry.shipped_table_files()}
    assert versions == {"h200-sm132-tp2-bf16.json": KERNEL_VERSION,
                        "h100-80gb-hbm3-sm132-tp2-bf16.json": KERNEL_VERSION,
                        "h200-sm132-tp4-bf16.json": KERNEL_VERSION}  # re-timed (tools.tune.retime)


def test_kernel_version_field(tmp_path):
    assert schema.validate_table(table([], kernel_version=None)).kernel_version == 0
    t = schema.validate_table(table([], kernel_version=3))
    assert t.kernel_version == 3 and t.stale
    assert not schema.validate_table(table([])).stale
    for bad in (-1, True, "1"):
        with pytest.raises(schema.TuningFileError, match="kernel_version"):
            schema.validate_table(table([], kernel_version=bad))
    # written back as read, right after the source
    out = tmp_path / "w.json"
    schema.write_table(t, str(out))
    assert list(json.loads(out.read_text()))[6] == "kernel_version"
    assert schema.load_table(str(out)).kernel_version == 3
    with pytest.raises(schema.TuningFileError, match="kernel_version"):
        schema.merge_tables(t, schema.validate_table(table([])))


def test_benchmarks_of_other_kernels_do_not_confirm_a_table():
    from megatron_flux.tools.tune.from_bench import check_same_machine, table_from_bench

    t = schema.validate_table(table([]))
    bench = {"tp": 2, "gpu": GPU[0], "dtype": "bf16", "env": {"sms": 100, "kernel_version": KERNEL_VERSION}}
    check_same_machine(bench, t, "b.json")
    bench["env"]["kernel_version"] = KERNEL_VERSION + 1
    with pytest.raises(schema.TuningFileError, match="kernel_version"):
        check_same_machine(bench, t, "b.json")
    bench = dict(bench, rows=[], env={"sms": 100, "kernel_version": 5, "gpus": [GPU[0]]})
    assert table_from_bench(bench, "b.json").kernel_version == 5


# ------------------------------------------------------------------ auto's log and plan
def test_auto_logs_where_a_choice_came_from(tmp_path, monkeypatch, caplog):
    import megatron_flux.backends.registry as B
    from megatron_flux.backends import auto

    monkeypatch.setattr(B, "_LOGGED", set())
    install(tmp_path, table([entry("ag", 2048, 4096, 4096, 0.5), entry("ag", 2048, 4096, 64, 2.0)]))
    monkeypatch.setattr(provider, "device_identity", lambda device: ("test-gpu", 100, GPU[0]))
    with caplog.at_level(logging.INFO, logger=B.logger.name):
        assert auto._decide("ag", 2048, 4096, 2048, BF16, 2, torch.device("cpu"), log=True)  # table, fused: quiet
        assert not auto._decide("ag", 32, 4096, 2048, BF16, 2, torch.device("cpu"), log=True)
        assert not auto._decide("rs", 2048, 4096, 4096, BF16, 2, torch.device("cpu"), log=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "'nccl' for ag m=64 n=2048 k=4096: table (2.000 at m=64" in lines[0]
    assert "'nccl' for rs m=2048 n=4096 k=4096: size rule" in lines[1]


def test_plan_marks_a_stale_entry(capsys, tmp_path, monkeypatch):
    from megatron_flux.tools import plan

    # llama3-8b's fc1 at TP 4 (per-rank n = 28672 / 4), measured with other kernels
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(table([entry("ag", 7168, 4096, 4096, 0.5)],
                                      kernel_version=KERNEL_VERSION + 1, tp=4)))
    monkeypatch.setenv(registry.ENV_FILES, str(stale))
    T.reset()
    with pytest.warns(registry.StaleTableWarning):
        assert plan.main(["--model-config", os.path.join(REPO, "configs", "llama3_8b_16l.json"),
                          "--tp", "4", "--gpu", GPU[0], "--sms", str(GPU[1])]) == 0
    out = capsys.readouterr().out
    fc1 = next(line for line in out.splitlines() if ":fc1 " in line)
    assert " 4096* " in fc1 and "size rule" in fc1
    assert "* a stale table" in out


# ------------------------------------------------------------------ the leave-out evaluation
def test_leave_out_on_the_shipped_tables():
    """With its shape family left out, the rule chooses a fused kernel that measured slower
    than NCCL once on the shipped tables, by 3 % (gpt3-175b's GEMM+RS at m = 256 on 4xH200;
    on 2xH200 its two false fused measured inside 2 % of NCCL); the old 1024-row rule chose
    slower ones on all three."""
    from megatron_flux.tools.auto_eval import evaluate

    res = {os.path.basename(p): evaluate(schema.load_table(p), 0.02) for p in registry.shipped_table_files()}
    for name, r in res.items():
        est = r["rules"]["estimate"]
        assert est["worst_vs_nccl"] <= 1.031, name
        assert est["false_fused"] <= 2, (name, r["false_fused"]["estimate"])
    assert res["h200-sm132-tp2-bf16.json"]["false_fused"]["estimate"] == [
        "ag n=36864 k=4608 m=8192 (0.9818)",  # inside the margin, not slower than NCCL
        "rs n=7168 k=20480 m=4096 (0.9903)"]  # yi-34b: inside the margin too
    assert res["h200-sm132-tp2-bf16.json"]["rules"]["estimate"]["fused_slower_than_nccl"] == 0
    assert res["h100-80gb-hbm3-sm132-tp2-bf16.json"]["rules"]["estimate"]["fused_slower_than_nccl"] == 0
    # the TP 4 grid searched again: fused wins at small m too, and gpt3-175b's neighbours say so
    # for its GEMM+RS at m = 256, which measured inside 3 % of NCCL
    assert res["h200-sm132-tp4-bf16.json"]["false_fused"]["estimate"] == ["rs n=12288 k=12288 m=256 (1.0268)"]
    assert res["h100-80gb-hbm3-sm132-tp2-bf16.json"]["rules"]["old_1024"]["fused_slower_than_nccl"] == 7


def test_the_committed_evaluation_is_current():
    """benchmarks/results/auto-rule-eval-*.json is what the tool computes now (docs/tuning.md
    quotes it); re-run `python -m megatron_flux.tools.auto_eval --out <that file>` when the rule
    or a shipped table changes."""
    import glob

    from megatron_flux.tools.auto_eval import evaluate, evaluate_held_out

    (path,) = glob.glob(os.path.join(REPO, "benchmarks", "results", "auto-rule-eval-*.json"))
    committed = json.load(open(path))
    assert committed["constants"]["size_rule_rows_per_rank"] == E.SIZE_RULE_ROWS_PER_RANK
    assert (committed["constants"]["m_weight"], committed["constants"]["reach"],
            committed["constants"]["k_nearest"], committed["constants"]["row_shift"]) == (
        E.M_WEIGHT, E.REACH, E.K_NEAREST, E.ROW_SHIFT)
    for p in registry.shipped_table_files():
        assert committed["tables"][os.path.basename(p)] == evaluate(schema.load_table(p), committed["margin"])
    benches = [(json.load(open(os.path.join(REPO, b))), b) for b in committed["held_out_benches"]]
    for p in registry.shipped_table_files():
        held = evaluate_held_out(schema.load_table(p), benches, committed["margin"])
        assert committed["held_out"].get(os.path.basename(p), {}) == held


def test_a_config_transplanted_to_an_unseen_shape_gets_its_stream_k_tail():
    """The nearest entry's config runs a shape it was not tuned on with the stream-K tail on
    (its own shape may have had no partial last wave to split); a table's own shape keeps its
    config as tuned, and kernels without a tail to split (the Gluon warp-specialized AG+GEMM,
    merged rows) are left alone."""
    import torch

    from megatron_flux.tuning import provider

    T.use_table_files(registry.shipped_table_files())
    h200 = ("NVIDIA H200", 132)
    own, where = provider.kernel_config("rs", 1024, 4096, 14336, torch.bfloat16, 2, h200)
    assert where == "table (m=1024)" and own.stream_k == 0 and not own.rs_warp_specialized
    cfg, where = provider.kernel_config("rs", 1024, 4096, 15360, torch.bfloat16, 2, h200,
                                        wave_aware=False)
    assert where.startswith("nearest entry (n=4096 k=14336 m=1024")
    assert cfg == dataclasses.replace(own, stream_k=1)
    # with the rules the runtime applies, this shape runs the ping-pong instead
    cfg, where = provider.kernel_config("rs", 1024, 4096, 15360, torch.bfloat16, 2, h200)
    assert where.startswith("ping-pong GEMM+RS") and "nearest entry (n=4096 k=14336" in where
    assert cfg.rs_warp_specialized and cfg.stream_k == 1  # with its split tail
    ws = next(e.config for e in schema.load_table(registry.shipped_table_files()[1]).entries
              if e.config.rs_warp_specialized and not e.config.stream_k)
    # the warp-specialized GEMM+RS has a split tail; its AG+GEMM and merged rows have none
    assert E.transplanted(ws, "rs") == dataclasses.replace(ws, stream_k=1)
    ag_ws = dataclasses.replace(ws, ag_warp_specialized=True)
    assert E.transplanted(ag_ws, "ag") is ag_ws
    merged = dataclasses.replace(ws, rs_merge_rows=True, rs_spread_reduce=True,
                                 rs_tma_push=False, rs_copy_engine=False)
    assert E.transplanted(merged, "rs") is merged


# ------------------------------------------------------------------ the wave rule
WIDE = GemmConfig(128, 256, 64, 3, 8, 8)  # the Triton kernel's 128x256 tile, stream-K off
PINGPONG = GemmConfig(128, 128, 64, 5, 4, 8, epilogue_split=1, rs_warp_specialized=True)


def test_wave_work_counts_whole_waves_and_a_split_tail():
    # GEMM+RS at m = 1024, n = 5120, TP 2 on 132 SMs: 128x256 tiles are 160 (1.21 waves, run
    # as 2); 128x128 ones 320 (2.42 waves, run as 3)
    assert E.wave_work("rs", WIDE, 1024, 5120, 13824, 2, 132) == 2 * 128 * 256
    assert E.wave_work("rs", PINGPONG, 1024, 5120, 13824, 2, 132) == 3 * 128 * 128
    # the stream-K tail of 28 tiles (0.21 of a wave) is split: one wave + 2.7 x 0.21
    sk = dataclasses.replace(WIDE, stream_k=1)
    assert E.wave_work("rs", sk, 1024, 5120, 13824, 2, 132) == pytest.approx(
        128 * 256 * (1 + E.STREAM_K_TAIL_COST * 28 / 132))
    # a tail of 60 tiles (0.45 of a wave) is not split: whole waves again
    assert E.wave_work("rs", sk, 1024, 6144, 13824, 2, 132) == 2 * 128 * 256
    # fewer tiles than SMs: one wave, split or not
    assert E.wave_work("rs", sk, 1024, 2048, 13824, 2, 132) == 128 * 256
    # the warp-specialized GEMM+RS's split tail, as the kernel plans it: at n = 5120 its 320
    # tiles are 2.42 waves; the 56-tile tail in two parts makes the last wave 1.2 / 2 of one
    split = dataclasses.replace(PINGPONG, stream_k=1)
    assert E.wave_work("rs", split, 1024, 5120, 13824, 2, 132) == pytest.approx(
        128 * 128 * (2 + SPLIT_PART_COST / 2))
    # at m = 8192 (19.4 waves) the kernel does not split: whole waves
    assert E.wave_work("rs", split, 8192, 5120, 13824, 2, 132) == 20 * 128 * 128
    # AG+GEMM's merged rows are one tile space over the gathered rows: 2 x 64 rows fill one
    # row of 128-row tiles, where each rank's segment takes its own
    merged = dataclasses.replace(CFG, ag_merge_local=True, ag_merge_lead=0)
    assert E.wave_work("ag", merged, 2 * 64, 128 * 132, 4096, 2, 132) == 1 * 128 * 128
    assert E.wave_work("ag", CFG, 2 * 64, 128 * 132, 4096, 2, 132) == 2 * 128 * 128


def test_wave_rule_replaces_a_tile_that_quantises_badly():
    """n = 6144 at m = 1024 (TP 2): the nearest entry's 128x256 tiles make 192 tiles, 1.45 waves
    run as 2 (the tail too large to split); a winning entry's 128x128 Gluon config makes 384,
    2.91 waves run as 3: 0.75 of the work. The replacement must have won, have tiles of at least
    128x128 and 128 rows, and be able to run the shape."""
    near = P(1024, 6144, 14336, 1.3, WIDE)
    far = P(2048, 4096, 28672, 0.85, PINGPONG)
    cfg, src, replaced = E.wave_aware_config("rs", [near, far], 1024, 6144, 16384, 2, 132)
    assert replaced and cfg == dataclasses.replace(PINGPONG, stream_k=1) and src is far
    # the same tile that lost to NCCL is no candidate
    lost = P(2048, 4096, 28672, 1.01, PINGPONG)
    cfg, src, replaced = E.wave_aware_config("rs", [near, lost], 1024, 6144, 16384, 2, 132)
    assert not replaced and src is near and cfg == dataclasses.replace(WIDE, stream_k=1)
    # 64-row tiles are no candidates (their K steps are slower, more than the waves gain)
    short = P(2048, 4096, 28672, 0.85, GemmConfig(64, 256, 64, 4, 4, 8))
    assert not E.wave_aware_config("rs", [near, short], 1024, 6144, 16384, 2, 132)[2]
    # n = 4096: 128 tiles of 128x256 are one wave, 256 of 128x128 two: nothing gained
    near4k = P(1024, 4096, 14336, 0.92, WIDE)
    assert not E.wave_aware_config("rs", [near4k, far], 1024, 4096, 16384, 2, 132)[2]
    # 320 rows per rank are not a multiple of the Gluon kernel's 128: it cannot run them
    assert not E.wave_aware_config("rs", [near, far], 2 * 320, 6144, 16384, 2, 132)[2]
    # a replacement gets no credit for a stream-K tail: at n = 2560 the nearest 128x256 tiles
    # are 80 (one wave); 128x128 Triton tiles are 160, one wave and a split tail (0.79 of the
    # work with the credit), two whole waves without it
    near2560 = P(1024, 2560, 13824, 1.1, WIDE)
    triton = P(2048, 4096, 28672, 0.85, CFG)
    assert E.wave_work("rs", dataclasses.replace(CFG, stream_k=1), 1024, 2560, 5120, 2, 132) < \
        0.9 * E.wave_work("rs", WIDE, 1024, 2560, 5120, 2, 132)
    assert not E.wave_aware_config("rs", [near2560, triton], 1024, 2560, 6912, 2, 132)[2]
    # only the candidates given may replace it
    assert not E.wave_aware_config("rs", [near, far], 1024, 6144, 16384, 2, 132, candidates=())[2]
    assert E.wave_aware_config("rs", [], 1024, 6144, 16384, 2, 132) is None


def test_kernel_config_applies_the_wave_rule_on_shipped_tables():
    """On the shipped 2xH200 TP 2 table, GEMM+RS at m = 1024 with n = 6144 and k = 28672 (no
    entry): the nearest entry is llama3-70b's 128x256 one (192 tiles, 1.45 waves run as 2);
    the wave rule runs a winning 128x128 Gluon entry's config instead (384 tiles, 2.91 waves
    run as 3: 0.75 of the work), with its split tail. ``wave_aware=False`` gives the nearest
    entry's; a shape with its own entry (internlm2-20b's, which the rule chose for when it was
    measured; llama3-8b's, tuned) keeps that entry's config."""
    T.use_table_files(registry.shipped_table_files())
    h200 = ("NVIDIA H200", 132)
    cfg, where = provider.kernel_config("rs", 1024, 6144, 28672, BF16, 2, h200)
    assert cfg.rs_warp_specialized and (cfg.block_m, cfg.block_n) == (128, 128) and cfg.stream_k
    assert "fewer waves" in where
    old, where = provider.kernel_config("rs", 1024, 6144, 28672, BF16, 2, h200, wave_aware=False)
    assert where.startswith("nearest entry (n=8192 k=28672 m=1024")
    assert (old.block_m, old.block_n) == (128, 256)
    own, where = provider.kernel_config("rs", 1024, 6144, 16384, BF16, 2, h200)
    assert where == "table (m=1024)" and own.rs_warp_specialized
    own, where = provider.kernel_config("rs", 1024, 4096, 14336, BF16, 2, h200)
    assert where == "table (m=1024)" and (own.block_m, own.block_n) == (128, 256)


# ------------------------------------------------------------------ the ping-pong GEMM+RS rule
def test_pingpong_rule_runs_gemm_rs_under_ten_waves_at_tp2_and_tp4():
    """A GEMM+RS shape no table lists, at TP 2 and 4 from 1024 rows, runs the ping-pong Gluon
    kernel (SM pushes, its split tail on) while 128x256 tiles make fewer than 10 waves and the
    per-rank K is below 32768; from 10 waves, from that K, at TP 8, below 1024 rows, where its
    128-row tiles cannot split the rows per rank, and where the other rules already chose a
    warp-specialized config, the other rules' config stays."""
    wide_ce = dataclasses.replace(WIDE, rs_copy_engine=True)
    near = [P(m, 4096, 7168, 0.87, wide_ce) for m in (1024, 4096, 8192)]
    base = E.transplanted(wide_ce, "rs")  # the nearest entry's, its stream-K tail on
    for m, n in ((1024, 5120), (4096, 4608), (8192, 5120)):  # 1.2, 4.4 and 9.7 waves
        cfg, where = E.unlisted_config("rs", near, m, n, 6848, 4, 132, pingpong=True)
        assert cfg == dataclasses.replace(base, **E.PINGPONG_RS), (m, n)
        assert cfg.rs_warp_specialized and not cfg.rs_copy_engine and cfg.stream_k == 1
        assert where.startswith("ping-pong GEMM+RS") and "nearest entry" in where
    # 64 x 28 = 1792 tiles of 128x256 are 13.6 waves: the wide tile stays
    assert E.unlisted_config("rs", near, 8192, 7168, 7168, 4, 132, pingpong=True)[0] == base
    assert E.pingpong_rs_config(base, 8192, 6144, 8192, 4, 132) is None  # 11.6 waves
    assert E.pingpong_rs_config(base, 1024, 5120, 13696, 2, 132) == cfg  # TP 2
    # at TP 2 from 2048 rows the copy engine delivers the pushes (not at 1024, nor at TP 4)
    assert E.pingpong_rs_config(base, 2048, 5120, 13696, 2, 132) == dataclasses.replace(
        cfg, rs_copy_engine=True)
    assert not E.pingpong_rs_config(base, 2048, 5120, 6848, 4, 132).rs_copy_engine
    assert E.pingpong_rs_config(base, 1024, 5120, 27392, 2, 132) == cfg
    assert E.pingpong_rs_config(base, 1024, 4608, 36864, 2, 132) is None  # long K
    assert E.pingpong_rs_config(base, 1024, 4608, 32768, 4, 132) is None
    assert E.pingpong_rs_config(base, 1024, 5120, 6848, 8, 132) is None  # TP 8
    assert E.pingpong_rs_config(base, 512, 5120, 6848, 4, 132) is None  # below 1024 rows
    assert E.pingpong_rs_config(base, 4 * 320, 5120, 6848, 4, 132) is None  # 320 rows per rank
    assert E.pingpong_rs_config(base, 1024, 5120, 256, 4, 132) is None  # 4 K steps < 5 stages
    assert E.pingpong_rs_config(PINGPONG, 1024, 5120, 6848, 4, 132) is None
    # without pingpong (A/B runs, extend without --pingpong), AG+GEMM, or no entry in reach
    assert E.unlisted_config("rs", near, 1024, 5120, 6848, 4, 132)[0] == base
    assert not E.unlisted_config("ag", [P(1024, 4096, 7168, 0.87, WIDE)], 1024, 5120, 6848, 4,
                                 132, pingpong=True)[0].rs_warp_specialized
    cfg, where = E.unlisted_config("rs", [], 1024, 5120, 6848, 4, 132, pingpong=True)
    assert cfg.rs_warp_specialized and where.endswith("(else default)")


def test_kernel_config_applies_the_pingpong_rule_on_the_shipped_tp4_table():
    """On the shipped 4xH200 table, gemma2-27b's GEMM+RS as the benchmark shapes it (n = 4608,
    k = 18432 per rank; no entry) runs the ping-pong kernel at m = 1024-8192: by the rule
    where the nearest entry's config is a 128x256 Triton one (m = 1024, 4096, 8192), as the
    nearest entry's own where that entry adopted it (m = 2048). n = 10240, k = 12288 at
    m = 8192 (19.4 waves) keeps the nearest entry's 128x256 tile (gpt3-175b's);
    ``wave_aware=False`` gives the nearest entry's config, and a shape the table lists keeps
    its entry's."""
    T.use_table_files(registry.shipped_table_files())
    h200 = ("NVIDIA H200", 132)
    by_rule = []
    for m in (1024, 2048, 4096, 8192):
        cfg, where = provider.kernel_config("rs", m, 4608, 18432, BF16, 4, h200)
        assert cfg.rs_warp_specialized and (cfg.block_m, cfg.block_n) == (128, 128), m
        assert not cfg.rs_copy_engine and cfg.stream_k == 1  # the split tail, rule or transplant
        if where.startswith("ping-pong"):
            by_rule.append(m)
            old, where = provider.kernel_config("rs", m, 4608, 18432, BF16, 4, h200, wave_aware=False)
            assert where.startswith("nearest entry") and not old.rs_warp_specialized
        else:
            assert where.startswith("nearest entry (n=3072 k=12288 m=2048"), where
    assert by_rule == [1024, 4096, 8192]
    cfg, where = provider.kernel_config("rs", 8192, 10240, 12288, BF16, 4, h200)  # 19.4 waves
    assert where.startswith("nearest entry (n=12288") and (cfg.block_m, cfg.block_n) == (128, 256)
    own, where = provider.kernel_config("rs", 4096, 4096, 3584, BF16, 4, h200)
    assert where == "table (m=4096)"


def test_auto_runs_unlisted_ag_gemm_fused_from_1024_rows_per_rank_on_h200_at_tp2():
    """On the shipped tables an AG+GEMM shape no table lists (n = 10240, k = 5632 per rank) runs
    fused on an H200 at TP 2 in bf16 from 1024 rows per rank (source "rule": every AG+GEMM
    measured there from those rows beat NCCL), where the estimate, from the neighbours at half
    the rows, says NCCL; not below those rows, not for a GEMM larger or smaller than every
    entry, and not at TP 4, on an H100 or in fp16, where the usual sources decide."""
    T.use_table_files(registry.shipped_table_files())
    h200, h100 = ("NVIDIA H200", 132), ("NVIDIA H100 80GB HBM3", 132)
    est = provider.estimator("ag", BF16, 2, h200)[0].decide(2048, 10240, 5632, 0.02)
    assert est is not None and not est.fused  # what the estimate alone would choose
    for m in (2048, 4096, 8192):
        d = provider.decide("ag", m, 10240, 5632, BF16, 2, h200)
        assert d.fused and d.source == "rule" and "1024 rows per rank" in d.why, (m, d)
    assert provider.decide("ag", 1024, 10240, 5632, BF16, 2, h200).source == "estimate"
    largest = max(p.n * p.k for p in provider.estimator("ag", BF16, 2, h200)[0].points)
    assert 65536 * 16384 > largest
    assert provider.decide("ag", 2048, 65536, 16384, BF16, 2, h200).source == "estimate"
    smallest = min(p.n * p.k for p in provider.estimator("ag", BF16, 2, h200)[0].points)
    assert 1152 * 2304 < smallest  # smaller than every entry: no rule either
    assert provider.decide("ag", 4096, 1152, 2304, BF16, 2, h200).source != "rule"
    assert provider.decide("ag", 4096, 10240, 5632, BF16, 4, h200).source != "rule"
    assert provider.decide("ag", 2048, 10240, 5632, BF16, 2, h100).source != "rule"
    assert provider.decide("ag", 2048, 10240, 5632, torch.float16, 2, h200).source != "rule"
    assert provider.decide("ag", 2048, 3072, 4096, BF16, 2, h200).source == "table"
    # the leave-out evaluation scores it as "ag_rows": never slower than NCCL on the TP 2 table
    from megatron_flux.tools.auto_eval import evaluate

    table = next(t for t in map(T.schema.load_table, registry.shipped_table_files())
                 if (t.gpu, t.tp, t.dtype) == ("h200", 2, "bf16"))
    rules = evaluate(table, 0.02)["rules"]
    assert rules["ag_rows"]["fused_slower_than_nccl"] == 0
    assert rules["ag_rows"]["false_nccl"] < rules["estimate"]["false_nccl"]


def test_auto_runs_the_pingpong_rules_config_fused_on_h200_at_tp2():
    """On the shipped tables, a GEMM+RS shape no table lists whose config is the ping-pong
    rule's (gemma3-12b's fc2 at m = 1024, n = 3840, k = 15360 per rank) runs fused on an H200
    at TP 2
    (source "rule": every such case measured there beat NCCL); below the rule's 1024 rows, at
    TP 4, on another GPU or dtype, and for a shape a table lists, the usual sources decide."""
    T.use_table_files(registry.shipped_table_files())
    h200, h100 = ("NVIDIA H200", 132), ("NVIDIA H100 80GB HBM3", 132)
    assert provider.kernel_config("rs", 1024, 3840, 15360, BF16, 2, h200)[1].startswith(
        E.PINGPONG_SOURCE)
    d = provider.decide("rs", 1024, 3840, 15360, BF16, 2, h200)
    assert d.fused and d.source == "rule" and "ping-pong" in d.why
    # from m = 2048 the nearest entry's own Gluon config runs it: the estimate decides
    assert not provider.kernel_config("rs", 2048, 3840, 15360, BF16, 2, h200)[1].startswith(
        E.PINGPONG_SOURCE)
    assert provider.decide("rs", 2048, 3840, 15360, BF16, 2, h200).source == "estimate"
    assert provider.decide("rs", 512, 3840, 15360, BF16, 2, h200).source != "rule"
    # gemma2-27b's fc2 at TP 4 runs the rule's config, but the estimate decides there
    assert provider.kernel_config("rs", 1024, 4608, 18432, BF16, 4, h200)[1].startswith(
        E.PINGPONG_SOURCE)
    assert provider.decide("rs", 1024, 4608, 18432, BF16, 4, h200).source != "rule"
    assert provider.decide("rs", 1024, 3840, 15360, BF16, 2, h100).source != "rule"
    # measured in bf16 only: fp16 (no table) and a dtype the tables have no key for do not
    assert provider.decide("rs", 1024, 3840, 15360, torch.float16, 2, h200).source != "rule"
    assert provider.decide("rs", 1024, 3840, 15360, torch.int8, 2, h200).source == "size rule"
    assert provider.decide("rs", 1024, 5120, 13824, BF16, 2, h200).source == "table"
