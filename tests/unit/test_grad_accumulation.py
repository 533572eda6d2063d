"""Gradient accumulation fusion (``weight.main_grad``) without apex.

Single-process tests pin megatron's convention in :func:`accumulate_weight_grad` (what is
accumulated, what autograd receives, the ``grad_added_to_main_grad`` flag). The gloo world at
TP=2 runs the layers with ``config.gradient_accumulation_fusion`` on: on the sequence-parallel
path (megatron-flux's ops) and on the stock paths (SP off, TP=1), where megatron's own function
would need apex. Two backward passes must accumulate; the dense float64 reference decides.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from helpers.dist_harness import run_checks

from megatron_flux.ops.grad_accumulation import (
    LinearWithMainGradAccumulation,
    accumulate_weight_grad,
    fused_wgrad_kernel,
    wgrad_target,
)

S_LOCAL, B, H, F = 2, 3, 8, 16
TOL = dict(rtol=1e-10, atol=1e-10)


def _randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------- single-process: the helper
def _operands(dtype=torch.float64):
    return _randn(6, 4, seed=1, dtype=dtype), _randn(6, 5, seed=2, dtype=dtype)  # dY [m, n], X [m, k]


def test_no_fusion_returns_the_weight_grad():
    dy, x = _operands()
    weight = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.float64))
    weight.main_grad = torch.zeros(4, 5, dtype=torch.float64)
    target = wgrad_target(weight, gradient_accumulation_fusion=False)
    torch.testing.assert_close(accumulate_weight_grad(weight, target, dy, x), dy.t() @ x, **TOL)
    assert weight.main_grad.abs().sum() == 0


def test_fusion_accumulates_and_returns_megatron_dummy():
    dy, x = _operands()
    weight = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.float64))
    weight.main_grad = torch.ones(4, 5, dtype=torch.float64)
    target = wgrad_target(weight, True)
    # no grad_added_to_main_grad attribute (no DDP hooks): autograd gets None
    assert accumulate_weight_grad(weight, target, dy, x) is None
    torch.testing.assert_close(weight.main_grad, 1 + dy.t() @ x, **TOL)
    # with the attribute: a dummy of main_grad's shape in the input dtype, flag set
    weight.grad_added_to_main_grad = False
    dummy = accumulate_weight_grad(weight, target, dy, x)
    assert dummy.shape == (4, 5) and dummy.dtype == x.dtype
    assert weight.grad_added_to_main_grad is True
    torch.testing.assert_close(weight.main_grad, 1 + 2 * (dy.t() @ x), **TOL)
    # zero_out_wgrad asks for a zero dummy (DDP adds it)
    weight.zero_out_wgrad = True
    assert torch.count_nonzero(accumulate_weight_grad(weight, target, dy, x)) == 0


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_fusion_with_mixed_dtypes(main_dtype):
    """bf16 activations into an fp32 / bf16 main_grad (megatron's usual setup)."""
    dy, x = _operands(torch.bfloat16)
    weight = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.bfloat16))
    weight.main_grad = torch.zeros(4, 5, dtype=main_dtype)
    accumulate_weight_grad(weight, wgrad_target(weight, True), dy, x)
    accumulate_weight_grad(weight, wgrad_target(weight, True), dy, x)
    assert weight.main_grad.dtype == main_dtype
    ref = 2 * (dy.double().t() @ x.double())
    torch.testing.assert_close(weight.main_grad.double(), ref, rtol=3e-2, atol=3e-2)


def test_fusion_without_main_grad_gives_a_regular_grad():
    dy, x = _operands()
    weight = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.float64))
    target = wgrad_target(weight, True)
    assert not target.fuse
    torch.testing.assert_close(accumulate_weight_grad(weight, target, dy, x), dy.t() @ x, **TOL)


def test_main_grad_of_wrong_shape_is_an_error():
    dy, x = _operands()
    weight = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.float64))
    weight.main_grad = torch.zeros(5, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="main_grad has shape"):
        accumulate_weight_grad(weight, wgrad_target(weight, True), dy, x)


