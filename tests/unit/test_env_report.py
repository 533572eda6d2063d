"""``megatron-flux check``: the report, its verdict on made-up machines, and the CLI."""

import copy
import json

import pytest

from megatron_flux.tools import cli
from megatron_flux.tools.check import _tables, collect, format_report, verdict

H200 = {"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "sms": 132, "memory_gib": 139.8}


def _machine(**changes):
    """A 2×H200 node as collect() would describe it, with every variable set as on our box."""
    info = {
        "versions": {"python": "3.12.3", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0",
                     "megatron.core": "0.19.2", "megatron_flux": "0.1.0"},
        "gluon": "available",
        "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"},
        "optional": {"apex_wgrad_kernel": True, "transformer_engine": None},
        "cuda_available": True,
        "devices": [H200, dict(H200, index=1)],
        "tp": 2,
        "peer_access": {"0->1": True, "1->0": True},
        "symmetric_memory": "usable",
        "tables": ["h200-sm132-tp2-bf16.json"],
    }
    info.update(copy.deepcopy(changes))
    return info


def test_this_cpu_machine_is_reported_without_the_fused_backend():
    info = collect(2)
    assert info["tp"] == 2 and info["versions"]["torch"]
    if not info["cuda_available"]:
        fb = info["fused_backend"]
        assert not fb["available"] and "no CUDA device is visible" in fb["why"]
        assert "UNAVAILABLE, 'auto' will use 'nccl'" in format_report(info)


def test_symmetric_memory_is_reported_as_usable_here_or_not_and_why():
    """Whether the module imports is not the question: symmetric memory is GPU memory, so on a
    machine without CUDA it is not usable, and the report says so with the reason."""
    import torch

    info = collect(2)
    if torch.cuda.is_available():
        assert info["symmetric_memory"] == "usable" or info["symmetric_memory"].startswith("not usable: ")
    else:
        assert info["symmetric_memory"] == ("not usable: no CUDA device is visible (symmetric "
                                            "memory is GPU memory)")
        assert "symmetric memory: not usable: no CUDA device" in format_report(info)
        # the verdict names the missing GPU once, not again as a symmetric-memory blocker
        assert not any("symmetric memory" in w for w in info["fused_backend"]["why"])


def test_a_good_node_passes_with_no_reasons():
    fb = verdict(_machine())
    assert fb == {"available": True, "why": [], "notes": []}
    assert "fused backend: AVAILABLE at TP 2" in format_report(dict(_machine(), fused_backend=fb))


@pytest.mark.parametrize("changes, reason", [
    (dict(devices=[dict(H200, capability=[8, 0])] * 2), "compute capability 8.0"),
    (dict(peer_access={"0->1": True, "1->0": False}), "no peer access between GPUs 1->0"),
    (dict(devices=[H200], tp=2, peer_access={}), "--tp 2 but only 1 GPU(s) visible"),
    (dict(tp=1), "tensor-parallel size 1"),
    (dict(cuda_available=False, devices=[], peer_access={}), "no CUDA device is visible"),
    (dict(symmetric_memory="not usable: torch.distributed._symmetric_memory does not import (x)"),
     "torch symmetric memory not usable"),
])
def test_each_blocker_is_named(changes, reason):
    fb = verdict(_machine(**changes))
    assert not fb["available"]
    assert any(reason in why for why in fb["why"]), fb["why"]


def test_an_unreadable_user_table_is_named(tmp_path, monkeypatch):
    from megatron_flux.tuning import registry

    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    monkeypatch.setenv("MEGATRON_FLUX_CONFIG", str(bad))
    registry.reset()
    try:
        info = collect(2)
    finally:
        monkeypatch.delenv("MEGATRON_FLUX_CONFIG")
        registry.reset()
    assert "t.json" in info["tables_error"]
    assert any("tuning tables cannot be read" in w for w in info["fused_backend"]["why"])


def test_notes_for_what_runs_but_may_not_be_meant():
    info = _machine(env={}, tables=[], gluon="ImportError: no gluon")
    info["optional"]["apex_wgrad_kernel"] = False
    fb = verdict(info)
    assert fb["available"]
    text = " | ".join(fb["notes"])
    for expected in ("CUDA_DEVICE_MAX_CONNECTIONS is not 1", "NVLink multicast is not turned off",
                     "Gluon unavailable", "no current tuning table for NVIDIA H200 (132 SMs) at TP 2",
                     "apex's weight-gradient kernel is not installed"):
        assert expected in text, text


def test_a_triton_other_than_the_tables_is_noted():
    """The shipped tables record the Triton they were measured with (3.6.0); another version
    runs their configs untimed, and check says so, naming both."""
    from megatron_flux.tools.check import _tables_triton

    assert _tables_triton([H200], 2) == ["3.6.0"]
    assert not any("triton" in n for n in verdict(_machine(tables_triton=["3.6.0"]))["notes"])
    other = _machine(tables_triton=["3.6.0"])
    other["versions"]["triton"] = "3.9.0"
    (note,) = [n for n in verdict(other)["notes"] if n.startswith("triton")]
    assert "triton 3.9.0 is not the Triton" in note and "(3.6.0)" in note
    assert verdict(_machine())["notes"] == []  # no recorded version: nothing to compare
    local = _machine(tables_triton=["3.6.0"])
    local["versions"]["triton"] = "3.6.0+git1234abcd"  # a local build of the same release
    assert verdict(local)["notes"] == []


