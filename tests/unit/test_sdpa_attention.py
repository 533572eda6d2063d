"""SDPACoreAttention against megatron-core's DotProductAttention, and swap_core_attention.

Everything runs on CPU at TP=1 (gloo world of one, megatron ``parallel_state`` initialised).
DotProductAttention itself is CUDA-bound in three places that have nothing to do with its
arithmetic: its score buffer comes from the global memory buffer (allocated on
``torch.cuda.current_device()``), its default causal mask is built with ``device="cuda"``, and
its dropout forks the CUDA RNG tracker; RoPE moves ``inv_freq`` to the current CUDA device. The
``cpu_megatron`` fixture redirects those to CPU for this module only, so the reference is
megatron-core's own code, not a re-implementation.
"""

import contextlib
import dataclasses
import inspect
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from helpers.dist_harness import gloo_world_of_one
from test_specs import fingerprint, leaves  # noqa: E402  (the spec walkers test_specs uses)

import megatron_flux
from megatron_flux import specs
from megatron_flux.layers import attention as attention_mod
from megatron_flux.layers.attention import SDPACoreAttention

HN = 16  # head dim
B = 2

# --------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------


class CpuMemoryBuffer:
    """``GlobalMemoryBuffer.get_tensor`` on CPU (DotProductAttention's score buffer)."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)


class RecordingRngTracker:
    """Stands in for the CUDA RNG tracker: ``fork()`` is recorded and changes nothing."""

    def __init__(self):
        self.forks = 0

    @contextlib.contextmanager
    def fork(self, name=None):
        self.forks += 1
        yield


@pytest.fixture(scope="module")
def cpu_megatron():
    """gloo world of 1 + megatron parallel_state at TP=PP=1, CUDA-only helpers on CPU."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    with gloo_world_of_one():
        ps.initialize_model_parallel(1, 1)
        tracker = RecordingRngTracker()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ps, "get_global_memory_buffer", lambda: CpuMemoryBuffer())
            mp.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker)
            mp.setattr(
                fused_softmax,
                "get_default_causal_mask",
                lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1),
            )
            mp.setattr(torch.cuda, "current_device", lambda: "cpu")  # RoPE's inv_freq
            yield tracker
        ps.destroy_model_parallel()


