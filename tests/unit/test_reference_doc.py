"""``docs/reference.md`` names every setting a user can give: each ``GemmConfig`` field a tuning
table may set, each ``--flux-*`` flag ``add_flux_args`` adds, and each ``MEGATRON_FLUX_*``
environment variable the package reads."""

import argparse
import dataclasses
import re

from helpers.paths import REPO

REFERENCE = (REPO / "docs" / "reference.md").read_text()


def test_every_kernel_config_field_is_documented():
    from megatron_flux.kernels.config import GemmConfig

    missing = [f.name for f in dataclasses.fields(GemmConfig) if f"`{f.name}`" not in REFERENCE]
    assert not missing, f"GemmConfig fields missing from docs/reference.md: {missing}"


def test_every_flux_flag_is_documented():
    from megatron_flux.arguments import add_flux_args

    parser = add_flux_args(argparse.ArgumentParser())
    flags = {opt for action in parser._actions for opt in action.option_strings
             if opt.startswith("--flux-") or opt.startswith("--no-flux-")}
    assert flags
    missing = sorted(flag for flag in flags if f"`{flag}" not in REFERENCE)
    assert not missing, f"flags missing from docs/reference.md: {missing}"


def test_every_environment_variable_read_is_documented():
    names = set()
    for path in (REPO / "megatron_flux").rglob("*.py"):
        names |= set(re.findall(r"[\"'](MEGATRON_FLUX_[A-Z0-9_]+)[\"']", path.read_text()))
    assert names
    missing = sorted(name for name in names if f"`{name}`" not in REFERENCE)
    assert not missing, f"environment variables missing from docs/reference.md: {missing}"
