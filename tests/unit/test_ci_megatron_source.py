"""``.ci/megatron-source`` (the CPU tests that touch Megatron, against a Megatron-LM checkout)
runs: against a git repository holding the installed megatron-core as its ``megatron/``
package, it names the commit and the version, imports every megatron name the package uses,
and hands the test files to pytest (here only to collect them)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import paths

SCRIPT = paths.REPO / ".ci" / "megatron-source"


@pytest.mark.slow
def test_megatron_source_runs_against_a_checkout(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    import megatron.core

    installed = os.path.dirname(os.path.dirname(megatron.core.__file__))
    repo = tmp_path / "Megatron-LM"
    shutil.copytree(installed, repo / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "pretrain_gpt.py").write_text("# Megatron-LM's entry point (a stand-in)\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "megatron-core as installed"], check=True)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    res = subprocess.run(["bash", str(SCRIPT), str(repo), "--collect-only", "-q"], cwd=paths.REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert re.search(r"megatron-source: [0-9a-f]{40} \S+ \(megatron-core " + re.escape(megatron.core.__version__), out), out[-3000:]
    imports = re.search(r"megatron-source: (\d+) imports, (\d+) failed, megatron.core from (\S+)", out)
    assert imports and int(imports.group(1)) > 30, out[-3000:]
    assert not imports.group(3).startswith(installed), imports.group(3)  # the checkout's copy
    collected = dict(re.findall(r"^(tests/unit/\S+\.py): (\d+)$", out, re.M))
    assert int(collected.get("tests/unit/test_linear_layers.py", 0)) > 10, out[-3000:]
    assert "tests/unit/test_launch_config.py" in collected and "tests/unit/test_patch.py" in collected