def attn_config(num_heads=8, num_groups=None, **overrides):
    kw = dict(
        num_layers=4,
        hidden_size=num_heads * HN,
        num_attention_heads=num_heads,
        num_query_groups=num_groups,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=False,
        fp16=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_pair(cfg, layer_number=3, attn_mask_type=AttnMaskType.causal, **kwargs):
    """(DotProductAttention, SDPACoreAttention) with identical constructor arguments."""
    args = dict(
        config=cfg, layer_number=layer_number, attn_mask_type=attn_mask_type, attention_type="self"
    )
    args.update(kwargs)
    return DotProductAttention(**args), SDPACoreAttention(**args)


def qkv(sq, sk, nq, ng, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, B, nq, HN, generator=g, dtype=dtype)
    k = torch.randn(sk, B, ng, HN, generator=g, dtype=dtype)
    v = torch.randn(sk, B, ng, HN, generator=g, dtype=dtype)
    return q, k, v


def run(module, q, k, v, mask, dy=None, **kwargs):
    """Output and (dq, dk, dv) for upstream gradient ``dy`` (random, seeded, if None)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask, **kwargs)
    if dy is None:
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=out.dtype)
    out.backward(dy)
    return out.detach(), (q.grad, k.grad, v.grad)


def tolerance(dtype):
    return dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)


def assert_same(ref, got, dtype, what=""):
    (out_r, grads_r), (out_g, grads_g) = ref, got
    tol = tolerance(dtype)
    torch.testing.assert_close(out_g, out_r, msg=lambda m: f"{what} output: {m}", **tol)
    for name, gr, gg in zip("qkv", grads_r, grads_g):
        torch.testing.assert_close(gg, gr, msg=lambda m, n=name: f"{what} d{n}: {m}", **tol)


def megatron_causal_mask(seq, reset_at=None):
    """The dataloader's mask, ``[B, 1, s, s]`` bool, True = masked (GPTDataset's own function).

    ``reset_at``: EOD positions per sample for ``reset_attention_mask`` (document masking).
    """
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    masks = []
    for i in range(B):
        tokens = torch.ones(seq, dtype=torch.long)
        if reset_at is not None:
            tokens[reset_at[i]] = 0
        mask, _, _ = _get_ltor_masks_and_position_ids(
            tokens, 0, False, reset_at is not None, False, True
        )
        masks.append(mask)
    return torch.stack(masks)


# --------------------------------------------------------------------------------------------
# signatures
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["__init__", "forward"])
def test_signatures_match_dot_product_attention(method):
    def params(cls):
        return [
            (p.name, p.kind, p.default)
            for p in inspect.signature(getattr(cls, method)).parameters.values()
        ]

    assert params(SDPACoreAttention) == params(DotProductAttention)


def test_exports():
    assert megatron_flux.SDPACoreAttention is SDPACoreAttention
    assert megatron_flux.swap_core_attention is specs.swap_core_attention
    assert "SDPACoreAttention" in megatron_flux.__all__
    assert "swap_core_attention" in megatron_flux.__all__
    assert "swap_core_attention" in specs.__all__
    import megatron_flux.layers as layers

    assert layers.SDPACoreAttention is SDPACoreAttention and "SDPACoreAttention" in layers.__all__
    assert inspect.signature(specs.swap_core_attention).parameters[
        "core_attention_cls"
    ].default is SDPACoreAttention


# --------------------------------------------------------------------------------------------
# numerics against DotProductAttention
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("num_groups", [8, 2], ids=["mha", "gqa8x2"])
@pytest.mark.parametrize("mask_kind", ["implicit", "explicit"])
@pytest.mark.parametrize("layer_scaling", [False, True], ids=["noscale", "qklayerscale"])
@pytest.mark.parametrize("seq", [16, 64])
def test_causal_matches_dot_product_attention(
    cpu_megatron, dtype, num_groups, mask_kind, layer_scaling, seq
):
    cfg = attn_config(8, num_groups, apply_query_key_layer_scaling=layer_scaling)
    ref_mod, sdpa = build_pair(cfg, layer_number=3)
    if layer_scaling:  # Megatron divides QK^T by the layer number, then multiplies back
        assert ref_mod.softmax_scale == pytest.approx(1 / (3 * math.sqrt(HN)))
    assert sdpa.softmax_scale == pytest.approx(1 / math.sqrt(HN))
    mask = None if mask_kind == "implicit" else megatron_causal_mask(seq)
    q, k, v = qkv(seq, seq, 8, num_groups, dtype)
    assert_same(run(ref_mod, q, k, v, mask), run(sdpa, q, k, v, mask), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("num_groups", [8, 2], ids=["mha", "gqa8x2"])
def test_gqa_fallback_without_enable_gqa(cpu_megatron, monkeypatch, dtype, num_groups):
    """torch < 2.5 has no ``enable_gqa``: k/v are repeat_interleave-d (same result)."""
    monkeypatch.setattr(attention_mod, "SDPA_SUPPORTS_GQA", False)
    ref_mod, sdpa = build_pair(attn_config(8, num_groups))
    q, k, v = qkv(32, 32, 8, num_groups, dtype)
    for mask in (None, megatron_causal_mask(32)):
        assert_same(run(ref_mod, q, k, v, mask), run(sdpa, q, k, v, mask), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("num_groups", [8, 2], ids=["mha", "gqa8x2"])
def test_document_mask_matches(cpu_megatron, dtype, num_groups):
    """Causal type with the dataloader's ``reset_attention_mask`` mask: the mask is used."""
    seq = 48
    mask = megatron_causal_mask(seq, reset_at=[[10, 30], [5]])
    assert not torch.equal(mask, megatron_causal_mask(seq))
    ref_mod, sdpa = build_pair(attn_config(8, num_groups))
    q, k, v = qkv(seq, seq, 8, num_groups, dtype)
    assert_same(run(ref_mod, q, k, v, mask), run(sdpa, q, k, v, mask), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("num_groups", [8, 2], ids=["mha", "gqa8x2"])
def test_padding_masks_including_fully_masked_rows(cpu_megatron, dtype, num_groups):
    """Padding masks, ``[b,1,sq,sk]`` and ``[b,1,1,sk]``, with query rows whose keys are all
    masked (Megatron gives them the mean of the values, zero grad to q/k)."""
    seq = 24
    ref_mod, sdpa = build_pair(attn_config(8, num_groups), attn_mask_type=AttnMaskType.padding)
    q, k, v = qkv(seq, seq, 8, num_groups, dtype)
    valid = torch.tensor([seq - 5, seq])  # sample 0 has 5 padding tokens
    pad = torch.arange(seq)[None, :] >= valid[:, None]  # [b, s]
    full = (pad[:, None, :, None] | pad[:, None, None, :])  # [b, 1, sq, sk]
    assert full.all(-1).any(), "the test needs fully masked rows"
    assert_same(run(ref_mod, q, k, v, full), run(sdpa, q, k, v, full), dtype, "[b,1,sq,sk]")
    keys_only = pad.clone()
    keys_only[1] = True  # every key of sample 1 masked
    keys_only = keys_only[:, None, None, :]  # [b, 1, 1, sk]
    assert_same(
        run(ref_mod, q, k, v, keys_only), run(sdpa, q, k, v, keys_only), dtype, "[b,1,1,sk]"
    )
    arbitrary = torch.rand(B, 1, seq, seq, generator=torch.Generator().manual_seed(5)) < 0.4
    arbitrary[0, 0, 3] = True
    assert_same(
        run(ref_mod, q, k, v, arbitrary), run(sdpa, q, k, v, arbitrary), dtype, "arbitrary"
    )


@pytest.mark.parametrize("num_groups", [8, 2], ids=["mha", "gqa8x2"])
def test_cross_attention_and_decode_shapes(cpu_megatron, num_groups):
    dtype = torch.float64
    cfg = attn_config(8, num_groups)
    # cross attention: sq != sk, no mask, and with a padding mask
    ref_mod, sdpa = build_pair(
        cfg, attn_mask_type=AttnMaskType.padding, attention_type="cross"
    )
    q, k, v = qkv(16, 24, 8, num_groups, dtype)
    mask = torch.rand(B, 1, 16, 24, generator=torch.Generator().manual_seed(1)) < 0.3
    for m in (None, mask):
        assert_same(run(ref_mod, q, k, v, m), run(sdpa, q, k, v, m), dtype, f"cross mask={m is not None}")
    # decoding one token against a KV cache: causal type, sq == 1, no mask = attend to all
    ref_mod, sdpa = build_pair(cfg)
    q, k, v = qkv(1, 20, 8, num_groups, dtype)
    assert_same(run(ref_mod, q, k, v, None), run(sdpa, q, k, v, None), dtype, "decode")
    # no_mask type ignores the missing mask: full (non-causal) attention
    ref_mod, sdpa = build_pair(cfg, attn_mask_type=AttnMaskType.no_mask)
    q, k, v = qkv(16, 16, 8, num_groups, dtype)
    assert_same(run(ref_mod, q, k, v, None), run(sdpa, q, k, v, None), dtype, "no_mask")


@pytest.mark.parametrize("layer_scaling", [False, True], ids=["noscale", "qklayerscale"])
def test_explicit_softmax_scale(cpu_megatron, layer_scaling):
    cfg = attn_config(8, 2, apply_query_key_layer_scaling=layer_scaling)
    ref_mod, sdpa = build_pair(cfg, layer_number=2, softmax_scale=0.05)
    assert sdpa.softmax_scale == 0.05
    q, k, v = qkv(32, 32, 8, 2, torch.float32)
    assert_same(run(ref_mod, q, k, v, None), run(sdpa, q, k, v, None), torch.float32)


def test_forward_mask_type_is_ignored_as_in_megatron(cpu_megatron):
    """Both use the constructor's mask type (DotProductAttention: 'attn_mask_type is not used')."""
    ref_mod, sdpa = build_pair(attn_config(8, 2))
    q, k, v = qkv(16, 16, 8, 2, torch.float64)
    kw = dict(attn_mask_type=AttnMaskType.no_mask)
    assert_same(run(ref_mod, q, k, v, None, **kw), run(sdpa, q, k, v, None, **kw), torch.float64)
    assert_same(run(ref_mod, q, k, v, None), run(sdpa, q, k, v, None, **kw), torch.float64)


def test_tolerance_is_tight_enough_to_catch_a_wrong_scale_or_mask(cpu_megatron):
    """The fp32 comparisons above would fail for a 1% scale error or a dropped causal mask."""
    cfg = attn_config(8, 2)
    ref_mod, sdpa = build_pair(cfg)
    q, k, v = qkv(32, 32, 8, 2, torch.float32)
    ref = run(ref_mod, q, k, v, None)
    wrong_scale = SDPACoreAttention(cfg, 3, AttnMaskType.causal, "self", softmax_scale=1.01 / math.sqrt(HN))
    not_causal = SDPACoreAttention(cfg, 3, AttnMaskType.no_mask, "self")
    for wrong in (wrong_scale, not_causal):
        with pytest.raises(AssertionError):
            assert_same(ref, run(wrong, q, k, v, None), torch.float32)


# --------------------------------------------------------------------------------------------
# what reaches scaled_dot_product_attention (the flash-eligible call), dropout
# --------------------------------------------------------------------------------------------


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("num_groups", [8, 2], ids=["mha", "gqa8x2"])
def test_causal_without_mask_is_a_maskless_is_causal_call(cpu_megatron, sdpa_calls, num_groups):
    cfg = attn_config(8, num_groups, apply_query_key_layer_scaling=True)
    sdpa = SDPACoreAttention(cfg, 3, AttnMaskType.causal, "self")
    sdpa(*qkv(16, 16, 8, num_groups, torch.float32), None)
    (call,) = sdpa_calls
    assert call["is_causal"] is True and call["attn_mask"] is None
    assert call["scale"] == pytest.approx(1 / math.sqrt(HN))  # layer scaling cancels
    assert call["dropout_p"] == 0.0
    assert call.get("enable_gqa", False) is (num_groups != 8)
    sdpa(*qkv(16, 16, 8, num_groups, torch.float32), megatron_causal_mask(16))
    assert sdpa_calls[1]["is_causal"] is False and sdpa_calls[1]["attn_mask"] is not None


def test_dropout_only_in_training_inside_the_rng_fork(cpu_megatron, sdpa_calls):
    tracker = cpu_megatron
    q, k, v = qkv(16, 16, 8, 2, torch.float32)
    cfg = attn_config(8, 2, attention_dropout=0.5)
    sdpa = SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
    assert sdpa.training
    forks = tracker.forks
    torch.manual_seed(0)
    out_train = sdpa(q, k, v, None)
    assert sdpa_calls[-1]["dropout_p"] == 0.5 and tracker.forks == forks + 1
    sdpa.eval()
    out_eval = sdpa(q, k, v, None)
    assert sdpa_calls[-1]["dropout_p"] == 0.0 and tracker.forks == forks + 1
    assert not torch.allclose(out_train, out_eval)
    ref_mod = DotProductAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    torch.testing.assert_close(out_eval, ref_mod(q, k, v, None), rtol=1e-5, atol=1e-6)

    # the constructor argument overrides the config, both ways
    assert SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.0)(
        q, k, v, None
    ).allclose(out_eval)
    assert sdpa_calls[-1]["dropout_p"] == 0.0
    SDPACoreAttention(attn_config(8, 2), 1, AttnMaskType.causal, "self", attention_dropout=0.25)(
        q, k, v, None
    )
    assert sdpa_calls[-1]["dropout_p"] == 0.25

    # p = 1 drops everything, as Megatron's nn.Dropout does
    cfg1 = attn_config(8, 2, attention_dropout=1.0)
    ref_mod, sdpa1 = build_pair(cfg1)
    assert torch.count_nonzero(sdpa1(q, k, v, None)) == 0
    assert torch.count_nonzero(ref_mod(q, k, v, None)) == 0

    # under sequence parallelism DotProductAttention does not fork the tracker; neither do we
    from megatron.core.process_groups_config import ProcessGroupCollection

    sp_cfg = attn_config(8, 2, attention_dropout=0.5, sequence_parallel=True, tensor_model_parallel_size=2)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    forks = tracker.forks
    SDPACoreAttention(sp_cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs)(q, k, v, None)
    assert sdpa_calls[-1]["dropout_p"] == 0.5 and tracker.forks == forks


