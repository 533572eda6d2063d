"""--flux-* flags: parsing, composition with other providers, validation, spec selection."""

import argparse
import json
import warnings

import pytest
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_flux.arguments import (
    FluxArgumentError,
    add_flux_args,
    apply_flux_args_to_config,
    compose_extra_args_providers,
    flux_pre_wrap_hooks,
    flux_spec_from_args,
    load_flux_config,
    validate_flux_args,
)
from megatron_flux.layers.norms import SequenceParallelLayerNorm, SequenceParallelRMSNorm
from helpers.dist_harness import gloo_world_of_one
from helpers.spec_utils import mlp_submodules
from test_specs import flux_linears  # noqa: F401  (fixture)


def parse(argv, provider=add_flux_args):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = provider(parser)
    return parser.parse_args(argv)


def megatron_like_args(argv=(), **megatron):
    """Parsed flux flags plus the Megatron attributes validation and spec selection read."""
    args = parse(list(argv))
    base = dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        tp_comm_overlap=False,
        transformer_impl="local",
        normalization="LayerNorm",
        num_experts=None,
        moe_grouped_gemm=False,
        qk_layernorm=False,
        multi_latent_attention=False,
        qk_l2_norm=False,
        spec=None,
    )
    base.update(megatron)
    for key, value in base.items():
        setattr(args, key, value)
    return args


# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------


def test_defaults():
    args = parse([])
    assert args.flux_tp_overlap is False
    assert args.flux_backend == "auto"
    assert args.flux_config is None
    assert args.flux_keep_gathered_input is True
    assert args.flux_gradient_accumulation_fusion is False
    assert args.flux_output_layer is True


def test_flags_parse():
    args = parse(
        ["--flux-tp-overlap", "--flux-backend", "nccl", "--flux-config", "t.json",
         "--no-flux-keep-gathered-input"]
    )
    assert args.flux_tp_overlap and not args.flux_keep_gathered_input
    assert args.flux_backend == "nccl" and args.flux_config == "t.json"


def test_backend_choices_enforced(capsys):
    with pytest.raises(SystemExit):
        parse(["--flux-backend", "nvshmem"])
    assert "invalid choice" in capsys.readouterr().err


def test_provider_returns_parser_and_adds_named_group():
    parser = argparse.ArgumentParser()
    assert add_flux_args(parser) is parser
    titles = [g.title for g in parser._action_groups]
    assert "megatron-flux" in titles
    group = next(g for g in parser._action_groups if g.title == "megatron-flux")
    assert {a.dest for a in group._group_actions} == {
        "flux_tp_overlap", "flux_backend", "flux_config", "flux_keep_gathered_input",
        "flux_column_dgrad", "flux_column_regather", "flux_gradient_accumulation_fusion",
        "flux_output_layer", "flux_step_auto",
    }


