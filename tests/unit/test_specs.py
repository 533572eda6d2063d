"""swap_tp_linears / swap_norms / get_gpt_layer_flux_spec on megatron-core's own local specs."""

import dataclasses
import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from helpers.dist_harness import gloo_world_of_one, run_distributed
from helpers.spec_utils import mlp_submodules

from megatron_flux import specs
from megatron_flux.layers.norms import SequenceParallelLayerNorm, SequenceParallelRMSNorm

STOCK_LINEARS = (ColumnParallelLinear, RowParallelLinear)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture
def flux_linears():
    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    return FluxColumnParallelLinear, FluxRowParallelLinear


def leaves(spec):
    """Every leaf occurrence in a spec (containers visited once, as the rewrite does)."""
    out, seen = [], set()

    def walk(obj):
        is_container = isinstance(obj, (list, tuple, dict, functools.partial)) or (
            dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        )
        if is_container:
            if id(obj) in seen:
                return
            seen.add(id(obj))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)
        elif isinstance(obj, functools.partial):
            walk(obj.func)
            for item in obj.args:
                walk(item)
            for item in obj.keywords.values():
                walk(item)
        else:
            out.append(obj)

    walk(spec)
    return out


def fingerprint(spec):
    """Structure + identities of every container and leaf: changes if anything is mutated."""
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return (
            type(spec),
            id(spec),
            tuple((f.name, fingerprint(getattr(spec, f.name))) for f in dataclasses.fields(spec)),
        )
    if isinstance(spec, (list, tuple)):
        return (type(spec), id(spec), tuple(fingerprint(x) for x in spec))
    if isinstance(spec, dict):
        return (dict, id(spec), tuple((k, fingerprint(v)) for k, v in spec.items()))
    if isinstance(spec, functools.partial):
        return (
            functools.partial,
            id(spec),
            fingerprint(spec.func),
            fingerprint(spec.args),
            tuple((k, fingerprint(v)) for k, v in spec.keywords.items()),
        )
    return ("leaf", id(spec))


def assert_no_stock_linears(spec):
    stock = [leaf for leaf in leaves(spec) if leaf in STOCK_LINEARS]
    stock += [
        leaf.module for leaf in leaves(spec) if isinstance(leaf, ModuleSpec) and leaf.module in STOCK_LINEARS
    ]
    assert not stock, stock


def linear_leaves(spec):
    found = []
    for leaf in leaves(spec):
        if isinstance(leaf, type) and issubclass(leaf, STOCK_LINEARS):
            found.append(leaf)
    return found


# --------------------------------------------------------------------------------------------
# swap_tp_linears
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalization", [None, "RMSNorm"])
@pytest.mark.parametrize("backend", ["auto", "nccl", "flux"])
def test_swap_gpt_and_llama_local_spec(flux_linears, normalization, backend):
    col, row = flux_linears
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=True)
    before = fingerprint(spec)
    stock_linears = linear_leaves(spec)
    assert set(stock_linears) == set(STOCK_LINEARS)

    swapped = specs.swap_tp_linears(spec, backend)

    assert fingerprint(spec) == before, "the input spec was mutated"
    assert_no_stock_linears(swapped)
    attn = swapped.submodules.self_attention.submodules
    assert attn.linear_qkv is col.with_backend(backend)
    assert attn.linear_proj is row.with_backend(backend)
    mlp = mlp_submodules(swapped.submodules.mlp)
    assert mlp.linear_fc1 is col.with_backend(backend)
    assert mlp.linear_fc2 is row.with_backend(backend)
    # Nothing else changed: same leaves except the linears.
    non_linear = lambda s: [x for x in leaves(s) if not (isinstance(x, type) and issubclass(x, STOCK_LINEARS))]
    assert non_linear(swapped) == non_linear(spec)
    # Containers are copies, not the input's objects.
    assert swapped is not spec and swapped.submodules is not spec.submodules
    assert swapped.submodules.sharded_state_dict_keys_map == spec.submodules.sharded_state_dict_keys_map
    assert swapped.submodules.sharded_state_dict_keys_map is not spec.submodules.sharded_state_dict_keys_map