def test_the_shipped_tables_are_found_for_their_machine():
    assert any("h200-sm132-tp2-bf16.json" in t for t in _tables([H200], 2))
    (tp4,) = _tables([H200], 4)
    assert "h200-sm132-tp4-bf16.json" in tp4 and "stale" not in tp4
    # a table that predates the kernels is listed as stale, and the note says what auto does
    stale = tp4[:-1] + "; stale: kernel version 0)"
    assert not any("no current tuning table" in note for note in verdict(_machine(env={}, tables=[tp4]))["notes"])
    assert any("no current tuning table" in note for note in verdict(_machine(env={}, tables=[stale]))["notes"])
    h100 = dict(H200, name="NVIDIA H100 80GB HBM3")
    found = _tables([h100], 2)
    assert len(found) == 1 and "h100-80gb-hbm3-sm132-tp2-bf16.json" in found[0]
    assert _tables([h100], 4) == []  # no H100 table at TP 4
    assert _tables([dict(H200, name="NVIDIA A100-SXM4-80GB")], 2) == []
    assert _tables([], 2) == []


def test_cli(capsys):
    assert cli.main(["check", "--json", "--tp", "2"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tp"] == 2 and set(info["fused_backend"]) == {"available", "why", "notes"}
    with pytest.raises(SystemExit):
        cli.main(["check", "--tp", "0"])
    assert cli.main(["--help"]) == 0
    assert "check" in capsys.readouterr().out


def _plugin_variables():
    """Every variable the plugin reads: the options' defaults and the tables' switches."""
    from megatron_flux import options
    from megatron_flux.tuning import registry

    return list(options.ENV.values()) + [registry.ENV_FILES, registry.ENV_SHIPPED, registry.ENV_CACHED]


def test_every_variable_the_plugin_reads_is_reported(tmp_path, monkeypatch):
    """check's report and the benchmark JSON's env_vars list each variable options.py (and the
    table registry) reads: set alone (to a valid value), it shows on check's env line."""
    import dataclasses

    from megatron_flux.options import ENV, FluxOptions
    from megatron_flux.tools.check import ENV_VARS
    from megatron_flux.tools.bench.report import ENV_VARS as BENCH_ENV_VARS
    from megatron_flux.tuning import registry

    defaults = {f.name: f.default for f in dataclasses.fields(FluxOptions)}
    values = {var: str(int(defaults[name])) if isinstance(defaults[name], bool) else str(defaults[name])
              for name, var in ENV.items()}
    values.update({registry.ENV_FILES: str(tmp_path), registry.ENV_SHIPPED: "0", registry.ENV_CACHED: "0"})
    assert set(values) == set(_plugin_variables()) and len(values) == 13
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in values.items():
        assert var in BENCH_ENV_VARS, var
        monkeypatch.setenv(var, value)
        registry.reset()
        try:
            info = collect(2)
        finally:
            monkeypatch.delenv(var)
            registry.reset()
        assert info["env"][var] == value and info["invalid_settings"] == [], var
        assert f"env: {var}={value}" in format_report(info), var


def test_allow_several_queues_set_is_not_asked_for_again():
    info = _machine(env={"MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES": "1"})
    (note,) = [n for n in verdict(info)["notes"] if "CUDA_DEVICE_MAX_CONNECTIONS" in n]
    assert "runs fused anyway, as MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES=1 asks" in note


@pytest.mark.parametrize("var, value, expected", [
    ("MEGATRON_FLUX_AUTO_MARGIN", "2", "auto_margin: expected a number in [0, 1)"),
    ("MEGATRON_FLUX_COLUMN_DGRAD", "bogus", "column_dgrad: must be one of"),
    ("MEGATRON_FLUX_RESERVED_SMS", "-4", "reserved_sms: must be >= 0"),
    ("MEGATRON_FLUX_CAPTURE", "yes", "must be 0 or 1"),
])
def test_an_invalid_setting_is_reported_and_fails_check(var, value, expected, monkeypatch, capsys):
    """check validates the variables through FluxOptions, as the job's start-up does: the
    report names the variable, its value and the rule, and the exit status is 2."""
    from megatron_flux.options import FluxOptions

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as startup:
        FluxOptions.from_env()
    assert cli.main(["check", "--tp", "2"]) == 2
    out = capsys.readouterr().out
    assert "INVALID settings" in out and f"${var}={value!r}" in out and expected in out
    assert str(startup.value) in out
    assert cli.main(["check", "--tp", "2", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["invalid_settings"] == [str(startup.value)]
    monkeypatch.delenv(var)
    assert cli.main(["check", "--tp", "2"]) == 0
    assert "INVALID" not in capsys.readouterr().out