def test_megatron_fsdp_main_grad_is_overwritten():
    dy, x = _operands()
    weight = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.float64))
    buffer = torch.full((4, 5), 7.0, dtype=torch.float64)
    weight.__fsdp_param__ = True
    weight.get_main_grad = lambda: buffer
    assert accumulate_weight_grad(weight, wgrad_target(weight, True), dy, x) is None
    assert weight.main_grad is buffer
    torch.testing.assert_close(buffer, dy.t() @ x, **TOL)


def test_non_sp_linear_with_main_grad():
    x = _randn(3, 2, 5, seed=3).requires_grad_()
    weight = torch.nn.Parameter(_randn(4, 5, seed=4))
    bias = torch.nn.Parameter(_randn(4, seed=5))
    weight.main_grad = torch.zeros(4, 5, dtype=torch.float64)
    g = _randn(3, 2, 4, seed=6)
    for _ in range(2):
        LinearWithMainGradAccumulation.apply(x, weight, bias, False, None).backward(g)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    (xr @ wr.t() + br).backward(g)
    torch.testing.assert_close(weight.main_grad, 2 * wr.grad, **TOL)
    assert weight.grad is None
    torch.testing.assert_close(x.grad, 2 * xr.grad, **TOL)
    torch.testing.assert_close(bias.grad, 2 * br.grad, **TOL)


def test_non_sp_linear_with_main_grad_and_a_wider_output_dtype():
    """``output_dtype`` (megatron-core after 0.19): the output in that dtype from the operands
    cast to it, not rounded to the input dtype first; backward in the input dtype."""
    x = _randn(3, 2, 5, seed=3, dtype=torch.float32).requires_grad_()
    weight = torch.nn.Parameter(_randn(4, 5, seed=4, dtype=torch.float32))
    bias = torch.nn.Parameter(_randn(4, seed=5, dtype=torch.float32))
    weight.main_grad = torch.zeros(4, 5, dtype=torch.float32)
    g = _randn(3, 2, 4, seed=6)
    out = LinearWithMainGradAccumulation.apply(x, weight, bias, False, None, torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x.double() @ weight.double().t() + bias.double(), **TOL)
    out.backward(g)
    g32 = g.float()
    assert x.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, g32 @ weight.detach())
    torch.testing.assert_close(weight.main_grad, g32.reshape(-1, 4).t() @ x.detach().reshape(-1, 5))
    torch.testing.assert_close(bias.grad, g32.reshape(-1, 4).sum(0))
    same = LinearWithMainGradAccumulation.apply(x, weight, bias, False, None, torch.float32)
    assert same.dtype == torch.float32


def test_apex_is_absent_here():
    """The distributed checks below exercise the torch fallback; they mean that only without apex."""
    assert fused_wgrad_kernel() is None


# --------------------------------------------------------------------------- distributed checks
def _layers():
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    return ModelParallelConfig, ColumnParallelLinear, FluxColumnParallelLinear, FluxRowParallelLinear


def _config(tp, sp, dtype=torch.float64, flux_only=False, **kw):
    """Megatron's fusion on; or (``flux_only``) off, with megatron-flux's own flag on instead."""
    cfg = _layers()[0](tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                       params_dtype=dtype, gradient_accumulation_fusion=not flux_only, **kw)
    if flux_only:
        cfg.flux_gradient_accumulation_fusion = True
    return cfg


def _build(cls, seed, *args, **kwargs):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(*args, keep_master_weight_for_test=True, init_method=lambda w: torch.nn.init.normal_(w, 0, 0.5),
                   **kwargs)


def _with_main_grad(layer, dtype, ddp_flag=True):
    """What megatron's DDP does to a parameter: a main_grad buffer (+ the flag its hooks read)."""
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=dtype)
    if ddp_flag:
        layer.weight.grad_added_to_main_grad = False
    return layer


def _dense_grads(x_full, w_full, b_full, g_full):
    x, w = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    b = b_full.clone().requires_grad_()
    (x @ w.t() + b).backward(g_full)
    return x.grad, w.grad, b.grad


