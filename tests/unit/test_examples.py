"""CPU checks of the examples: model configs, argument expansion, fusion fallbacks, the spec hook,
the custom-model spec, the launchers' refusal without GPUs. The pretrain flow through
megatron.training runs only where it imports (Python >= 3.12, megatron-core 0.19) and CUDA is
present (Megatron's argument validation queries the GPU)."""

import argparse
import importlib.util
import inspect
import os
import subprocess
import sys
import types

import pytest

import pretrain_support as ps
from helpers.paths import REPO

EXAMPLES = REPO / "examples"
CONFIGS = sorted((REPO / "configs").glob("*.json"))


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- model configs


def test_the_three_model_configs_exist():
    assert {p.name for p in CONFIGS} >= {"tiny_smoke.json", "llama3_8b_16l.json",
                                         "gpt3_175b_4l.json"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_shapes_fit_tp2(path):
    cfg = ps.load_model_config(str(path))
    h, heads = cfg["hidden-size"], cfg["num-attention-heads"]
    assert h % heads == 0 and heads % 2 == 0 and cfg["ffn-hidden-size"] % 2 == 0
    assert cfg.get("num-query-groups", heads) % 2 == 0
    assert cfg["seq-length"] * cfg["micro-batch-size"] % 2 == 0  # sequence parallel split
    assert cfg["vocab-size"] > 0 and cfg["num-layers"] >= 1
    assert cfg["global-batch-size"] % cfg["micro-batch-size"] == 0
    for key in cfg:
        assert not key.startswith("-") and "_" not in key  # Megatron's dashed names


def test_llama_and_gpt_configs_have_their_shapes():
    llama = ps.load_model_config(str(REPO / "configs/llama3_8b_16l.json"))
    assert (llama["hidden-size"], llama["ffn-hidden-size"], llama["num-attention-heads"],
            llama["num-query-groups"], llama["vocab-size"]) == (4096, 14336, 32, 8, 128256)
    assert llama["normalization"] == "RMSNorm" and llama["swiglu"] is True
    assert llama["position-embedding-type"] == "rope" and llama["disable-bias-linear"] is True
    gpt = ps.load_model_config(str(REPO / "configs/gpt3_175b_4l.json"))
    assert (gpt["hidden-size"], gpt["ffn-hidden-size"], gpt["num-attention-heads"]) == (
        12288, 49152, 96)
    assert gpt["normalization"] == "LayerNorm" and "swiglu" not in gpt
    # parameter memory per GPU at TP=2 (bf16 + fp32 main grad + fp32 master + Adam = 18 B)
    # leaves room on a 141 GB H200
    for cfg, gated in ((llama, True), (gpt, False)):
        h, f, L, v = cfg["hidden-size"], cfg["ffn-hidden-size"], cfg["num-layers"], cfg["vocab-size"]
        kv = h * cfg.get("num-query-groups", cfg["num-attention-heads"]) // cfg["num-attention-heads"]
        per_layer = h * (h + 2 * kv) + h * h + (3 if gated else 2) * h * f
        emb = v * h * (2 if cfg.get("untie-embeddings-and-output-weights") else 1)
        assert (L * per_layer + emb) / 2 * 18 / 1e9 < 100


def test_config_comment_keys_dropped_and_bad_configs_refused(tmp_path):
    good = tmp_path / "c.json"
    good.write_text('{"_comment": "x", "num-layers": 2, "swiglu": true, "bf16": false, '
                    '"seed": null, "split": [99, 1, 0]}')
    cfg = ps.load_model_config(str(good))
    assert "_comment" not in cfg
    assert ps.config_to_argv(cfg) == ["--num-layers", "2", "--swiglu", "--split", "99", "1", "0"]
    for text in ('["num-layers"]', '{"--num-layers": 2}', '{"a": {"b": 1}}', "{nope"):
        good.write_text(text)
        with pytest.raises(ps.ModelConfigError):
            ps.load_model_config(str(good))
    with pytest.raises(ps.ModelConfigError):
        ps.load_model_config(str(tmp_path / "missing.json"))


def test_model_config_expands_first_so_command_line_wins(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"num-layers": 2, "hidden-size": 64}')
    argv = ps.expand_model_config_argv(
        ["--flux-tp-overlap", "--model-config", str(path), "--num-layers", "4"])
    assert argv == ["--num-layers", "2", "--hidden-size", "64", "--flux-tp-overlap",
                    "--num-layers", "4"]
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--flux-tp-overlap", action="store_true")
    assert parser.parse_args(argv).num_layers == 4
    assert ps.expand_model_config_argv([f"--model-config={path}"]) == [
        "--num-layers", "2", "--hidden-size", "64"]
    with pytest.raises(ps.ModelConfigError):
        ps.expand_model_config_argv(["--model-config"])


def test_pretrain_support_cli_prints_config_args():
    out = subprocess.run([sys.executable, str(EXAMPLES / "pretrain_support.py"),
                          str(REPO / "configs/tiny_smoke.json")],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["--num-layers", "2"] and "--swiglu" in out


# ---------------------------------------------------------------- fusions, spec hook


def test_unavailable_fusions_turned_off_and_reported(monkeypatch):
    monkeypatch.setattr(ps, "unavailable_fusions", lambda: {
        "gradient_accumulation_fusion": "a", "masked_softmax_fusion": "b",
        "apply_rope_fusion": "c", "persist_layer_norm": "d"})
    args = argparse.Namespace(gradient_accumulation_fusion=True, masked_softmax_fusion=True,
                              apply_rope_fusion=False, no_persist_layer_norm=False,
                              bias_dropout_fusion=True)
    messages = ps.disable_unavailable_fusions(args)
    assert not args.gradient_accumulation_fusion and not args.masked_softmax_fusion
    assert args.no_persist_layer_norm is True and args.bias_dropout_fusion is True
    assert len(messages) == 3  # rope was already off
    # without --flux-tp-overlap megatron-flux's own fusion stays off
    assert not getattr(args, "flux_gradient_accumulation_fusion", False)


@pytest.mark.parametrize("asked", [True, False])
def test_flux_linears_keep_the_fusion_megatron_loses_to_missing_apex(monkeypatch, asked):
    """With --flux-tp-overlap the plugin's linears keep gradient accumulation fusion when it is
    turned off only for lack of apex; one the user turned off stays off for them too."""
    monkeypatch.setattr(ps, "unavailable_fusions",
                        lambda: {"gradient_accumulation_fusion": "no apex"})
    args = argparse.Namespace(gradient_accumulation_fusion=asked, flux_tp_overlap=True,
                              flux_gradient_accumulation_fusion=False)
    messages = ps.disable_unavailable_fusions(args)
    assert args.gradient_accumulation_fusion is False
    assert args.flux_gradient_accumulation_fusion is asked
    assert len(messages) == (2 if asked else 0)


def test_unavailable_fusions_follow_megatrons_own_checks(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    missing = ps.unavailable_fusions()
    assert {"gradient_accumulation_fusion", "apply_rope_fusion"} <= set(missing)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object())
    missing = ps.unavailable_fusions()
    assert "gradient_accumulation_fusion" not in missing and "apply_rope_fusion" not in missing


def test_prebuilt_dataset_helpers_skip_make_only_without_a_makefile(monkeypatch, tmp_path):
    import types

    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers
    # no prebuilt extension importable (Python 3.11 here; the wheel's is cp312): untouched
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    assert ps.use_prebuilt_dataset_helpers() is None
    assert dataset_utils.compile_helpers is original
    # prebuilt extension, no Makefile (a wheel): make is skipped
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", types.ModuleType("h"))
    monkeypatch.setattr(dataset_utils, "__file__", str(tmp_path / "utils.py"))
    msg = ps.use_prebuilt_dataset_helpers()
    assert "prebuilt" in msg and dataset_utils.compile_helpers() is None
    monkeypatch.setattr(dataset_utils, "compile_helpers", original)
    # a source checkout with its Makefile: make runs as Megatron intends
    (tmp_path / "Makefile").write_text("all:\n")
    assert ps.use_prebuilt_dataset_helpers() is None
    assert dataset_utils.compile_helpers is original


def _llama_config(**kw):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def test_spec_hook_off_without_the_flag():
    assert ps.flux_layer_spec_hook(argparse.Namespace(flux_tp_overlap=False)) is None


def test_spec_hook_gives_the_flux_block_spec(monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_flux import FluxColumnParallelLinear, FluxRowParallelLinear
    from megatron_flux.layers.norms import SequenceParallelRMSNorm

    # the block spec asks parallel_state for this pipeline stage: one stage, rank 0
    for name, value in (("get_pipeline_model_parallel_world_size", 1),
                        ("get_pipeline_model_parallel_rank", 0),
                        ("get_virtual_pipeline_model_parallel_world_size", None)):
        monkeypatch.setattr(parallel_state, name, lambda *a, _v=value, **k: _v, raising=False)
    args = argparse.Namespace(flux_tp_overlap=True, flux_backend="nccl", normalization="RMSNorm",
                              flux_keep_gathered_input=True, qk_l2_norm=False)
    hook = ps.flux_layer_spec_hook(args)
    assert "vp_stage" in inspect.signature(hook).parameters  # GPTModelBuilder passes it
    config = _llama_config()
    model_cfg = argparse.Namespace(transformer=config)  # stands in for GPTModelConfig
    spec = hook(model_cfg, vp_stage=None)
    assert isinstance(spec, TransformerBlockSubmodules) and len(spec.layer_specs) == 2
    assert spec.layer_norm is SequenceParallelRMSNorm
    layer = spec.layer_specs[0].submodules
    assert issubclass(layer.self_attention.submodules.linear_qkv, FluxColumnParallelLinear)
    assert issubclass(layer.self_attention.submodules.linear_proj, FluxRowParallelLinear)
    assert layer.self_attention.submodules.linear_qkv is FluxColumnParallelLinear.with_backend("nccl")
    assert layer.input_layernorm is SequenceParallelRMSNorm
    assert config.flux_keep_gathered_input is True


def _block_spec_env(monkeypatch):
    from megatron.core import parallel_state

    for name, value in (("get_pipeline_model_parallel_world_size", 1),
                        ("get_pipeline_model_parallel_rank", 0),
                        ("get_virtual_pipeline_model_parallel_world_size", None)):
        monkeypatch.setattr(parallel_state, name, lambda *a, _v=value, **k: _v, raising=False)


def _stock_args(**kw):
    base = dict(flux_tp_overlap=False, transformer_impl="local", sequence_parallel=True,
                core_attention="local", qk_l2_norm=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_stock_spec_hook_keeps_megatron_linears_with_sp_norms(monkeypatch):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_flux.layers.norms import SequenceParallelRMSNorm

    _block_spec_env(monkeypatch)
    hook = ps.layer_spec_hook(_stock_args())
    assert hook is not None and hook.__name__ == "stock_layer_spec"
    assert "vp_stage" in inspect.signature(hook).parameters
    spec = hook(argparse.Namespace(transformer=_llama_config()), vp_stage=None)
    assert spec.layer_norm is SequenceParallelRMSNorm and len(spec.layer_specs) == 2
    layer = spec.layer_specs[0].submodules
    attn = layer.self_attention.submodules
    assert attn.linear_qkv is ColumnParallelLinear and attn.linear_proj is RowParallelLinear
    assert attn.core_attention is DotProductAttention
    assert layer.input_layernorm is SequenceParallelRMSNorm


def test_core_attention_sdpa_in_stock_and_flux_specs(monkeypatch):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_flux import FluxColumnParallelLinear, SDPACoreAttention

    _block_spec_env(monkeypatch)
    for args, linear in ((_stock_args(core_attention="sdpa"), ColumnParallelLinear),
                         (_stock_args(core_attention="sdpa", flux_tp_overlap=True,
                                      flux_backend="nccl", normalization="RMSNorm",
                                      flux_keep_gathered_input=True), FluxColumnParallelLinear)):
        spec = ps.layer_spec_hook(args)(argparse.Namespace(transformer=_llama_config()))
        attn = spec.layer_specs[0].submodules.self_attention.submodules
        assert attn.core_attention is SDPACoreAttention
        assert issubclass(attn.linear_qkv, linear)
    # the shipped model configs ask for it, without a dataloader mask (so flash can run), all
    # but the tiny smoke config, which README and docs/reference.md name as the exception
    for path in CONFIGS:
        cfg = ps.load_model_config(str(path))
        if path.name == "tiny_smoke.json":
            assert "core-attention" not in cfg
        else:
            assert cfg["core-attention"] == "sdpa" and cfg["no-create-attention-mask-in-dataloader"], path.name


def test_stock_spec_hook_is_megatrons_default_where_nothing_needs_changing():
    assert ps.layer_spec_hook(_stock_args(sequence_parallel=False)) is None
    assert ps.layer_spec_hook(_stock_args(transformer_impl="transformer_engine")) is None
    assert ps.stock_layer_spec_hook(_stock_args(flux_tp_overlap=True)) is None


def test_example_args_core_attention():
    parser = ps.add_example_args(argparse.ArgumentParser())
    assert parser.parse_args([]).core_attention == "local"
    assert parser.parse_args(["--core-attention", "sdpa"]).core_attention == "sdpa"
    with pytest.raises(SystemExit):
        parser.parse_args(["--core-attention", "flash"])


# ---------------------------------------------------------------- custom model


@pytest.mark.parametrize("mode", ["flux", "swap"])
def test_custom_model_spec(mode):
    from megatron_flux import FluxColumnParallelLinear, FluxRowParallelLinear
    from megatron_flux.layers.norms import SequenceParallelRMSNorm

    cm = _load_example("custom_model")
    args = cm.parse_args(["--num-layers", "3"])
    config = cm.llama_config(2, args, use_cpu_initialization=True)
    assert config.sequence_parallel and config.normalization == "RMSNorm"
    assert not (config.gradient_accumulation_fusion or config.masked_softmax_fusion
                or config.apply_rope_fusion)
    spec = cm.llama_block_spec(config, mode, backend="nccl")
    assert len(spec.layer_specs) == 3 and spec.layer_norm is SequenceParallelRMSNorm
    sub = spec.layer_specs[0].submodules
    assert issubclass(sub.self_attention.submodules.linear_qkv, FluxColumnParallelLinear)
    mlp = sub.mlp
    mlp_sub = mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules
    assert issubclass(mlp_sub.linear_fc2, FluxRowParallelLinear)
    assert sub.input_layernorm is SequenceParallelRMSNorm
    assert sub.pre_mlp_layernorm is SequenceParallelRMSNorm


def test_custom_model_backend_choices_are_the_registrys(capsys):
    from megatron_flux.backends import BACKEND_CHOICES

    cm = _load_example("custom_model")
    for name in BACKEND_CHOICES:
        assert cm.parse_args(["--backend", name]).backend == name
    assert cm.parse_args([]).backend == "auto"
    with pytest.raises(SystemExit):
        cm.parse_args(["--backend", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cm.parse_args(["--help"])
    assert "megatron" in capsys.readouterr().out.split("--backend", 1)[1]


def test_custom_model_says_it_needs_gpus():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the example would train")
    res = subprocess.run([sys.executable, str(EXAMPLES / "custom_model.py"), "--steps", "1"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode != 0 and "NVIDIA GPUs" in res.stderr


# ---------------------------------------------------------------- launchers


SCRIPTS = ["pretrain_llama.sh", "pretrain_gpt.sh", "device_smoke.sh", "_common.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(EXAMPLES / script)], check=True)


@pytest.mark.parametrize("script", ["pretrain_llama.sh", "pretrain_gpt.sh"])
@pytest.mark.parametrize("gpus", [0, 1])
def test_launchers_refuse_without_two_gpus(tmp_path, script, gpus):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: x)'\n" for i in range(gpus))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(0o755)
    res = subprocess.run(["bash", str(EXAMPLES / script)], capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{fake}:/usr/bin:/bin"})
    assert res.returncode == 2
    assert f"at least 2 NVIDIA GPUs (found {gpus}" in res.stderr


def test_launchers_pass_the_flag_tp_and_sequence_parallel():
    common = (EXAMPLES / "_common.sh").read_text()
    for needed in ('--tensor-model-parallel-size "${NPROC}"', "--sequence-parallel",
                   "--transformer-impl local", "--mock-data", "--tokenizer-type NullTokenizer",
                   "--log-throughput", "--nproc-per-node \"${NPROC}\""):
        assert needed in common, needed
    assert "pip install -" not in common.replace("pip install 'megatron", "")  # installs nothing
    for script, config in (("pretrain_llama.sh", "configs/llama3_8b_16l.json"),
                           ("pretrain_gpt.sh", "configs/gpt3_175b_4l.json")):
        text = (EXAMPLES / script).read_text()
        assert "flux_megatron_args" in text and '"${FLUX_ARGS[@]}"' in text
        assert config in text and "require_gpus 2" in text


def test_launchers_say_what_is_missing_instead_of_installing(tmp_path):
    """Without megatron-core 0.19 the launcher stops with what to install; it installs nothing
    (this CPU machine has megatron-core 0.16, or none at all in the empty environment)."""
    script = f'source "{EXAMPLES}/_common.sh"; PYTHON="{sys.executable}"; ensure_megatron'
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    assert "need 0.19" in res.stderr or "cannot import megatron.core" in res.stderr, res.stderr
    assert "megatron-flux[train]" in res.stderr or "megatron-core>=0.19" in res.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    res = subprocess.run(["bash", "-c", f'source "{EXAMPLES}/_common.sh"; PYTHON=/usr/bin/python3; '
                          "ensure_megatron"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(bare)})
    assert res.returncode == 2 and "cannot import megatron.core" in res.stderr, res.stderr
    assert not (bare / ".local").exists()


def _fake_interpreter(tmp_path, probe_lines):
    """An interpreter stand-in: ``probe_lines`` for the launcher's import probe, a failure for
    anything else; every start is counted in ``heavy``."""
    heavy = tmp_path / "heavy"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\necho start >> \"" + str(heavy) + "\"\n"
                    'case "$2" in *python_version*) printf "%s\\n" '
                    + " ".join(f"'{line}'" for line in probe_lines) + ";;\n"
                    "*) exit 1;; esac\n")
    fake.chmod(0o755)
    return fake, heavy


@pytest.mark.parametrize("probe, error", [
    (["python 3.12.3", "python_supported 1", "torch_cuda 1", "megatron_core 0.19.2", "megatron_training 1", "megatron_flux 1"], None),
    (["python 3.12.3", "python_supported 1", "torch_cuda 0"], "PyTorch is missing or has no CUDA"),
    (["python 3.12.3", "python_supported 1", "torch_cuda 1", "megatron_core 0.19.2", "megatron_training 0", "megatron_flux 1"],
     "megatron-core 0.19.2 is importable but megatron.training is not"),
    (["python 3.12.3", "python_supported 1", "torch_cuda 1", "megatron_core 0.19.2", "megatron_training 1",
      "megatron_flux 0 ImportError: no module named triton"], "(ImportError: no module named triton)"),
])
def test_launcher_checks_start_the_interpreter_once(tmp_path, probe, error):
    """The launcher's checks of the interpreter (Python, CUDA torch, megatron-core 0.19 with
    megatron.training, megatron-flux) read one probe: each interpreter start imports torch and
    megatron-core again, seconds each before the job starts."""
    fake, heavy = _fake_interpreter(tmp_path, probe)
    res = subprocess.run(["bash", "-c", f'source "{EXAMPLES}/_common.sh"; PYTHON="{fake}"; '
                          "require_python; ensure_megatron; echo checked"],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    if error is None:
        assert res.returncode == 0 and res.stdout.strip() == "checked", res.stderr
    else:
        assert res.returncode == 2 and error in res.stderr, res.stderr
    assert heavy.read_text().count("start") == 1


@pytest.mark.parametrize("env,expected", [
    ({}, "--flux-tp-overlap --flux-backend auto"),
    ({"FLUX_BACKEND": "flux"}, "--flux-tp-overlap --flux-backend flux"),
    ({"FLUX_TP_OVERLAP": "0", "FLUX_BACKEND": "flux"}, ""),
])
def test_launcher_flag_switch(env, expected):
    res = subprocess.run(
        ["bash", "-c", f'source "{EXAMPLES}/_common.sh"; flux_megatron_args; echo "${{FLUX_ARGS[*]}}"'],
        capture_output=True, text=True,
        env={k: v for k, v in {**os.environ, **env}.items()
             if k not in ("FLUX_TP_OVERLAP", "FLUX_BACKEND") or k in env})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected


def test_launcher_preflight_prints_the_check_verdict_with_the_flag_only():
    """run_pretrain first prints `megatron-flux check`'s verdict at the job's TP size (this CPU
    machine: unavailable, and why); without the flag, nothing."""
    assert "flux_preflight" in (EXAMPLES / "_common.sh").read_text().split("run_pretrain()")[1]
    script = (f'source "{EXAMPLES}/_common.sh"; PYTHON="{sys.executable}"; NPROC=2; '
              'FLUX_ARGS=(--flux-tp-overlap); flux_preflight; echo ---; FLUX_ARGS=(); flux_preflight')
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    with_flag, without = res.stdout.split("---\n")
    assert with_flag.startswith("> megatron-flux check: fused backend: ")
    assert without == ""


def _dry_run_config(cwd, **env):
    """The ``--model-config`` value of pretrain_llama.sh's dry run, started in ``cwd``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "MODEL_CONFIG"))}
    res = subprocess.run(["bash", str(EXAMPLES / "pretrain_llama.sh")], capture_output=True,
                         text=True, cwd=cwd, env={**full, **env, "FLUX_DRY_RUN": "1"})
    lines = res.stdout.splitlines()
    return res, (lines[lines.index("--model-config") + 1] if "--model-config" in lines else None)


def test_launcher_resolves_a_relative_model_config_from_the_callers_directory(tmp_path):
    """A relative MODEL_CONFIG means the file in the directory the launcher was started in,
    even where the checkout has one of the same name; one only the checkout has
    (``configs/...``) is found there; one nowhere stops the launcher."""
    mine = tmp_path / "my.json"
    mine.write_text((REPO / "configs/tiny_smoke.json").read_text())
    (tmp_path / "configs").mkdir()
    theirs = tmp_path / "configs" / "tiny_smoke.json"
    theirs.write_text(mine.read_text())
    for given, expected in (("my.json", mine), ("./my.json", mine), ("configs/../my.json", mine),
                            ("configs/tiny_smoke.json", theirs),
                            ("configs/llama3_8b_16l.json", REPO / "configs/llama3_8b_16l.json"),
                            (str(mine), mine)):
        res, config = _dry_run_config(tmp_path, MODEL_CONFIG=given)
        assert res.returncode == 0, res.stderr
        assert config == str(expected), given
    res, config = _dry_run_config(tmp_path)  # the launcher's default, from anywhere
    assert config == str(REPO / "configs/llama3_8b_16l.json")
    res, _ = _dry_run_config(tmp_path, MODEL_CONFIG="nope.json")
    assert res.returncode == 2 and "model config nope.json not found" in res.stderr


def test_tokens_per_microbatch_follows_the_command_line_over_the_config(tmp_path):
    tiny = str(REPO / "configs/tiny_smoke.json")  # seq-length 512, micro-batch-size 2
    assert ps.tokens_per_microbatch(["--model-config", tiny]) == 1024
    assert ps.tokens_per_microbatch(["--model-config", tiny, "--micro-batch-size", "4"]) == 2048
    assert ps.tokens_per_microbatch(["--seq-length=256", "--model-config", tiny]) == 512
    assert ps.tokens_per_microbatch(["--seq-length", "128"]) == 128
    assert ps.tokens_per_microbatch(["--micro-batch-size", "2"]) is None
    out = subprocess.run([sys.executable, str(EXAMPLES / "pretrain_support.py"),
                          "--tokens-per-microbatch", "--model-config", tiny, "--flux-tp-overlap",
                          "--seq-length", "2048"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4096"


def test_launcher_preflight_plans_the_jobs_tokens_per_microbatch(tmp_path):
    """The pre-flight plan gets the m the job runs: with --micro-batch-size or --seq-length
    after the script name, the command line's, else the config's."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\ncase " $* " in *" check "*) exit 0;; *" plan "*) echo "$*"; exit 0;; esac\n'
                    f'exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    tiny = REPO / "configs/tiny_smoke.json"
    for extra, m in (("", "1024"), ("--micro-batch-size 4", "2048"),
                     ("--seq-length 2048 --micro-batch-size 1", "2048")):
        script = (f'source "{EXAMPLES}/_common.sh"; PYTHON="{fake}"; NPROC=2; '
                  f'FLUX_ARGS=(--flux-tp-overlap); flux_preflight "{tiny}" "${{FLUX_ARGS[@]}}" {extra}')
        res = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().endswith(f"plan --model-config {tiny} --tp 2 --m {m} --offer"), res.stdout


# ---------------------------------------------------------------- megatron.training flow


def _megatron_training_or_skip():
    try:
        import megatron.training  # noqa: F401
        import megatron.training.argument_utils  # noqa: F401
    except Exception as exc:  # Python < 3.12 (typing.override), megatron-core < 0.19
        pytest.skip(f"megatron.training is not importable here: {type(exc).__name__}: {exc}")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("Megatron's argument validation queries the GPU (needs CUDA)")


_FLOW = r"""
import sys
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
import importlib.util
spec = importlib.util.spec_from_file_location("pretrain_gpt", sys.argv.pop(1))
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
args, full = mod.make_pretrain_config()
t = full.model.transformer
hook = full.model.transformer_layer_spec
print("RESULT", args.flux_tp_overlap, args.flux_backend, t.sequence_parallel,
      t.tensor_model_parallel_size, t.normalization, t.num_layers,
      t.gradient_accumulation_fusion and not
      __import__("megatron.core.tensor_parallel.layers", fromlist=["x"])._grad_accum_fusion_available,
      hook is not None and hook.__name__,
      [getattr(h, "func", h).__name__ for h in full.model.pre_wrap_hooks])
"""


def test_pretrain_flow_parses_flag_and_swaps_spec():
    _megatron_training_or_skip()
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-c", _FLOW, str(EXAMPLES / "pretrain_gpt.py"),
         "--model-config", str(REPO / "configs/tiny_smoke.json"),
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--transformer-impl", "local",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "2",
         "--flux-tp-overlap", "--flux-backend", "nccl"],
        capture_output=True, text=True, env=env, timeout=600)
    line = [l for l in res.stdout.splitlines() if l.startswith("RESULT")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    assert line[0].split()[1:] == ["True", "nccl", "True", "2", "RMSNorm", "2", "False",
                                   "flux_layer_spec", "['swap_output_layer']"]


# ---------------------------------------------------------------- interleaved backends


class _FakeLinear:
    def __init__(self):
        self.flux_backend = "auto"


def test_interleaver_rotates_backends_in_blocks(monkeypatch):
    """Iteration i runs backends[(i // steps) % n]; every Flux linear is switched, and each
    switch is logged once with Megatron's 1-based iteration number."""
    import megatron_flux.layers.linear as L

    class FakeCol(_FakeLinear, L.FluxColumnParallelLinear):
        def __init__(self):
            _FakeLinear.__init__(self)

    class FakeRow(_FakeLinear, L.FluxRowParallelLinear):
        def __init__(self):
            _FakeLinear.__init__(self)

    layers = [FakeCol(), FakeRow(), FakeCol()]

    class Model:
        def modules(self):
            return iter([object()] + layers)

    inter = ps.BackendInterleaver(["megatron", "nccl", "flux"], steps=2)
    model, logged = Model(), []
    seen = [inter.switch(model, i, logged.append) for i in range(8)]
    assert seen == ["megatron", "megatron", "nccl", "nccl", "flux", "flux", "megatron", "megatron"]
    assert all(layer.flux_backend == "megatron" for layer in layers)
    assert logged == [f"{ps.INTERLEAVE_TAG} iteration {k}: backend {b}"
                      for k, b in ((1, "megatron"), (3, "nccl"), (5, "flux"), (7, "megatron"))]


def test_interleaver_keep_blocks_set_keep_gathered_input_on_column_layers_only():
    """``flux+keep`` runs ``flux`` with the column layers keeping the gathered input; the
    blocks after it get the job's own value back."""
    import megatron_flux.layers.linear as L

    class FakeCol(_FakeLinear, L.FluxColumnParallelLinear):
        def __init__(self, keep):
            _FakeLinear.__init__(self)
            self.flux_keep_gathered_input = keep

    class FakeRow(_FakeLinear, L.FluxRowParallelLinear):
        def __init__(self):
            _FakeLinear.__init__(self)

    cols, row = [FakeCol(False), FakeCol(True)], FakeRow()

    class Model:
        def modules(self):
            return iter(cols + [row])

    inter = ps.BackendInterleaver(["flux", "flux+keep", "nccl"], steps=1)
    model, logged = Model(), []
    states = []
    for i in range(4):
        assert inter.switch(model, i, logged.append) == ["flux", "flux+keep", "nccl", "flux"][i]
        states.append(([c.flux_backend for c in cols] + [row.flux_backend],
                       [c.flux_keep_gathered_input for c in cols]))
    assert states == [(["flux"] * 3, [False, True]), (["flux"] * 3, [True, True]),
                      (["nccl"] * 3, [False, True]), (["flux"] * 3, [False, True])]
    assert not hasattr(row, "flux_keep_gathered_input")
    assert logged[1] == f"{ps.INTERLEAVE_TAG} iteration 2: backend flux+keep"
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):
        ps.BackendInterleaver(["fast+keep"], steps=1)
    with pytest.raises(ValueError, match=r"unknown modifier.*'kept'"):
        ps.BackendInterleaver(["flux+kept"], steps=1)


def test_interleaver_ncclgather_blocks_switch_the_fused_backends_regather(monkeypatch):
    """``flux+ncclgather`` sets the fused backend's ``column_regather`` to ``"nccl"`` for its
    block; the other blocks get the job's own value back; a job without the modifier never
    builds the fused backend."""
    import megatron_flux.backends as B
    import megatron_flux.layers.linear as L

    class FakeCol(_FakeLinear, L.FluxColumnParallelLinear):
        def __init__(self):
            _FakeLinear.__init__(self)
            self.flux_keep_gathered_input = False

    fused = types.SimpleNamespace(column_regather="copy_engine")
    built = []
    monkeypatch.setattr(B, "get_backend", lambda name: built.append(name) or fused)
    col = FakeCol()

    class Model:
        def modules(self):
            return iter([col])

    plain = ps.BackendInterleaver(["nccl", "flux"], steps=1)
    for i in range(3):
        plain.switch(Model(), i, lambda _: None)
    assert built == []
    inter = ps.BackendInterleaver(["flux", "flux+ncclgather+keep", "nccl"], steps=1)
    model, seen = Model(), []
    for i in range(4):
        inter.switch(model, i, lambda _: None)
        seen.append((col.flux_backend, fused.column_regather, col.flux_keep_gathered_input))
    assert seen == [("flux", "copy_engine", False), ("flux", "nccl", True),
                    ("nccl", "copy_engine", False), ("flux", "copy_engine", False)]


def test_interleaver_auto_blocks_run_what_the_step_selection_chose():
    """A block named ``auto`` runs what ``--flux-backend auto`` would: the job first runs the
    step-time selection (logged as backend ``selecting``), then the blocks rotate from there, and
    ``auto`` blocks run its choice; ``auto-op`` runs the per-op setting; ``+nokeep`` and
    ``+cegather`` set the re-gather forms."""
    import megatron_flux.backends as B
    import megatron_flux.layers.linear as L

    class FakeCol(_FakeLinear, L.FluxColumnParallelLinear):
        def __init__(self):
            _FakeLinear.__init__(self)
            self.flux_keep_gathered_input = True

    col = FakeCol()
    fused = types.SimpleNamespace(column_regather="nccl")

    class Model:
        def modules(self):
            return iter([col])

    class Selector:
        def __init__(self, layers, log):
            self.layers, self.decided, self.steps = layers, None, []

        def step(self, iteration):
            self.steps.append(iteration)
            if len(self.steps) == 3:
                self.decided = "nccl"
            return self.decided

    import pytest as _pytest

    mp = _pytest.MonkeyPatch()
    mp.setattr(B, "get_backend", lambda name: fused)
    try:
        inter = ps.BackendInterleaver(["megatron", "auto", "auto-op", "flux+nokeep+cegather"],
                                      steps=1, selector_factory=Selector)
        model, logged, seen = Model(), [], []
        for i in range(7):
            seen.append((inter.switch(model, i, logged.append), col.flux_backend,
                         col.flux_keep_gathered_input, fused.column_regather))
    finally:
        mp.undo()
    assert inter.selector.steps == [0, 1, 2]
    assert [s[0] for s in seen] == ["selecting", "selecting", "megatron", "auto", "auto-op",
                                    "flux+nokeep+cegather", "megatron"]
    assert seen[3][1] == "nccl" and seen[4][1] == "auto"
    assert seen[5][1:] == ("flux", False, "copy_engine") and seen[6][2:] == (True, "nccl")
    assert logged[0] == f"{ps.INTERLEAVE_TAG} iteration 1: backend selecting"
    assert logged[1] == f"{ps.INTERLEAVE_TAG} iteration 3: backend megatron"
    with pytest.raises(ValueError, match="contradictory"):
        ps.BackendInterleaver(["flux+keep+nokeep"], steps=1)


def test_interleaver_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):
        ps.BackendInterleaver(["megatron", "fast"], steps=2)
    with pytest.raises(ValueError, match=">= 1"):
        ps.BackendInterleaver(["nccl"], steps=0)

    class Empty:
        def modules(self):
            return iter([object()])

    with pytest.raises(RuntimeError, match="no Flux linears"):
        ps.BackendInterleaver(["nccl"], steps=1).switch(Empty(), 0)
    args = argparse.Namespace(flux_interleave_backends=["nccl"], flux_interleave_steps=3,
                              flux_tp_overlap=False)
    with pytest.raises(ValueError, match="needs --flux-tp-overlap"):
        ps.backend_interleaver(args)
    args.flux_tp_overlap = True
    inter = ps.backend_interleaver(args)
    assert inter.steps == 3 and ps.backend_interleaver(args) is inter  # cached
    assert ps.backend_interleaver(argparse.Namespace()) is None


def test_interleave_args_parse():
    parser = ps.add_example_args(argparse.ArgumentParser())
    args = parser.parse_args(["--flux-interleave-backends", "megatron", "flux", "--flux-interleave-steps", "4"])
    assert args.flux_interleave_backends == ["megatron", "flux"] and args.flux_interleave_steps == 4
    assert parser.parse_args([]).flux_interleave_backends is None


def test_interleave_variants_register_fused_backends_with_changed_configs(monkeypatch):
    """--flux-interleave-variants NAME=JSON: a fused backend whose config per call is the
    tables' with the JSON's fields changed, only for the ops it names."""
    from megatron_flux.backends import get_backend, registry
    from megatron_flux.backends.flux.variant import variant_backend
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.tuning.provider import TableConfigProvider

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_INSTANCES", {})
    parser = ps.add_example_args(argparse.ArgumentParser())
    args = parser.parse_args(["--flux-interleave-backends", "flux", "rsce", "--flux-interleave-variants",
                              'rsce={"ops": ["GEMM+RS"], "rs_copy_engine": true, "num_stages": 4}'])
    args.flux_tp_overlap = True
    inter = ps.backend_interleaver(args)
    assert inter.backends == ["flux", "rsce"]

    class Recorder:
        def __init__(self, config_provider):
            self.provider = config_provider

    rec = variant_backend({"rs_copy_engine": True, "num_stages": 4}, ["rs"], backend_cls=Recorder)
    table = TableConfigProvider()
    shape = (8192, 4096, 2048)
    rs = rec.provider("rs", *shape, tp=2)
    want = GemmConfig.from_dict({**table("rs", *shape, tp=2).to_dict(), "rs_copy_engine": True, "num_stages": 4})
    assert rs == want and rs != table("rs", *shape, tp=2)
    assert rec.provider("ag", 8192, 3072, 4096, tp=2) == table("ag", 8192, 3072, 4096, tp=2)  # not named
    assert ps.parse_variant('v={"block_n": 128}') == ("v", {"block_n": 128}, None)
    # the registered factory builds that backend (here a stand-in class, no GPU needed)
    import megatron_flux.backends.flux.backend as fb
    monkeypatch.setattr(fb, "FluxBackend", type("FakeFlux", (registry.TPOverlapBackend,), {
        "__init__": lambda self, config_provider: setattr(self, "provider", config_provider),
        "all_gather_matmul": None, "matmul_reduce_scatter": None, "all_gather": None,
        "reduce_scatter": None}))
    built = get_backend("rsce")
    assert built.provider("rs", *shape, tp=2) == want


@pytest.mark.parametrize("spec, match", [
    ("rsce", "NAME=JSON"), ("flux={}", "taken"), ("a+b={}", "NAME=JSON"), ("v={oops", "not JSON"),
    ("v=[1]", "JSON object"), ('v={"ops": []}', "non-empty list"), ('v={"ops": ["allreduce"]}', "allreduce"),
    ('v={"blok_n": 64}', "unknown GemmConfig fields"), ('v={"block_n": 100}', "v"),
])
def test_interleave_variants_refuse_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        ps.parse_variant(spec)
    args = argparse.Namespace(flux_interleave_variants=["v={}"], flux_tp_overlap=True)
    with pytest.raises(ValueError, match="needs --flux-interleave-backends"):
        ps.backend_interleaver(args)