def test_swap_0_19_partial_mlp_builder(flux_linears):
    """0.19 specs hold ``partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))``."""
    col, row = flux_linears

    def as_mlp_submodule(submodules, config, **kwargs):  # 0.16's MLP has no as_mlp_submodule
        return MLP(config=config, submodules=submodules, **kwargs)

    mlp_builder = functools.partial(
        as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    experts = functools.partial(
        MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    layer = get_gpt_layer_local_spec()
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp_builder)
    )
    tree = {"block": TransformerBlockSubmodules(layer_specs=[layer, layer]), "experts": experts}
    before = fingerprint(tree)

    out = specs.swap_tp_linears(tree, "nccl")

    assert fingerprint(tree) == before
    assert_no_stock_linears(out)
    new_mlp = out["block"].layer_specs[0].submodules.mlp
    assert isinstance(new_mlp, functools.partial) and new_mlp is not mlp_builder
    assert new_mlp.func is as_mlp_submodule
    assert new_mlp.keywords["submodules"].linear_fc1 is col.with_backend("nccl")
    assert new_mlp.keywords["submodules"].linear_fc2 is row.with_backend("nccl")
    assert mlp_builder.keywords["submodules"].linear_fc1 is ColumnParallelLinear
    assert out["block"].layer_specs[1].submodules.mlp is new_mlp
    assert out["experts"].func is MLP
    assert out["experts"].keywords["submodules"].linear_fc2 is row.with_backend("nccl")


def test_shared_objects_stay_shared_and_are_walked_once(flux_linears, monkeypatch):
    layer = get_gpt_layer_local_spec()
    shared_mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mlp_a = ModuleSpec(module=MLP, submodules=shared_mlp)
    mlp_b = ModuleSpec(module=MLP, submodules=shared_mlp)
    other = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp_b))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp_a))
    block = TransformerBlockSubmodules(layer_specs=[layer, layer, other, layer])

    visits = []
    real_copy = specs.copy.copy
    monkeypatch.setattr(specs.copy, "copy", lambda obj: visits.append(id(obj)) or real_copy(obj))
    out = specs.swap_tp_linears(block, "auto")

    assert len(visits) == len(set(visits)), "a shared object was copied twice"
    ls = out.layer_specs
    assert ls[0] is ls[1] is ls[3] and ls[0] is not layer
    assert ls[2] is not ls[0]
    assert ls[0].submodules.mlp.submodules is ls[2].submodules.mlp.submodules
    assert ls[0].submodules.mlp.submodules is not shared_mlp
    # Sub-objects megatron's spec function shares across fields (e.g. the same norm class or
    # the same bias-dropout-add function) stay the same objects.
    assert ls[0].submodules.input_layernorm is layer.submodules.input_layernorm


def test_module_spec_leaves_and_import_paths(flux_linears):
    col, row = flux_linears
    params = {"gather_output": False}
    tree = MLPSubmodules(
        linear_fc1=ModuleSpec(module=ColumnParallelLinear, params=params),
        linear_fc2=ModuleSpec(module=("megatron.core.tensor_parallel.layers", "RowParallelLinear")),
    )
    out = specs.swap_tp_linears(tree, "flux")
    assert isinstance(out.linear_fc1, ModuleSpec)
    assert out.linear_fc1.module is col.with_backend("flux")
    assert out.linear_fc1.params == params and out.linear_fc1.params is not params
    assert out.linear_fc2.module is row.with_backend("flux")
    assert tree.linear_fc1.module is ColumnParallelLinear
    assert tree.linear_fc2.module == ("megatron.core.tensor_parallel.layers", "RowParallelLinear")


def test_bound_config_stays_shared(flux_linears):
    """A config bound into a spec (partial or params) is the model's one config: never copied."""
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    tree = MLPSubmodules(
        linear_fc1=functools.partial(ColumnParallelLinear, config=cfg),
        linear_fc2=ModuleSpec(module=RowParallelLinear, params={"config": cfg}),
    )
    out = specs.swap_tp_linears(tree, "auto")
    assert out.linear_fc1.keywords["config"] is cfg
    assert out.linear_fc2.params["config"] is cfg
    assert out.linear_fc1.func is flux_linears[0].with_backend("auto")