# --------------------------------------------------------------------------------------------
# clear errors
# --------------------------------------------------------------------------------------------


def test_unsupported_configurations_raise(cpu_megatron):
    with pytest.raises(NotImplementedError, match="context parallelism"):
        SDPACoreAttention(attn_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")
    for softmax_type in ("off-by-one", "learnable"):
        with pytest.raises(NotImplementedError, match="softmax_type"):
            SDPACoreAttention(attn_config(softmax_type=softmax_type), 1, AttnMaskType.causal, "self")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        SDPACoreAttention(attn_config(window_size=(8, 0)), 1, AttnMaskType.causal, "self")
    # a layer that window_attn_skip_freq makes full-attention is fine
    cfg = attn_config(window_size=(8, 0), window_attn_skip_freq=2)
    SDPACoreAttention(cfg, 2, AttnMaskType.causal, "self")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")


def test_unsupported_inputs_raise(cpu_megatron):
    sdpa = SDPACoreAttention(attn_config(8, 2), 1, AttnMaskType.causal, "self")
    q, k, v = qkv(16, 16, 8, 2, torch.float32)
    with pytest.raises(NotImplementedError, match="packed"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(NotImplementedError, match="attention_bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1, 8, 16, 16))
    with pytest.raises(ValueError, match="boolean"):
        sdpa(q, k, v, megatron_causal_mask(16).float())
    with pytest.raises(ValueError, match="sq == sk"):
        sdpa(q[:8], k, v, None)
    q3, k3, v3 = qkv(16, 16, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="divide"):
        sdpa(q3, k3, v3, None)
    with pytest.raises(ValueError, match=r"\[sq, b, np, hn\]"):
        sdpa(q.flatten(2), k, v, None)


# --------------------------------------------------------------------------------------------
# swap_core_attention on specs
# --------------------------------------------------------------------------------------------


def core_attention_of(spec):
    return spec.submodules.self_attention.submodules.core_attention


def assert_only_core_attention_changed(before, after, new_cls=SDPACoreAttention):
    old, new = leaves(before), leaves(after)
    assert len(old) == len(new)
    changed = [(a, b) for a, b in zip(old, new) if a is not b]
    assert changed and all(a is DotProductAttention and b is new_cls for a, b in changed), changed
    assert DotProductAttention not in new


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"normalization": "RMSNorm", "qk_layernorm": True},
        {"num_experts": 4},
        {"multi_latent_attention": True},
    ],
    ids=["gpt", "llama-qknorm", "moe", "mla"],
)
def test_swap_on_megatron_local_spec(kwargs):
    spec = get_gpt_layer_local_spec(**kwargs)
    before = fingerprint(spec)
    assert core_attention_of(spec) is DotProductAttention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = specs.swap_core_attention(spec)
    assert fingerprint(spec) == before, "the input spec was mutated"
    assert core_attention_of(spec) is DotProductAttention
    assert core_attention_of(out) is SDPACoreAttention
    assert out is not spec and out.submodules is not spec.submodules
    assert_only_core_attention_changed(spec, out)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_swap_on_flux_spec(normalization):
    spec = specs.get_gpt_layer_flux_spec(normalization=normalization, backend="nccl")
    before = fingerprint(spec)
    out = specs.swap_core_attention(spec)
    assert fingerprint(spec) == before
    assert core_attention_of(out) is SDPACoreAttention
    assert_only_core_attention_changed(spec, out)
    # the Flux linears and norms are untouched
    sub, new = spec.submodules, out.submodules
    assert new.self_attention.submodules.linear_qkv is sub.self_attention.submodules.linear_qkv
    assert new.input_layernorm is sub.input_layernorm


