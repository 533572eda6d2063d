"""Backends: how one sequence-parallel op (AG+GEMM, GEMM+RS and their plain collectives) runs.

* :mod:`.base`     the contract (:class:`TPOverlapBackend`) the autograd ops call
* :mod:`.registry` ``register_backend`` / ``get_backend`` / ``resolve_backend`` (the ``auto`` policy)
* :mod:`.auto`     ``auto``'s per-shape choice between the fused backend and NCCL, from the tables
* :mod:`.nccl`     the reference: ``torch.distributed`` collectives and ``torch.matmul``
* :mod:`.flux`     the fused Triton kernels over torch symmetric memory
"""

from megatron_flux.backends.base import TPOverlapBackend
from megatron_flux.backends.registry import (
    BACKEND_CHOICES,
    MEGATRON_PASSTHROUGH,
    available_backends,
    check_fused_errors,
    clear_resolution_cache,
    expect_cuda_graphs,
    fused_unavailable_reason,
    get_backend,
    log_once,
    poll_fused_errors,
    register_backend,
    resolve_backend,
    validate_backend_name,
)

__all__ = [
    "BACKEND_CHOICES",
    "MEGATRON_PASSTHROUGH",
    "TPOverlapBackend",
    "available_backends",
    "check_fused_errors",
    "clear_resolution_cache",
    "expect_cuda_graphs",
    "fused_unavailable_reason",
    "get_backend",
    "log_once",
    "poll_fused_errors",
    "register_backend",
    "resolve_backend",
    "validate_backend_name",
]
