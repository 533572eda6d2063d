"""Column-parallel linear with sequence parallelism: ``Y = AllGather(X) @ Wᵀ (+ b)``.

Megatron's ``ColumnParallelLinear`` with ``sequence_parallel`` receives this rank's slice
``[s/tp, b, h]`` of the sequence and a ``[n/tp, h]`` slice of the weight's rows. It all-gathers
the sequence, multiplies, and in backward reduce-scatters the input gradient, gathering the
input a second time for the weight gradient. Here each of those steps is one backend call
(:mod:`megatron_flux.backends`), so a fused backend hides the collective inside the GEMM:

============  ======================================================================
forward       ``Y  = all_gather_matmul(X, Wᵀ)`` (+ bias)
dgrad         ``dX = matmul_reduce_scatter(dY, W)``, started before the wgrad and waited for
              after it (megatron-core overlaps the reduce-scatter with the wgrad GEMM)
wgrad         ``dW = dYᵀ @ AG(X)``: AG(X) kept from forward (``keep_gathered_input``) or
              re-gathered with ``backend.all_gather_start`` beside the dgrad (megatron's
              default: saves ``tp - 1`` shards of activation memory per layer at the cost of
              a collective, which runs hidden behind the dgrad)
bias grad     ``db = Σ_rows dY`` (dY is full-sequence here, so no reduction is needed)
============  ======================================================================

The backend is chosen per call by :func:`megatron_flux.backends.resolve_backend`, so ``"auto"``
takes the fused backend whenever it supports the operands and the reference otherwise.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_flux.backends import get_backend, resolve_backend
from megatron_flux.ops.grad_accumulation import accumulate_weight_grad, wgrad_target

__all__ = [
    "ColumnParallelLinearFunction",
    "GatherAlongLastDim",
    "check_linear_operands",
    "column_parallel_linear",
    "gather_along_last_dim",
    "output_of_shape",
]


def output_of_shape(y2d: torch.Tensor, shape) -> torch.Tensor:
    """``y2d`` reshaped to ``shape`` as a tensor autograd does not treat as a view.

    A custom Function's output that is a ``view`` of a tensor made inside ``forward`` may not be
    modified in place afterwards (autograd raises), and megatron-core does modify it: its
    vocabulary-parallel cross entropy subtracts the row maximum from fp32 logits in place.
    megatron-core's own linear returns ``torch.matmul``'s result, which is reshaped by
    ``_unsafe_view`` for the same reason; so is ours. No copy.
    """
    return torch.ops.aten._unsafe_view(y2d, shape)


def check_linear_operands(
    op: str, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], in_dim: int
) -> None:
    """Raise a clear error for operands the op would otherwise reject cryptically (or, for a
    wrong rank, silently misinterpret): ``input`` is ``[s, ..., in_dim]`` with at least 2 dims,
    ``weight`` is 2-D, and all three share dtype and device."""
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D, got shape {tuple(weight.shape)}")
    if input.dim() < 2:
        raise ValueError(
            f"{op}: input must be [sequence, batch, hidden] (at least 2-D), got {tuple(input.shape)}"
        )
    if input.shape[-1] != in_dim:
        raise ValueError(
            f"{op}: input's last dimension is {input.shape[-1]}, the weight "
            f"{tuple(weight.shape)} expects {in_dim}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != input.dtype:
            raise TypeError(
                f"{op}: input is {input.dtype} but {name} is {t.dtype}; megatron-flux does not "
                f"cast (cast the activation to params_dtype before the layer)"
            )
        if t.device != input.device:
            raise ValueError(f"{op}: input is on {input.device} but {name} is on {t.device}")


class ColumnParallelLinearFunction(torch.autograd.Function):
    """Autograd function of :func:`column_parallel_linear` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        backend: str,
        group: dist.ProcessGroup,
        keep_gathered_input: bool,
        gradient_accumulation_fusion: bool,
    ) -> torch.Tensor:
        tp = dist.get_world_size(group=group)
        x2d = input.contiguous().view(-1, input.shape[-1])
        wt = weight.t()
        keep = keep_gathered_input and ctx.needs_input_grad[1]
        gathered_out = (
            torch.empty((x2d.shape[0] * tp, x2d.shape[1]), dtype=x2d.dtype, device=x2d.device)
            if keep
            else None
        )
        impl = resolve_backend(backend, x2d, wt, group, op="ag")
        y2d, gathered = impl.all_gather_matmul(
            x2d, wt, group, return_gathered=keep, gathered_out=gathered_out
        )
        if bias is not None:
            y2d.add_(bias)

        if not ctx.needs_input_grad[1]:
            saved_input = None  # frozen weight: no wgrad, nothing of X to keep
        else:
            saved_input = gathered if keep else x2d
        ctx.save_for_backward(saved_input, weight)
        ctx.kept_gathered = keep
        ctx.input_shape = input.shape
        ctx.backend = backend
        ctx.group = group
        ctx.wgrad_target = wgrad_target(weight, gradient_accumulation_fusion)
        return output_of_shape(y2d, (input.shape[0] * tp, *input.shape[1:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        saved_input, weight = ctx.saved_tensors
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        group = ctx.group
        dy = grad_output.contiguous().view(-1, grad_output.shape[-1])

        dgrad_impl = resolve_backend(ctx.backend, dy, weight, group, op="rs") if need_dgrad else None
        # The weight gradient's re-gather of the input (unless forward kept it) starts first and
        # is waited for after the dgrad is queued, so it runs beside the dgrad GEMM: an async
        # NCCL all-gather beside cuBLAS (megatron-core's order), or, with the fused backend,
        # copy-engine pushes that need no SM beside its persistent GEMM+RS grid.
        regather = None
        if need_wgrad and not ctx.kept_gathered:
            impl = dgrad_impl or resolve_backend(ctx.backend, saved_input, weight.t(), group, op="ag")
            regather = impl.all_gather_start(saved_input, group)
        # The dgrad's reduce-scatter may still run while the wgrad GEMM does (NCCL: as
        # megatron-core; fused: already reduced).
        pending_dgrad = dgrad_impl.matmul_reduce_scatter_start(dy, weight, group) if need_dgrad else None
        total_input = regather.wait() if regather is not None else saved_input

        grad_weight = (
            accumulate_weight_grad(weight, ctx.wgrad_target, dy, total_input) if need_wgrad else None
        )
        grad_bias = dy.sum(dim=0) if need_bgrad else None
        grad_input = pending_dgrad.wait().view(ctx.input_shape) if need_dgrad else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def column_parallel_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group: dist.ProcessGroup,
    backend: str = "auto",
    keep_gathered_input: bool = False,
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """``AllGather_seq(input) @ weightᵀ + bias`` with sequence-parallel gradients.

    Args:
        input: ``[s/tp, b, h]`` (any number of middle dims), this rank's sequence slice.
        weight: ``[n/tp, h]``, this rank's rows of the weight.
        bias: optional ``[n/tp]``, added to the output (``None`` for ``skip_bias_add``).
        group: the tensor-parallel process group.
        backend: a registered backend name or ``"auto"``, resolved on every call.
        keep_gathered_input: keep the forward's gathered input for the weight gradient instead
            of re-gathering it in backward (faster backward, ``tp×`` the saved activation).
        gradient_accumulation_fusion: accumulate the weight gradient into ``weight.main_grad``
            (megatron's convention, see :mod:`megatron_flux.ops.grad_accumulation`).

    Returns:
        ``[s, b, n/tp]``.
    """
    check_linear_operands("column_parallel_linear", input, weight, bias, weight.shape[1])
    keep = bool(keep_gathered_input) and torch.is_grad_enabled() and weight.requires_grad
    return ColumnParallelLinearFunction.apply(
        input, weight, bias, backend, group, keep, bool(gradient_accumulation_fusion)
    )


class GatherAlongLastDim(torch.autograd.Function):
    """Concatenate every rank's ``[..., n/tp]`` into ``[..., n]``; backward keeps this rank's slice.

    The device-agnostic twin of megatron's ``gather_from_tensor_model_parallel_region``, whose
    buffer is allocated on ``torch.cuda.current_device()`` (so ``gather_output`` cannot run on
    CPU with the stock layer).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tp = dist.get_world_size(group=group)
        ctx.group = group
        if tp == 1:
            return x
        x = x.contiguous()
        rows = x.view(-1, x.shape[-1])
        gathered = get_backend("nccl").all_gather(rows, group)  # [tp * rows, n/tp]
        out = gathered.view(tp, rows.shape[0], rows.shape[1]).permute(1, 0, 2)
        return out.reshape(*x.shape[:-1], tp * x.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None]:
        tp = dist.get_world_size(group=ctx.group)
        if tp == 1:
            return grad_output, None
        rank = dist.get_rank(group=ctx.group)
        width = grad_output.shape[-1] // tp
        return grad_output.narrow(-1, rank * width, width).contiguous(), None


def gather_along_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather ``x`` along its last dimension over ``group`` (differentiable)."""
    return GatherAlongLastDim.apply(x, group)