def test_swap_keeps_sharing_and_handles_import_paths_and_custom_classes():
    layer = get_gpt_layer_local_spec()
    block = TransformerBlockSubmodules(layer_specs=[layer, layer, layer])
    out = specs.swap_core_attention(block)
    assert out.layer_specs[0] is out.layer_specs[1] is out.layer_specs[2]
    assert core_attention_of(out.layer_specs[0]) is SDPACoreAttention
    assert core_attention_of(layer) is DotProductAttention

    by_path = ModuleSpec(
        module=("megatron.core.transformer.dot_product_attention", "DotProductAttention")
    )
    assert specs.swap_core_attention({"attn": by_path})["attn"].module is SDPACoreAttention

    class MyAttention(SDPACoreAttention):
        pass

    out = specs.swap_core_attention(layer, MyAttention)
    assert core_attention_of(out) is MyAttention
    assert_only_core_attention_changed(layer, out, MyAttention)
    with pytest.raises(TypeError, match="class"):
        specs.swap_core_attention(layer, "not a class")


def test_swap_leaves_subclasses_and_warns_when_nothing_to_swap():
    class CustomDPA(DotProductAttention):
        pass

    layer = get_gpt_layer_local_spec()
    attn = layer.submodules.self_attention
    custom = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            layer.submodules,
            self_attention=dataclasses.replace(
                attn, submodules=dataclasses.replace(attn.submodules, core_attention=CustomDPA)
            ),
        ),
    )
    with pytest.warns(UserWarning, match="no megatron-core DotProductAttention"):
        out = specs.swap_core_attention(custom)
    assert core_attention_of(out) is CustomDPA
    # swapping twice is quiet and changes nothing more
    once = specs.swap_core_attention(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twice = specs.swap_core_attention(once)
    assert leaves(twice) == leaves(once)


# --------------------------------------------------------------------------------------------
# whole layers and models: swapped spec == stock spec on CPU at TP=1
# --------------------------------------------------------------------------------------------


def model_config(family, **overrides):
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        ffn_hidden_size=96,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        bf16=False,
        fp16=False,
    )
    if family == "llama":
        kw.update(
            num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False,
        )
    else:
        kw.update(normalization="LayerNorm", activation_func=F.gelu)
    kw.update(overrides)
    return TransformerConfig(**kw)