def test_flux_leaves_get_the_new_backend(flux_linears):
    col, row = flux_linears
    spec = specs.swap_tp_linears(get_gpt_layer_local_spec(), "nccl")
    respec = specs.swap_tp_linears(spec, "flux")
    mlp = mlp_submodules(respec.submodules.mlp)
    assert mlp.linear_fc1 is col.with_backend("flux")
    assert mlp.linear_fc2 is row.with_backend("flux")
    assert mlp_submodules(spec.submodules.mlp).linear_fc1 is col.with_backend("nccl")
    plain = MLPSubmodules(linear_fc1=col, linear_fc2=row)
    out = specs.swap_tp_linears(plain, "nccl")
    assert out.linear_fc1 is col.with_backend("nccl") and out.linear_fc2 is row.with_backend("nccl")

    class MyFluxColumn(col):  # a user's own Flux subclass keeps its class, changes backend
        pass

    # linear_fc2 has no default in 0.19's MLPSubmodules, so both fields are given.
    tree = MLPSubmodules(linear_fc1=MyFluxColumn.with_backend("nccl"), linear_fc2=row.with_backend("nccl"))
    out = specs.swap_tp_linears(tree, "flux")
    assert out.linear_fc1 is MyFluxColumn.with_backend("flux")
    assert issubclass(out.linear_fc1, MyFluxColumn)
    assert out.linear_fc2 is row.with_backend("flux")


def test_moe_spec_experts_and_shared_experts_swapped(flux_linears):
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    assert len(linear_leaves(spec)) >= 4
    out = specs.swap_tp_linears(spec, "auto")
    assert_no_stock_linears(out)
    assert len(linear_leaves(out)) == len(linear_leaves(spec))


def test_mla_identity_checked_down_projections_stay_stock(flux_linears):
    col, _ = flux_linears
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    out = specs.swap_tp_linears(spec, "auto")
    attn = out.submodules.self_attention.submodules
    assert attn.linear_q_down_proj is ColumnParallelLinear
    assert attn.linear_kv_down_proj is ColumnParallelLinear
    assert attn.linear_q_up_proj is col.with_backend("auto")
    assert attn.linear_kv_up_proj is col.with_backend("auto")


def test_invalid_backend_rejected():
    with pytest.raises(ValueError, match="unknown megatron-flux backend 'nvshmem'"):
        specs.swap_tp_linears(get_gpt_layer_local_spec(), "nvshmem")
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):  # even with no linear
        specs.swap_tp_linears(ModuleSpec(module=IdentityOp), "nvshmem")
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):
        specs.get_gpt_layer_flux_spec(backend="NCCL")


def test_warns_when_nothing_to_swap_or_foreign_linears(flux_linears):
    with pytest.warns(UserWarning, match="found no ColumnParallelLinear"):
        specs.swap_tp_linears(ModuleSpec(module=IdentityOp), "auto")

    class CustomLinear(torch.nn.Module):
        pass

    CustomLinear.__name__ = CustomLinear.__qualname__ = "MyColumnParallelLinear"
    tree = MLPSubmodules(linear_fc1=CustomLinear, linear_fc2=RowParallelLinear)
    with pytest.warns(UserWarning, match="MyColumnParallelLinear"):
        out = specs.swap_tp_linears(tree, "auto")
    assert out.linear_fc1 is CustomLinear


# --------------------------------------------------------------------------------------------
# norms and the GPT/Llama spec
# --------------------------------------------------------------------------------------------


def test_swap_norms_replaces_local_norms_only():
    spec = get_gpt_layer_local_spec(qk_layernorm=True)
    before = fingerprint(spec)
    out = specs.swap_norms(spec, "RMSNorm")
    assert fingerprint(spec) == before
    sub = out.submodules
    assert sub.input_layernorm is SequenceParallelRMSNorm
    assert sub.pre_mlp_layernorm is SequenceParallelRMSNorm
    assert sub.self_attention.submodules.q_layernorm is SequenceParallelRMSNorm
    assert sub.self_attention.submodules.k_layernorm is SequenceParallelRMSNorm
    assert sub.pre_cross_attn_layernorm is IdentityOp
    l2 = specs.swap_norms(get_gpt_layer_local_spec(qk_l2_norm=True), "LayerNorm")
    assert l2.submodules.self_attention.submodules.q_layernorm is L2Norm
    assert l2.submodules.input_layernorm is SequenceParallelLayerNorm
    # Our own norms are re-targeted.
    assert specs.swap_norms(out, "LayerNorm").submodules.input_layernorm is SequenceParallelLayerNorm


