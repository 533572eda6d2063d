"""CPU parts of `megatron-flux tune`: candidates, buckets, shapes, CLI parsing, progress."""

import dataclasses
import io
import json
import os
import sys

import pytest

from megatron_flux.tools import cli
from megatron_flux.kernels.config import GemmConfig, default_config
from megatron_flux.tools.tune import candidates as C
from megatron_flux.tools.tune import search as S
from megatron_flux.tuning import estimate as E
from megatron_flux.tools.model_shapes import tokens_per_microbatch, tp_gemms
from megatron_flux.tools.tune.progress import NullProgress, SimpleProgress, progress

from helpers import paths

REPO = str(paths.REPO)


def test_candidates_start_with_default_are_unique_valid_and_bounded():
    for op in ("ag", "rs"):
        c = C.generate_candidates(op, 4096, 14336, 4096, 2, max_candidates=40)
        assert c[0] == default_config(op, 4096, 14336, 4096)
        assert len(c) == 40 and len(set(c)) == 40
        assert all(isinstance(x, GemmConfig) and C.smem_bytes(x) <= C.SMEM_BYTES for x in c)


def test_candidates_order_by_distance_from_default():
    base = default_config("ag", 4096, 14336, 4096)
    c = C.generate_candidates("ag", 4096, 14336, 4096, 2, max_candidates=10**6, seeds=())
    dist = [sum(getattr(x, f) != getattr(base, f) for f in C.SEARCH_SPACE) for x in c]
    assert dist == sorted(dist) and dist[0] == 0 and dist[1] == 1
    # every single-knob change that passes the filters is there
    singles = {(f, getattr(x, f)) for x, d in zip(c, dist) if d == 1 for f in C.SEARCH_SPACE
               if getattr(x, f) != getattr(base, f)}
    assert ("num_stages", 4) in singles and ("warp_specialize", True) in singles and ("chunk_rows", 512) in singles
    # deterministic: every rank builds the same list
    assert c == C.generate_candidates("ag", 4096, 14336, 4096, 2, max_candidates=10**6, seeds=())