def grads_close(stock, swapped, rtol=1e-4, atol=1e-5):
    for (name, ps_), (name_f, pf) in zip(stock.named_parameters(), swapped.named_parameters()):
        assert name == name_f
        torch.testing.assert_close(pf.grad, ps_.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("mask_kind", ["implicit", "explicit"])
@pytest.mark.parametrize("base", ["local", "flux"])
def test_transformer_layer_with_swapped_spec_matches(cpu_megatron, family, mask_kind, base):
    cfg = model_config(family)
    normalization = cfg.normalization
    stock_spec = get_gpt_layer_local_spec(normalization=normalization)
    if base == "local":
        swapped_spec = specs.swap_core_attention(stock_spec)
    else:
        swapped_spec = specs.swap_core_attention(
            specs.get_gpt_layer_flux_spec(normalization=normalization, backend="nccl")
        )
    torch.manual_seed(0)
    stock = build_module(stock_spec, config=cfg, layer_number=1)
    swapped = build_module(swapped_spec, config=cfg, layer_number=1)
    assert type(stock.self_attention.core_attention) is DotProductAttention
    assert type(swapped.self_attention.core_attention) is SDPACoreAttention
    assert list(swapped.state_dict()) == list(stock.state_dict())
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    swapped.load_state_dict(stock.state_dict())

    seq = 32
    mask = None if mask_kind == "implicit" else megatron_causal_mask(seq)
    x = torch.randn(seq, B, cfg.hidden_size)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_s, _ = stock(xs, attention_mask=mask)
    out_f, _ = swapped(xf, attention_mask=mask)
    torch.testing.assert_close(out_f, out_s, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out_s)
    out_s.backward(dy)
    out_f.backward(dy)
    torch.testing.assert_close(xf.grad, xs.grad, rtol=1e-5, atol=1e-5)
    grads_close(stock, swapped)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_gpt_model_with_swapped_spec_matches(cpu_megatron, family):
    from megatron.core.models.gpt import GPTModel

    cfg = model_config(family)
    stock_spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    pos_type = "rope" if family == "llama" else "learned_absolute"
    vocab, seq = 96, 32

    def build(spec):
        torch.manual_seed(0)
        return GPTModel(
            config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
            max_sequence_length=seq, position_embedding_type=pos_type,
        )

    stock = build(stock_spec)
    swapped = build(specs.swap_core_attention(stock_spec))
    assert all(
        type(layer.self_attention.core_attention) is SDPACoreAttention
        for layer in swapped.decoder.layers
    )
    assert list(swapped.state_dict()) == list(stock.state_dict())
    swapped.load_state_dict(stock.state_dict())

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (B, seq), generator=g)
    labels = torch.randint(0, vocab, (B, seq), generator=g)
    pos = torch.arange(seq).expand(B, seq)
    for mask in (None, megatron_causal_mask(seq)):
        stock.zero_grad()
        swapped.zero_grad()
        loss_s = stock(ids, pos, mask, labels=labels)
        loss_f = swapped(ids, pos, mask, labels=labels)
        torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-6)
        loss_s.mean().backward()
        loss_f.mean().backward()
        grads_close(stock, swapped)
