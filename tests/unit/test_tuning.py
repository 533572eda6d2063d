"""CPU tests of the tuning tables: keys, nearest bucket, lookup, fallback, validation, auto."""

import copy
import io
import json
import os

import pytest
import torch

from megatron_flux import tuning as T
from megatron_flux.kernels.config import GemmConfig, default_config
from megatron_flux.kernels.version import KERNEL_VERSION
from megatron_flux.backends import auto
from megatron_flux.tuning import registry, schema
from megatron_flux.tuning.keys import dtype_key, nearest_bucket, normalize_gpu_name, normalize_op

from helpers import paths

H200 = ("NVIDIA H200", 132)
REPO = str(paths.REPO)
#: Each shipped table, regenerated from its committed runs: (GPU, TP, the tuning run, the steps
#: applied to it in order: ("confirm", bench) = tuning.confirm with a benchmark made with the
#: table, a list = tuning.confirm.confirm_repeats of runs taken jointly; ("adopt", [A/B runs]) =
#: tuning.adopt of an interleaved flux vs flux_variant A/B; ("add", [tuning runs]) = tuning.add
#: of a later tune's entries for shapes the table lacks; ("retune", tuning run) = tuning.retune:
#: a re-search of shapes the table holds replaces them; ("kernel_version", v) = the table
#: stamped with the kernel version its times were measured with, megatron_flux.kernels.version).
#: docs/tuning.md lists the same files.
R = "benchmarks/results/"
SHIPPED = {
    "h200-sm132-tp2-bf16.json": ("h200", 2, R + "tune-h200x2-2026-11-23.json", [
        # the copy-engine GEMM+RS where every A/B run timed it faster
        ("adopt", [R + f"ab-rs-copy-engine-h200x2-2026-11-24-{run}.json"
                   for run in ("large-conn1", "large-conndefault", "small-conn1", "train-shapes-conn1")]),
        # the Gluon ping-pong where both A/B runs timed it faster, then the m >= 1024 benchmark
        # (three runs, both connection settings) and the small-m grid made with the adopted
        # configs, taken jointly; they cover all 48 grid entries, so earlier confirmations of
        # the tuning run leave no trace in the table
        ("adopt", [R + f"ab-gluon-pingpong-h200x2-2026-11-26-conn1-run{run}.json" for run in (1, 2)]),
        ("confirm", [R + f"bench-h200x2-2026-11-26-s27-{run}.json" for run in ("conn1-run1", "conndefault",
                                                                            "conn1-run2")]
         + [R + "bench-small-h200x2-2026-11-26-s27-conn1.json"]),
        ("kernel_version", 1),
        # eight models outside the grid, benchmarked with the table (four, then four more with
        # the first four added): untuned entries that give auto's estimate more shape families
        # (tools.tune.extend; both ran the nearest entries' configs as they stand)
        ("extend", [R + "bench-h200x2-2026-11-27-unseen.json", R + "bench-h200x2-2026-11-27-unseen-b.json"]),
        # five more, both benchmarked with the table as extended above and the wave rule
        # (estimate.wave_aware_config)
        ("extend-waves", [R + "bench-h200x2-2026-11-28-unseen-c.json", R + "bench-h200x2-2026-11-28-unseen-d.json"]),
        # the training config's GEMMs at micro-batch 2 (m = 8192) and its output layer, tuned
        # (tools.tune.add: entries the table held keep theirs), then confirmed with a benchmark
        # of all ten of its shapes at m = 4096 and 8192 made with the table so extended
        ("add", [R + "tune-h200x2-2026-11-28-train-shapes.json"]),
        ("confirm", [R + "bench-h200x2-2026-11-28-train-shapes.json"]),
        # the Gluon ping-pong GEMM+RS against six models' entries at m = 1024-4096, where the
        # A/B timed it faster than their (mostly 128x256) configs
        ("adopt", [R + "ab-rs-pingpong-h200x2-2026-11-28.json"]),
        # the ping-pong with its split tail (stream_k=1) against the entries' configs at
        # m = 1024-2048, nine models the table holds and five it does not (only the former
        # have entries to adopt into)
        ("adopt", [R + "ab-rs-split-h200x2-2026-11-28-unseen.json",
                   R + "ab-rs-split-h200x2-2026-11-28.json"]),
        # and with copy-engine pushes, on two entries whose 128x256 configs measured near or
        # above NCCL's time (falcon-7b m = 4096, yi-34b m = 4096; m = 8192 beside them)
        ("adopt", [R + "ab-rs-split-ce-h200x2-2026-11-29-outliers.json"]),
    ]),
    "h200-sm132-tp4-bf16.json": ("h200", 4, R + "tune-h200x4-2026-11-22.json", [
        ("confirm", R + "bench-h200x4-2026-11-22.json"),
        # tuned and timed with kernel version 0; the current kernels timed its configs on the
        # whole grid (m = 256-8192, then the small m), and eight models outside the grid ran
        # with their borrowed configs (stream-K tail on)
        ("retime", [R + "bench-h200x4-2026-11-27.json", R + "bench-small-h200x4-2026-11-27.json"]),
        ("extend-transplanted", [R + "bench-h200x4-2026-11-27-unseen.json"]),
        # the training config's ten TP GEMMs at m = 4096 and 8192, tuned with the current
        # kernels from what each ran untuned (tools.tune.add: the four the grid shares keep
        # theirs), then confirmed with a benchmark of all twenty made with the table so extended
        ("add", [R + "tune-h200x4-2026-11-28-train-shapes.json"]),
        ("confirm", R + "bench-h200x4-2026-11-28-train-shapes.json"),
        # the grid searched again with the current kernels, from what each entry ran
        # (tools.tune.retune: its 48 entries replace the grid's), then confirmed with the whole
        # grid's benchmark (m = 64-8192) made with the re-searched configs
        ("retune", R + "tune-h200x4-2026-11-28-grid.json"),
        ("confirm", R + "bench-h200x4-2026-11-28-grid-retuned.json"),
        # the ping-pong Gluon GEMM+RS (which that search tried only at short K) where an A/B
        # over the grid's m >= 1024 timed it faster than the re-searched configs
        ("adopt", [R + "ab-rs-pingpong-h200x4-2026-11-28-grid.json"]),
        # and on the eight models the table holds with borrowed configs (m = 1024-4096)
        ("adopt", [R + "ab-rs-pingpong-h200x4-2026-11-28-extended.json"]),
    ]),
    # 2xH100: the m >= 1024 grid and the small m tuned into one table, then three benchmarks
    # made with it, taken jointly (a list: tuning.confirm.confirm_repeats)
    "h100-80gb-hbm3-sm132-tp2-bf16.json": ("h100-80gb-hbm3", 2, R + "tune-h100x2-2026-11-26.json", [
        ("confirm", [R + "bench-h100x2-2026-11-26-s27-all-run1.json",
                     R + "bench-h100x2-2026-11-26-s27-all-run2.json",
                     R + "bench-h100x2-2026-11-26-s27-conn1.json"]),
        # the Gluon ping-pong on llama3-8b where it beat the table config by more than the
        # same-config control in all three A/B runs (AG m = 2048 / 4096, RS m = 2048)
        ("adopt", [R + f"ab-gluon-pingpong-h100x2-2026-11-26-s32-llama8b-run{run}.json"
                   for run in (1, 2, 3)]),
        ("kernel_version", 1),
    ]),
}


def _comparable(table) -> dict:
    """``schema.table_to_dict(table)`` with ``search.not_searched`` reduced to its knob names:
    that field is the tuner's prose about why it leaves a knob alone, copied from the tuning
    run, not something a run measured, so its wording may be edited apart from the runs."""
    d = schema.table_to_dict(table)
    search = d.get("search")
    if isinstance(search, dict) and isinstance(search.get("not_searched"), dict):
        d = dict(d, search=dict(search, not_searched=sorted(search["not_searched"])))
    return d


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(registry.ENV_FILES, raising=False)
    monkeypatch.delenv(registry.ENV_SHIPPED, raising=False)
    T.reset()
    yield
    T.reset()


