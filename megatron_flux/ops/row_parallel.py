"""Row-parallel linear with sequence parallelism: ``Y = ReduceScatter(X @ Wᵀ) (+ b)``.

Megatron's ``RowParallelLinear`` with ``sequence_parallel`` receives the full sequence with this
rank's slice of the hidden dim, ``[s, b, k/tp]``, and a ``[n, k/tp]`` slice of the weight's
columns. The partial products are summed over the group and each rank keeps its ``s/tp`` slice
of the sequence. Each step is one backend call (:mod:`megatron_flux.backends`):

============  ======================================================================
forward       ``Y  = matmul_reduce_scatter(X, Wᵀ, bias=b)`` (bias added once, after the sum)
dgrad         ``dX, AG(dY) = all_gather_matmul(dY, W, return_gathered=True)``
wgrad         ``dW = AG(dY)ᵀ @ X``, straight after the dgrad: a backend may hand back a
              gathered buffer that is only valid until its next call
bias grad     ``db = Σ_rows dY`` over this rank's rows only; the bias carries
              ``sequence_parallel=True``, so megatron's ``finalize_model_grads`` sums it over
              the tensor-parallel group, exactly as for the stock layer
============  ======================================================================
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_flux.backends import resolve_backend
from megatron_flux.ops.column_parallel import check_linear_operands, output_of_shape
from megatron_flux.ops.grad_accumulation import accumulate_weight_grad, wgrad_target

__all__ = ["RowParallelLinearFunction", "row_parallel_linear"]


class RowParallelLinearFunction(torch.autograd.Function):
    """Autograd function of :func:`row_parallel_linear` (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        backend: str,
        group: dist.ProcessGroup,
        gradient_accumulation_fusion: bool,
    ) -> torch.Tensor:
        tp = dist.get_world_size(group=group)
        x2d = input.contiguous().view(-1, input.shape[-1])
        wt = weight.t()
        impl = resolve_backend(backend, x2d, wt, group, op="rs")
        y2d = impl.matmul_reduce_scatter(x2d, wt, group, bias=bias)

        ctx.save_for_backward(x2d if ctx.needs_input_grad[1] else None, weight)
        ctx.input_shape = input.shape
        ctx.backend = backend
        ctx.group = group
        ctx.wgrad_target = wgrad_target(weight, gradient_accumulation_fusion)
        return output_of_shape(y2d, (input.shape[0] // tp, *input.shape[1:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        group = ctx.group
        dy = grad_output.contiguous().view(-1, grad_output.shape[-1])
        impl = resolve_backend(ctx.backend, dy, weight, group, op="ag")

        grad_input = grad_weight = None
        if need_dgrad:
            dx2d, gathered_dy = impl.all_gather_matmul(dy, weight, group, return_gathered=need_wgrad)
            grad_input = dx2d.view(ctx.input_shape)
        elif need_wgrad:
            gathered_dy = impl.all_gather(dy, group)
        if need_wgrad:
            # Consumed before any further backend call (the buffer may be the backend's).
            grad_weight = accumulate_weight_grad(weight, ctx.wgrad_target, gathered_dy, x2d)
        grad_bias = dy.sum(dim=0) if need_bgrad else None
        return grad_input, grad_weight, grad_bias, None, None, None


def row_parallel_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group: dist.ProcessGroup,
    backend: str = "auto",
    gradient_accumulation_fusion: bool = False,
) -> torch.Tensor:
    """``ReduceScatter_seq(input @ weightᵀ) + bias`` with sequence-parallel gradients.

    Args:
        input: ``[s, b, k/tp]`` (any number of middle dims), the full sequence; ``s`` must be
            divisible by the group size.
        weight: ``[n, k/tp]``, this rank's columns of the weight.
        bias: optional ``[n]``, added once after the reduction (``None`` for ``skip_bias_add``).
        group: the tensor-parallel process group.
        backend: a registered backend name or ``"auto"``, resolved on every call.
        gradient_accumulation_fusion: accumulate the weight gradient into ``weight.main_grad``.

    Returns:
        ``[s/tp, b, n]``, this rank's slice of the sequence.
    """
    check_linear_operands("row_parallel_linear", input, weight, bias, weight.shape[1])
    tp = dist.get_world_size(group=group)
    if input.shape[0] % tp != 0:
        raise ValueError(
            f"row_parallel_linear: sequence length {input.shape[0]} (dim 0 of input "
            f"{tuple(input.shape)}) is not divisible by the tensor-parallel size {tp}; "
            f"sequence parallelism splits the sequence evenly across ranks"
        )
    return RowParallelLinearFunction.apply(
        input, weight, bias, backend, group, bool(gradient_accumulation_fusion)
    )
