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