def test_seed_configs_come_right_after_the_default_and_respect_the_filters():
    for op, m in (("ag", 4096), ("rs", 4096), ("ag", 64), ("rs", 64)):
        base = default_config(op, m, 14336, 4096, tp=2)
        c = C.generate_candidates(op, m, 14336, 4096, 2, max_candidates=10**6)
        expected = []
        # merged rows try their own seeds first; a tile spanning segments may be as tall as
        # every rank's rows (here 64 of them, like one segment's rounded up)
        merged_seeds = C.RS_MERGED_SEEDS if base.rs_merge_rows else ()
        for seed in merged_seeds + C.SEED_CONFIGS:
            cfg = GemmConfig(**{**base.to_dict(), **seed})
            if cfg != base and cfg not in expected and cfg.block_m <= max(64, m // 2):
                expected.append(cfg)
        twin = []
        if base.rs_merge_rows or base.ag_merge_local:  # small m: the per-segment default too
            twin.append(default_config(op, m, 14336, 4096, tp=2, gather_small_m=False))
        if op == "rs" and not base.rs_merge_rows:  # (merged rows push from the SMs)
            twin.append(dataclasses.replace(base, rs_copy_engine=True))
        assert c[0] == base and c[1:1 + len(twin) + len(expected)] == twin + expected, op
        assert len(c) == len(set(c))
    # the multi-knob seeds are there although they differ from the default in several knobs
    c = C.generate_candidates("ag", 4096, 14336, 4096, 2, max_candidates=8)
    assert any(x.warp_specialize and x.epilogue_split == 1 for x in c)
    # m = 64 on 2 ranks: 32-row segments, no 128-row seed survives; the default gathers first
    c = C.generate_candidates("ag", 64, 14336, 4096, 2)
    assert c[0].ag_merge_local and c[0].ag_merge_lead == 0
    assert all(x.block_m == 64 for x in c[2:])


def test_candidate_filters():
    # rs never varies chunk_rows; ag keeps chunks below the rows of a segment
    rs = C.generate_candidates("rs", 4096, 4096, 14336, 2, max_candidates=10**6)
    assert {x.chunk_rows for x in rs} == {default_config("rs", 4096, 4096, 14336).chunk_rows}
    ag = C.generate_candidates("ag", 1024, 14336, 4096, 2, max_candidates=10**6)
    assert all(x.chunk_rows < 512 for x in ag[1:] if x.chunk_rows != ag[0].chunk_rows)
    # small m: no block_m above the segment rows (rounded up, at least 64); the default and
    # the per-segment default are kept as they are
    small = C.generate_candidates("ag", 64, 14336, 4096, 2, max_candidates=10**6)
    assert max(x.block_m for x in small[2:]) == 64
    # a tight shared-memory budget removes the big pipelines
    tight = C.generate_candidates("ag", 4096, 14336, 4096, 2, max_candidates=10**6, smem_limit=100 * 1024)
    assert all(C.smem_bytes(x) <= 100 * 1024 for x in tight[1:])
    with pytest.raises(ValueError, match="divisible"):
        C.generate_candidates("ag", 65, 128, 128, 2)
    with pytest.raises(ValueError, match="GemmConfig does not have"):
        C.generate_candidates("ag", 64, 128, 128, 2, space={"pull": (True, False)})


def _brute_force_variations(op, m_total, n, k, tp, space, smem_limit=C.SMEM_BYTES):
    """The candidates (no seeds) as the tuner first built them: every config of the product,
    filtered, sorted by (distance, single knobs breadth-first, product index). The tuner now
    builds them one distance at a time; this is the reference it must match."""
    import itertools

    base = default_config(op, m_total, n, k, tp=tp)
    space = {f: ((getattr(base, f),) if any(f in knobs for o, knobs in C._OP_KNOBS.items() if o != op)
                 else values) for f, values in space.items()}  # the other op's knobs stay
    twins = ([default_config(op, m_total, n, k, tp=tp, gather_small_m=False)]
             if base.ag_merge_local or base.rs_merge_rows else [])  # small m: per segment too
    knobs = list(space)
    m_local = m_total // tp
    scored, seen = [], {base, *twins}
    for i, values in enumerate(itertools.product(*(space[f] for f in knobs))):
        changes = {f: v for f, v in zip(knobs, values) if getattr(base, f) != v}
        if not changes:
            continue
        try:
            cfg = dataclasses.replace(base, **changes)
        except (ValueError, TypeError):
            continue
        spans = cfg.rs_merge_rows or (cfg.ag_merge_local and cfg.ag_merge_lead == 0)
        bm_max = max(64, 1 << ((m_total if spans else m_local) - 1).bit_length())
        if (cfg in seen or C.smem_bytes(cfg) > smem_limit or cfg.block_m > bm_max
                or cfg.block_n > max(64, 1 << (n - 1).bit_length())
                or cfg.block_k > max(32, 1 << (k - 1).bit_length())):
            continue
        if op == "ag" and "chunk_rows" in changes and cfg.chunk_rows >= m_local:
            continue
        seen.add(cfg)
        scored.append((len(changes), i, cfg, changes))
    per_knob, keyed = {}, []
    for d, i, cfg, changes in sorted(scored, key=lambda t: (t[0], t[1])):
        if d == 1:
            (knob,) = changes
            nth = per_knob[knob] = per_knob.get(knob, -1) + 1
            order = (C._VARIATION_ORDER.index(knob) if knob in C._VARIATION_ORDER
                     else len(C._VARIATION_ORDER))
            keyed.append(((1, nth, order, i), cfg))
        else:
            keyed.append(((d, 0, 0, i), cfg))
    return [base] + twins + [c for _, c in sorted(keyed, key=lambda t: t[0])]


@pytest.mark.parametrize("op, m, n, k, tp", [("ag", 4096, 14336, 4096, 2), ("rs", 128, 4096, 14336, 2),
                                             ("ag", 64, 14336, 4096, 8), ("rs", 8192, 12288, 24576, 8)])
def test_variations_by_distance_match_sorting_the_whole_product(op, m, n, k, tp):
    """Built one distance at a time and cut at ``max_candidates``, the list is the prefix of
    the whole product sorted (a space small enough to enumerate here, with a repeated value, a
    knob the default's value is missing from, and one that every config changes)."""
    space = {"block_m": (64, 128), "block_n": (32, 64, 128, 256), "block_k": (64, 128),
             "num_stages": (3, 3, 4), "epilogue_split": (1, 2), "chunk_rows": (256, 4096),
             "flatten": (True, False), "group_m": (2, 4)}
    full = _brute_force_variations(op, m, n, k, tp, space)
    assert len(full) > 50
    for cap in (1, 2, 5, 17, 40, len(full), 10**6):
        assert C.generate_candidates(op, m, n, k, tp, max_candidates=cap, space=space,
                                     seeds=()) == full[:cap], cap


def test_m_buckets_and_shapes():
    assert S.m_buckets([4096, 64, 64, 1024], 2) == [64, 1024, 4096]
    with pytest.raises(ValueError, match="multiples of tp=4"):
        S.m_buckets([64, 66], 4)
    assert S.parse_shape("AG+GEMM:14336:4096") == ("ag", 14336, 4096)
    for bad in ("ag:1", "xx:1:2", "rs:a:2", "rs:0:2"):
        with pytest.raises(ValueError):
            S.parse_shape(bad)


def test_plan_shapes_match_the_shipped_table_keys():
    args = S.parse_args(["--models", "llama3-8b", "gpt3-175b"])
    plan = S.plan_shapes(args, 2)
    assert plan == [("ag", 14336, 4096, "llama3-8b"), ("rs", 4096, 14336, "llama3-8b"),
                    ("ag", 24576, 12288, "gpt3-175b"), ("rs", 12288, 24576, "gpt3-175b")]
    args = S.parse_args(["--shapes", "rs:4096:7168", "--ops", "ag"])
    assert S.plan_shapes(args, 2) == [("rs", 4096, 7168, None)]


def test_model_config_file(tmp_path):
    p = tmp_path / "llama-tiny.json"
    p.write_text(json.dumps({"hidden_size": 256, "ffn_hidden_size": 512, "swiglu": True}))
    args = S.parse_args(["--model-config", str(p), "--ops", "ag"])
    assert S.plan_shapes(args, 2) == [("ag", 512, 256, "llama-tiny:fc1"), ("ag", 256, 256, "llama-tiny:fc2.dgrad")]
    p.write_text(json.dumps({"ffn_hidden_size": 512}))
    with pytest.raises(ValueError, match="hidden_size"):
        tp_gemms(str(p), 2)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_shipped_training_configs_plan_their_tp_gemms(tp):
    """The pretrain scripts' configs (Megatron argument names with '-') give the GEMMs that the
    training runs: QKV and fc1 (AG), proj and fc2 (RS, with fc2's true input width), and the
    output layer (AG) over the vocabulary as Megatron pads it (a multiple of 128 x tp)."""
    padded = {2: 128256, 4: 128512, 8: 129024}[tp]  # Llama-3's 128256 tokens
    llama = tp_gemms(os.path.join(REPO, "configs", "llama3_8b_16l.json"), tp)
    assert [(g.op, g.n, g.k) for g in llama] == [
        ("ag", (32 + 2 * 8) * 128 // tp, 4096), ("rs", 4096, 4096 // tp),
        ("ag", 2 * 14336 // tp, 4096), ("rs", 4096, 14336 // tp), ("ag", padded // tp, 4096)]
    assert [g.label for g in llama] == ["llama3_8b_16l:" + x
                                        for x in ("qkv", "proj", "fc1", "fc2", "output")]
    gpt = tp_gemms(os.path.join(REPO, "configs", "gpt3_175b_4l.json"), tp)
    padded = {2: 50432, 4: 50688, 8: 51200}[tp]  # GPT-2's 50257 tokens
    assert [(g.op, g.n, g.k) for g in gpt] == [
        ("ag", 3 * 12288 // tp, 12288), ("rs", 12288, 12288 // tp),
        ("ag", 49152 // tp, 12288), ("rs", 12288, 49152 // tp), ("ag", padded // tp, 12288)]
    # backward: each linear's data gradient is the reverse op with n and k swapped
    both = tp_gemms(os.path.join(REPO, "configs", "llama3_8b_16l.json"), tp, backward=True)
    assert both[:5] == llama
    assert [(g.op, g.n, g.k, g.label) for g in both[5:]] == [
        ("rs" if g.op == "ag" else "ag", g.k, g.n, g.label + ".dgrad") for g in llama]
    args = S.parse_args(["--model-config", os.path.join(REPO, "configs", "llama3_8b_16l.json")])
    assert [(op, n, k) for op, n, k, _ in S.plan_shapes(args, tp)] == [(g.op, g.n, g.k) for g in both]
    assert tokens_per_microbatch(os.path.join(REPO, "configs", "llama3_8b_16l.json")) == 4096


def test_model_config_errors_name_the_file_and_field(tmp_path):
    p = tmp_path / "odd.json"
    p.write_text(json.dumps({"hidden-size": 100, "num-attention-heads": 3}))
    with pytest.raises(ValueError, match="odd.json: hidden_size = 100 is not a multiple"):
        tp_gemms(str(p), 2)
    p.write_text(json.dumps({"hidden-size": 96, "num-attention-heads": 6, "ffn-hidden-size": 99}))
    with pytest.raises(ValueError, match=r"fc1 width \(from ffn_hidden_size\) = 99 is not divisible by TP = 2"):
        tp_gemms(str(p), 2)
    p.write_text(json.dumps({"hidden-size": 96, "num-attention-heads": 6, "group-query-attention": True,
                             "num-query-groups": 4}))
    with pytest.raises(ValueError, match="not a multiple of num_query_groups"):
        tp_gemms(str(p), 2)


def test_tune_cli_arg_parsing():
    a = S.parse_args([])
    assert a.ops == ["ag", "rs"] and a.dtype == "bf16" and a.m is None and a.m_set is None
    assert S.resolve_ms(a, 2) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    a = S.parse_args(["--ops", "GEMM+RS", "--m", "4096", "1024", "--dtype", "fp16", "--out", "x.json",
                      "--max-candidates", "8", "--top", "2", "--trials", "3", "--no-merge"])
    assert a.ops == ["rs"] and S.resolve_ms(a, 2) == [1024, 4096] and a.dtype == "fp16"
    assert (a.out, a.max_candidates, a.top, a.trials, a.no_merge) == ("x.json", 8, 2, 3, True)
    assert S.resolve_ms(S.parse_args(["--m-set", "small"]), 2) == [64, 128, 256, 512]
    for bad in (["--trials", "0"], ["--ops", "allreduce"], ["--shapes", "ag:1"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            S.parse_args(bad)


def test_model_config_buckets_default_to_its_tokens_per_microbatch(capsys):
    """Like bench --model-config and plan, tune --model-config without --ms tunes the config's
    seq-length x micro-batch (llama3_8b_16l: 4096); an explicit --m-set or --ms still wins."""
    llama = os.path.join(REPO, "configs", "llama3_8b_16l.json")
    assert S.resolve_ms(S.parse_args(["--model-config", llama]), 2) == [tokens_per_microbatch(llama)] == [4096]
    assert S.resolve_ms(S.parse_args(["--model-config", llama, "--m-set", "small"]), 2) == [64, 128, 256, 512]
    assert S.resolve_ms(S.parse_args(["--model-config", llama, "--ms", "1024"]), 2) == [1024]
    assert cli.main(["tune", "--dry-run", "--tp", "2", "--model-config", llama, "--max-candidates", "2"]) == 0
    out = capsys.readouterr().out
    assert "x 1 m-buckets" in out and "m=4096" in out and "m=64 " not in out


def test_help_states_the_real_defaults(capsys):
    with pytest.raises(SystemExit):
        S.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "both (all, the default)" in text
    assert "replaces the untuned config" in text and "replaces the default config" not in text


def test_dry_run_and_cli_dispatch(capsys):
    assert cli.main(["tune", "--dry-run", "--tp", "2", "--models", "llama3-8b", "--m", "64", "4096",
                     "--max-candidates", "5"]) == 0
    out = capsys.readouterr().out
    assert "ag n=14336 k=4096 m=64  (llama3-8b): 5 candidates" in out
    assert "2 shapes x 2 m-buckets, 20 candidate runs, TP=2, bf16" in out
    with pytest.raises(SystemExit) as ei:
        cli.main(["tune", "--help"])
    assert ei.value.code == 0
    assert "--max-candidates" in capsys.readouterr().out


def test_tune_without_gpus_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "--models", "llama3-8b"]) == 2
    assert "needs NVIDIA GPUs" in capsys.readouterr().err


def test_simple_progress_bar():
    buf = io.StringIO()
    bar = SimpleProgress(4, "tune ", stream=buf, width=8)
    bar.update(1)
    bar.set_postfix_str("ag m=64")
    bar.update(2)
    bar.write("done one")
    bar.close()
    text = buf.getvalue()
    assert "[##......] 1/4" in text and "[######..] 3/4  75% ag m=64" in text and "done one\n" in text
    assert text.endswith("\n")
    bar.update(10)
    assert bar.n == 4
    quiet = progress(3, enabled=False)
    assert isinstance(quiet, NullProgress)
    # --no-progress: each entry's line, nothing else; other ranks: nothing at all
    for messages, want in ((True, "ag n=1 k=2 m=3: flux 0.1 ms\n"), (False, "")):
        buf = io.StringIO()
        quiet = NullProgress(3, "tune ", stream=buf, messages=messages)
        quiet.update(1)
        quiet.set_postfix_str("ag m=3")
        quiet.write("ag n=1 k=2 m=3: flux 0.1 ms")
        quiet.close()
        assert buf.getvalue() == want
    assert isinstance(progress(3, force_simple=True), SimpleProgress)


def test_a_capped_list_varies_the_comm_knobs_first():
    """Single-knob variations go breadth-first, comm knobs first: 12 candidates for a large AG
    entry try a smaller chunk and the other side-stream priority (with 8 and the earlier
    product order, no tuned entry ever did)."""
    c = C.generate_candidates("ag", 8192, 7168, 4096, 2, max_candidates=12)
    base = c[0]
    singles = [f for x in c[1:] for f in C.SEARCH_SPACE
               if getattr(x, f) != getattr(base, f)
               and sum(getattr(x, g) != getattr(base, g) for g in C.SEARCH_SPACE) == 1]
    assert {"chunk_rows", "comm_priority"} <= set(singles)
    assert len(singles) == len(set(singles))  # one value of each knob before a second one


def test_comm_priority_is_an_ag_knob_only():
    ag = C.generate_candidates("ag", 4096, 14336, 4096, 2, max_candidates=10**6)
    rs = C.generate_candidates("rs", 4096, 4096, 14336, 2, max_candidates=10**6)
    assert {c.comm_priority for c in ag} == {-1, 0}
    assert {c.comm_priority for c in rs} == {-1}
    assert default_config("ag", 4096, 14336, 4096).comm_priority == -1
    for bad in (1, -6, 0.5):
        with pytest.raises(ValueError, match="comm_priority"):
            GemmConfig(comm_priority=bad)
    # tables written before the knob existed load with the default
    d = default_config("ag", 4096, 14336, 4096).to_dict()
    d.pop("comm_priority")
    assert GemmConfig.from_dict(d).comm_priority == -1


def test_spread_reduce_is_an_rs_knob_on_by_default_from_tp_8():
    """GEMM+RS spreads its reduction over the grid by default at TP >= 8 only (measured comm
    off: config.default_config); the tuner tries both ways for RS entries and never for AG
    ones."""
    assert default_config("rs", 1024, 4096, 3584, tp=8).rs_spread_reduce is True
    assert default_config("rs", 256, 4096, 3584, tp=16).rs_spread_reduce is True
    for tp in (None, 1, 2, 4):
        assert default_config("rs", 1024, 4096, 7168, tp=tp).rs_spread_reduce is False
    assert default_config("ag", 1024, 14336, 4096, tp=8).rs_spread_reduce is False
    rs = C.generate_candidates("rs", 4096, 4096, 14336, 2, max_candidates=10**6)
    ag = C.generate_candidates("ag", 4096, 14336, 4096, 8, max_candidates=10**6)
    assert {c.rs_spread_reduce for c in rs} == {False, True}
    assert {c.rs_spread_reduce for c in ag} == {False}
    assert C.generate_candidates("rs", 4096, 4096, 14336, 8, max_candidates=1)[0].rs_spread_reduce
    with pytest.raises(ValueError, match="rs_spread_reduce"):
        GemmConfig(rs_spread_reduce=1)
    d = default_config("rs", 4096, 4096, 14336).to_dict()
    d.pop("rs_spread_reduce")  # tables written before the knob existed load without it
    assert GemmConfig.from_dict(d).rs_spread_reduce is False


def test_pick_winner_keeps_the_default_unless_beaten_by_the_margin():
    from megatron_flux.tools.tune.search import pick_winner

    meds = {"c0": 1.000, "c1": 0.995, "c2": 1.02}
    assert pick_winner(meds, "c0", 0.01) == "c0"  # 0.5 % faster: noise, keep the default
    assert pick_winner(meds, "c0", 0.0) == "c1"  # no margin: plain minimum
    assert pick_winner({"c0": 1.0, "c1": 0.98}, "c0", 0.01) == "c1"  # 2 % faster wins
    assert pick_winner({"c1": 0.99, "c2": 0.99}, "c0", 0.01) == "c1"  # default absent: minimum, ties by name
    with pytest.raises(ValueError):
        pick_winner({}, "c0", 0.01)


def test_min_gain_is_validated():
    from megatron_flux.tools.tune.search import parse_args

    assert parse_args([]).min_gain == 0.01
    assert parse_args(["--min-gain", "0"]).min_gain == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--min-gain", "1.5"])


def test_every_config_knob_is_searched_or_says_why_not():
    fields = {f.name for f in dataclasses.fields(GemmConfig)}
    assert fields == set(C.SEARCH_SPACE) | set(C.NOT_SEARCHED)
    assert not set(C.SEARCH_SPACE) & set(C.NOT_SEARCHED)
    assert all(isinstance(why, str) and why for why in C.NOT_SEARCHED.values())
    for m in (1024, 8192):  # the candidates keep the default's value of an unsearched knob
        cands = C.generate_candidates("rs", m, 4096, 14336, 2, max_candidates=64)
        assert all(c.flatten_consume == cands[0].flatten_consume for c in cands)


def test_gemm_rs_tries_both_forms_of_its_warp_specialized_kernel_at_every_k():
    """Every GEMM+RS entry, short K or long, gets the warp-specialized kernel's three seeds
    right after the common seeds, so a capped list keeps them: the ping-pong with SM and with
    copy-engine pushes, and the cooperative form (128x256, 8 warps) with SM pushes; AG+GEMM
    never gets the RS kernel's knob."""
    for k in (2048, 4096, 14336, 18432):
        c = C.generate_candidates("rs", 8192, 4096, k, 4, max_candidates=13)
        ws = [x for x in c if x.rs_warp_specialized]
        assert [(x.block_m, x.block_n, x.num_stages, x.num_warps, x.rs_copy_engine) for x in ws] == \
            [(128, 128, 5, 4, False), (128, 128, 5, 4, True), (128, 256, 3, 8, False)], k
        assert all(c.index(x) <= 3 + len(C.SEED_CONFIGS) + 2 for x in ws)
    c = C.generate_candidates("ag", 8192, 4096, 2048, 2, max_candidates=10**6)
    assert not any(x.rs_warp_specialized for x in c)
    assert C.seeds_for("GEMM+RS") == C.seeds_for("rs") == C.SEED_CONFIGS + C.RS_SEEDS


def test_ag_gemm_tries_both_forms_of_its_warp_specialized_kernel():
    """Every AG+GEMM entry gets the warp-specialized seeds right after the common seeds, one
    per form (ping-pong 128x128/5 with 4 warps, cooperative 128x256/3 with 8); GEMM+RS never
    gets the AG kernel's knob."""
    assert C.seeds_for("ag") == C.seeds_for("AG+GEMM") == C.SEED_CONFIGS + C.AG_SEEDS
    for n, k in ((2048, 4096), (14336, 4096), (28672, 8192)):
        c = C.generate_candidates("ag", 8192, n, k, 2, max_candidates=64)
        ws = [x for x in c if x.ag_warp_specialized]
        assert [(x.block_n, x.num_stages, x.num_warps) for x in ws] == [(128, 5, 4), (256, 3, 8)], (n, k)
        for x in ws:
            assert c.index(x) <= 3 + len(C.SEED_CONFIGS)
            assert x.chunk_rows == c[0].chunk_rows and x.comm_priority == c[0].comm_priority
    for k in (2048, 14336):
        assert not any(x.ag_warp_specialized
                       for x in C.generate_candidates("rs", 8192, 4096, k, 2, max_candidates=10**6))


def test_hopper_search_pins_knobs_that_compile_to_the_same_kernel():
    """On sm_90 ``warp_specialize`` changes no instruction (``SAME_CODE_BELOW``), so the
    tuner's space pins it: no candidate (seeds included) turns it on, and the seed that
    did becomes its one-store twin instead of a duplicate timing. Blackwell and an unknown GPU
    keep it."""
    space, pinned = C.search_space_for((9, 0))
    assert space["warp_specialize"] == (False,) and "warp_specialize" in pinned
    assert "sm_90" in pinned["warp_specialize"]
    for op in ("ag", "rs"):
        c = C.generate_candidates(op, 4096, 14336, 4096, 2, max_candidates=10**6, space=space)
        assert not any(x.warp_specialize for x in c)
        assert len(set(c)) == len(c)
        assert any(x.block_n == 256 and x.epilogue_split == 1 and x.num_warps == 8 for x in c)
    for cap in ((10, 0), None):
        space, pinned = C.search_space_for(cap)
        assert space == C.SEARCH_SPACE and not pinned
        c = C.generate_candidates("ag", 4096, 14336, 4096, 2, max_candidates=10**6, space=space)
        assert any(x.warp_specialize for x in c)


def test_tiles_spanning_segments_may_be_as_tall_as_every_ranks_rows():
    """At m = 128 on 2 ranks a segment is 64 rows. A per-segment candidate keeps 64-row tiles;
    one whose tile space spans segments (AG+GEMM gathered first, merged GEMM+RS rows) may take
    128-row tiles, which cover both ranks' rows. (The per-segment default is a candidate
    whatever its tile.)"""
    for op in ("ag", "rs"):
        c = C.generate_candidates(op, 128, 14336, 4096, 2, max_candidates=10**6)
        twin = default_config(op, 128, 14336, 4096, tp=2, gather_small_m=False)
        spans = [x.rs_merge_rows or (x.ag_merge_local and x.ag_merge_lead == 0) for x in c]
        assert any(x.block_m == 128 for x, span in zip(c, spans) if span), op
        assert all(x.block_m == 64 for x, span in zip(c, spans) if not span and x != twin), op


def test_small_m_gemm_rs_also_tries_merged_rows_on_the_gluon_kernel():
    """Where the GEMM+RS default merges every rank's rows (small m), the candidates include the
    per-segment default and, first among the seeds, merged rows on the warp-specialized kernel
    (up to m = 512, where the default no longer merges); not at larger m, nor when the caller
    gives the seeds."""
    c = C.generate_candidates("rs", 128, 4096, 14336, 2, max_candidates=8)
    assert c[0].rs_merge_rows and not c[1].rs_merge_rows
    assert c[2:3] == [dataclasses.replace(c[0], **seed) for seed in C.RS_MERGED_SEEDS]
    # its 128-row tile spans both ranks' 64 rows (the per-segment bound, 64 rows, would drop it)
    assert c[2].rs_warp_specialized and c[2].rs_merge_rows and c[2].block_m == 128
    # at m = 512 the default runs per segment: the seed names its merged-rows knobs and still
    # applies
    c = C.generate_candidates("rs", 512, 12288, 24576, 2, max_candidates=8)
    assert not c[0].rs_merge_rows
    assert any(x.rs_warp_specialized and x.rs_merge_rows and x.rs_spread_reduce for x in c)
    assert not any(x.rs_merge_rows
                   for x in C.generate_candidates("rs", 1024, 12288, 24576, 2, max_candidates=8))
    # explicit seeds are the seeds: nothing is added to them
    assert not any(x.rs_warp_specialized
                   for x in C.generate_candidates("rs", 128, 4096, 14336, 2, seeds=()))


def test_every_tune_option_survives_torchruns_own_parser():
    """``torchrun ... megatron-flux tune`` parses the whole command line with torchrun's parser
    first, which rejects an option that abbreviates several of its own (``--m``: "ambiguous
    option") or takes one that abbreviates one of them: each primary spelling, the one help,
    docs and ``megatron-flux plan --offer`` print, must reach the tuner."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    for action in S.build_parser()._actions:
        opt = next((o for o in action.option_strings if o.startswith("--")), None)
        if opt is None:
            continue
        ns = torchrun.parse_args(["--nproc-per-node", "2", "--no-python", "megatron-flux", "tune", opt, "1"])
        assert ns.training_script_args == ["tune", opt, "1"], opt


def test_the_table_source_is_the_tune_command_once(monkeypatch):
    """The table's ``source`` is built from the arguments ``main`` parses: ``megatron-flux tune
    --ms 4096`` whether the console script (``sys.argv`` holds the subcommand) or ``python -m
    megatron_flux.tools.tune`` ran it."""
    seen = []

    def parse(argv):
        seen.append(S.table_source(argv))
        raise SystemExit(0)

    monkeypatch.setattr(S, "parse_args", parse)
    monkeypatch.setattr(sys, "argv", ["/usr/bin/megatron-flux", "tune", "--ms", "4096"])
    with pytest.raises(SystemExit):
        cli.main(sys.argv[1:])
    monkeypatch.setattr(sys, "argv", ["/x/megatron_flux/tools/tune/__main__.py", "--ms", "4096"])
    with pytest.raises(SystemExit):
        S.main()
    assert seen == ["megatron-flux tune --ms 4096"] * 2


def test_the_tables_configs_come_right_after_the_default_once_each():
    base = default_config("rs", 4096, 6656, 8960, tp=2)
    mine = dataclasses.replace(base, block_n=128, num_warps=4)
    other = dataclasses.replace(base, num_stages=4)
    cands = C.generate_candidates("rs", 4096, 6656, 8960, 2, max_candidates=6,
                                  from_tables=(mine, base, other, mine))
    assert cands[:3] == [base, mine, other] and len(cands) == 6 and len(set(cands)) == 6
    # they count toward --max-candidates, as the default does
    assert C.generate_candidates("rs", 4096, 6656, 8960, 2, max_candidates=2,
                                 from_tables=(mine, other)) == [base, mine]


def test_a_tune_starts_from_what_the_shipped_tables_run_untuned():
    """A shape no table lists (LLaMA-1 30B's fc2 at TP 2): the incumbent is the lookup's own
    config, a nearby entry's rather than the default; a shape the table holds: its entry; a
    machine without tables: the default."""
    import torch

    from megatron_flux.tuning import provider, registry

    registry.reset()
    ident = ("NVIDIA H200", 132)
    inc = S.untuned_config("rs", 4096, 6656, 8960, torch.bfloat16, 2, ident)
    assert tuple(inc) == provider.kernel_config("rs", 4096, 6656, 8960, torch.bfloat16, 2, ident)
    assert inc.source.startswith("nearest entry")
    assert inc.config != default_config("rs", 4096, 6656, 8960, tp=2)
    assert S.untuned_config("rs", 4096, 4096, 7168, torch.bfloat16, 2, ident).source == "table (m=4096)"
    none = S.untuned_config("rs", 4096, 6656, 8960, torch.bfloat16, 2, ("NVIDIA B200", 148))
    assert none.source.endswith("(else default)")  # the ping-pong rule, on the default
    assert none.config == dataclasses.replace(default_config("rs", 4096, 6656, 8960, tp=2),
                                              **dict(E.PINGPONG_RS, rs_copy_engine=True))
    # (copy-engine pushes: TP 2 from m = 2048)
    ag = S.untuned_config("ag", 4096, 6656, 8960, torch.bfloat16, 2, ("NVIDIA B200", 148))
    assert ag == S.Incumbent(default_config("ag", 4096, 6656, 8960, tp=2), "default")


def test_a_tune_waits_longer_than_training_but_keeps_a_longer_bound():
    """A candidate's first call compiles its kernels on each rank; a rank that compiles longer
    pushes later, so the tuner's waits allow more polls than training's (a user's bound above
    that is kept)."""
    from megatron_flux.options import FluxOptions, get_options, set_options

    assert S.TUNE_MAX_SPINS > get_options().max_spins
    assert S.tune_options().max_spins == S.TUNE_MAX_SPINS
    assert S.tune_options().allow_several_queues  # no other rank-spanning kernel beside it
    set_options(FluxOptions(max_spins=1 << 30))
    try:
        assert S.tune_options().max_spins == 1 << 30
    finally:
        set_options(None)
