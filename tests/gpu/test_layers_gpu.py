"""Forward and backward through the Flux layers on GPUs: ``flux`` backend vs the ``nccl`` one.

An MLP block (column fc1 with bias -> GeLU -> row fc2 with bias, sequence parallel, bf16) runs
once with ``flux_backend="flux"`` and once, from the same weights, with ``"nccl"`` (NCCL +
cuBLAS); outputs and the gradients of input, weights and biases must agree to bf16 accuracy.
Needs megatron-core on the GPU machine; skipped below 2 GPUs.
"""

import pytest
import torch

from helpers.gpu_harness import init_rank, nccl_worker, run_nccl_world

pytestmark = pytest.mark.gpu

_NEEDS_2_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs"
)


def _rel(x, ref):
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _mlp(config, h, ffn, backend, keep_gathered):
    from megatron_flux import FluxColumnParallelLinear, FluxRowParallelLinear

    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    fc1 = FluxColumnParallelLinear(h, ffn, config=config, init_method=init, bias=True,
                                   gather_output=False, flux_backend=backend)
    fc2 = FluxRowParallelLinear(ffn, h, config=config, init_method=init, bias=True,
                                input_is_parallel=True, skip_bias_add=False, flux_backend=backend)
    return fc1, fc2


def _tp_world(rank, world, port):
    """In a spawned rank: join the NCCL world, megatron-core's TP groups over all of it, and
    the bf16 sequence-parallel config the workers build their layers with."""
    init_rank(rank, world, port)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=world > 1,
                               params_dtype=torch.bfloat16)