@pytest.mark.parametrize(
    "normalization,norm_cls", [("LayerNorm", SequenceParallelLayerNorm), ("RMSNorm", SequenceParallelRMSNorm)]
)
def test_get_gpt_layer_flux_spec(flux_linears, normalization, norm_cls, monkeypatch):
    col, row = flux_linears
    import megatron.core.models.backends as mcore_backends
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

    # With apex installed LNImpl is FusedLayerNorm; megatron's local spec with "RMSNorm"
    # rebinds it to WrappedTorchNorm process-wide. Building our spec must not do that.
    monkeypatch.setattr(mcore_backends, "LNImpl", FusedLayerNorm)
    spec = specs.get_gpt_layer_flux_spec(normalization=normalization, qk_layernorm=True, backend="nccl")
    assert mcore_backends.LNImpl is FusedLayerNorm, "megatron's global LNImpl was rebound"
    assert_no_stock_linears(spec)
    assert not any(leaf in (WrappedTorchNorm,) for leaf in leaves(spec))
    sub = spec.submodules
    assert sub.input_layernorm is norm_cls and sub.pre_mlp_layernorm is norm_cls
    assert sub.self_attention.submodules.q_layernorm is norm_cls
    assert sub.self_attention.submodules.linear_qkv is col.with_backend("nccl")
    assert mlp_submodules(sub.mlp).linear_fc2 is row.with_backend("nccl")


def test_get_gpt_layer_flux_spec_argument_checks(flux_linears):
    with pytest.raises(TypeError, match="does not accept"):
        specs.get_gpt_layer_flux_spec(not_an_argument=1)
    with pytest.raises(ValueError, match="Kitchen"):
        specs.get_gpt_layer_flux_spec(use_kitchen=True)
    with pytest.raises(ValueError, match="no sequence-parallel norm"):
        specs.get_gpt_layer_flux_spec(normalization="L2Norm")
    # Pass-through of an argument the installed get_gpt_layer_local_spec accepts.
    accepted = specs._local_spec_parameters()
    if "moe_use_legacy_grouped_gemm" in accepted:
        specs.get_gpt_layer_flux_spec(num_experts=2, moe_use_legacy_grouped_gemm=False)


def test_final_norm_helper():
    assert specs.get_flux_final_norm("RMSNorm") is SequenceParallelRMSNorm
    assert specs.get_flux_final_norm("LayerNorm") is SequenceParallelLayerNorm


def test_decoder_block_flux_spec_has_our_final_norm(flux_linears):
    cfg = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
        num_moe_experts=2, moe_layer_freq=[1, 0, 1], use_cpu_initialization=True,
    )
    block = specs.get_gpt_decoder_block_flux_spec(cfg, pp_rank=0, backend="nccl")
    assert isinstance(block, TransformerBlockSubmodules)
    assert block.layer_norm is SequenceParallelRMSNorm
    assert len(block.layer_specs) == 3
    assert block.layer_specs[0] is block.layer_specs[2]  # moe layers stay shared
    assert block.layer_specs[1] is not block.layer_specs[0]
    assert_no_stock_linears(block)


def test_flux_spec_provider(flux_linears):
    col, row = flux_linears
    if specs.FluxSpecProvider is None:
        pytest.skip("installed megatron-core has no BackendSpecProvider")
    from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend

    provider = specs.FluxSpecProvider("nccl")
    assert issubclass(specs.FluxSpecProvider, LocalSpecProvider)
    assert BackendSpecProvider in specs.FluxSpecProvider.__mro__
    assert provider.column_parallel_linear() is col.with_backend("nccl")
    assert provider.row_parallel_linear() is row.with_backend("nccl")
    assert provider.layer_norm(rms_norm=True) is SequenceParallelRMSNorm
    assert provider.layer_norm(rms_norm=False, for_qk=True) is SequenceParallelLayerNorm
    assert provider.fuse_layernorm_and_linear() is False
    mlp = get_mlp_module_spec_for_backend(backend=provider)
    assert_no_stock_linears(mlp)
    moe = get_mlp_module_spec_for_backend(backend=provider, num_experts=2)
    assert_no_stock_linears(moe)
    with pytest.raises(NotImplementedError, match="TE-only"):
        provider.linear()
    with pytest.raises(ValueError):
        specs.FluxSpecProvider("bogus")