def table_obj(**over):
    cfg = GemmConfig(128, 128, 64, 4, 4, 8).to_dict()
    obj = {
        "format": "megatron-flux-tuning", "version": 1,
        "gpu": {"name": "NVIDIA Test GPU", "sms": 100}, "tp": 2, "dtype": "bf16", "source": "unit test",
        "kernel_version": KERNEL_VERSION,
        "entries": [
            {"op": "ag", "n": 512, "k": 256, "m": 64, "config": dict(cfg, block_n=64), "tuned": True,
             "flux_ms": 2.0, "nccl_ms": 1.0},
            {"op": "ag", "n": 512, "k": 256, "m": 1024, "config": dict(cfg, block_m=64), "tuned": True,
             "flux_ms": 1.0, "nccl_ms": 2.0},
            {"op": "rs", "n": 256, "k": 256, "m": 256, "config": {"num_stages": 2}, "tuned": False},
        ],
    }
    obj.update(over)
    return obj


def write(tmp_path, obj, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


TEST_GPU = ("NVIDIA Test GPU", 100)


# ---------------------------------------------------------------- keys
def test_gpu_name_normalisation():
    assert normalize_gpu_name("NVIDIA H200") == "h200"
    assert normalize_gpu_name("  nvidia  H100 80GB HBM3 ") == "h100-80gb-hbm3"
    assert normalize_gpu_name("NVIDIA H200 NVL") == "h200-nvl"
    with pytest.raises(ValueError):
        normalize_gpu_name("")


def test_dtype_and_op_keys():
    assert dtype_key(torch.bfloat16) == "bf16" and dtype_key(torch.float16) == "fp16"
    assert dtype_key("bfloat16") == "bf16" and dtype_key(torch.float32) == "fp32"
    with pytest.raises(ValueError):
        dtype_key(torch.int8)
    assert normalize_op("AG+GEMM") == "ag" and normalize_op("GEMM+RS") == "rs" and normalize_op("rs") == "rs"
    with pytest.raises(ValueError):
        normalize_op("allreduce")


def test_shape_key_has_every_field():
    key = T.provider.shape_key("AG+GEMM", 512, 256, torch.bfloat16, 2, ("NVIDIA H200", 132))
    assert key == T.ShapeKey("h200", 132, 2, "bf16", "ag", 512, 256)


# ---------------------------------------------------------------- nearest bucket
@pytest.mark.parametrize("m,want", [
    (64, 64), (1, 64), (100, 64), (3000, 4096), (2896, 2048), (2897, 4096), (1024, 1024), (1448, 1024),
    (1449, 2048), (100000, 8192), (32, 64),
])
def test_nearest_bucket_log2(m, want):
    assert nearest_bucket(m, [8192, 64, 1024, 2048, 4096]) == want


def test_nearest_bucket_tie_goes_to_smaller_and_empty_is_none():
    assert nearest_bucket(32, [16, 64]) == 16
    assert nearest_bucket(32, [64, 16]) == 16
    assert nearest_bucket(5, []) is None


# ---------------------------------------------------------------- lookup and fallback
def test_lookup_nearest_bucket_and_config(tmp_path):
    T.use_table_files([write(tmp_path, table_obj())])
    prov = T.TableConfigProvider()
    cfg = prov("ag", 64, 512, 256, dtype=torch.bfloat16, tp=2, device=TEST_GPU)
    assert cfg.block_n == 64
    assert prov("ag", 700, 512, 256, dtype=torch.bfloat16, tp=2, device=TEST_GPU).block_m == 64  # -> 1024
    assert prov("ag", 200, 512, 256, dtype=torch.bfloat16, tp=2, device=TEST_GPU).block_n == 64  # -> 64
    # missing config fields come from default_config for that shape
    rs = prov("rs", 256, 256, 256, dtype=torch.bfloat16, tp=2, device=TEST_GPU)
    assert rs == GemmConfig.from_dict(dict(default_config("rs", 256, 256, 256).to_dict(), num_stages=2))


def test_missing_config_fields_take_the_default_at_the_tables_tp():
    """A field a table entry does not name takes ``default_config``'s value at the table's TP:
    the spread GEMM+RS reduction is on by default from TP 8, so a TP 8 entry gets it."""
    from megatron_flux.tuning import schema

    for tp, spread in ((2, False), (4, False), (8, True)):
        t = schema.validate_table(table_obj(tp=tp), "mem")
        rs = next(e for e in t.entries if e.op == "rs")
        assert rs.config.rs_spread_reduce is spread and rs.config.num_stages == 2


def test_small_m_defaults_merge_the_rows_but_old_table_entries_keep_their_schedule():
    """At m <= 512 and TP >= 2 the AG default waits for every peer and runs the gathered rows
    as one operand (merged local rows, lead 0), with 64-row tiles up to m = 128, and up to
    m = 256 the RS default runs every rank's rows as one tile space (``rs_merge_rows``, spread
    reduction, vector pushes); not at larger m or without a TP. A table entry that names no schedule knob
    keeps the per-segment one it was measured with (the shipped TP 4 table has such entries)."""
    from megatron_flux.tuning import schema

    for m, tp in ((64, 2), (256, 8)):
        rs = default_config("rs", m, 4096, 14336, tp=tp)
        assert rs.rs_merge_rows and rs.rs_spread_reduce and not rs.rs_tma_push, (m, tp)
        assert not default_config("rs", m, 4096, 14336, tp=tp, gather_small_m=False).rs_merge_rows
    assert not default_config("rs", 512, 4096, 14336, tp=2).rs_merge_rows
    # the merged tile loads the busiest of 132 SMs least: narrow at small n, taller at larger m
    for m, n, tile in ((64, 12288, (64, 128)), (64, 8192, (64, 64)), (64, 4096, (64, 32)),
                       (128, 4096, (64, 64)), (128, 8192, (64, 128)), (128, 12288, (128, 128)),
                       (256, 4096, (64, 128)), (256, 8192, (128, 128)), (256, 12288, (128, 256))):
        cfg = default_config("rs", m, n, 14336, tp=2)
        assert (cfg.block_m, cfg.block_n) == tile, (m, n)
        assert cfg.num_warps == (8 if cfg.block_m == 128 else 4)
    with pytest.raises(ValueError, match="rs_merge_rows"):
        GemmConfig(rs_merge_rows=True)  # TMA pushes, no spread reduction

    for m, tp, block_m in ((64, 2, 64), (128, 8, 64), (256, 2, 128), (512, 4, 128)):
        cfg = default_config("ag", m, 14336, 4096, tp=tp)
        assert cfg.ag_merge_local and cfg.ag_merge_lead == 0 and cfg.block_m == block_m, (m, tp)
        assert not default_config("ag", m, 14336, 4096, tp=tp, gather_small_m=False).ag_merge_local
    # the gathered rows' tile at m <= 128 (config.gathered_ag_tile): 64x256 where the busiest
    # SM streams fewer columns through it, else 64x128 (the grid's TP 2 shapes, per-rank n)
    for m, n, block_n in ((64, 24576, 256), (64, 28672, 256), (64, 14336, 128),
                          (128, 24576, 128), (128, 28672, 256), (128, 14336, 256),
                          (256, 24576, 256)):
        cfg = default_config("ag", m, n, 4096, tp=2)
        assert (cfg.block_m, cfg.block_n) == (64 if m <= 128 else 128, block_n), (m, n)
    for op, m, tp in (("ag", 1024, 2), ("ag", 64, None), ("ag", 64, 1), ("rs", 64, 2)):
        assert not default_config(op, m, 14336, 4096, tp=tp).ag_merge_local, (op, m, tp)
    for op, m, tp in (("rs", 64, None), ("rs", 64, 1), ("ag", 64, 2)):
        assert not default_config(op, m, 14336, 4096, tp=tp).rs_merge_rows, (op, m, tp)
    obj = table_obj(tp=2)
    next(e for e in obj["entries"] if e["op"] == "ag" and e["m"] == 64)["config"] = {"block_n": 64}
    t = schema.validate_table(obj, "mem")
    cfg = next(e.config for e in t.entries if e.op == "ag" and e.m == 64)
    assert not cfg.ag_merge_local and cfg.stream_k == 1


def test_rs_default_splits_its_tail_but_old_table_entries_keep_their_schedule():
    """GEMM+RS's 128x256 default splits a small last wave along K (``stream_k=1``), except
    with the spread reduction (TP >= 8: no own tiles); the small-m defaults do not. A table
    entry that names no ``stream_k`` keeps 0: GEMM+RS had no stream-K when it was measured
    (kernel version 0; the shipped TP 4 table held such entries until its grid was searched
    again with the current kernels)."""
    from megatron_flux.tuning import schema

    assert default_config("rs", 8192, 12288, 24576, tp=2).stream_k == 1
    assert default_config("rs", 8192, 12288, 24576).stream_k == 1
    assert default_config("rs", 8192, 12288, 24576, tp=8).stream_k == 0  # spread reduction
    for m in (64, 512):
        assert default_config("rs", m, 12288, 24576, tp=2).stream_k == 0, m
    obj = table_obj(tp=2)
    entry = {"op": "rs", "n": 12288, "k": 24576, "m": 8192, "config": {"block_n": 256},
             "tuned": False}
    obj["entries"].append(entry)
    cfg = next(e.config for e in schema.validate_table(obj, "mem").entries
               if e.op == "rs" and e.m == 8192)
    assert cfg.block_n == 256 and cfg.stream_k == 0
    entry["config"] = {"block_n": 256, "stream_k": 1}
    cfg = next(e.config for e in schema.validate_table(obj, "mem").entries
               if e.op == "rs" and e.m == 8192)
    assert cfg.stream_k == 1
    shipped = schema.load_table(os.path.join(os.path.dirname(schema.__file__), "tables",
                                             "h200-sm132-tp4-bf16.json"))
    assert not [e for e in shipped.entries if e.notes.get("config_kernel_version") == 0]


@pytest.mark.parametrize("change", [
    dict(dtype=torch.float16), dict(n=1024), dict(k=128), dict(op="rs"), "no-context",
])
def test_shape_misses_fall_back_to_default_config(tmp_path, change):
    T.use_table_files([write(tmp_path, table_obj())])
    args = dict(op="ag", m=64, n=512, k=256, dtype=torch.bfloat16, tp=2, device=TEST_GPU)
    prov = T.TableConfigProvider()
    hit = prov(**{"m_total" if a == "m" else a: v for a, v in args.items()})
    assert hit != default_config("ag", 64, 512, 256)  # the table's block_n=64 config
    if change == "no-context":
        got = prov("ag", 64, 512, 256)
        args["tp"] = None
    else:
        args.update(change)
        got = prov(**{"m_total" if a == "m" else a: v for a, v in args.items()})
    assert got == default_config(args["op"], args["m"], args["n"], args["k"], tp=args["tp"])


def _shipped_tp2_entries():
    return T.load_table(os.path.join(registry.SHIPPED_DIR, "h200-sm132-tp2-bf16.json")).entries


@pytest.mark.parametrize("device,tp", [(("NVIDIA H100", 132), 2), (("NVIDIA H200", 114), 2), (H200, 8)])
def test_machine_misses_fall_back_without_user_tables(device, tp):
    """The shipped H200/132 SMs/TP=2 table does not apply to another GPU, SM count or TP (TP 8:
    no table ships for it)."""
    prov = T.TableConfigProvider()
    # an entry whose tuned config is not the default (there must be one: the search found it)
    entry = next(e for e in _shipped_tp2_entries() if e.config != default_config(e.op, e.m, e.n, e.k))
    op, m, n, k = entry.op, entry.m, entry.n, entry.k
    assert prov(op, m, n, k, dtype=torch.bfloat16, tp=2, device=H200) == entry.config
    assert T.prefer_fused(op, m, n, k, torch.bfloat16, 2, H200) is (entry.flux_ms <= 0.98 * entry.nccl_ms)
    assert T.prefer_fused(op, m, n, k, torch.bfloat16, tp, device) is None
    assert prov(op, m, n, k, dtype=torch.bfloat16, tp=tp, device=device) == default_config(op, m, n, k)


def test_unknown_gpu_without_user_tables_is_not_an_error():
    prov = T.TableConfigProvider()
    got = prov("ag", 4096, 14336, 4096, dtype=torch.bfloat16, tp=2, device=("Imaginary GPU 9000", 7))
    assert got == default_config("ag", 4096, 14336, 4096)
    assert T.prefer_fused("ag", 4096, 14336, 4096, torch.bfloat16, 2, ("Imaginary GPU 9000", 7)) is None
    # also for dtypes without a key at all
    assert T.prefer_fused("ag", 4096, 14336, 4096, torch.int8, 2, H200) is None


def test_user_table_for_another_machine_is_a_clear_error(tmp_path):
    path = write(tmp_path, table_obj())
    T.use_table_files([path])
    with pytest.raises(T.TuningFileError, match="gpu.name") as ei:
        T.prefer_fused("ag", 64, 512, 256, torch.bfloat16, 2, H200)
    assert path in str(ei.value) and "NVIDIA Test GPU" in str(ei.value)
    T.reset()
    T.use_table_files([path])
    with pytest.raises(T.TuningFileError, match="'tp'"):
        T.prefer_fused("ag", 64, 512, 256, torch.bfloat16, 4, TEST_GPU)
    # auto's decision and the kernel config raise it too, not a silent fallback
    for call in (lambda: T.provider.decide("rs", 64, 512, 256, torch.bfloat16, 2, H200),
                 lambda: T.provider.kernel_config("rs", 64, 512, 256, torch.bfloat16, 2, H200)):
        T.reset()
        T.use_table_files([path])
        with pytest.raises(T.TuningFileError, match="gpu.name"):
            call()


def test_user_table_wins_over_shipped_and_env_var(tmp_path, monkeypatch):
    shipped = T.prefer_fused("ag", 64, 14336, 4096, torch.bfloat16, 2, H200)
    assert shipped is False  # measured: nccl 0.063 ms, flux 0.138 ms
    obj = table_obj(gpu={"name": "NVIDIA H200", "sms": 132},
                    entries=[{"op": "ag", "n": 14336, "k": 4096, "m": 64, "tuned": True,
                              "config": {}, "flux_ms": 0.01, "nccl_ms": 0.06}])
    monkeypatch.setenv(registry.ENV_FILES, write(tmp_path, obj, "env.json"))
    T.reset()
    assert T.prefer_fused("ag", 64, 14336, 4096, torch.bfloat16, 2, H200) is True
    # the other buckets still come from the shipped table (merged per key)
    assert T.prefer_fused("ag", 4096, 14336, 4096, torch.bfloat16, 2, H200) is True
    assert T.get_index().buckets(T.ShapeKey("h200", 132, 2, "bf16", "ag", 14336, 4096)) == [
        64, 128, 256, 512, 1024, 2048, 4096, 8192]
    # --flux-config (use_table_files) beats the environment variable
    obj2 = copy.deepcopy(obj)
    obj2["entries"][0].update(flux_ms=0.1, nccl_ms=0.05)
    T.use_table_files([write(tmp_path, obj2, "flag.json")])
    T.provider.clear_caches()
    assert T.prefer_fused("ag", 64, 14336, 4096, torch.bfloat16, 2, H200) is False


def test_env_var_directory_and_shipped_off(tmp_path, monkeypatch):
    d = tmp_path / "tables"
    d.mkdir()
    write(d, table_obj(), "a.json")
    monkeypatch.setenv(registry.ENV_FILES, str(d))
    monkeypatch.setenv(registry.ENV_SHIPPED, "0")
    T.reset()
    assert T.prefer_fused("ag", 64, 512, 256, torch.bfloat16, 2, TEST_GPU) is False
    assert T.get_index().buckets(T.ShapeKey("h200", 132, 2, "bf16", "ag", 14336, 4096)) == []


# ---------------------------------------------------------------- auto decision
def test_prefer_fused_from_table(tmp_path):
    T.use_table_files([write(tmp_path, table_obj())])
    assert T.prefer_fused("ag", 64, 512, 256, torch.bfloat16, 2, TEST_GPU) is False   # 2.0 > 1.0
    assert T.prefer_fused("ag", 128, 512, 256, torch.bfloat16, 2, TEST_GPU) is False  # nearest 64
    assert T.prefer_fused("ag", 4096, 512, 256, torch.bfloat16, 2, TEST_GPU) is True  # 1.0 < 2.0
    assert T.prefer_fused("rs", 256, 256, 256, torch.bfloat16, 2, TEST_GPU) is None   # no times
    assert T.prefer_fused("rs", 256, 999, 256, torch.bfloat16, 2, TEST_GPU) is None   # unknown n


@pytest.mark.parametrize("name,device", [("h200-sm132-tp2-bf16.json", H200),
                                         ("h100-80gb-hbm3-sm132-tp2-bf16.json", ("NVIDIA H100 80GB HBM3", 132))])
def test_shipped_tp2_table_decisions_follow_its_times_and_the_margin(name, device):
    t = T.load_table(os.path.join(registry.SHIPPED_DIR, name))
    assert T.provider.auto_margin() == T.provider.DEFAULT_AUTO_MARGIN == 0.02
    fused = 0
    for e in t.entries:
        want = e.flux_ms <= 0.98 * e.nccl_ms
        assert T.prefer_fused(e.op, e.m, e.n, e.k, torch.bfloat16, 2, device) is want, e
        fused += want
    assert 0 < fused < len(t.entries)
    # a confirmed entry takes fused only where its tuning run and the benchmark both measured it
    # faster by the margin (small m included: H200 GEMM+RS llama3-70b m=512 qualifies)
    for e in t.entries:
        nt = e.notes
        if nt.get("confirmed") and T.prefer_fused(e.op, e.m, e.n, e.k, torch.bfloat16, 2, device):
            assert nt["tune_flux_ms"] <= 0.98 * nt["tune_nccl_ms"], e
            assert nt["bench_flux_ms"] <= 0.98 * nt["bench_nccl_ms"], e


def test_auto_margin_from_the_options():
    from megatron_flux.options import FluxOptions, set_options

    # the shipped entry where fused wins by the least: the margin decides it
    e = min((e for e in _shipped_tp2_entries() if e.flux_ms < e.nccl_ms), key=lambda e: e.nccl_ms - e.flux_ms)
    gain = 1 - e.flux_ms / e.nccl_ms
    key = (e.op, e.m, e.n, e.k, torch.bfloat16, 2, H200)
    assert T.prefer_fused(*key) is (e.flux_ms <= 0.98 * e.nccl_ms)  # the default 2 % margin
    try:
        set_options(FluxOptions(auto_margin=0))
        assert T.prefer_fused(*key) is True
        set_options(FluxOptions.from_env({T.provider.ENV_AUTO_MARGIN: f"{gain + 0.005:.6f}"}))
        assert T.prefer_fused(*key) is False
        set_options(FluxOptions(auto_margin=0.5))
        assert T.prefer_fused("ag", 2048, 14336, 4096, torch.bfloat16, 2, H200) is False
    finally:
        set_options(None)
    assert T.prefer_fused(*key) is (e.flux_ms <= 0.98 * e.nccl_ms)
    for bad in ("x", "-0.1", "1"):
        with pytest.raises(ValueError, match="MEGATRON_FLUX_AUTO_MARGIN"):
            FluxOptions.from_env({T.provider.ENV_AUTO_MARGIN: bad})


def test_shipped_tables_are_the_committed_runs():
    assert sorted(os.path.basename(f) for f in T.shipped_table_files()) == sorted(SHIPPED)


def _replayable_tune_run(path):
    """A committed tuning run as a table, without the knobs removed since (config.REMOVED_FIELDS):
    the H200 TP 2 run picked ``rs_tma_reduce=false`` for GEMM+RS n=4096 k=14336 m=2048, whose
    config the adopted Gluon variant replaced in the shipped table, so no shipped config
    depends on the dropped value."""
    from megatron_flux.kernels.config import REMOVED_FIELDS

    obj = json.load(open(path))
    for e in obj["entries"]:
        e["config"] = {k: v for k, v in e["config"].items() if k not in REMOVED_FIELDS}
    return T.validate_table(obj, path)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_table_is_tuned_and_confirmed_by_the_benchmark(name):
    gpu, tp, tune_rel, steps = SHIPPED[name]
    confirms = [r for step, rel in steps if step == "confirm" for r in ([rel] if isinstance(rel, str) else rel)]
    retimes = [r for step, rel in steps if step == "retime" for r in rel]
    t = T.load_table(os.path.join(registry.SHIPPED_DIR, name))
    assert t.source.startswith("megatron-flux tune ")
    assert t.tp == tp and t.sms == 132 and t.gpu == gpu and t.dtype == "bf16"
    extended = [e for e in t.entries if not e.tuned]
    assert all(e.notes.get("measured_by") in {r for step, rel in steps if step.startswith("extend") for r in rel}
               for e in extended)
    # the benchmark grid (3 models x 2 ops x 8 m-buckets) is confirmed; entries the benchmarks
    # did not run (a training config's own shapes) keep the tune's times and say so
    confirmed = [e for e in t.entries if e.notes.get("confirmed")]
    # 2xH200 TP 2 and 4xH200 TP 4 also: the training config's 16 other entries (10 shapes at
    # m = 4096 and 8192, less the 4 the grid's llama3-8b shares)
    assert len(confirmed) == {"h200-sm132-tp2-bf16.json": 64, "h200-sm132-tp4-bf16.json": 64}.get(name, 48)
    assert all(e.notes.get("model", "").count(":") == 1 for e in t.entries if e not in confirmed)
    assert {e.notes["bench_source"] for e in confirmed} <= set(retimes) | set(confirms)
    if retimes:  # the current kernels' times, the configs of the kernels the table was tuned on
        assert t.extra["search"]["retimed_by"]["benches"] == retimes
        assert all(e.notes["config_kernel_version"] == 0 for e in confirmed
                   if e.notes["bench_source"] in retimes)
    if [st for st, _ in steps if st in ("confirm", "retime")][-1] == "confirm":
        assert t.extra["search"]["confirmed_by"]["bench"] == confirms[-1]
    # the configs differ from the defaults somewhere (the search found better ones)
    assert any(e.config != default_config(e.op, e.m, e.n, e.k) for e in t.entries)
    # regenerating from the committed tuning run, benchmarks and A/B runs gives the same file
    from megatron_flux.tools.tune.add import add_tuned
    from megatron_flux.tools.tune.adopt import adopt_variant
    from megatron_flux.tools.tune.confirm import confirm_repeats, confirm_table
    from megatron_flux.tools.tune.extend import extend_table
    from megatron_flux.tools.tune.retime import retime_table
    from megatron_flux.tools.tune.retune import retune_table

    def load(rel):
        return json.load(open(os.path.join(REPO, rel)))

    again = _replayable_tune_run(os.path.join(REPO, tune_rel))
    for step, rel in steps:
        if step == "confirm" and isinstance(rel, str):
            again = confirm_table(again, load(rel), rel)
        elif step == "confirm":
            again = confirm_repeats(again, [(load(r), r) for r in rel])
        elif step == "kernel_version":
            again.extra["kernel_version"] = rel
        elif step == "add":
            again = add_tuned(again, [(T.validate_table(load(r), r), r) for r in rel])
        elif step == "retune":
            again = retune_table(again, T.validate_table(load(rel), rel), rel)
        elif step == "retime":
            again = retime_table(again, [(load(r), r) for r in rel])
        elif step in ("extend", "extend-transplanted"):
            for r in rel:
                again = extend_table(again, load(r), r, transplant=step == "extend-transplanted",
                                     ws_split=False)
        elif step == "extend-waves":  # every benchmark ran with the table as the step found it
            base = again
            for r in rel:
                again = extend_table(again, load(r), r, waves=True, ran_with=base, ws_split=False)
        else:
            again = adopt_variant(again, [(load(r), r) for r in rel])
    assert _comparable(again) == _comparable(t)
    # each entry's times are those of the run less favourable to fused: of its A/B runs, with
    # the variant's time, where the adoption came last; else of the tuning run (or the A/B
    # that adopted its config) and the latest benchmark that ran it
    for e in confirmed:
        nt = e.notes
        if "config_kernel_version" in nt:  # re-timed: the benchmarks' least favourable run
            continue
        if "adopted" in nt:
            ab = nt["adopted"]
            assert all(v < f for v, f in zip(ab["variant_ms"], ab["table_config_ms"]))
            if nt["times_from"] == "adopted":
                worse = max(v / n for v, n in zip(ab["variant_ms"], ab["nccl_ms"]))
                assert e.flux_ms / e.nccl_ms == pytest.approx(worse)
                continue
        worse = max(nt["tune_flux_ms"] / nt["tune_nccl_ms"], nt["bench_flux_ms"] / nt["bench_nccl_ms"])
        assert e.flux_ms / e.nccl_ms == pytest.approx(worse)


def _fake_backends():
    from megatron_flux.backends.base import TPOverlapBackend

    class Fake(TPOverlapBackend):
        def __init__(self, name):
            self.name = name
            self.calls = []

        def all_gather_matmul(self, a_shard, b, group, **kw):
            self.calls.append("ag")

        def matmul_reduce_scatter(self, a, b, group, **kw):
            self.calls.append("rs")

        def all_gather(self, x, group, *, out=None):
            self.calls.append("all_gather")

        def reduce_scatter(self, x, group, *, out=None):
            self.calls.append("reduce_scatter")

    return Fake("flux"), Fake("nccl")


class _Group:
    def __init__(self, rank=0):
        self._rank = rank

    def size(self):
        return 2

    def rank(self):
        return self._rank


@pytest.fixture
def fake_fused(monkeypatch):
    """'flux' registered as a fake that supports any operands; the device reads as an H200."""
    import megatron_flux.backends.registry as B
    from megatron_flux.tuning import device as D

    fused, nccl = _fake_backends()
    B._ensure_builtin()
    monkeypatch.setitem(B._INSTANCES, "flux", fused)
    monkeypatch.setitem(B._REGISTRY, "flux", fused)
    monkeypatch.setitem(B._INSTANCES, "nccl", nccl)
    monkeypatch.setattr(B, "fused_unavailable_reason", lambda device: None)
    monkeypatch.setattr(D, "device_identity", lambda device: ("h200", 132, "NVIDIA H200"))
    monkeypatch.setattr(T.provider, "device_identity", lambda device: ("h200", 132, "NVIDIA H200"))
    return fused, nccl


def _picked(impl, op):
    return impl.backend_for(op) if isinstance(impl, auto.AutoDispatch) else impl


def test_resolve_backend_auto_consults_the_table(fake_fused):
    from megatron_flux.backends import resolve_backend

    fused, nccl = fake_fused
    bf = torch.bfloat16
    g = _Group()
    # llama3-8b AG+GEMM: rank shard [m/2, 4096] @ [4096, 14336]
    small = resolve_backend("auto", torch.empty(32, 4096, dtype=bf), torch.empty(4096, 14336, dtype=bf), g)
    # m=64: fused 2.2x slower; the RS reading (m=32, that (n, k) has no RS entry, none near):
    # the size rule, nccl both ways
    assert small is nccl
    small.all_gather_matmul(None, None, g)
    assert nccl.calls == ["ag"] and fused.calls == []
    large = resolve_backend("auto", torch.empty(2048, 4096, dtype=bf), torch.empty(4096, 14336, dtype=bf), g)
    assert _picked(large, "ag") is fused      # m=4096: fused 0.872x nccl
    # no RS entry for (n, k) = (14336, 4096) and none within the estimate's reach: the
    # ping-pong GEMM+RS rule's config, which runs fused on an H200 at TP 2
    assert _picked(large, "rs") is fused
    # GEMM+RS gpt3-175b m=8192: [8192, 24576] @ [24576, 12288]: what the shipped entry says
    (e,) = [e for e in _shipped_tp2_entries() if (e.op, e.n, e.k, e.m) == ("rs", 12288, 24576, 8192)]
    want = fused if e.flux_ms <= 0.98 * e.nccl_ms else nccl
    rs = resolve_backend("auto", torch.empty(8192, 24576, dtype=bf), torch.empty(24576, 12288, dtype=bf), g)
    assert _picked(rs, "rs") is want
    # the same with the op given: the concrete backend
    assert resolve_backend("auto", torch.empty(8192, 24576, dtype=bf), torch.empty(24576, 12288, dtype=bf),
                           g, op="rs") is want
    assert resolve_backend("auto", torch.empty(32, 4096, dtype=bf), torch.empty(4096, 14336, dtype=bf),
                           g, op="ag") is nccl
    # a shape far from every entry: the size rule (AG+GEMM fused from 1024 rows per rank,
    # GEMM+RS on NCCL)
    unk = resolve_backend("auto", torch.empty(64, 48, dtype=bf), torch.empty(48, 80, dtype=bf), g)
    assert unk is nccl
    unk = resolve_backend("auto", torch.empty(1024, 48, dtype=bf), torch.empty(48, 80, dtype=bf), g)
    assert _picked(unk, "ag") is fused and _picked(unk, "rs") is nccl  # AG reading: 2048 rows
    # named backends ignore the table
    assert resolve_backend("flux", torch.empty(32, 4096, dtype=bf), torch.empty(4096, 14336, dtype=bf), g) is fused


def test_auto_says_why_once_per_tp_group(fake_fused, monkeypatch, caplog):
    """Every rank of a TP group reads the same tables and decides alike: the group's first rank
    says why a shape runs NCCL (or an estimate's fused), the others only decide."""
    import logging

    import megatron_flux.backends.registry as B
    from megatron_flux.backends import resolve_backend

    fused, nccl = fake_fused
    monkeypatch.setattr(B, "_LOGGED", set())
    a, b = torch.empty(32, 4096, dtype=torch.bfloat16), torch.empty(4096, 14336, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="megatron_flux"):
        assert resolve_backend("auto", a, b, _Group(rank=1), op="ag") is nccl
        assert not [r for r in caplog.records if "uses 'nccl'" in r.getMessage()]
        B.clear_resolution_cache()
        auto.clear_cache()
        assert resolve_backend("auto", a, b, _Group(rank=0), op="ag") is nccl
    said = [r.getMessage() for r in caplog.records if "uses 'nccl'" in r.getMessage()]
    assert len(said) == 1 and "for ag m=64 n=14336 k=4096" in said[0]


def test_resolve_backend_auto_dispatches_per_op_when_ambiguous(fake_fused, tmp_path):
    from megatron_flux.backends import resolve_backend

    fused, nccl = fake_fused
    # (n, k) = (512, 512) listed under both ops: AG at m = 64*2 = 128 loses, RS at m = 64 wins
    cfg = {}
    obj = table_obj(gpu={"name": "NVIDIA H200", "sms": 132}, entries=[
        {"op": "ag", "n": 512, "k": 512, "m": 128, "config": cfg, "tuned": True, "flux_ms": 2.0, "nccl_ms": 1.0},
        {"op": "rs", "n": 512, "k": 512, "m": 64, "config": cfg, "tuned": True, "flux_ms": 1.0, "nccl_ms": 2.0},
    ])
    T.use_table_files([write(tmp_path, obj)])
    a, b = torch.empty(64, 512, dtype=torch.bfloat16), torch.empty(512, 512, dtype=torch.bfloat16)
    impl = resolve_backend("auto", a, b, _Group())
    assert isinstance(impl, auto.AutoDispatch)
    impl.all_gather_matmul(a, b, None)
    impl.matmul_reduce_scatter(a, b, None)
    assert nccl.calls == ["ag"] and fused.calls == ["rs"]
    assert resolve_backend("auto", a, b, _Group(), op="rs") is fused
    assert resolve_backend("auto", a, b, _Group(), op="ag") is nccl


def test_auto_decision_is_cached_per_shape(fake_fused, monkeypatch):
    from megatron_flux.backends import resolve_backend

    calls = []
    real = T.provider._current_entry
    monkeypatch.setattr(T.provider, "_current_entry", lambda *a: calls.append(a) or real(*a))
    a, b = torch.empty(32, 4096, dtype=torch.bfloat16), torch.empty(4096, 14336, dtype=torch.bfloat16)
    for _ in range(5):
        resolve_backend("auto", a, b, _Group())
    assert len(calls) == 2  # one lookup per reading (ag, rs), then cached


# ---------------------------------------------------------------- validation errors
BAD = [
    (lambda o: o.update(format="x"), "format"),
    (lambda o: o.update(version=99), "version"),
    (lambda o: o.update(version="1"), "version"),
    (lambda o: o.pop("source"), "source"),
    (lambda o: o.update(source=""), "source"),
    (lambda o: o.update(tp=1), "tp"),
    (lambda o: o.update(dtype="int8"), "dtype"),
    (lambda o: o["gpu"].pop("sms"), "gpu.sms"),
    (lambda o: o["gpu"].update(sms=0), "gpu.sms"),
    (lambda o: o["gpu"].update(name=""), "gpu.name"),
    (lambda o: o.update(extra_field=1), "extra_field"),
    (lambda o: o.update(entries={}), "entries"),
    (lambda o: o["entries"][1].update(op="ar"), "entries[1].op"),
    (lambda o: o["entries"][1].update(n=0), "entries[1].n"),
    (lambda o: o["entries"][1].update(m=65), "entries[1].m"),
    (lambda o: o["entries"][0].pop("tuned"), "entries[0].tuned"),
    (lambda o: o["entries"][0].update(flux_ms=-1), "entries[0].flux_ms"),
    (lambda o: o["entries"][0].update(nccl_ms="fast"), "entries[0].nccl_ms"),
    (lambda o: o["entries"][0]["config"].update(block_m=100), "entries[0].config"),
    (lambda o: o["entries"][0]["config"].update(blockm=128), "entries[0].config.blockm"),
    (lambda o: o["entries"][0]["config"].update(flatten=1), "entries[0].config.flatten"),
    (lambda o: o["entries"][0]["config"].update(num_warps=4.0), "entries[0].config.num_warps"),
    (lambda o: o["entries"][2].update(typo=1), "entries[2].typo"),
    (lambda o: o["entries"].append(copy.deepcopy(o["entries"][0])), "entries[3]"),
]


@pytest.mark.parametrize("mutate,field", BAD, ids=[f for _, f in BAD])
def test_validation_errors_name_file_and_field(tmp_path, mutate, field):
    obj = table_obj()
    mutate(obj)
    path = write(tmp_path, obj, "broken.json")
    with pytest.raises(T.TuningFileError) as ei:
        T.load_table(path)
    assert ei.value.field == field
    assert ei.value.path == path
    assert path in str(ei.value) and repr(field) in str(ei.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(T.TuningFileError, match="no such file"):
        T.load_table(str(tmp_path / "nope.json"))
    p = tmp_path / "bad.json"
    p.write_text("{oops")
    with pytest.raises(T.TuningFileError, match="not valid JSON") as ei:
        T.use_table_files([str(p)])
    assert str(p) in str(ei.value)


def test_malformed_file_through_env_var_fails_at_first_lookup(tmp_path, monkeypatch):
    obj = table_obj()
    obj["entries"][0]["m"] = "64"
    monkeypatch.setenv(registry.ENV_FILES, write(tmp_path, obj, "env.json"))
    with pytest.raises(T.TuningFileError, match=r"env\.json.*entries\[0\]\.m"):
        T.prefer_fused("ag", 64, 512, 256, torch.bfloat16, 2, TEST_GPU)


def test_flux_config_flag_validates_and_installs_the_table(tmp_path):
    from megatron_flux.arguments import FluxArgumentError, validate_flux_args

    def args(path):
        import argparse

        return argparse.Namespace(flux_config=path, flux_backend="auto", flux_tp_overlap=True,
                                  tensor_model_parallel_size=2, sequence_parallel=True,
                                  tp_comm_overlap=False, transformer_impl="local", spec=None)

    bad = table_obj()
    bad["entries"][0]["config"]["block_k"] = 3
    with pytest.raises(FluxArgumentError, match=r"bad\.json.*entries\[0\]\.config"):
        validate_flux_args(args(write(tmp_path, bad, "bad.json")))
    good = write(tmp_path, table_obj(), "good.json")
    validate_flux_args(args(good))
    assert registry.user_table_files() == [good]
    assert T.prefer_fused("ag", 64, 512, 256, torch.bfloat16, 2, TEST_GPU) is False


# ---------------------------------------------------------------- JSON round trip and merge
def test_json_round_trip_and_merge(tmp_path):
    t = schema.validate_table(table_obj(), "mem")
    out = str(tmp_path / "sub" / "rt.json")
    T.write_table(t, out)
    back = T.load_table(out)
    assert back.entries == sorted(t.entries, key=lambda e: (e.op, e.n, e.k, e.m))
    assert (back.gpu_name, back.sms, back.tp, back.dtype, back.source) == (t.gpu_name, t.sms, t.tp, t.dtype, t.source)
    assert schema.table_to_dict(back) == schema.table_to_dict(schema.validate_table(json.load(open(out)), out))

    newer = table_obj(source="second run", entries=[
        {"op": "ag", "n": 512, "k": 256, "m": 64, "config": {}, "tuned": True, "flux_ms": 0.5, "nccl_ms": 1.0},
        {"op": "ag", "n": 512, "k": 256, "m": 8192, "config": {}, "tuned": True, "flux_ms": 5.0, "nccl_ms": 6.0},
    ])
    merged = schema.merge_tables(back, schema.validate_table(newer, out))
    got = {(e.op, e.m): e.flux_ms for e in merged.entries}
    assert got == {("ag", 64): 0.5, ("ag", 1024): 1.0, ("ag", 8192): 5.0, ("rs", 256): None}
    assert "unit test" in merged.source and "second run" in merged.source
    with pytest.raises(T.TuningFileError, match="'tp'"):
        schema.merge_tables(back, schema.validate_table(table_obj(tp=4), "x"))
    assert schema.default_filename("NVIDIA H200", 132, 2, "bf16") == "h200-sm132-tp2-bf16.json"


def test_write_refuses_an_invalid_table(tmp_path):
    t = schema.validate_table(table_obj(), "mem")
    t.tp = 1
    with pytest.raises(T.TuningFileError, match="'tp'"):
        T.write_table(t, str(tmp_path / "x.json"))
    assert not (tmp_path / "x.json").exists()


def test_flux_backend_default_provider_is_the_table(tmp_path):
    from megatron_flux.backends.flux import FluxBackend

    T.use_table_files([write(tmp_path, table_obj())])
    fb = FluxBackend()
    ctx = dict(dtype=torch.bfloat16, tp=2, device=TEST_GPU)
    assert fb.config("ag", 100, 512, 256, **ctx).block_n == 64            # nearest bucket 64
    assert fb.config("ag", 100, 512, 256) == default_config("ag", 100, 512, 256)  # no context
    assert fb.config("ag", 100, 999, 256, **ctx) == default_config("ag", 100, 999, 256, tp=2)
    # a plain 4-argument provider keeps working, and answers are cached per shape
    seen = []
    fixed = GemmConfig(64, 64, 32, 2, 4, 1)
    fb2 = FluxBackend(config_provider=lambda op, m, n, k: seen.append((op, m, n, k)) or fixed)
    assert fb2.config("rs", 64, 128, 128, **ctx) is fixed and fb2.config("rs", 64, 128, 128, **ctx) is fixed
    assert seen == [("rs", 64, 128, 128)]
    fb2.clear_config_cache()
    fb2.config("rs", 64, 128, 128, **ctx)
    assert len(seen) == 2


def test_confirm_keeps_the_times_less_favourable_to_fused(tmp_path):
    from megatron_flux.tools.tune.confirm import confirm_table

    t = T.load_table(write(tmp_path, table_obj()))
    # table_obj: ag n=512 k=256 m=64 flux 2.0 nccl 1.0; m=1024 flux 1.0 nccl 2.0
    bench = {"tp": 2, "gpu": "NVIDIA Test GPU", "rows": [
        {"op": "AG+GEMM", "m": 64, "n": 1024, "k": 256, "method": "flux", "status": "ok", "check": "ok", "median_ms": 1.0},
        {"op": "AG+GEMM", "m": 64, "n": 1024, "k": 256, "method": "nccl", "status": "ok", "check": "ok", "median_ms": 1.0},
        {"op": "AG+GEMM", "m": 1024, "n": 1024, "k": 256, "method": "flux", "status": "ok", "check": "ok", "median_ms": 3.0},
        {"op": "AG+GEMM", "m": 1024, "n": 1024, "k": 256, "method": "nccl", "status": "ok", "check": "ok", "median_ms": 2.0},
    ]}
    c = confirm_table(t, bench, "b.json")
    by_m = {(e.op, e.m): e for e in c.entries}
    assert (by_m[("ag", 64)].flux_ms, by_m[("ag", 64)].nccl_ms) == (2.0, 1.0)   # the table's was worse
    assert by_m[("ag", 64)].notes["times_from"] == "tune"
    assert (by_m[("ag", 1024)].flux_ms, by_m[("ag", 1024)].nccl_ms) == (3.0, 2.0)  # the bench's was worse
    assert by_m[("ag", 1024)].notes["times_from"] == "bench"
    assert all(e.config == o.config for e, o in zip(c.entries, t.entries))
    assert by_m[("rs", 256)].notes["confirmed"] is False  # no times, no bench row: kept as is
    with pytest.raises(T.TuningFileError, match="tp"):
        confirm_table(t, {**bench, "tp": 4}, "b.json")
    with pytest.raises(T.TuningFileError, match="gpu"):  # times from other cards
        confirm_table(t, {**bench, "gpu": "NVIDIA H100 80GB HBM3"}, "b.json")
    with pytest.raises(T.TuningFileError, match="dtype"):
        confirm_table(t, {**bench, "dtype": "fp16"}, "b.json")


def test_confirm_keeps_earlier_confirmations_the_bench_did_not_rerun(tmp_path):
    """A partial retune is confirmed by a benchmark of the shapes it touched; the rest stand."""
    from megatron_flux.tools.tune.confirm import confirm_table

    t = T.load_table(write(tmp_path, table_obj()))
    row = lambda m, meth, ms: {"op": "AG+GEMM", "m": m, "n": 1024, "k": 256, "method": meth,  # noqa: E731
                               "status": "ok", "check": "ok", "median_ms": ms}
    first = confirm_table(t, {"tp": 2, "gpu": "NVIDIA Test GPU", "rows": [row(64, "flux", 1.0), row(64, "nccl", 1.0),
                                                row(1024, "flux", 3.0), row(1024, "nccl", 2.0)]}, "b1.json")
    # the kernel improved: a second benchmark of m=1024 only, fused now 0.5x
    second = confirm_table(first, {"tp": 2, "gpu": "NVIDIA Test GPU", "rows": [row(1024, "flux", 1.0), row(1024, "nccl", 2.0)]}, "b2.json")
    by_m = {(e.op, e.m): e for e in second.entries}
    m64, m1024 = by_m[("ag", 64)], by_m[("ag", 1024)]
    assert m64.notes["confirmed"] and m64.notes["bench_source"] == "b1.json"   # kept as confirmed by b1
    assert (m64.flux_ms, m64.nccl_ms) == (2.0, 1.0)
    # compared with its own tuning run (1.0 vs 2.0), not with b1's 3.0 vs 2.0: it can move both ways
    assert m1024.notes["bench_source"] == "b2.json" and m1024.notes["tune_flux_ms"] == 1.0
    assert (m1024.flux_ms, m1024.nccl_ms) == (1.0, 2.0)
    assert by_m[("rs", 256)].notes["confirmed"] is False
    cb = second.extra["search"]["confirmed_by"]
    assert (cb["bench"], cb["entries"], cb["kept_from_earlier"], cb["earlier_benches"]) == ("b2.json", 1, 1, ["b1.json"])


def test_confirm_repeats_keeps_the_least_favourable_of_every_run(tmp_path):
    """Repeated benchmarks of one table are taken jointly: an entry keeps the times of whichever
    run (or its tuning run) was least favourable to fused, names every run that ran it, and the
    latest run alone cannot overturn the earlier ones. For runs of disjoint shapes it is one
    confirmation after the other."""
    from megatron_flux.tools.tune.confirm import confirm_repeats, confirm_table
    from megatron_flux.tools.tune.extend import extend_table
    from megatron_flux.tools.tune.retime import retime_table

    t = T.load_table(write(tmp_path, table_obj()))
    row = lambda m, meth, ms: {"op": "AG+GEMM", "m": m, "n": 1024, "k": 256, "method": meth,  # noqa: E731
                               "status": "ok", "check": "ok", "median_ms": ms}
    bench = lambda *rows: {"tp": 2, "gpu": "NVIDIA Test GPU", "rows": list(rows)}  # noqa: E731
    # table_obj's m=1024 entry: tune flux 1.0, nccl 2.0. Run 1 says fused loses, run 2 wins.
    b1 = bench(row(1024, "flux", 2.2), row(1024, "nccl", 2.0))
    b2 = bench(row(1024, "flux", 1.0), row(1024, "nccl", 2.0), row(64, "flux", 1.0), row(64, "nccl", 1.0))
    joint = confirm_repeats(t, [(b1, "b1.json"), (b2, "b2.json")])
    m1024 = {(e.op, e.m): e for e in joint.entries}[("ag", 1024)]
    assert (m1024.flux_ms, m1024.nccl_ms) == (2.2, 2.0) and m1024.notes["bench_source"] == "b1.json"
    assert m1024.notes["bench_runs"] == ["b1.json", "b2.json"]
    assert m1024.notes["times_from"] == "bench"
    # one after the other, the later run would have won it back for fused
    seq = confirm_table(confirm_table(t, b1, "b1.json"), b2, "b2.json")
    assert {(e.op, e.m): e for e in seq.entries}[("ag", 1024)].flux_ms == 1.0
    cb = joint.extra["search"]["confirmed_by"]
    assert cb["benches"] == ["b1.json", "b2.json"] and cb["bench"] == "b2.json" and cb["entries"] == 2
    # disjoint shapes: the same entries as confirming one run after the other
    small, large = bench(row(64, "flux", 1.0), row(64, "nccl", 1.0)), bench(row(1024, "flux", 3.0), row(1024, "nccl", 2.0))
    a = confirm_repeats(t, [(small, "s.json"), (large, "l.json")])
    b = confirm_table(confirm_table(t, small, "s.json"), large, "l.json")
    assert [(e.flux_ms, e.nccl_ms, e.notes) for e in a.entries] == [(e.flux_ms, e.nccl_ms, e.notes) for e in b.entries]
    with pytest.raises(T.TuningFileError, match="gpu"):
        confirm_repeats(t, [(b1, "b1.json"), ({**b2, "gpu": "NVIDIA H100 80GB HBM3"}, "h.json")])
    with pytest.raises(ValueError):
        confirm_repeats(t, [])


def test_extend_refuses_waves_without_the_stream_k_transplant(tmp_path):
    """The wave rule's configs carry the stream-K tail transplant: a benchmark cannot have run
    the wave rule on the nearest entries' configs as they stand."""
    from megatron_flux.tools.tune.extend import extend_table

    t = T.load_table(write(tmp_path, table_obj()))
    bench = {"tp": 2, "gpu": "NVIDIA Test GPU", "rows": []}
    with pytest.raises(ValueError, match="transplant"):
        extend_table(t, bench, "b.json", transplant=False, waves=True)
    assert len(extend_table(t, bench, "b.json", waves=True).entries) == len(t.entries)
    # the ping-pong GEMM+RS rule came after the wave rule
    with pytest.raises(ValueError, match="waves=True"):
        extend_table(t, bench, "b.json", pingpong=True)
    assert len(extend_table(t, bench, "b.json", waves=True, pingpong=True).entries) == len(t.entries)


def _ab_bench(tp, rows, variant=None, gpu="NVIDIA H200"):
    """A benchmark JSON with flux / flux_variant / nccl (/ flux_control, if given a fourth time)
    medians per (op, m, n, k), run on ``gpu`` (132 SMs)."""
    out = []
    for (op, m, n, k), times in rows.items():
        for method, ms in zip(("flux", "flux_variant", "nccl", "flux_control"), times):
            out.append({"op": op, "model": "x", "m": m, "n": n, "k": k, "method": method,
                        "median_ms": ms, "status": "ok", "check": "ok"})
    return {"tp": tp, "gpu": gpu, "env": {"gpus": [gpu] * tp, "sms": 132}, "rows": out,
            "flux_variant": variant or {"rs_copy_engine": True}}


def test_adopt_takes_a_variant_only_where_every_ab_run_timed_it_faster(tmp_path):
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.tools.tune.add import add_tuned
    from megatron_flux.tools.tune.adopt import adopt_variant
    from megatron_flux.tuning.schema import Entry, Table

    cfg = GemmConfig()
    entries = [Entry(op="rs", n=4096, k=7168, m=m, config=cfg, tuned=True, flux_ms=1.0,
                     nccl_ms=1.1, notes={}) for m in (1024, 2048, 4096, 8192)]
    table = Table(path="t.json", gpu_name="NVIDIA H200", gpu="h200", sms=132, tp=2,
                  dtype="bf16", source="megatron-flux tune", entries=entries, extra={})
    # bench shapes are global: GEMM+RS k = 2 x 7168 at TP 2
    run1 = _ab_bench(2, {("GEMM+RS", 1024, 4096, 14336): (1.0, 0.9, 1.2),    # faster in both
                         ("GEMM+RS", 2048, 4096, 14336): (1.0, 0.9, 1.2),    # slower in run 2
                         ("GEMM+RS", 4096, 4096, 14336): (1.0, 1.0, 1.2)})   # not faster
    run2 = _ab_bench(2, {("GEMM+RS", 1024, 4096, 14336): (2.0, 1.9, 2.0),
                         ("GEMM+RS", 2048, 4096, 14336): (1.0, 1.1, 1.2)})
    t = adopt_variant(table, [(run1, "a.json"), (run2, "b.json")])
    by_m = {e.m: e for e in t.entries}
    assert by_m[1024].config.rs_copy_engine is True
    assert (by_m[1024].flux_ms, by_m[1024].nccl_ms) == (1.9, 2.0)  # run 2: less favourable
    assert by_m[1024].notes["adopted"]["sources"] == ["a.json", "b.json"]
    for m in (2048, 4096, 8192):  # slower once, level, never run
        assert by_m[m].config.rs_copy_engine is False and by_m[m].flux_ms == 1.0
    assert t.extra["search"]["adopted"][0]["entries"] == 1
    with pytest.raises(T.TuningFileError, match="flux_variant"):
        adopt_variant(table, [(run1, "a.json"), (_ab_bench(2, {}, {"rs_tma_push": False}), "c")])
    with pytest.raises(T.TuningFileError, match="tp"):
        adopt_variant(table, [(_ab_bench(4, {}), "d.json")])
    with pytest.raises(T.TuningFileError, match="flux_variant"):
        adopt_variant(table, [({"tp": 2, "gpu": "NVIDIA H200", "rows": []}, "e.json")])
    # an A/B run on other cards never changes the table (on two H100s the Gluon ping-pong loses
    # where it wins on two H200s)
    with pytest.raises(T.TuningFileError, match="H100"):
        adopt_variant(table, [(run1, "a.json"), (_ab_bench(2, {}, gpu="NVIDIA H100 80GB HBM3"), "h.json")])
    other_sms = _ab_bench(2, {})
    other_sms["env"]["sms"] = 114
    with pytest.raises(T.TuningFileError, match="sms"):
        adopt_variant(table, [(other_sms, "p.json")])


def test_adopt_needs_the_variant_to_beat_the_same_config_control():
    """Where a run also timed flux_control (the table config in a second backend object), the
    variant must be faster than flux by more than |control/flux - 1| in that run; the control's
    times are kept in the notes (None for a run without one). Runs without a control keep the
    plain rule, and their adoptions carry no control_ms key."""
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.tools.tune.add import add_tuned
    from megatron_flux.tools.tune.adopt import adopt_variant
    from megatron_flux.tuning.schema import Entry, Table

    entries = [Entry(op="rs", n=4096, k=7168, m=m, config=GemmConfig(), tuned=True, flux_ms=1.0,
                     nccl_ms=1.1, notes={}) for m in (1024, 2048, 4096)]
    table = Table(path="t.json", gpu_name="NVIDIA H200", gpu="h200", sms=132, tp=2,
                  dtype="bf16", source="megatron-flux tune", entries=entries, extra={})
    run1 = _ab_bench(2, {("GEMM+RS", 1024, 4096, 14336): (1.0, 0.95, 1.2, 1.02),  # 5 % > 2 %
                         ("GEMM+RS", 2048, 4096, 14336): (1.0, 0.95, 1.2, 0.94),  # 5 % < 6 %
                         ("GEMM+RS", 4096, 4096, 14336): (1.0, 0.95, 1.2)})       # no control
    run2 = _ab_bench(2, {("GEMM+RS", 1024, 4096, 14336): (1.0, 0.97, 1.2)})
    by_m = {e.m: e for e in adopt_variant(table, [(run1, "a.json"), (run2, "b.json")]).entries}
    assert by_m[1024].config.rs_copy_engine is True
    assert by_m[1024].notes["adopted"]["control_ms"] == [1.02, None]
    assert "flux_control" in by_m[1024].notes["adopted"]["rule"]
    assert by_m[2048].config.rs_copy_engine is False and "adopted" not in by_m[2048].notes
    assert by_m[4096].config.rs_copy_engine is True
    assert "control_ms" not in by_m[4096].notes["adopted"]


def test_retime_keeps_the_configs_and_takes_the_current_kernels_times():
    """A stale table re-timed by benchmarks of the current kernels: each entry they ran keeps
    its config and takes their times (of two runs, the one less favourable to fused); an entry
    none ran is dropped; the version becomes theirs; another machine's benchmark is refused."""
    from megatron_flux.tools.tune.retime import retime_table

    stale = T.validate_table(table_obj(kernel_version=0), "stale.json")

    def bench(flux_ms, gpu="NVIDIA Test GPU", version=KERNEL_VERSION):
        # the global shape of the AG entry (n = 512 per rank at TP 2): n = 1024, k = 256
        rows = [{"op": "AG+GEMM", "model": "m", "m": 1024, "n": 1024, "k": 256, "method": meth,
                 "status": "ok", "check": "ok", "median_ms": ms}
                for meth, ms in (("flux", flux_ms), ("nccl", 1.0))]
        return {"tp": 2, "gpu": gpu, "dtype": "bf16", "rows": rows,
                "env": {"sms": 100, "kernel_version": version, "gpus": [gpu]}}

    t = retime_table(stale, [(bench(0.8), "a.json"), (bench(0.9), "b.json")])
    assert t.kernel_version == KERNEL_VERSION and not t.stale
    (e,) = t.entries  # the m = 64 and RS entries were not run: dropped
    old = next(x for x in stale.entries if x.op == "ag" and x.m == 1024)
    assert (e.m, e.config, e.flux_ms, e.nccl_ms) == (1024, old.config, 0.9, 1.0)
    assert e.notes["config_kernel_version"] == 0 and e.notes["bench_source"] == "b.json"
    assert t.extra["search"]["retimed_by"] == {"benches": ["a.json", "b.json"], "entries": 1,
                                               "dropped": 2, "configs_from_kernel_version": 0}
    with pytest.raises(T.TuningFileError, match="gpu"):
        retime_table(stale, [(bench(0.8, gpu="NVIDIA H200"), "c.json")])
    with pytest.raises(T.TuningFileError, match="kernel_version"):
        retime_table(stale, [(bench(0.8), "a.json"), (bench(0.8, version=KERNEL_VERSION + 1), "d.json")])