def test_compose_with_another_provider():
    calls = []

    def script_provider(parser):
        calls.append("script")
        group = parser.add_argument_group(title="script")
        group.add_argument("--my-flag", type=int, default=3)
        return parser

    def sloppy_provider(parser):  # forgets to return the parser
        calls.append("sloppy")
        parser.add_argument("--other", action="store_true")

    provider = compose_extra_args_providers(script_provider, None, add_flux_args, sloppy_provider)
    args = parse(["--my-flag", "5", "--flux-tp-overlap", "--other"], provider=provider)
    assert calls == ["script", "sloppy"]
    assert args.my_flag == 5 and args.flux_tp_overlap and args.other
    parser = argparse.ArgumentParser()
    assert provider(parser) is parser


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def test_valid_combination_passes_silently():
    args = megatron_like_args(["--flux-tp-overlap"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_flux_args(args) is args
    assert args.flux_tp_overlap is True


def test_data_parallel_overlap_warns_once_unless_sms_are_reserved(monkeypatch):
    """NCCL's data-parallel kernels beside the persistent grids: one warning naming the flag
    and the knob; none at DP 1, without the overlap flags, or with SMs reserved."""
    monkeypatch.delenv("MEGATRON_FLUX_RESERVED_SMS", raising=False)
    args = megatron_like_args(["--flux-tp-overlap"], data_parallel_size=4,
                              overlap_grad_reduce=True)
    with pytest.warns(UserWarning, match="--overlap-grad-reduce at data-parallel size 4.*"
                      "MEGATRON_FLUX_RESERVED_SMS") as record:
        validate_flux_args(args)
    assert len(record) == 1
    quiet = [dict(data_parallel_size=1, overlap_grad_reduce=True),
             dict(data_parallel_size=4, overlap_grad_reduce=False, overlap_param_gather=False)]
    for megatron in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            validate_flux_args(megatron_like_args(["--flux-tp-overlap"], **megatron))
    monkeypatch.setenv("MEGATRON_FLUX_RESERVED_SMS", "16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_flux_args(args)
    monkeypatch.delenv("MEGATRON_FLUX_RESERVED_SMS")
    with pytest.warns(UserWarning, match="--overlap-param-gather"):
        validate_flux_args(megatron_like_args(["--flux-tp-overlap"], data_parallel_size=2,
                                              overlap_param_gather=True))


def test_off_is_not_validated_against_megatron_flags():
    args = megatron_like_args([], sequence_parallel=False, tp_comm_overlap=True,
                              transformer_impl="transformer_engine")
    validate_flux_args(args)


def test_requires_sequence_parallel():
    args = megatron_like_args(["--flux-tp-overlap"], sequence_parallel=False)
    with pytest.raises(FluxArgumentError, match="requires --sequence-parallel"):
        validate_flux_args(args)


def test_tp1_is_a_noop_with_exactly_one_warning():
    # Megatron's own validation already turned SP off at TP=1; that must not be an error here.
    args = megatron_like_args(["--flux-tp-overlap"], tensor_model_parallel_size=1,
                              sequence_parallel=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_flux_args(args)
        validate_flux_args(args)  # validating again does not warn again
    assert len(caught) == 1
    assert issubclass(caught[0].category, UserWarning)
    assert "--tensor-model-parallel-size 1" in str(caught[0].message)
    assert args.flux_tp_overlap is False
    assert flux_spec_from_args(args) is None


def test_two_overlap_systems_rejected():
    args = megatron_like_args(["--flux-tp-overlap"], tp_comm_overlap=True)
    with pytest.raises(FluxArgumentError, match="--tp-comm-overlap"):
        validate_flux_args(args)


def test_transformer_engine_impl_rejected():
    args = megatron_like_args(["--flux-tp-overlap"], transformer_impl="transformer_engine")
    with pytest.raises(FluxArgumentError, match="--transformer-impl local"):
        validate_flux_args(args)


def test_selective_recompute_modules_that_need_transformer_engine_rejected(monkeypatch):
    from megatron_flux import arguments

    monkeypatch.setattr(arguments, "_have_transformer_engine", lambda: False)
    for modules in (["layernorm"], ["mlp", "moe_act"], ["core_attn", "mla_up_proj"]):
        args = megatron_like_args(["--flux-tp-overlap"], recompute_granularity="selective",
                                  recompute_modules=modules)
        with pytest.raises(FluxArgumentError, match="needs Transformer Engine"):
            validate_flux_args(args)
    # what runs without it (tests/unit/test_gpt_model_sp.py recomputes through the plugin's layers)
    for granularity, modules in (("selective", ["mlp", "core_attn"]), ("selective", None),
                                 ("full", ["layernorm"]), (None, ["layernorm"])):
        validate_flux_args(megatron_like_args(["--flux-tp-overlap"], recompute_granularity=granularity,
                                              recompute_modules=modules))
    monkeypatch.setattr(arguments, "_have_transformer_engine", lambda: True)
    validate_flux_args(megatron_like_args(["--flux-tp-overlap"], recompute_granularity="selective",
                                          recompute_modules=["layernorm"]))


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("use_legacy_models", True, "legacy"),
        ("experimental_attention_variant", "dsa", "experimental-attention-variant"),
        ("use_kitchen", True, "Kitchen"),
        ("heterogeneous_layers_config_path", "layers.json", "heterogeneous"),
        ("spec", ["my.module", "my_spec"], "--spec"),
    ],
)
def test_unsupported_spec_paths_rejected(name, value, match):
    args = megatron_like_args(["--flux-tp-overlap"], **{name: value})
    with pytest.raises(FluxArgumentError, match=match):
        validate_flux_args(args)


def test_flux_config_validation(tmp_path):
    good = tmp_path / "table.json"
    good.write_text(json.dumps({"m4096_n8192_k4096": {"block_m": 128}}))
    assert load_flux_config(str(good)) == {"m4096_n8192_k4096": {"block_m": 128}}
    validate_flux_args(megatron_like_args(["--flux-config", str(good)]))

    with pytest.raises(FluxArgumentError, match="no such file"):
        validate_flux_args(megatron_like_args(["--flux-config", str(tmp_path / "missing.json")]))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FluxArgumentError, match="not valid JSON"):
        validate_flux_args(megatron_like_args(["--flux-config", str(bad)]))
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(FluxArgumentError, match="expected a JSON object, got list"):
        validate_flux_args(megatron_like_args(["--flux-tp-overlap", "--flux-config", str(arr)]))
    with pytest.raises(FluxArgumentError, match="no such file"):
        validate_flux_args(megatron_like_args(["--flux-config", str(tmp_path)]))


# --------------------------------------------------------------------------------------------
# spec selection
# --------------------------------------------------------------------------------------------


def test_spec_is_none_when_overlap_off():
    assert flux_spec_from_args(megatron_like_args([])) is None


@pytest.mark.parametrize(
    "normalization,norm_cls", [("LayerNorm", SequenceParallelLayerNorm), ("RMSNorm", SequenceParallelRMSNorm)]
)
def test_layer_spec_from_args(flux_linears, normalization, norm_cls):
    col, row = flux_linears
    args = megatron_like_args(["--flux-tp-overlap", "--flux-backend", "nccl"],
                              normalization=normalization, qk_layernorm=True)
    validate_flux_args(args)
    spec = flux_spec_from_args(args)
    sub = spec.submodules
    assert sub.input_layernorm is norm_cls
    assert sub.self_attention.submodules.q_layernorm is norm_cls
    assert sub.self_attention.submodules.linear_qkv is col.with_backend("nccl")
    assert mlp_submodules(sub.mlp).linear_fc2 is row.with_backend("nccl")


def test_moe_and_mla_from_args(flux_linears):
    col, _ = flux_linears
    args = megatron_like_args(["--flux-tp-overlap"], num_experts=4, moe_use_legacy_grouped_gemm=False)
    spec = flux_spec_from_args(args)
    experts = mlp_submodules(spec.submodules.mlp).experts
    assert mlp_submodules(experts).linear_fc1 is col.with_backend("auto")
    args = megatron_like_args(["--flux-tp-overlap"], multi_latent_attention=True)
    spec = flux_spec_from_args(args)
    assert spec.submodules.self_attention.submodules.linear_kv_up_proj is col.with_backend("auto")


def test_block_spec_from_args_with_config(flux_linears):
    _, row = flux_linears
    args = megatron_like_args(["--flux-tp-overlap", "--flux-backend", "flux",
                               "--flux-keep-gathered-input"], normalization="RMSNorm")
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                            normalization="RMSNorm", use_cpu_initialization=True)
    block = flux_spec_from_args(args, cfg, pp_rank=0)
    assert cfg.flux_keep_gathered_input is True
    assert isinstance(block, TransformerBlockSubmodules)
    assert block.layer_norm is SequenceParallelRMSNorm
    assert len(block.layer_specs) == 2
    assert mlp_submodules(block.layer_specs[0].submodules.mlp).linear_fc2 is row.with_backend("flux")


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank (the column layer's tp_group), torn down afterwards."""
    with gloo_world_of_one() as group:
        yield group


def test_keep_gathered_input_reaches_the_column_layer(flux_linears, world_of_one):
    """The flag lands where FluxColumnParallelLinear reads it (config.flux_keep_gathered_input)."""
    import torch

    col, _ = flux_linears
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            use_cpu_initialization=True)
    for argv, expected in (([], True), (["--no-flux-keep-gathered-input"], False),
                           (["--flux-keep-gathered-input"], True)):
        apply_flux_args_to_config(megatron_like_args(argv), cfg)
        layer = col(16, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                    gather_output=False, tp_group=world_of_one)
        assert layer.flux_keep_gathered_input is expected


