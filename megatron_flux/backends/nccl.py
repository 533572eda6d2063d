"""The reference backend: a plain ``torch.distributed`` collective, then (or after) ``torch.matmul``.

This is what megatron-core itself does on the sequence-parallel path, minus the CUDA-only
global memory buffer, so it is both the numerical reference the fused backend is checked
against and the fallback ``"auto"`` picks when the fused kernels cannot run. It works on any
device and process group: CUDA tensors over NCCL, CPU tensors over gloo (the test suite).

Nothing here overlaps communication with computation; the point is to be obviously correct.
Buffers are freshly allocated on every call (``gathered`` stays valid for as long as the
caller holds it, which satisfies the contract's weaker promise).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_flux.backends.base import PendingGather, TPOverlapBackend, output_like

__all__ = ["NcclBackend"]

# torch >= 2.10 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
# the ``*_single`` names (FutureWarning on every call); older torch only has the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_unsupported_collective(exc: BaseException) -> bool:
    """Whether ``exc`` says the process group lacks the collective (gloo before torch 2.3
    raised ``... does not support _reduce_scatter_base``), as opposed to another failure."""
    if isinstance(exc, NotImplementedError):
        return True
    return isinstance(exc, RuntimeError) and "not support" in str(exc).lower()


class NcclBackend(TPOverlapBackend):
    """``torch.distributed`` collectives + ``torch.matmul``; device- and process-group-agnostic."""

    name = "nccl"

    # ----------------------------------------------------------------------------- collectives
    def all_gather(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.all_gather_start(x, group, out=out).wait()

    def all_gather_start(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: Optional[torch.Tensor] = None
    ) -> PendingGather:
        """The all-gather issued with ``async_op=True`` (into a contiguous ``out``), so the
        caller can queue independent work before :meth:`PendingGather.wait`; Megatron's
        weight-gradient re-gather overlaps the input-gradient GEMM this way. A single rank
        copies, and a non-contiguous ``out`` is filled through a temporary, synchronously."""
        x = x.contiguous()
        tp = dist.get_world_size(group=group)
        shape = (x.shape[0] * tp, *x.shape[1:])
        out = output_like(out, shape, x, "all_gather")
        if tp == 1:
            return PendingGather(out.copy_(x))
        if out.is_contiguous():
            return PendingGather(out, _all_gather_single(out, x, group=group, async_op=True))
        tmp = torch.empty(shape, dtype=x.dtype, device=x.device)
        _all_gather_single(tmp, x, group=group)
        return PendingGather(out.copy_(tmp))

    def reduce_scatter(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        x = x.contiguous()
        tp = dist.get_world_size(group=group)
        if x.dim() == 0 or x.shape[0] % tp != 0:
            raise ValueError(
                f"reduce_scatter: the first dimension of a {tuple(x.shape)} tensor is not "
                f"divisible by the tensor-parallel size {tp}"
            )
        shape = (x.shape[0] // tp, *x.shape[1:])
        out = output_like(out, shape, x, "reduce_scatter")
        if tp == 1:
            return out.copy_(x)
        target = out if out.is_contiguous() else torch.empty(shape, dtype=x.dtype, device=x.device)
        self._reduce_scatter_into(target, x, group)
        if target is not out:
            out.copy_(target)
        return out

    def _reduce_scatter_into(
        self, out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup,
        async_op: bool = False,
    ):
        """Sum ``x`` over the group into this rank's rows ``out`` (both contiguous) by the
        tensor reduce-scatter, returning its work handle with ``async_op`` (else ``None``).

        A process group without it (torch >= 2.6's NCCL and gloo have it) raises a clear error:
        no rank switches to another collective on its own, which would pair its collective
        with its peers' reduce-scatters (a hang or wrong sums), since an error that one rank
        meets, its peers need not.
        """
        try:
            return _reduce_scatter_single(out, x, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError) as exc:
            if not _is_unsupported_collective(exc):
                raise
            raise RuntimeError(
                f"megatron-flux nccl reduce_scatter: the {dist.get_backend(group)!r} process "
                f"group on rank {dist.get_rank()} does not run the tensor reduce-scatter "
                f"({exc}); megatron-flux needs it (torch >= 2.6's NCCL and gloo have it)"
            ) from exc

    # ------------------------------------------------------------------------------ fused ops
    def all_gather_matmul(
        self,
        a_shard: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        out: Optional[torch.Tensor] = None,
        return_gathered: bool = False,
        gathered_out: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        _check_operands("all_gather_matmul", a_shard, b)
        tp = dist.get_world_size(group=group)
        gathered = self.all_gather(
            a_shard, group, out=gathered_out if return_gathered else None
        )
        shape = (a_shard.shape[0] * tp, b.shape[1])
        if out is None:
            result = torch.matmul(gathered, b)
        else:
            output_like(out, shape, a_shard, "all_gather_matmul")
            result = torch.matmul(gathered, b, out=out)
        return result, (gathered if return_gathered else None)

    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        out: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        _check_reduce_scatter_operands(a, b, dist.get_world_size(group=group), bias)
        partial = torch.matmul(a.contiguous(), b)
        result = self.reduce_scatter(partial, group, out=out)
        if bias is not None:
            result.add_(bias)
        return result

    def matmul_reduce_scatter_start(self, a, b, group, *, bias=None) -> PendingGather:
        """The GEMM, then the reduce-scatter issued with ``async_op=True`` (megatron-core's
        column backward: the input gradient's reduce-scatter runs beside the weight-gradient
        GEMM)."""
        tp = dist.get_world_size(group=group)
        _check_reduce_scatter_operands(a, b, tp, bias)
        partial = torch.matmul(a.contiguous(), b)
        out = torch.empty((a.shape[0] // tp, b.shape[1]), dtype=a.dtype, device=a.device)
        work = None
        if tp == 1:
            out.copy_(partial)
        else:
            work = self._reduce_scatter_into(out, partial, group, async_op=True)
        then = (lambda r: r.add_(bias)) if bias is not None else None
        return PendingGather(out, work, then)


def _check_reduce_scatter_operands(a: torch.Tensor, b: torch.Tensor, tp: int, bias) -> None:
    """What ``matmul_reduce_scatter`` (either form) refuses: bad operands, rows not divisible
    by the group size, a bias of the wrong shape, dtype or device."""
    _check_operands("matmul_reduce_scatter", a, b)
    if a.shape[0] % tp != 0:
        raise ValueError(
            f"matmul_reduce_scatter: m={a.shape[0]} rows of A are not divisible by the "
            f"tensor-parallel size {tp} (each rank must own m/tp rows of the result)"
        )
    if bias is not None and (
        bias.shape != (b.shape[1],) or bias.dtype != a.dtype or bias.device != a.device
    ):
        raise ValueError(
            f"matmul_reduce_scatter: bias must be a [{b.shape[1]}] {a.dtype} tensor on "
            f"{a.device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )


def _check_operands(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Reject operands ``torch.matmul`` would either refuse cryptically or broadcast silently."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"{op}: A and B must be 2-D (flatten [s, b, h] activations to [s*b, h] first), "
            f"got A {tuple(a.shape)} and B {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ, A {tuple(a.shape)} @ B {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(
            f"{op}: A is {a.dtype} but B is {b.dtype}; cast the activation to the weight's "
            f"dtype (megatron's params_dtype) before the layer"
        )
    if a.device != b.device:
        raise ValueError(f"{op}: A is on {a.device} but B is on {b.device}")
