"""``benchmarks/device.sh``: every stage it runs is documented in its header and named in its
"unknown stage" message, and nothing documented is missing (the header is the only manual a GPU
session has)."""

import os
import re

from helpers import paths

SCRIPT = os.path.join(paths.REPO, "benchmarks", "device.sh")


def _text():
    with open(SCRIPT) as f:
        return f.read()


def test_every_stage_is_documented_and_listed():
    text = _text()
    loop = text[text.index('for stage in "$@"; do'):]
    run = set(re.findall(r"^    ([a-z0-9]+)\)", loop, flags=re.M))
    header = text[:text.index("set -uo pipefail")]
    documented = set(re.findall(r"^#   ([a-z0-9]+) ", header, flags=re.M))
    listed = set(re.search(r"stages: ([a-z0-9 ]+)", loop).group(1).split())
    assert run == documented == listed, (run ^ documented, run ^ listed)
    assert {"main", "trainshapes", "modelbench", "bundle"} <= run


def _tune_table(tmp_path, resume=None):
    """device.sh's tune_table with torchrun replaced by echo: the tune command it would run (in
    tune.log) and the table file it leaves for the tune to merge into."""
    import subprocess

    text = _text()
    start = text.index("tune_table() {")
    fn = text[start:text.index("\n}\n", start) + 3]
    out = tmp_path / "tune" / "table.json"
    out.parent.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TUNE_RESUME"}
    if resume is not None:
        env["TUNE_RESUME"] = str(resume)
    res = subprocess.run(["bash", "-c", fn + 'TORCHRUN=(echo torchrun); tune_table "$1" --ms 4096', "_",
                          str(out)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return (out.parent / "tune.log").read_text(), out


def test_a_tune_starts_fresh_unless_told_to_resume(tmp_path):
    log, out = _tune_table(tmp_path)
    assert "--no-merge" in log and "--skip-tuned" not in log and not out.exists()
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"entries": ["an earlier call\'s"]}')
    (tmp_path / "tune" / "tune.log").unlink()
    (tmp_path / "tune").rmdir()
    log, out = _tune_table(tmp_path, resume=earlier)
    # the earlier table is where the tune merges, and its entries are not tuned again
    assert "--skip-tuned" in log and "--no-merge" not in log and f"--out {out}" in log
    assert out.read_text() == earlier.read_text()


def test_every_variant_file_is_a_valid_config_change():
    """``benchmarks/variants/*.json`` (``device.sh ab``'s ``AB_VARIANT``): each is a JSON object
    of GemmConfig fields that the default config takes, so a GPU session never spends its time
    on a variant that cannot run."""
    import glob
    import json

    from megatron_flux.backends.flux.variant import check_variant_fields

    files = sorted(glob.glob(os.path.join(paths.REPO, "benchmarks", "variants", "*.json")))
    assert files
    for path in files:
        with open(path) as f:
            check_variant_fields(json.load(f))
