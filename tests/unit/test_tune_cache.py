"""CPU tests of tuning a model in one step: the user cache of tables, the tuner's time budget,
`megatron-flux plan`'s coverage and tune command, and the launchers' offer."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_flux import tuning as T
from megatron_flux.kernels.config import GemmConfig
from megatron_flux.kernels.version import KERNEL_VERSION
from megatron_flux.tools import plan as P
from megatron_flux.tools.tune import candidates, search
from megatron_flux.tuning import provider, registry, schema

from helpers.paths import REPO
LLAMA = str(REPO / "configs" / "llama3_8b_16l.json")
GPT3 = str(REPO / "configs" / "gpt3_175b_4l.json")
H200 = ("NVIDIA H200", 132)
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def cache_home(monkeypatch, tmp_path):
    """An empty user cache under tmp_path; shipped tables on, nothing else."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var in (registry.ENV_FILES, registry.ENV_SHIPPED, registry.ENV_CACHED):
        monkeypatch.delenv(var, raising=False)
    T.reset()
    yield tmp_path / "xdg" / "megatron-flux" / "tables"
    T.reset()


def table(ratio=0.5, n=3072, k=4096, m=4096, kernel_version=KERNEL_VERSION, gpu=H200, tp=2, **cfg):
    obj = {"format": "megatron-flux-tuning", "version": 1, "gpu": {"name": gpu[0], "sms": gpu[1]},
           "tp": tp, "dtype": "bf16", "source": "unit test",
           "entries": [{"op": "ag", "n": n, "k": k, "m": m,
                        "config": dict(GemmConfig(128, 128, 64, 4, 4, 8).to_dict(), **cfg),
                        "tuned": True, "flux_ms": ratio, "nccl_ms": 1.0}]}
    if kernel_version is not None:
        obj["kernel_version"] = kernel_version
    return obj


