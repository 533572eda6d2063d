"""Weight-gradient accumulation into ``weight.main_grad`` (megatron's gradient accumulation fusion).

With ``config.gradient_accumulation_fusion`` megatron-core does not hand the weight gradient to
autograd: the wgrad GEMM accumulates straight into the fp32 (or bf16) ``weight.main_grad``
buffer that megatron's DDP owns, using apex's ``fused_weight_gradient_mlp_cuda``. Autograd then
receives a *dummy* gradient (only so that DDP's grad hooks fire on the main thread) when the
weight carries ``grad_added_to_main_grad``, else ``None``; ``weight.grad_added_to_main_grad``
is set so DDP does not add the dummy to ``main_grad`` again. This module reproduces that
convention (``LinearWithGradAccumulationAndAsyncCommunication.backward``, megatron-core 0.16
and 0.19 alike) with one difference: without apex (or off CUDA) the accumulation is done in
plain torch instead of raising, so megatron-flux layers work on any install. Into an fp32
``main_grad`` from bf16/fp16 activations that is still one GEMM on CUDA:
``torch.addmm(main_grad, dYᵀ, X, out_dtype=torch.float32, out=main_grad)``, fp32 output with
beta = 1, what apex's ``wgrad_gemm_accum_fp32`` does. On one H200 (torch 2.11, Llama-3-8B TP 2
weight gradients, m = 8192) it ran 1.02-1.04x the bf16 GEMM alone, where the GEMM then
``main_grad.add_`` (what DDP does without the fusion) ran 1.15-1.19x; and it sums the fp32
product, not its bf16 rounding. A torch that refuses an
fp32 ``self`` there gets the GEMM in the activation dtype and an ``add_``, with one warning.

It also holds :class:`LinearWithMainGradAccumulation`, the non-sequence-parallel linear the
layers use in place of megatron's when the fusion is on but apex is not there.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = [
    "LinearWithMainGradAccumulation",
    "WgradTarget",
    "accumulate_weight_grad",
    "fused_wgrad_kernel",
    "wgrad_target",
]


class WgradTarget(NamedTuple):
    """Whether the weight gradient is accumulated into ``main_grad`` (``fuse``) and the buffer."""

    fuse: bool
    main_grad: Optional[torch.Tensor]


@functools.lru_cache(maxsize=1)
def fused_wgrad_kernel():
    """apex's ``fused_weight_gradient_mlp_cuda`` extension, or ``None`` when not installed."""
    try:
        import fused_weight_gradient_mlp_cuda
    except ImportError:
        return None
    return fused_weight_gradient_mlp_cuda


def wgrad_target(weight: torch.Tensor, gradient_accumulation_fusion: bool) -> WgradTarget:
    """Where this call's weight gradient goes, decided at forward time as megatron does.

    Megatron reads ``weight.main_grad`` in forward and keeps it on the autograd context rather
    than in ``save_for_backward``: one module may run several times per step (MTP logits), and
    the in-place accumulation would trip autograd's version checks on a saved tensor. A weight
    without ``main_grad`` (no megatron DDP around it) gets a regular gradient: megatron would
    crash there, a regular gradient is the correct answer.
    """
    if not gradient_accumulation_fusion:
        return WgradTarget(False, None)
    fsdp = hasattr(weight, "__fsdp_param__")
    main_grad = getattr(weight, "main_grad", None)
    return WgradTarget(fsdp or main_grad is not None, main_grad)


def accumulate_weight_grad(
    weight: torch.Tensor,
    target: WgradTarget,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
) -> Optional[torch.Tensor]:
    """Compute ``dW = grad_outputᵀ @ total_input`` and return what autograd should receive.

    Args:
        weight: the ``[n, k]`` parameter.
        target: :func:`wgrad_target` from the forward.
        grad_output: ``[m, n]`` 2-D.
        total_input: ``[m, k]`` 2-D, the (gathered) input of the forward GEMM.

    Returns:
        ``dW`` without fusion; with fusion megatron's dummy gradient (zeros if
        ``weight.zero_out_wgrad``) when ``weight`` has ``grad_added_to_main_grad``, else ``None``.
    """
    if not target.fuse:
        return grad_output.t().matmul(total_input)
    grad_output = grad_output.contiguous()
    total_input = total_input.contiguous()
    if hasattr(weight, "__fsdp_param__"):
        # Megatron-FSDP hands out a fresh main-grad buffer that the GEMM overwrites.
        weight.main_grad = weight.get_main_grad()
        torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
    else:
        weight.main_grad = target.main_grad
        _accumulate(target.main_grad, grad_output, total_input)
    main_grad = weight.main_grad

    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # DDP (overlap_grad_reduce) needs *a* gradient so its hooks run on the backward thread; it
    # skips adding it to main_grad because of the flag below (and adds it, hence zeros, when
    # zero_out_wgrad is set).
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    dummy = make(main_grad.shape, dtype=total_input.dtype, device=main_grad.device)
    weight.grad_added_to_main_grad = True
    return dummy


