"""The ``megatron-flux plan`` commands the README and docs/ show run as written on a machine
without a GPU (what they say of themselves): from the repository root, exit status 0."""

import contextlib
import io
import re
import shlex

import pytest

from helpers.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def plan_commands():
    """``(file name, argv)`` of every full ``megatron-flux plan`` command (one naming a model
    config, not elided with ``...``) in inline code or on a code block's line."""
    out = []
    for path in DOCS:
        text = path.read_text()
        found = re.findall(r"(?<!`)`(megatron-flux plan [^`]*)`", text)
        found += re.findall(r"^\s*(megatron-flux plan .*)$", text, flags=re.M)
        for command in found:
            argv = shlex.split(" ".join(command.split()))
            if "--model-config" in argv and "..." not in argv:
                out.append((path.name, argv[1:]))
    return out


def test_the_docs_show_plan_commands():
    assert {name for name, _ in plan_commands()} >= {"README.md", "tuning.md", "performance.md"}


@pytest.mark.parametrize("name, argv", plan_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_documented_plan_commands_run_without_a_gpu(name, argv, monkeypatch):
    import torch

    from megatron_flux.tools import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exc:
            rc = exc.code
    assert rc == 0, f"{name}: megatron-flux {shlex.join(argv)} exited {rc}: {err.getvalue()[-500:]}"
    assert "TP GEMMs have a current table entry" in out.getvalue()