def _two_steps(layer, xs, gs):
    """Two forward/backward passes (two micro-batches) on the same layer."""
    for x, g in zip(xs, gs):
        out, _ = layer(x)
        out.backward(g)


def _column_case(rank, tp, *, sp, main_dtype=torch.float64, params_dtype=torch.float64, tol=TOL,
                 keep=False, ddp_flag=True, flux_only=False):
    flux_col = _layers()[2]
    layer = _build(flux_col, 0, H, F, config=_config(tp, sp, params_dtype, flux_only), bias=True,
                   gather_output=False, flux_backend="nccl", flux_keep_gathered_input=keep)
    assert layer.flux_gradient_accumulation_fusion
    assert layer.gradient_accumulation_fusion is layer.config.gradient_accumulation_fusion is (not flux_only)
    _with_main_grad(layer, main_dtype, ddp_flag)
    w_full = layer.master_weight.double()
    rows_w = slice(rank * (F // tp), (rank + 1) * (F // tp))
    s = S_LOCAL * tp
    xs_full = [_randn(s, B, H, seed=10 + i) for i in range(2)]
    gs_full = [_randn(s, B, F, seed=20 + i) for i in range(2)]
    tokens = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL) if sp else slice(None)
    xs = [xf[tokens].to(params_dtype).clone().requires_grad_() for xf in xs_full]
    _two_steps(layer, xs, [g[..., rows_w].to(params_dtype) for g in gs_full])

    refs = [_dense_grads(xf, w_full, torch.zeros(F, dtype=torch.float64), gf) for xf, gf in zip(xs_full, gs_full)]
    dw_ref = (refs[0][1] + refs[1][1])[rows_w]
    torch.testing.assert_close(layer.weight.main_grad.double(), dw_ref, **tol)
    if ddp_flag:
        assert layer.weight.grad_added_to_main_grad is True
        assert layer.weight.grad is not None and layer.weight.grad.shape == layer.weight.shape  # the dummy
    else:
        assert layer.weight.grad is None
    torch.testing.assert_close(layer.bias.grad.double(), (refs[0][2] + refs[1][2])[rows_w], **tol)
    for x, ref in zip(xs, refs):
        torch.testing.assert_close(x.grad.double(), ref[0][tokens], **tol)


def check_column_sp_accumulates(rank, tp):
    _column_case(rank, tp, sp=True)
    _column_case(rank, tp, sp=True, keep=True, ddp_flag=False)


def check_column_sp_fp32_and_bf16_main_grad(rank, tp):
    _column_case(rank, tp, sp=True, params_dtype=torch.float32, main_dtype=torch.float32,
                 tol=dict(rtol=1e-5, atol=1e-5))
    _column_case(rank, tp, sp=True, params_dtype=torch.float32, main_dtype=torch.bfloat16,
                 tol=dict(rtol=2e-2, atol=1e-1))


def check_column_sp_off_accumulates(rank, tp):
    """Stock path (SP off, TP>1, all-reduced dgrad) with the fusion on and no apex."""
    _column_case(rank, tp, sp=False)


def _row_case(rank, tp, *, sp, tp_group=None, layer_tp=None, flux_only=False):
    flux_row = _layers()[3]
    layer_tp = layer_tp or tp
    layer = _build(flux_row, 1, F, H, config=_config(layer_tp, sp, flux_only=flux_only), bias=True,
                   input_is_parallel=True, skip_bias_add=False, flux_backend="nccl", tp_group=tp_group)
    assert layer.gradient_accumulation_fusion is (not flux_only)
    _with_main_grad(layer, torch.float64)
    w_full = layer.master_weight.double()
    lrank = dist.get_rank(group=layer.tp_group)
    cols = slice(lrank * (F // layer_tp), (lrank + 1) * (F // layer_tp))
    s = S_LOCAL * layer_tp
    tokens = slice(lrank * S_LOCAL, (lrank + 1) * S_LOCAL) if sp else slice(None)
    xs_full = [_randn(s, B, F, seed=30 + i) for i in range(2)]
    gs_full = [_randn(s, B, H, seed=40 + i) for i in range(2)]
    xs = [xf[..., cols].clone().requires_grad_() for xf in xs_full]
    _two_steps(layer, xs, [g[tokens] for g in gs_full])

    refs = [_dense_grads(xf, w_full, torch.zeros(H, dtype=torch.float64), gf) for xf, gf in zip(xs_full, gs_full)]
    torch.testing.assert_close(layer.weight.main_grad, (refs[0][1] + refs[1][1])[:, cols], **TOL)
    assert layer.weight.grad_added_to_main_grad is True
    for x, ref in zip(xs, refs):
        torch.testing.assert_close(x.grad, ref[0][..., cols], **TOL)


def check_row_sp_accumulates(rank, tp):
    _row_case(rank, tp, sp=True)


def check_flux_flag_alone_accumulates_on_the_sp_path(rank, tp):
    """Megatron's flag off, megatron-flux's on (``--flux-gradient-accumulation-fusion``): the
    sequence-parallel ops of both layers still accumulate into main_grad."""
    _column_case(rank, tp, sp=True, flux_only=True)
    _row_case(rank, tp, sp=True, flux_only=True)


def check_row_sp_off_accumulates(rank, tp):
    _row_case(rank, tp, sp=False)


def check_tp1_accumulates(rank, tp):
    groups = [dist.new_group([r]) for r in range(tp)]
    _row_case(rank, tp, sp=False, tp_group=groups[rank], layer_tp=1)


def check_frozen_weight_skips_accumulation(rank, tp):
    flux_col = _layers()[2]
    layer = _build(flux_col, 0, H, F, config=_config(tp, True), bias=False, flux_backend="nccl")
    _with_main_grad(layer, torch.float64)
    layer.weight.requires_grad_(False)
    x = _randn(S_LOCAL, B, H, seed=50).requires_grad_()
    out, _ = layer(x)
    out.sum().backward()
    assert x.grad is not None and torch.count_nonzero(layer.weight.main_grad) == 0
    assert layer.weight.grad_added_to_main_grad is False


def check_construction_without_apex(rank, tp):
    """Stock raises without apex; Flux constructs and leaves the shared config as it was,
    also when the parent constructor fails for another reason."""
    _, stock_col, flux_col, flux_row = _layers()
    cfg = _config(tp, True)
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        _build(stock_col, 0, H, F, config=cfg)
    _build(flux_col, 0, H, F, config=cfg)
    _build(flux_row, 0, F, H, config=cfg, bias=True, input_is_parallel=True, skip_bias_add=False)
    assert cfg.gradient_accumulation_fusion is True
    with pytest.raises(Exception, match="not divisible"):
        _build(flux_col, 0, H, F + 1, config=cfg)
    assert cfg.gradient_accumulation_fusion is True


def check_column_output_dtype_with_fusion_and_no_apex(rank, tp):
    """A column layer asked for an output dtype other than its input's (megatron-core after
    0.19 passes ``output_dtype``; 0.16 cannot, so the test passes it as that forward does),
    with the fusion on and no apex: SP off, the torch fallback returns that dtype and
    accumulates; SP on, megatron-core's own matmul would run, which needs apex: a clear error."""
    from test_linear_layers import _with_output_dtype

    flux_col = _layers()[2]
    layer = _build(flux_col, 0, H, F, config=_config(tp, False, torch.float32), bias=True,
                   gather_output=False, flux_backend="nccl")
    _with_output_dtype(_with_main_grad(layer, torch.float32), torch.float64)
    x = _randn(S_LOCAL * tp, B, H, seed=70, dtype=torch.float32).requires_grad_()
    g = _randn(S_LOCAL * tp, B, F // tp, seed=71 + rank)
    out, _ = layer(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, x.double() @ layer.weight.double().t() + layer.bias.double(), **TOL)
    out.backward(g)
    g32 = g.float()
    torch.testing.assert_close(layer.weight.main_grad, g32.reshape(-1, F // tp).t() @ x.detach().reshape(-1, H))
    dgrad = g32 @ layer.weight.detach()
    dist.all_reduce(dgrad)  # the column layer all-reduces its input gradient with SP off
    torch.testing.assert_close(x.grad, dgrad)
    sp = _with_output_dtype(_build(flux_col, 0, H, F, config=_config(tp, True, torch.float32),
                                   flux_backend="nccl"), torch.float64)
    with pytest.raises(RuntimeError, match=r"output_dtype=torch.float64 \(inputs torch.float32\) "
                                           "runs megatron-core's own sequence-parallel matmul") as e:
        sp(_randn(S_LOCAL, B, H, seed=72, dtype=torch.float32))
    assert str(e.value).endswith("install apex or turn the fusion off"), "no other backend helps"


CHECKS = [
    check_column_output_dtype_with_fusion_and_no_apex,
    check_column_sp_accumulates,
    check_column_sp_fp32_and_bf16_main_grad,
    check_column_sp_off_accumulates,
    check_row_sp_accumulates,
    check_flux_flag_alone_accumulates_on_the_sp_path,
    check_row_sp_off_accumulates,
    check_tp1_accumulates,
    check_frozen_weight_skips_accumulation,
    check_construction_without_apex,
]


@pytest.fixture(scope="module")
def world_results():
    return run_checks(CHECKS, 2, timeout=120, tensor_model_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_grad_accumulation_in_layers(world_results, check):
    failure = world_results[check.__name__]
    assert failure is None, failure


@pytest.mark.parametrize("failure", ["oom", "cuda", "cublas"])
def test_a_device_failure_is_raised_not_taken_for_a_refused_mixed_dtype_gemm(monkeypatch,
                                                                             failure):
    """The fp32 accumulation GEMM (``addmm`` with ``out_dtype``) falls back to the activation
    dtype only where torch refuses it (once per process, with a warning): an out-of-memory, a
    CUDA or a cuBLAS error is raised, and the fallback stays off."""
    from megatron_flux.ops import grad_accumulation as ga

    errors = {"oom": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
              "cuda": RuntimeError("CUDA error: an illegal memory access was encountered"),
              "cublas": RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling "
                                     "cublasGemmEx")}

    def addmm(*args, **kwargs):
        raise errors[failure]

    monkeypatch.setattr(ga, "_FP32_ACCUMULATE_REFUSED", False)
    monkeypatch.setattr(ga.torch, "addmm", addmm)
    main_grad = torch.zeros(3, 4)
    with pytest.raises(type(errors[failure])):
        ga._accumulate_fp32_product(main_grad, torch.ones(2, 3, dtype=torch.bfloat16),
                                    torch.ones(2, 4, dtype=torch.bfloat16))
    assert ga._FP32_ACCUMULATE_REFUSED is False


@pytest.mark.parametrize("refusal", [
    "addmm: out_dtype is not supported for these inputs",
    # torch's own wording of a cuBLAS refusal (TORCH_CUDABLAS_CHECK)
    "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx( handle, opa, opb, m, "
    "n, k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, c, CUDA_R_32F, ldc, "
    "compute_type, CUBLAS_GEMM_DEFAULT_TENSOR_OP)`"])
def test_a_refused_mixed_dtype_gemm_falls_back_once_with_a_warning(monkeypatch, refusal):
    """Where this torch refuses ``addmm(..., out_dtype=torch.float32)``, the product is
    computed in the activation dtype and added (``main_grad`` untouched by the refusal), and
    the refusal is remembered."""
    from megatron_flux.ops import grad_accumulation as ga

    def addmm(*args, **kwargs):
        raise RuntimeError(refusal)

    monkeypatch.setattr(ga, "_FP32_ACCUMULATE_REFUSED", False)
    monkeypatch.setattr(ga.torch, "addmm", addmm)
    main_grad = torch.zeros(3, 4)
    with pytest.warns(RuntimeWarning, match="cannot accumulate"):
        assert ga._accumulate_fp32_product(main_grad, torch.ones(2, 3, dtype=torch.bfloat16),
                                           torch.ones(2, 4, dtype=torch.bfloat16)) is False
    assert ga._FP32_ACCUMULATE_REFUSED is True
    assert torch.equal(main_grad, torch.zeros(3, 4))
