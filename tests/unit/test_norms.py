"""SequenceParallelLayerNorm / SequenceParallelRMSNorm against float64 references and megatron-core."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_flux.layers.norms import (
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    get_flux_norm,
)

H = 16


def make_config(normalization="LayerNorm", sequence_parallel=False, **kw):
    """A small TransformerConfig; SP needs TP>1 in megatron's validation, so TP=2 then."""
    kw.setdefault("use_cpu_initialization", True)
    return TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        normalization=normalization,
        sequence_parallel=sequence_parallel,
        tensor_model_parallel_size=2 if sequence_parallel else 1,
        **kw,
    )


def rms_reference(x, weight, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def layer_norm_reference(x, weight, bias, eps):
    return F.layer_norm(x.double(), (x.shape[-1],), weight.double(), bias.double(), eps)


def randomize_(norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1.0)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layer_norm_matches_reference_values_and_grads(sequence_parallel):
    cfg = make_config("LayerNorm", sequence_parallel)
    norm = SequenceParallelLayerNorm(config=cfg, hidden_size=H, eps=1e-5)
    randomize_(norm)
    x = torch.randn(5, 3, H, requires_grad=True)
    y = norm(x)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    b64 = norm.bias.detach().double().requires_grad_()
    y64 = layer_norm_reference(x64, w64, b64, 1e-5)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)

    dy = torch.randn_like(y)
    y.backward(dy)
    y64.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.bias.grad.double(), b64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_rms_norm_matches_float64_reference_values_and_grads(sequence_parallel):
    cfg = make_config("RMSNorm", sequence_parallel)
    norm = SequenceParallelRMSNorm(config=cfg, hidden_size=H, eps=1e-6)
    randomize_(norm)
    assert norm.bias is None
    x = torch.randn(5, 3, H, requires_grad=True)
    y = norm(x)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    y64 = rms_reference(x64, w64, 1e-6)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)

    dy = torch.randn_like(y)
    y.backward(dy)
    y64.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_eps_is_used():
    # float64 throughout: the references are float64, and so are assert_close's tolerances
    # (a float32 output missed them by one rounding on some random inputs)
    cfg = make_config("RMSNorm")
    x = torch.full((2, 1, H), 1e-2, dtype=torch.float64)
    big = SequenceParallelRMSNorm(config=cfg, hidden_size=H, eps=1.0).double()(x)
    torch.testing.assert_close(big, rms_reference(x, torch.ones(H), 1.0))
    cfg = make_config("LayerNorm")
    x = torch.randn(2, 1, H, dtype=torch.float64)
    out = SequenceParallelLayerNorm(config=cfg, hidden_size=H, eps=0.5).double()(x)
    torch.testing.assert_close(
        out, layer_norm_reference(x, torch.ones(H), torch.zeros(H), 0.5)
    )


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sequence_parallel_attribute_on_every_param(normalization, sequence_parallel):
    cfg = make_config(normalization, sequence_parallel)
    norm = get_flux_norm(normalization)(config=cfg, hidden_size=H, eps=1e-5)
    params = list(norm.parameters())
    assert len(params) == (2 if normalization == "LayerNorm" else 1)
    for p in params:
        assert getattr(p, "sequence_parallel") is sequence_parallel
    assert norm.sequence_parallel is sequence_parallel


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_sequence_parallel_does_not_assert_unlike_wrapped_torch_norm(normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = make_config(normalization, sequence_parallel=True)
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config=cfg, hidden_size=H, eps=1e-5)
    norm = get_flux_norm(normalization)(config=cfg, hidden_size=H, eps=1e-5)
    assert norm(torch.randn(4, 2, H)).shape == (4, 2, H)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_state_dict_interoperates_with_megatron_norm(normalization):
    """Same keys/shapes as megatron-core's norm (WrappedTorchNorm, SP off), both directions."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = make_config(normalization)
    stock = WrappedTorchNorm(config=cfg, hidden_size=H, eps=1e-5)
    ours = get_flux_norm(normalization)(config=cfg, hidden_size=H, eps=1e-5)
    stock_sd, ours_sd = stock.state_dict(), ours.state_dict()
    assert list(ours_sd) == list(stock_sd)
    assert {k: v.shape for k, v in ours_sd.items()} == {k: v.shape for k, v in stock_sd.items()}

    randomize_(stock, seed=1)
    ours.load_state_dict(stock.state_dict(), strict=True)
    x = torch.randn(3, 2, H)
    torch.testing.assert_close(ours(x), stock(x))
    randomize_(ours, seed=2)
    stock.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(ours(x), stock(x))


def test_layer_norm_state_dict_matches_fused_layer_norm(monkeypatch):
    """apex's FusedLayerNorm is LNImpl when apex is installed; checkpoints must load both ways.

    Only its constructor runs here (apex is absent, so we lift its availability check): that is
    where its parameters, hence its state-dict keys, are created.
    """
    import megatron.core.fusions.fused_layer_norm as fln

    monkeypatch.setattr(fln, "HAVE_FUSED_LAYER_NORM", True)
    cfg = make_config("LayerNorm")
    fused = fln.FusedLayerNorm(config=cfg, hidden_size=H, eps=1e-5)
    ours = SequenceParallelLayerNorm(config=cfg, hidden_size=H, eps=1e-5)
    assert list(ours.state_dict()) == list(fused.state_dict()) == ["weight", "bias"]
    randomize_(fused, seed=3)
    ours.load_state_dict(fused.state_dict(), strict=True)
    fused.load_state_dict(ours.state_dict(), strict=True)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centered_gamma(normalization):
    plain_cfg = make_config(normalization)
    zc_cfg = make_config(normalization, layernorm_zero_centered_gamma=True)
    cls = get_flux_norm(normalization)
    plain = cls(config=plain_cfg, hidden_size=H)
    zc = cls(config=zc_cfg, hidden_size=H)
    assert torch.count_nonzero(zc.weight) == 0
    assert torch.all(plain.weight == 1)
    x = torch.randn(3, 2, H)
    torch.testing.assert_close(zc(x), plain(x))
    with torch.no_grad():
        zc.weight.copy_(torch.linspace(-0.5, 0.5, H))
        plain.weight.copy_(zc.weight + 1)
    torch.testing.assert_close(zc(x), plain(x))
    # The explicit constructor argument (FusedLayerNorm's signature) is honoured too.
    assert cls(config=plain_cfg, hidden_size=H, zero_centered_gamma=True).zero_centered_gamma


def test_params_dtype_and_device_follow_config():
    cfg = make_config("RMSNorm", params_dtype=torch.bfloat16)
    norm = SequenceParallelRMSNorm(config=cfg, hidden_size=H)
    assert norm.weight.dtype == torch.bfloat16 and norm.weight.device.type == "cpu"
    cfg = make_config("LayerNorm", init_model_with_meta_device=True)
    norm = SequenceParallelLayerNorm(config=cfg, hidden_size=H)
    assert norm.weight.is_meta and norm.bias.is_meta


def test_mixed_dtype_input_and_params():
    """fp32 activations (fp32_residual_connection) into bf16 norm params: runs, grads reach params."""
    cfg = make_config("LayerNorm", params_dtype=torch.bfloat16)
    norm = SequenceParallelLayerNorm(config=cfg, hidden_size=H)
    x = torch.randn(3, 2, H, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert norm.weight.grad.dtype == torch.bfloat16 and norm.bias.grad is not None


def test_half_precision_input_keeps_dtype():
    cfg = make_config("RMSNorm", params_dtype=torch.bfloat16)
    norm = SequenceParallelRMSNorm(config=cfg, hidden_size=H)
    x = torch.randn(3, 2, H).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), rms_reference(x.float(), norm.weight.float(), 1e-5),
                               rtol=2e-2, atol=2e-2)


def test_config_normalization_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="normalization='RMSNorm'"):
        SequenceParallelLayerNorm(config=make_config("RMSNorm"), hidden_size=H)
    with pytest.raises(ValueError, match="normalization='LayerNorm'"):
        SequenceParallelRMSNorm(config=make_config("LayerNorm"), hidden_size=H)
    with pytest.raises(ValueError, match="cannot build"):
        SequenceParallelLayerNorm(config=make_config(), hidden_size=H, normalization="RMSNorm")
    with pytest.raises(ValueError, match="no sequence-parallel norm"):
        get_flux_norm("L2Norm")


def test_megatron_positional_signature():
    """FusedLayerNorm/WrappedTorchNorm positional order: config, hidden_size, eps, persist, zc, norm."""
    cfg = make_config("LayerNorm")
    norm = SequenceParallelLayerNorm(cfg, H, 1e-3, False, False, "LayerNorm")
    assert norm.eps == 1e-3 and norm.hidden_size == torch.Size([H])


def test_sequence_sharded_grads_sum_to_full_grad():
    """Why the ``sequence_parallel`` tag is needed: per-shard weight grads are partial sums.

    Splitting the sequence in two (as TP=2 with SP does) and summing the shards' weight/bias
    grads gives the full-sequence grad, which is what finalize_model_grads' all-reduce produces.
    """
    cfg = make_config("LayerNorm", sequence_parallel=True)
    norm = SequenceParallelLayerNorm(config=cfg, hidden_size=H)
    randomize_(norm)
    x = torch.randn(8, 2, H)
    dy = torch.randn(8, 2, H)
    norm(x).backward(dy)
    full = [p.grad.clone() for p in norm.parameters()]
    partial = []
    for xs, dys in zip(x.chunk(2), dy.chunk(2)):
        norm.zero_grad()
        norm(xs).backward(dys)
        partial.append([p.grad.clone() for p in norm.parameters()])
    for i, g in enumerate(full):
        assert not torch.allclose(partial[0][i], g)
        torch.testing.assert_close(partial[0][i] + partial[1][i], g, rtol=1e-5, atol=1e-5)
