"""The table tools' command lines (``python -m megatron_flux.tools.tune.{confirm,adopt,retime,
extend,add,retune,from_bench}`` and ``python -m megatron_flux.tools.auto_eval``): ``--help``
exits 0, and a user error (a missing file, a benchmark from another machine) is one line on
stderr with exit 2, no traceback."""

import json
import subprocess
import sys

import pytest

from helpers.paths import REPO
from test_tune_add import table

TABLE_TOOLS = ("confirm", "adopt", "retime", "extend", "add", "retune")


def _run(module, *argv):
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _one_line_error(res, *expected):
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("tool", TABLE_TOOLS + ("from_bench",))
def test_help_exits_0_with_usage_and_no_arguments_exit_2(tool):
    res = _run(f"megatron_flux.tools.tune.{tool}", "--help")
    assert res.returncode == 0 and f"python -m megatron_flux.tools.tune.{tool}" in res.stdout, res
    res = _run(f"megatron_flux.tools.tune.{tool}")
    assert res.returncode == 2 and f"python -m megatron_flux.tools.tune.{tool}" in res.stderr, res


@pytest.mark.parametrize("tool", TABLE_TOOLS)
def test_a_missing_file_is_one_line(tool, tmp_path):
    good = tmp_path / "t.json"
    good.write_text(json.dumps(table([])))
    missing = tmp_path / "missing.json"
    _one_line_error(_run(f"megatron_flux.tools.tune.{tool}", good, missing, tmp_path / "out.json"),
                    f"python -m megatron_flux.tools.tune.{tool}: ", str(missing), "No such file")
    _one_line_error(_run(f"megatron_flux.tools.tune.{tool}", missing, good, tmp_path / "out.json"),
                    str(missing), "no such file")
    assert not (tmp_path / "out.json").exists()


def test_a_benchmark_from_another_machine_is_one_line(tmp_path):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(table([])))
    bench = tmp_path / "h100.json"
    bench.write_text(json.dumps({"tp": 2, "gpu": "NVIDIA H100 80GB HBM3", "dtype": "bf16", "rows": [],
                                 "env": {"sms": 132, "gpus": ["NVIDIA H100 80GB HBM3"]}}))
    _one_line_error(_run("megatron_flux.tools.tune.confirm", t, bench, tmp_path / "out.json"),
                    str(bench), "'gpu'", "is not the table's GPU")


def test_from_bench_missing_or_malformed_file(tmp_path):
    missing = tmp_path / "missing.json"
    _one_line_error(_run("megatron_flux.tools.tune.from_bench", missing, tmp_path / "out.json"),
                    str(missing), "No such file")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _one_line_error(_run("megatron_flux.tools.tune.from_bench", bad, tmp_path / "out.json"),
                    str(bad), "not valid JSON")


def test_auto_eval_missing_files(tmp_path):
    assert _run("megatron_flux.tools.auto_eval", "--help").returncode == 0
    missing = tmp_path / "missing.json"
    _one_line_error(_run("megatron_flux.tools.auto_eval", missing), str(missing), "no such file")
    _one_line_error(_run("megatron_flux.tools.auto_eval", "--held-out", missing), str(missing),
                    "No such file")
