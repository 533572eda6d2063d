"""The upstream patch (patches/): its content always; that it applies when the file is given.

Set ``MEGATRON_LM_PRETRAIN_GPT=/path/to/Megatron-LM/pretrain_gpt.py`` (tag core_v0.19.0) to
run ``git apply --check`` against it.
"""

import os
import re
import shutil
import subprocess

import pytest

from helpers.paths import REPO
PATCH = REPO / "patches" / "megatron-lm-core_v0.19.0-pretrain_gpt.patch"


def _hunks(text):
    """[(old_start, old_len, new_start, new_len, body_lines)] of a unified diff."""
    hunks, current = [], None
    for line in text.splitlines():
        m = re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", line)
        if m:
            current = (*map(int, m.groups()), [])
            hunks.append(current)
        elif current is not None and line[:1] in (" ", "+", "-"):
            current[4].append(line)
    return hunks


def test_patch_touches_only_pretrain_gpt_and_is_well_formed():
    text = PATCH.read_text()
    files = re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, flags=re.M)
    assert files == [("pretrain_gpt.py", "pretrain_gpt.py")]
    hunks = _hunks(text)
    assert hunks
    for old_start, old_len, new_start, new_len, body in hunks:
        assert sum(1 for l in body if l[0] in " -") == old_len
        assert sum(1 for l in body if l[0] in " +") == new_len


def test_patch_adds_flag_provider_validation_and_spec_swap():
    body = [l for h in _hunks(PATCH.read_text()) for l in h[4]]
    added = "\n".join(l[1:] for l in body if l[0] == "+")
    removed = [l[1:].strip() for l in body if l[0] == "-"]
    # minimal: the only removed line is the old extra_args_provider
    assert removed == ["extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"]
    assert "from megatron_flux import" in added
    assert re.search(r"compose_extra_args_providers\(\s*add_modelopt_args if has_nvidia_modelopt "
                     r"else None, add_flux_args\s*\)", added)
    assert "validate_flux_args(args)" in added
    assert "if args.flux_tp_overlap:" in added
    assert re.search(r"model_cfg\.transformer_layer_spec = lambda cfg, vp_stage=None: "
                     r"flux_spec_from_args\(\s*args, cfg\.transformer, vp_stage=vp_stage\s*\)", added)
    # the output layer's pre-wrap hook, inside the same `if args.flux_tp_overlap:` block
    assert re.search(r"\n        model_cfg\.pre_wrap_hooks\.extend\(flux_pre_wrap_hooks\(args\)\)",
                     added)
    # the names it imports exist in the plugin
    import megatron_flux

    for name in ("add_flux_args", "compose_extra_args_providers", "flux_pre_wrap_hooks",
                 "flux_spec_from_args", "validate_flux_args"):
        assert name in megatron_flux.__all__ and callable(getattr(megatron_flux, name))


def test_patch_spec_callable_matches_megatron_builder_protocol():
    """GPTModelBuilder passes vp_stage only if the callable's signature has it; ours does."""
    added = "\n".join(l[1:] for h in _hunks(PATCH.read_text()) for l in h[4] if l[0] == "+")
    m = re.search(r"lambda ([^:]+):", added)
    assert m and [p.strip() for p in m.group(1).split(",")] == ["cfg", "vp_stage=None"]


def test_patch_applies_to_upstream_file(tmp_path):
    src = os.environ.get("MEGATRON_LM_PRETRAIN_GPT")
    if not src:
        pytest.skip("set MEGATRON_LM_PRETRAIN_GPT to Megatron-LM's pretrain_gpt.py (core_v0.19.0)")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    shutil.copy(src, tmp_path / "pretrain_gpt.py")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    check = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=tmp_path,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, check=True)
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    compile(patched, "pretrain_gpt.py", "exec")
    assert "add_flux_args" in patched and "validate_flux_args(args)" in patched
