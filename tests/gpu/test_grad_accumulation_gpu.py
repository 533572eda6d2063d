"""Weight-gradient accumulation into an fp32 ``main_grad`` on one GPU, without apex.

On CUDA :func:`accumulate_weight_grad` runs it as one GEMM with fp32 output and beta = 1
(``torch.addmm(..., out_dtype=torch.float32)``), so the fp32 product is summed, never its bf16
or fp16 rounding. Float64 tells the two apart: the fused sum is within ~1e-5 of it (relative,
by norm); the activation-dtype GEMM then ``add_`` is ~1e-3 off in bf16 and ~3e-4 in fp16.
"""

import warnings

import pytest
import torch

from megatron_flux.ops.grad_accumulation import (
    accumulate_weight_grad,
    fused_wgrad_kernel,
    wgrad_target,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_main_grad_accumulates_the_fp32_product_in_place(dtype):
    if fused_wgrad_kernel() is not None:
        pytest.skip("apex is installed: its kernel runs instead")
    m, n, k = 2048, 384, 640
    gen = torch.Generator(device="cuda").manual_seed(3)
    dys = [torch.randn(m, n, device="cuda", generator=gen).to(dtype) for _ in range(2)]
    xs = [torch.randn(m, k, device="cuda", generator=gen).to(dtype) for _ in range(2)]
    weight = torch.nn.Parameter(torch.zeros(n, k, device="cuda", dtype=dtype))
    start = torch.randn(n, k, device="cuda", generator=gen) * 64
    weight.main_grad = start.clone()
    weight.grad_added_to_main_grad = False
    buffer = weight.main_grad.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused fused path would warn
        for dy, x in zip(dys, xs):  # two micro-batches
            dummy = accumulate_weight_grad(weight, wgrad_target(weight, True), dy, x)
            assert dummy is not None and weight.grad_added_to_main_grad is True
    torch.cuda.synchronize()
    assert weight.main_grad.data_ptr() == buffer and weight.main_grad.dtype == torch.float32
    ref = start.double() + sum(dy.double().t() @ x.double() for dy, x in zip(dys, xs))
    rel = float((weight.main_grad.double() - ref).norm() / ref.norm())
    assert rel < 3e-5, rel
    # what the unfused path gives, for scale: the product rounded to the activation dtype
    unfused = start.clone()
    for dy, x in zip(dys, xs):
        unfused.add_(dy.t().matmul(x))
    rel_unfused = float((unfused.double() - ref).norm() / ref.norm())
    assert rel_unfused > 3 * rel, (rel_unfused, rel)