# --------------------------------------------------------------------------------------------
# building real layers
# --------------------------------------------------------------------------------------------


class CpuCoreAttention(torch.nn.Module):
    """Causal attention with DotProductAttention's call signatures, runnable on CPU.

    megatron-core's DotProductAttention takes its score buffer from the CUDA global memory
    buffer and forks the CUDA RNG tracker, so CPU tests substitute this (in the stock and the
    Flux layer alike: the comparison is about the linears and norms).
    """

    def __init__(self, config, layer_number=1, attn_mask_type=None, attention_type=None, **kwargs):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        sq, b, nq, d = query.shape
        rep = nq // key.shape[2]
        key = key.repeat_interleave(rep, dim=2)
        value = value.repeat_interleave(rep, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(sq, b, nq * d)


def allreduce_sp_grads(module, config):
    """Megatron's ``finalize_model_grads`` step for ``sequence_parallel``-tagged parameters
    (norms, routers): their gradients summed over the TP group, on a DDP-like chunk."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _allreduce_layernorm_grads

    chunk = torch.nn.Module()
    chunk.module = module
    chunk.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_layernorm_grads([chunk], config, parallel_state.get_tensor_model_parallel_group())


def with_cpu_attention(spec):
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(
        attn, submodules=dataclasses.replace(attn.submodules, core_attention=CpuCoreAttention)
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn)
    )


def llama_config(**overrides):
    kw = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


@pytest.fixture(scope="module")
def single_rank_model_parallel():
    """torch.distributed (gloo, world 1) + megatron parallel_state at TP=PP=1, in-process."""
    from megatron.core import parallel_state as ps

    with gloo_world_of_one():
        ps.initialize_model_parallel(1, 1)
        yield
        ps.destroy_model_parallel()


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_layer_from_flux_spec_builds_and_matches_stock_at_tp1(
    flux_linears, single_rank_model_parallel, family
):
    col, row = flux_linears
    if family == "llama":
        cfg = llama_config()
        normalization = "RMSNorm"
    else:
        cfg = llama_config(
            normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu,
            add_bias_linear=True, num_query_groups=None,
        )
        normalization = "LayerNorm"
    stock_spec = with_cpu_attention(get_gpt_layer_local_spec(normalization=normalization))
    flux_spec = with_cpu_attention(
        specs.get_gpt_layer_flux_spec(normalization=normalization, backend="nccl")
    )
    torch.manual_seed(0)
    stock = build_module(stock_spec, config=cfg, layer_number=1)
    flux = build_module(flux_spec, config=cfg, layer_number=1)
    assert type(flux.self_attention.linear_qkv) is col.with_backend("nccl")
    assert type(flux.mlp.linear_fc2) is row.with_backend("nccl")
    assert type(flux.input_layernorm) is specs.get_flux_final_norm(normalization)

    # Same parameter names: a stock checkpoint loads into the Flux layer and vice versa.
    assert list(flux.state_dict()) == list(stock.state_dict())
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    flux.load_state_dict(stock.state_dict())

    x = torch.randn(8, 2, cfg.hidden_size)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_s, _ = stock(xs, attention_mask=None)
    out_f, _ = flux(xf, attention_mask=None)
    torch.testing.assert_close(out_f, out_s)
    dy = torch.randn_like(out_s)
    out_s.backward(dy)
    out_f.backward(dy)
    torch.testing.assert_close(xf.grad, xs.grad)
    for (name, ps_), pf in zip(stock.named_parameters(), flux.parameters()):
        torch.testing.assert_close(pf.grad, ps_.grad, msg=name)

    # Distributed-checkpoint keys are the stock ones too; the norms' map onto TE's fused names.
    def ckpt_keys(layer):
        return {k: v.key for k, v in layer.sharded_state_dict(prefix="decoder.layers.0.").items()}

    keys = ckpt_keys(flux)
    assert keys == ckpt_keys(stock)
    assert keys["decoder.layers.0.input_layernorm.weight"] == (
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )


# --------------------------------------------------------------------------------------------
# TP=2 with sequence parallelism (gloo) against the stock layer at TP=1
# --------------------------------------------------------------------------------------------

TP = 2


def shard_llama_param(name, full, rank, tp=TP):
    """This rank's slice of a full (TP=1) Llama-layer parameter, Megatron's TP layout."""
    if name.endswith("layernorm.weight"):
        return full  # replicated
    if name == "self_attention.linear_qkv.weight":
        return full.chunk(tp, dim=0)[rank]  # rows are grouped by query group, groups split
    if name == "mlp.linear_fc1.weight":  # [gate; up], each split: local [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if name in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return full.chunk(tp, dim=1)[rank]
    raise KeyError(name)


def _tp2_sp_llama_layer(rank, world_size, full_params, x_full, dy_full):
    """For keep_gathered_input False and True: this rank's output, input grad, param grads."""
    results = {}
    for keep_gathered_input in (False, True):
        cfg = llama_config(tensor_model_parallel_size=TP, sequence_parallel=True)
        cfg.flux_keep_gathered_input = keep_gathered_input
        spec = with_cpu_attention(specs.get_gpt_layer_flux_spec(normalization="RMSNorm"))
        layer = build_module(spec, config=cfg, layer_number=1)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(shard_llama_param(name, full_params[name], rank))
        x = x_full.chunk(TP, dim=0)[rank].clone().requires_grad_()
        out, _ = layer(x, attention_mask=None)
        out.backward(dy_full.chunk(TP, dim=0)[rank])

        allreduce_sp_grads(layer, cfg)
        results[keep_gathered_input] = {
            "out": out.detach(),
            "x_grad": x.grad,
            "grads": {n: p.grad for n, p in layer.named_parameters()},
            "keeps": layer.self_attention.linear_qkv.flux_keep_gathered_input,
            "linear_types": sorted(
                {type(m).__name__ for m in layer.modules() if "Linear" in type(m).__name__}
            ),
        }
    return results


@pytest.mark.slow
def test_llama_layer_tp2_sequence_parallel_matches_stock_tp1(flux_linears, single_rank_model_parallel):
    """Flux spec, TP=2 + SP on gloo == stock local spec at TP=1 without SP, same full weights.

    (Stock sequence parallelism cannot be the reference: it allocates on CUDA.) Covers the
    forward output, the input gradient, every weight gradient (sharded like the weight), and
    the norms' gradients after megatron-core's own TP all-reduce of ``sequence_parallel``
    params, which only holds because the norms tag their parameters; with the column layers
    re-gathering their input for wgrad and keeping it from forward.
    """
    cfg = llama_config()
    stock = build_module(
        with_cpu_attention(get_gpt_layer_local_spec(normalization="RMSNorm")), config=cfg, layer_number=1
    )
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    full_params = {n: p.detach().clone() for n, p in stock.named_parameters()}
    x_full = torch.randn(8, 2, cfg.hidden_size, generator=g)
    dy_full = torch.randn(8, 2, cfg.hidden_size, generator=g)
    x_ref = x_full.clone().requires_grad_()
    out_ref, _ = stock(x_ref, attention_mask=None)
    out_ref.backward(dy_full)

    per_rank = run_distributed(
        _tp2_sp_llama_layer, TP, full_params, x_full, dy_full,
        tensor_model_parallel_size=TP, timeout=180,
    )

    tol = dict(rtol=1e-5, atol=1e-5)
    for keep in (False, True):
        results = [r[keep] for r in per_rank]
        assert results[0]["keeps"] is keep
        assert results[0]["linear_types"] == [
            "FluxColumnParallelLinear_auto", "FluxRowParallelLinear_auto"
        ]
        torch.testing.assert_close(torch.cat([r["out"] for r in results]), out_ref.detach(), **tol)
        torch.testing.assert_close(torch.cat([r["x_grad"] for r in results]), x_ref.grad, **tol)
        for name, p in stock.named_parameters():
            for rank, r in enumerate(results):
                torch.testing.assert_close(
                    r["grads"][name], shard_llama_param(name, p.grad, rank),
                    msg=f"{name} rank {rank} keep={keep}", **tol,
                )