@pytest.mark.parametrize("megatron_gaf", [False, True])
def test_gradient_accumulation_fusion_flag_reaches_both_layers(flux_linears, world_of_one,
                                                               megatron_gaf):
    """``--flux-gradient-accumulation-fusion`` lands where both layers read it; megatron-core's
    own code paths keep Megatron's setting (``gradient_accumulation_fusion``), the plugin's
    ops take either."""
    import torch

    col, row = flux_linears
    for argv, flux_flag in (([], False), (["--flux-gradient-accumulation-fusion"], True)):
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                use_cpu_initialization=True,
                                gradient_accumulation_fusion=megatron_gaf)
        apply_flux_args_to_config(megatron_like_args(argv), cfg)
        assert cfg.flux_gradient_accumulation_fusion is flux_flag
        for cls, kw in ((col, dict(gather_output=False)), (row, dict(input_is_parallel=True,
                                                                     skip_bias_add=True))):
            layer = cls(16, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                        tp_group=world_of_one, **kw)
            assert layer.gradient_accumulation_fusion is megatron_gaf
            assert layer.flux_gradient_accumulation_fusion is (megatron_gaf or flux_flag)


def test_output_layer_pre_wrap_hook(flux_linears, world_of_one):
    """With --flux-tp-overlap one pre-wrap hook converts GPTModel's output layer, with
    --flux-backend's backend, and returns the chunk list as Megatron's hooks must; none without
    the flag or with --no-flux-output-layer."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear

    col, _ = flux_linears
    assert flux_pre_wrap_hooks(megatron_like_args()) == []
    assert flux_pre_wrap_hooks(megatron_like_args(["--flux-tp-overlap", "--flux-backend", "nccl",
                                                   "--no-flux-output-layer"])) == []
    hooks = flux_pre_wrap_hooks(megatron_like_args(["--flux-tp-overlap", "--flux-backend", "nccl"]))
    assert len(hooks) == 1
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            use_cpu_initialization=True)
    model = torch.nn.Module()
    model.output_layer = ColumnParallelLinear(16, 32, config=cfg, init_method=torch.nn.init.zeros_,
                                              bias=False, gather_output=False, tp_group=world_of_one)
    chunks = [model]
    assert hooks[0](chunks) is chunks
    assert type(model.output_layer) is col.with_backend("nccl")


def test_auto_adds_the_step_selection_hook_unless_told_not_to():
    """``--flux-backend auto`` (the default) also installs the step-time selection
    (megatron_flux.step_auto); not with --no-flux-step-auto, another backend, or when the job
    rotates backends itself."""
    from megatron_flux import arguments
    from megatron_flux.arguments import _step_auto_hook

    def hooks(argv, **extra):
        args = megatron_like_args(["--flux-tp-overlap", "--no-flux-output-layer", *argv])
        for k, v in extra.items():
            setattr(args, k, v)
        return flux_pre_wrap_hooks(args)

    check = arguments._optimizer_error_check_hook
    assert hooks([]) == [_step_auto_hook, check]
    assert hooks(["--no-flux-step-auto"]) == [check]
    assert hooks(["--flux-backend", "flux"]) == [check]
    assert hooks([], flux_interleave_backends=["megatron", "flux"]) == [check]


@pytest.mark.parametrize("flag,field,value", [("--flux-column-dgrad", "column_dgrad", "fused"),
                                               ("--flux-column-regather", "column_regather",
                                                "copy_engine")])
def test_backend_flags_become_the_process_options_not_environment(monkeypatch, flag, field,
                                                                  value):
    """``--flux-column-dgrad`` / ``--flux-column-regather`` reach the process's ``FluxOptions``
    (what the fused backend runs with), over the environment's defaults, and nothing is written
    to the environment; a bad value is refused by argparse."""
    import os

    from megatron_flux.options import ENV, get_options, set_options

    monkeypatch.delenv(ENV[field], raising=False)
    before = dict(os.environ)
    try:
        assert getattr(parse([]), flag[2:].replace("-", "_")) is None
        validate_flux_args(megatron_like_args())
        assert getattr(get_options(), field) == "nccl"
        validate_flux_args(megatron_like_args(["--flux-tp-overlap", flag, value]))
        assert getattr(get_options(), field) == value
        monkeypatch.setenv(ENV[field], value)
        validate_flux_args(megatron_like_args())  # the environment is the default
        assert getattr(get_options(), field) == value
        monkeypatch.delenv(ENV[field])
        assert dict(os.environ) == before
        with pytest.raises(SystemExit):
            parse([flag, "cublas"])
    finally:
        set_options(None)


def test_graphs_add_the_fused_error_poll_hook(monkeypatch):
    """With CUDA graphs on, a pre-wrap hook checks the fused kernels' error words at every
    training forward (replayed calls never reach the per-call checks); none without graphs."""
    import torch

    from megatron_flux import arguments
    from megatron_flux.backends import registry

    flags = ["--flux-tp-overlap", "--flux-backend", "flux", "--no-flux-output-layer"]
    assert arguments._graph_error_poll_hook not in flux_pre_wrap_hooks(megatron_like_args(flags))
    hooks = flux_pre_wrap_hooks(megatron_like_args(flags, cuda_graph_impl="local"))
    assert hooks == [arguments._graph_error_poll_hook, arguments._optimizer_error_check_hook]
    polls = []
    monkeypatch.setattr(registry, "poll_fused_errors", lambda: polls.append(1))
    monkeypatch.setattr("megatron_flux.backends.poll_fused_errors", lambda: polls.append(1))
    model = torch.nn.Linear(2, 2)
    assert hooks[0]([model]) == [model]
    model(torch.zeros(1, 2))
    model.eval()
    model(torch.zeros(1, 2))
    assert polls == [1], "one poll per training forward"


@pytest.mark.parametrize("graphs", ["none", "local", "full_iteration"])
def test_every_optimizer_step_checks_the_error_words_first(monkeypatch, graphs):
    """With the fused kernels possible, the error words are read synchronously before every
    optimizer step, graphs or not: a wait that timed out in the step's forward or backward
    raises before the update (the per-call checks report it up to 16 calls late, the graphs'
    poll one forward late); not with the NCCL or megatron-core backends."""
    import torch

    from megatron_flux import arguments
    from megatron_flux.backends import registry
    from megatron_flux.comm.errors import FusedOpTimeout

    flags = ["--flux-tp-overlap", "--no-flux-output-layer", "--no-flux-step-auto"]
    hooks = flux_pre_wrap_hooks(megatron_like_args(flags, cuda_graph_impl=graphs))
    assert hooks[-1] is arguments._optimizer_error_check_hook
    for backend in ("nccl", "megatron"):
        args = megatron_like_args(flags + ["--flux-backend", backend], cuda_graph_impl=graphs)
        assert arguments._optimizer_error_check_hook not in flux_pre_wrap_hooks(args)
        args.flux_interleave_backends = ["megatron", "nccl"]
        assert arguments._optimizer_error_check_hook not in flux_pre_wrap_hooks(args)
        args.flux_interleave_backends = ["megatron", "flux"]  # a job rotating the fused one
        assert arguments._optimizer_error_check_hook in flux_pre_wrap_hooks(args)
        args.flux_interleave_backends, args.flux_interleave_variants = None, ['{"name": "v"}']
        assert arguments._optimizer_error_check_hook in flux_pre_wrap_hooks(args)

    class Fused:  # the fused backend's error check: the second one finds a timed-out wait
        checks = []

        def check_errors(self, sync):
            self.checks.append(sync)
            if len(self.checks) == 2:
                raise FusedOpTimeout("GEMM+RS: rank 1 timed out")

    class Variant:  # a fused variant a job rotates: checked too
        checks = []

        def check_errors(self, sync):
            self.checks.append(sync)

    monkeypatch.setitem(registry._INSTANCES, "flux", Fused())
    monkeypatch.setitem(registry._INSTANCES, "flux_variant_v", Variant())
    monkeypatch.setattr(arguments, "_OPTIMIZER_CHECK", None)
    model = torch.nn.Linear(2, 2)
    try:
        assert hooks[-1]([model]) == [model]
        handle = arguments._OPTIMIZER_CHECK
        assert handle is not None, "the pre-wrap hook installs the optimizer check"
        assert arguments.install_optimizer_error_check() is handle, "once per process"
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        assert Fused.checks == [True] and Variant.checks == [True], "one synchronous check per step"
        before = model.weight.detach().clone()
        with pytest.raises(FusedOpTimeout, match="rank 1"):
            opt.step()
        assert torch.equal(model.weight, before), "no update after a reported timeout"
    finally:
        if arguments._OPTIMIZER_CHECK is not None:
            arguments._OPTIMIZER_CHECK.remove()


def test_layers_built_for_cuda_graphs_reserve_for_capture(flux_linears, world_of_one, monkeypatch):
    """A Flux linear whose config enables megatron-core's CUDA graphs tells the fused backend
    to reserve the graph workspaces from its eager calls on (before the capture); one without
    graphs, or running megatron's own code, does not."""
    import torch

    from megatron_flux.layers import linear

    calls = []
    monkeypatch.setattr(linear, "expect_cuda_graphs", lambda: calls.append(1))
    col, _ = flux_linears
    for graphs, backend, expected in (("none", "auto", 0), ("local", "auto", 1),
                                      ("local", "megatron", 1)):
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                use_cpu_initialization=True)
        cfg.cuda_graph_impl = graphs
        col(16, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
            gather_output=False, tp_group=world_of_one, flux_backend=backend)
        assert len(calls) == expected