def _accumulate(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """``main_grad += grad_outputᵀ @ total_input`` (apex on CUDA when present, else torch)."""
    if main_grad.shape != (grad_output.shape[1], total_input.shape[1]):
        raise RuntimeError(
            f"weight.main_grad has shape {tuple(main_grad.shape)}, expected "
            f"{(grad_output.shape[1], total_input.shape[1])}"
        )
    kernel = fused_wgrad_kernel()
    if kernel is not None and main_grad.is_cuda:
        if main_grad.dtype == torch.float32:
            kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
            return
        raise RuntimeError(
            f"gradient accumulation fusion does not support main_grad of dtype {main_grad.dtype}"
        )
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    if main_grad.dtype == torch.float32 and main_grad.is_cuda and not _FP32_ACCUMULATE_REFUSED:
        if _accumulate_fp32_product(main_grad, grad_output, total_input):
            return
    # e.g. bf16 activations into an fp32 main_grad without a mixed-dtype GEMM: the GEMM runs in
    # the activation dtype and is added in main_grad's -- the numerics of megatron without the
    # fusion (DDP adds the bf16 .grad into main_grad).
    main_grad.add_(grad_output.t().matmul(total_input))


#: set when this torch has refused ``torch.addmm(..., out_dtype=torch.float32)`` into an fp32
#: ``main_grad`` once; tried on CUDA only (torch's CPU build has no kernel for
#: ``addmm.dtype_out``)
_FP32_ACCUMULATE_REFUSED = False


def _accumulate_fp32_product(main_grad, grad_output, total_input) -> bool:
    """``main_grad += grad_outputᵀ total_input`` as one GEMM with bf16/fp16 operands and the
    fp32 accumulator read and written in its epilogue (beta = 1), as apex's
    ``wgrad_gemm_accum_fp32``. Returns False, once per process with a warning, where this torch
    refuses the mixed-dtype ``addmm`` (its dtype checks run before any work, so ``main_grad``
    is untouched); a failure of the device (out of memory, a CUDA or cuBLAS error) is raised,
    not taken for a refusal."""
    global _FP32_ACCUMULATE_REFUSED
    try:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                    out=main_grad)
        return True
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        text = str(exc)
        # torch words every cuBLAS failure "CUDA error: CUBLAS_STATUS_... when calling ...",
        # so a refusal (NOT_SUPPORTED) is told apart first
        if "CUBLAS_STATUS_NOT_SUPPORTED" not in text and (
                isinstance(exc, torch.OutOfMemoryError) or "CUDA error" in text
                or "CUBLAS_STATUS" in text):
            raise
        _FP32_ACCUMULATE_REFUSED = True
        warnings.warn(
            "megatron-flux: torch.addmm(..., out_dtype=torch.float32) cannot accumulate "
            f"into an fp32 main_grad here ({type(exc).__name__}: {text.splitlines()[0]}); "
            "the weight gradient is computed in the activation dtype and added instead",
            RuntimeWarning, stacklevel=4)
        return False


class LinearWithMainGradAccumulation(torch.autograd.Function):
    """``Y = X Wᵀ + b`` whose weight gradient goes into ``main_grad`` in plain torch.

    The layers route megatron's *non*-sequence-parallel linear (TP=1, SP off) here when
    ``gradient_accumulation_fusion`` is on but apex's kernel cannot run; megatron's own function
    would raise ``NameError`` on the missing extension. ``allreduce_dgrad`` all-reduces the input
    gradient over ``tp_group`` (column layers with SP off), as megatron does.

    ``output_dtype`` (megatron-core after 0.19 passes it; fp32 logits from bf16 inputs): ``Y``
    in that dtype, computed from the operands cast to it (exact for a wider dtype: no rounding
    to the input dtype first), as megatron-core's GEMM with that output dtype does; backward
    casts ``dY`` to the input dtype first, as megatron-core does.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group, output_dtype=None):
        ctx.save_for_backward(input, weight)
        ctx.wgrad_target = wgrad_target(weight, True)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        ctx.input_dtype = input.dtype
        if output_dtype is not None and output_dtype != input.dtype:
            output = torch.matmul(input.to(output_dtype), weight.to(output_dtype).t())
            if bias is not None:
                output = output + bias.to(output_dtype)
            return output
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_output = grad_output.to(ctx.input_dtype)
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        input_2d = input.reshape(-1, input.shape[-1])
        grad_weight = accumulate_weight_grad(weight, ctx.wgrad_target, grad_output_2d, input_2d)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None
