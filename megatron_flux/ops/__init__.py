"""Autograd functions for the two sequence-parallel tensor-parallel patterns.

* :func:`column_parallel_linear`: ``Y = AG(X) @ Wᵀ (+ b)``; ``dX = RS(dY @ W)``.
* :func:`row_parallel_linear`: ``Y = RS(X @ Wᵀ) (+ b)``; ``dX = AG(dY) @ W``.

Both take Megatron's ``[s, b, h]`` activations, flatten them to ``[s*b, h]`` for the backend
(gathering rows of the flattened tensor is gathering along the sequence), and resolve the
backend by name on every call. Weight gradients follow megatron's gradient accumulation fusion
convention (:mod:`megatron_flux.ops.grad_accumulation`).
"""

from megatron_flux.ops.column_parallel import (
    ColumnParallelLinearFunction,
    column_parallel_linear,
    gather_along_last_dim,
)
from megatron_flux.ops.grad_accumulation import (
    LinearWithMainGradAccumulation,
    accumulate_weight_grad,
    fused_wgrad_kernel,
    wgrad_target,
)
from megatron_flux.ops.row_parallel import RowParallelLinearFunction, row_parallel_linear

__all__ = [
    "ColumnParallelLinearFunction",
    "LinearWithMainGradAccumulation",
    "RowParallelLinearFunction",
    "accumulate_weight_grad",
    "column_parallel_linear",
    "fused_wgrad_kernel",
    "gather_along_last_dim",
    "row_parallel_linear",
    "wgrad_target",
]