@nccl_worker
def _worker(rank, world, port):
    from megatron.core import parallel_state

    config = _tp_world(rank, world, port)
    h, ffn, s, b = 1024, 4096, 512, 2
    fluxed = _mlp(config, h, ffn, "flux", False)
    ref = _mlp(config, h, ffn, "nccl", False)
    for dst, src in zip(ref, fluxed):
        dst.load_state_dict(src.state_dict())
    checks = 0
    for step in range(3):  # fresh inputs each step; repeated calls reuse signals/workspaces
        x = torch.randn(s // world, b, h, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(s // world, b, h, device="cuda", dtype=torch.bfloat16)
        outs, grads = [], []
        for fc1, fc2 in (fluxed, ref):
            for p in list(fc1.parameters()) + list(fc2.parameters()):
                p.grad = None
            xi = x.clone().requires_grad_(True)
            y1, _ = fc1(xi)
            y, _ = fc2(torch.nn.functional.gelu(y1))
            y.backward(dy)
            outs.append(y)
            grads.append([xi.grad] + [p.grad for p in list(fc1.parameters()) + list(fc2.parameters())])
        assert outs[0].shape == (s // world, b, h)
        err = _rel(outs[0], outs[1])
        assert err < 2e-2, f"step {step}: forward rel err {err}"
        for i, (g_flux, g_ref) in enumerate(zip(*grads)):
            err = _rel(g_flux, g_ref)
            assert err < 3e-2, f"step {step}: grad {i} rel err {err}"
            checks += 1
    torch.cuda.synchronize()
    parallel_state.destroy_model_parallel()
    return checks


@_NEEDS_2_GPUS
@pytest.mark.parametrize("column_dgrad", ["nccl", "fused", "copy_engine"])
def test_mlp_block_flux_matches_nccl(column_dgrad, monkeypatch):
    """Both forms of the column backward's input gradient (the workers' fused backend reads
    ``$MEGATRON_FLUX_COLUMN_DGRAD``)."""
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("MEGATRON_FLUX_COLUMN_DGRAD", column_dgrad)
    # TP = every local GPU (up to 8; the shapes divide by 8): 2 here, 4 or 8 on larger boxes
    checks = run_nccl_world(_worker, min(torch.cuda.device_count(), 8), timeout=300)
    assert all(c > 0 for c in checks)


@nccl_worker
def _output_layer_worker(rank, world, port):
    """megatron-core's own output layer (sequence-parallel all-gather, then cuBLAS) against a
    copy converted by ``swap_output_layer`` to the fused backend, which accumulates its weight
    gradient into an fp32 ``main_grad`` (``flux_gradient_accumulation_fusion``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_flux import FluxColumnParallelLinear, swap_output_layer

    config = _tp_world(rank, world, port)
    h, vocab, s, b = 1024, 8192 * world, 512, 2
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    stock, converted = (ColumnParallelLinear(h, vocab, config=config, init_method=init,
                                             bias=False, gather_output=False)
                        for _ in range(2))
    converted.load_state_dict(stock.state_dict())
    config.flux_gradient_accumulation_fusion = True  # what --flux-gradient-accumulation-fusion sets
    model = torch.nn.Module()
    model.output_layer = converted
    swap_output_layer([model], flux_backend="flux")
    assert type(converted) is FluxColumnParallelLinear.with_backend("flux")
    assert converted.flux_gradient_accumulation_fusion
    converted.weight.main_grad = torch.zeros(converted.weight.shape, device="cuda",
                                             dtype=torch.float32)
    ref_main = torch.zeros_like(converted.weight.main_grad)
    checks = 0
    for step in range(3):  # three micro-batches accumulate into main_grad
        x = torch.randn(s // world, b, h, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(s, b, vocab // world, device="cuda", dtype=torch.bfloat16)
        stock.weight.grad = None
        xs, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ys, _ = stock(xs)
        ys.backward(dy)
        yc, _ = converted(xc, runtime_gather_output=False)
        yc.backward(dy)
        ref_main += stock.weight.grad.float()
        for what, got, ref, tol in (("output", yc, ys, 2e-2), ("input grad", xc.grad, xs.grad, 3e-2),
                                    ("main_grad", converted.weight.main_grad, ref_main, 3e-2)):
            err = _rel(got, ref)
            assert err < tol, f"step {step}: {what} rel err {err}"
            checks += 1
    torch.cuda.synchronize()
    parallel_state.destroy_model_parallel()
    return checks


@_NEEDS_2_GPUS
def test_converted_output_layer_matches_megatron_core():
    """GPTModel's output layer converted in place (``swap_output_layer``) computes what
    megatron-core's own sequence-parallel layer does, fused, with its weight gradient
    accumulated into ``main_grad``."""
    pytest.importorskip("megatron.core")
    checks = run_nccl_world(_output_layer_worker, min(torch.cuda.device_count(), 8), timeout=300)
    assert all(c == 9 for c in checks)


@nccl_worker
def _gpt_model_worker(rank, world, port, recompute):
    """A Llama-style GPTModel (plugin spec, converted output layer, bf16, weight gradients into
    fp32 ``main_grad``) with the ``flux`` backend against the same model with ``nccl``, with or
    without full activation recomputation (the fused kernels then run forward again inside
    backward). tests/unit/test_gpt_model_sp.py checks the ``nccl`` model against stock on the CPU."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_flux import specs, swap_output_layer

    _tp_world(rank, world, port)
    extra = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
             if recompute else {})
    cfg = TransformerConfig(
        num_layers=2, hidden_size=1024, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=2048, tensor_model_parallel_size=world, sequence_parallel=world > 1,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True, attention_dropout=0.0,
        hidden_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, **extra)
    cfg.flux_gradient_accumulation_fusion = True
    vocab, seq, batch = 4096 * world, 512, 2
    models = {}
    for backend in ("flux", "nccl"):
        torch.manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=specs.get_gpt_decoder_block_flux_spec(
            cfg, backend=backend), vocab_size=vocab, max_sequence_length=seq,
            position_embedding_type="rope").cuda()
        models[backend] = swap_output_layer(model, backend)
    models["nccl"].load_state_dict(models["flux"].state_dict())
    checks = 0
    for step in range(2):  # two micro-batches accumulate into main_grad
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        pos = torch.arange(seq, device="cuda").expand(batch, seq)
        losses = {}
        for backend, model in models.items():
            if step == 0:
                for p in model.parameters():
                    p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
            loss = model(ids, pos, None, labels=ids)
            loss.float().mean().backward()
            for p in model.parameters():  # DDP's hook: what reached .grad joins main_grad
                if p.grad is not None:
                    p.main_grad += p.grad.float()
                    p.grad = None
            losses[backend] = loss.detach().float()
        err = _rel(losses["flux"], losses["nccl"])
        assert err < 1e-2, f"step {step}: loss rel err {err}"
        # (the norms' gradients are this rank's share until finalize_model_grads sums them
        # over TP: the same share in both models)
        for (name, p), q in zip(models["flux"].named_parameters(), models["nccl"].parameters()):
            assert q.main_grad.norm() > 0, name
            err = _rel(p.main_grad, q.main_grad)
            assert err < 3e-2, f"step {step}: {name} main_grad rel err {err}"
            checks += 1
    torch.cuda.synchronize()
    parallel_state.destroy_model_parallel()
    return checks


@_NEEDS_2_GPUS
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute-full"])
def test_gpt_model_flux_matches_nccl(recompute):
    """A whole model through the fused backend, also under activation recomputation."""
    pytest.importorskip("megatron.core")
    checks = run_nccl_world(_gpt_model_worker, min(torch.cuda.device_count(), 8), recompute, timeout=300)
    assert all(c > 10 for c in checks)
