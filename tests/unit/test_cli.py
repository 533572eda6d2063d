"""The ``megatron-flux`` command line: names, help and one-line errors for bad input files."""

import json
import sys

import pytest

from megatron_flux.tools import cli

SUBCOMMANDS = ("bench", "tune", "plan", "check")
H200 = ["--gpu", "NVIDIA H200", "--sms", "132"]


def test_top_level_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatron-flux {bench,tune,plan,check}")
    assert cli.main([]) == 2 and "usage: megatron-flux" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2 and "unknown subcommand 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_each_subcommand_names_itself_as_typed(cmd, capsys):
    """``--help`` and usage errors show the command people type (``megatron-flux bench``), not
    the module that implements it."""
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: megatron-flux {cmd} ")
    assert "python -m" not in out.split("\n\n")[0]


@pytest.mark.parametrize("cmd, extra", [("plan", ["--tp", "2"] + H200), ("tune", ["--dry-run"])])
def test_a_missing_model_config_is_one_line_and_exit_2(cmd, extra, tmp_path, capsys):
    missing = str(tmp_path / "no-such.json")
    assert cli.main([cmd, "--model-config", missing, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"megatron-flux {cmd}: --model-config {missing}: no such file\n"
    assert captured.out == ""


@pytest.mark.parametrize("cmd, extra", [("plan", ["--tp", "2"] + H200), ("tune", ["--dry-run"])])
def test_malformed_json_is_reported_where_it_breaks(cmd, extra, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 4096,\n "ffn_hidden_size": }\n')
    assert cli.main([cmd, "--model-config", str(bad), *extra]) == 2
    err = capsys.readouterr().err
    assert err == (f"megatron-flux {cmd}: {bad}: not valid JSON: Expecting value at line 2, "
                   "column 21\n")
    assert "YAML" not in err


def test_a_yaml_config_is_read_and_a_broken_one_named_as_yaml(tmp_path, capsys):
    pytest.importorskip("yaml")
    good = tmp_path / "tiny.yaml"
    good.write_text("hidden_size: 256\nffn_hidden_size: 512\nswiglu: true\n")
    assert cli.main(["tune", "--model-config", str(good), "--dry-run", "--tp", "2", "--m", "1024",
                     "--ops", "ag"]) == 0
    assert "ag n=512 k=256 m=1024  (tiny:fc1)" in capsys.readouterr().out
    bad = tmp_path / "bad.yml"
    bad.write_text("hidden_size: [256\n")
    assert cli.main(["plan", "--model-config", str(bad), "--tp", "2", *H200]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-flux plan: {bad}: not valid YAML:") and "JSON" not in err


def test_a_config_whose_widths_do_not_split_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "odd.json"
    cfg.write_text(json.dumps({"hidden_size": 96, "ffn_hidden_size": 99}))
    assert cli.main(["tune", "--model-config", str(cfg), "--dry-run", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-flux tune: ") and "not divisible by TP = 2" in err
    assert len(err.splitlines()) == 1


def test_without_pyyaml_a_yaml_config_says_so_and_other_names_get_the_json_error(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("hidden_size: 256\n")
    assert cli.main(["plan", "--model-config", str(cfg), "--tp", "2", *H200]) == 2
    assert capsys.readouterr().err == (f"megatron-flux plan: {cfg}: a YAML file, and PyYAML is "
                                       "not installed (pip install pyyaml)\n")
    cfg = tmp_path / "tiny.cfg"  # no telling extension: JSON, and its error
    cfg.write_text("hidden_size: 256\n")
    assert cli.main(["plan", "--model-config", str(cfg), "--tp", "2", *H200]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-flux plan: {cfg}: not valid JSON: Expecting value at line 1")
    assert "YAML" not in err


@pytest.mark.parametrize("argv, said", [
    (["tune", "--dry-run", "--ops", "gemm"], "argument --ops: unknown op 'gemm'; expected one of"),
    (["bench", "--list-grid", "--flux-variant", "{bad"], "argument --flux-variant: not valid JSON ("),
    (["bench", "--list-grid", "--flux-variant", "[1]"],
     "argument --flux-variant: expected a JSON object of GemmConfig fields, got '[1]'"),
])
def test_a_bad_typed_value_says_what_is_wrong_not_which_function_parsed_it(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "invalid" not in err, err


@pytest.mark.parametrize("module", ["megatron_flux.tools.cli", "megatron_flux.tools.bench"])
def test_output_into_a_closed_pipe_ends_quietly(module):
    """``megatron-flux bench --list-grid | head``: the reader goes away, the writer stops without
    a BrokenPipeError traceback (exit status 1, as the Python docs' SIGPIPE recipe)."""
    import subprocess

    from helpers.paths import REPO

    argv = (["bench"] if module.endswith("cli") else []) + ["--list-grid"]
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the child has written anything: every write meets EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