def put(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return str(path)


# ------------------------------------------------------------------ where the cache is
def test_cache_dir_and_file_names(monkeypatch, cache_home):
    assert registry.user_cache_dir() == str(cache_home)
    assert registry.cache_table_path("NVIDIA H200", 132, 2, "bf16") == str(
        cache_home / f"h200-sm132-tp2-bf16-kv{KERNEL_VERSION}.json")
    assert registry.cache_table_path("NVIDIA H100 80GB HBM3", 132, 4, "fp16", 7).endswith(
        "h100-80gb-hbm3-sm132-tp4-fp16-kv7.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert registry.user_cache_dir() == "/home/someone/.cache/megatron-flux/tables"


def test_a_cached_table_is_read_between_the_given_and_the_shipped_ones(cache_home, tmp_path, monkeypatch):
    # the shipped H200 TP 2 table has qkv (ag 3072x4096 at m=4096) at 0.681
    assert provider.decide("ag", 4096, 3072, 4096, BF16, 2, H200).why.startswith("table (0.681")
    put(registry.cache_table_path(*H200, 2, "bf16"), table(ratio=1.5, block_n=64))
    T.reset()
    d = provider.decide("ag", 4096, 3072, 4096, BF16, 2, H200)
    assert d.source == "table" and not d.fused and d.why.startswith("table (1.500")
    assert provider.kernel_config("ag", 4096, 3072, 4096, BF16, 2, H200)[0].block_n == 64
    # a table given through the environment wins over the cache
    monkeypatch.setenv(registry.ENV_FILES, put(tmp_path / "env.json", table(ratio=0.9)))
    T.reset()
    assert provider.decide("ag", 4096, 3072, 4096, BF16, 2, H200).why.startswith("table (0.900")
    monkeypatch.delenv(registry.ENV_FILES)
    # switched off: the shipped entry again
    monkeypatch.setenv(registry.ENV_CACHED, "0")
    T.reset()
    assert registry.cached_table_files() == []
    assert provider.decide("ag", 4096, 3072, 4096, BF16, 2, H200).why.startswith("table (0.681")


def test_cache_tables_for_other_machines_are_not_an_error(cache_home):
    """The cache may hold tables of every machine a home directory has seen; unlike a table the
    user names, one for another GPU is simply not used."""
    put(cache_home / "a100-sm108-tp2-bf16-kv1.json", table(gpu=("NVIDIA A100-SXM4-80GB", 108)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert provider.decide("ag", 4096, 3072, 4096, BF16, 2, H200).source == "table"


def test_cached_tables_of_another_kernel_version(cache_home):
    old = put(cache_home / "h200-sm132-tp2-bf16-kv0.json", table(ratio=0.1, kernel_version=0, n=5000))
    with pytest.warns(registry.StaleTableWarning) as got:
        d = provider.decide("ag", 4096, 5000, 4096, BF16, 2, H200)
        provider.decide("ag", 2048, 5000, 4096, BF16, 2, H200)
    assert len(got) == 1 and old in str(got[0].message) and "It is not used" in str(got[0].message)
    assert d.source != "table"  # neither its times nor its configs
    assert provider.kernel_config("ag", 4096, 5000, 4096, BF16, 2, H200)[1] != "table (m=4096)"
    # once this version's table is in the cache, the old one is another install's: quiet
    put(registry.cache_table_path(*H200, 2, "bf16"), table(ratio=0.7, n=5000))
    T.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert provider.decide("ag", 4096, 5000, 4096, BF16, 2, H200).why.startswith("table (0.700")


def test_a_broken_cache_file_warns_and_is_skipped(cache_home):
    put(cache_home / "junk.json", {"format": "nope"})
    with pytest.warns(UserWarning, match="ignoring the cached tuning table .*junk.json"):
        assert provider.decide("ag", 4096, 3072, 4096, BF16, 2, H200).source == "table"


# ------------------------------------------------------------------ the tuner
def test_tune_in_budget_stops_before_an_entry_that_would_not_fit():
    now = [0.0]
    durations = {"a": 10.0, "b": 30.0, "c": 10.0, "d": 10.0}

    def tune(item):
        now[0] += durations[item]
        return {"item": item}

    kept = []
    entries, left = search.tune_in_budget(list("abcd"), tune, lambda e: kept.append(len(e)), 45.0,
                                          clock=lambda: now[0])
    # after a (10 s) and b (40 s), the slowest so far (30 s) would end c past 45 s
    assert [e["item"] for e in entries] == ["a", "b"] and left == ["c", "d"] and kept == [1, 2]
    now[0] = 0.0
    entries, left = search.tune_in_budget(list("abcd"), tune, lambda e: None, None, clock=lambda: now[0])
    assert len(entries) == 4 and left == []
    # every rank stops where any one would (the agreement is an OR over ranks)
    now[0] = 0.0
    entries, left = search.tune_in_budget(list("abcd"), tune, lambda e: None, 1e9, clock=lambda: now[0],
                                          agree=lambda stop: True)
    assert entries == [] and left == list("abcd")


def test_an_entry_that_fails_on_one_rank_stops_every_rank_at_the_same_point():
    kept, flags = [], []

    def tune(item):
        if item == "b":
            raise ValueError("boom")
        return {"item": item}

    def agree(flag):  # this rank's view of the OR over ranks
        flags.append(flag)
        return flag

    with pytest.raises(search.TuneFailed, match="entry b: ValueError: boom") as info:
        search.tune_in_budget(list("abc"), tune, lambda e: kept.append(len(e)), None, agree=agree,
                              describe=lambda item: f"entry {item}")
    assert isinstance(info.value.__cause__, ValueError) and kept == [1] and flags == [False, True]
    # a rank whose own entry went well stops too, when another rank's failed
    with pytest.raises(search.TuneFailed, match="entry a: failed on another rank"):
        search.tune_in_budget(list("abc"), lambda item: {"item": item}, lambda e: None, None,
                              agree=lambda flag: True, describe=lambda item: f"entry {item}")
    # so does an error in keeping the table (rank 0 writes it alone)
    def keep(entries):
        raise NameError("argv")

    with pytest.raises(search.TuneFailed, match="NameError: argv"):
        search.tune_in_budget(list("abc"), lambda item: {"item": item}, keep, None)


def test_the_table_a_tune_merges_into(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert search.previous_table(str(out), merge=True) == (None, None)  # no file yet
    put(out, table(ratio=0.9, n=5000))
    previous, problem = search.previous_table(str(out), merge=True)
    assert problem is None and [e.n for e in previous.entries] == [5000]
    assert search.previous_table(str(out), merge=False) == (None, None)
    # a file measured with other kernels is written over, and the run says so
    put(out, {**table(ratio=0.9, n=5000), "kernel_version": KERNEL_VERSION + 1})
    assert search.previous_table(str(out), merge=True) == (None, None)
    assert "writing a new table over it" in capsys.readouterr().out
    # a broken file is a one-line problem every rank is told, not an exception on rank 0 alone
    out.write_text("{not json")
    previous, problem = search.previous_table(str(out), merge=True)
    assert previous is None and str(out) in problem and "--no-merge" in problem


def test_the_tuned_table_object_validates_and_names_the_command():
    argv = ["--model-config", LLAMA, "--ms", "4096", "--max-candidates", "8", "--no-merge", "--out", "t.json"]
    args = search.parse_args(argv)
    args.space, pinned = candidates.search_space_for((9, 0))
    cfg = candidates.generate_candidates("ag", 4096, 1536, 4096, 4, max_candidates=8, space=args.space)[0]
    entry = {"op": "ag", "n": 1536, "k": 4096, "m": 4096, "config": cfg.to_dict(), "tuned": True,
             "flux_ms": 0.124, "nccl_ms": 0.177, "notes": {"model": "llama3_8b_16l:qkv"}}
    obj = search.table_object(args, argv, "NVIDIA H200", 132, 4, "bf16", pinned, [entry],
                              {"torch": "2.11.0", "triton": "3.6.0"})
    table = schema.validate_table(json.loads(json.dumps(obj)), "t.json")
    assert obj["kernel_version"] == KERNEL_VERSION and table.kernel_version == KERNEL_VERSION
    assert table.tp == 4 and len(table.entries) == 1 and table.entries[0].config == cfg
    assert table.source == "megatron-flux tune " + " ".join(argv)


def test_tune_flags(capsys, monkeypatch):
    args = search.parse_args(["--model-config", LLAMA, "--time-budget-s", "600", "--skip-tuned", "--tp", "2"])
    assert args.time_budget_s == 600 and args.skip_tuned and args.out is None
    for bad in (["--time-budget-s", "0"], ["--tp", "1"]):
        with pytest.raises(SystemExit):
            search.parse_args(bad)
    # under torchrun, --tp must be the number of processes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert search.main(["--model-config", LLAMA, "--tp", "4"]) == 2
    assert "--tp 4 but torchrun started 2 processes" in capsys.readouterr().err


def test_the_tuner_writes_the_kernel_version_into_the_user_cache_by_default():
    """The GPU part cannot run here; its output path and the table it writes can be read."""
    import inspect

    src = inspect.getsource(search._run)
    assert "out = args.out or cache_table_path(gpu_name, sms, tp, dtype_key(dtype))" in src
    assert "obj = table_object(" in src  # whose kernel version is checked below


# ------------------------------------------------------------------ plan and the launcher
def test_plan_counts_the_tuned_gemms_and_prints_the_command_for_the_rest(capsys):
    # the shipped TP 2 table holds all ten at micro-batch 1 and 2: nothing to tune
    for m in ("4096", "8192"):
        assert P.main(["--model-config", LLAMA, "--tp", "2", "--gpu", "NVIDIA H200", "--sms", "132",
                       "--m", m]) == 0
        out = capsys.readouterr().out
        assert f"10 of 10 TP GEMMs have a current table entry at m={m}" in out and "megatron-flux tune" not in out
    # the shipped TP 4 table holds GPT-3 175B's fc1 and fc2 with their data gradients at
    # m = 2048 (the benchmark grid's gpt3-175b), not its QKV, attention projection or output layer
    assert P.main(["--model-config", GPT3, "--tp", "4", "--gpu", "NVIDIA H200", "--sms", "132"]) == 0
    out = capsys.readouterr().out
    assert "4 of 10 TP GEMMs have a current table entry at m=2048" in out
    assert ("torchrun --nproc-per-node 4 --no-python megatron-flux tune --shapes ag:9216:12288 "
            "rs:12288:3072 ag:12672:12288 rs:12288:9216 ag:3072:12288 rs:12288:12672 --ms 2048") in out
    assert P.main(["--model-config", GPT3, "--tp", "4", "--gpu", "NVIDIA H200", "--sms", "132",
                   "--offer"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith("4 of 10 TP GEMMs have a current table entry")
    assert "--nproc-per-node 4 --no-python megatron-flux tune --shapes " in line
    assert line.rstrip().endswith("--ms 2048")
    rows = P.plan_rows(GPT3, 4, 2048, H200, BF16)  # without a current table: the model's config
    assert P.tune_offer([dict(r, source="estimate") for r in rows], GPT3, 4, 2048, "bf16").endswith(
        f"megatron-flux tune --model-config {GPT3} --ms 2048")
    rows = P.plan_rows(LLAMA, 2, 4096, H200, torch.float16)  # no fp16 table: all to tune
    assert P.tune_offer(rows, LLAMA, 2, 4096, "fp16").endswith(f"--model-config {LLAMA} --ms 4096 --dtype fp16")


def test_plan_offer_is_silent_once_every_gemm_is_tuned(cache_home, capsys):
    rows = P.plan_rows(GPT3, 4, 2048, H200, BF16)
    assert sum(r["source"] != "table" for r in rows) == 6
    for r in rows:
        if r["source"] != "table":
            path = registry.cache_table_path(*H200, 4, "bf16")
            old = json.loads(Path(path).read_text()) if os.path.exists(path) else table(n=1, k=1, tp=4)
            old["entries"].append(dict(table()["entries"][0], op=r["op"], n=r["n"], k=r["k"], m=2048))
            put(path, old)
    T.reset()
    assert P.main(["--model-config", GPT3, "--tp", "4", "--gpu", "NVIDIA H200", "--sms", "132", "--offer"]) == 0
    assert capsys.readouterr().out == ""


def test_launcher_prints_the_tune_offer_for_the_model(tmp_path):
    """run_pretrain's preflight runs `plan --offer` on the job's config at its TP size (here on a
    CPU machine, so a wrapper names the GPU the plan would read from the local device)."""
    assert 'flux_preflight "${config}"' in (REPO / "examples" / "_common.sh").read_text().split("run_pretrain()")[1]
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/bash\ncase " $* " in *" plan "*) exec "{sys.executable}" "$@" '
                       f'--gpu "NVIDIA H200" --sms 132;; esac\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    script = (f'source "{REPO}/examples/_common.sh"; PYTHON="{wrapper}"; NPROC=4; '
              f'FLUX_ARGS=(--flux-tp-overlap); flux_preflight "{GPT3}"')
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    plan_lines = [line for line in res.stdout.splitlines() if line.startswith("> megatron-flux plan: ")]
    assert len(plan_lines) == 1 and "4 of 10 TP GEMMs" in plan_lines[0]
    assert "--nproc-per-node 4 --no-python megatron-flux tune --shapes" in plan_lines[0]
    # a plan that fails (no GPU named, none here) prints nothing and stops nothing
    script = script.replace(f'PYTHON="{wrapper}"', f'PYTHON="{sys.executable}"')
    res = subprocess.run(["bash", "-c", script + "; echo survived"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0 and res.stdout.rstrip().endswith("survived")
    if not torch.cuda.is_available():
        assert "megatron-flux plan" not in res.stdout
