"""The contract between the layers' autograd functions and a communication backend.

A backend runs the two sequence-parallel patterns of tensor parallelism on 2-D row-major
operands (the ops flatten Megatron's ``[s, b, h]`` activations to ``[s*b, h]`` first; gathering
along dim 0 of the flattened tensor is exactly Megatron's gather along the sequence dim):

* ``all_gather_matmul``:   ``C = AllGather_rows(A_shard) @ B``
* ``matmul_reduce_scatter``: ``C = ReduceScatter_rows(A @ B) (+ bias)``

``B`` is a ``[k, n]`` matrix given with any strides; the layers pass ``weight.t()`` (a view of
a row-major ``[n, k]`` weight) or ``weight`` itself, so both layouts must be handled without
a copy where the backend can. Rank ``r`` owns rows ``[r*m_local, (r+1)*m_local)`` of every
gathered / reduced matrix, where ``m_local = rows of the shard``.

Backends register themselves in :mod:`megatron_flux.backends` by name.
"""

from __future__ import annotations

import abc
from typing import Optional, Tuple

import torch
import torch.distributed as dist

#: the most answers a per-signature cache of the backends keeps (resolution, support, configs):
#: a job whose shapes keep changing (variable sequence lengths) starts such a cache over rather
#: than growing it without bound
MAX_CACHED_SIGNATURES = 4096


def remember(cache: dict, key, value):
    """``cache[key] = value``, the cache first started over where it holds
    :data:`MAX_CACHED_SIGNATURES` answers; returns ``value``."""
    if len(cache) >= MAX_CACHED_SIGNATURES:
        cache.clear()
    cache[key] = value
    return value


def output_like(
    out: Optional[torch.Tensor],
    shape: Tuple[int, ...],
    like: torch.Tensor,
    op: str,
    *,
    contiguous: bool = False,
) -> torch.Tensor:
    """``out`` after checking it fits (shape, dtype, device, and contiguity when the consumer
    needs it), or a fresh tensor shaped ``shape`` like ``like``. Shared by the backends so every
    backend rejects a misfit ``out=`` the same way."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if (tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device
            or (contiguous and not out.is_contiguous())):
        raise ValueError(
            f"{op}: out must be a {'contiguous ' if contiguous else ''}{shape} {like.dtype} tensor "
            f"on {like.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
            + ("" if out.is_contiguous() else " (not contiguous)")
        )
    return out


class PendingGather:
    """A collective (or fused op) that may still be running: :meth:`wait` makes the caller's
    stream wait for it and returns its result, after ``then(result)`` when given (e.g. a bias
    add that must follow the reduction)."""

    def __init__(self, out: torch.Tensor, work=None, then=None):
        self._out, self._work, self._then = out, work, then

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            self._then(self._out)
            self._then = None
        return self._out


#: the same handle, for results that are not gathers
Pending = PendingGather


class TPOverlapBackend(abc.ABC):
    """One way of running AG+GEMM and GEMM+RS over a tensor-parallel group."""

    #: registry name (``"nccl"``, ``"flux"``, ...)
    name: str = ""

    #: Whether this backend's fused kernels wait on other ranks while holding SMs (persistent
    #: kernels that spin on peers' signals). Nothing else may then run beside them on the GPU:
    #: a concurrent kernel (an asynchronous NCCL collective, say) that takes SMs from one rank's
    #: grid can leave the peers' spinning grids waiting for tiles that never get an SM. Such a
    #: backend's ``all_gather_start`` must therefore need no SM while its other ops run (the
    #: fused backend's uses the copy engine): the column backward queues it beside the dgrad.
    waits_across_ranks_on_sms: bool = False

    #: Whether a CUDA graph may capture this backend's calls and replay them. One that may not
    #: (the fused backend: its signals carry per-call epochs that a replay would repeat) gives
    #: way to ``nccl`` inside a capture (:func:`megatron_flux.backends.resolve_backend`).
    capturable: bool = True

    def unsupported_reason(
        self, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup
    ) -> Optional[str]:
        """Why this backend cannot run an op on these operands, or ``None`` if it can.

        The layers ask before every fused call and fall back to the reference backend
        (logging the reason once) when a reason is returned, so this must be cheap and must
        never touch the GPU.
        """
        return None

    @abc.abstractmethod
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
        """``C = AllGather_rows(a_shard) @ b``.

        Args:
            a_shard: ``[m_local, k]`` contiguous, this rank's rows.
            b: ``[k, n]``, any strides.
            out: optional preallocated ``[m_local * tp, n]`` output (same dtype as ``a_shard``).
            return_gathered: also hand back the gathered ``[m_local * tp, k]`` input (for the
                weight gradient).
            gathered_out: where to put the gathered input when ``return_gathered``; if ``None``
                the backend may return a buffer it owns, valid only until its next call on this
                group (callers that keep it longer must pass ``gathered_out``).

        Returns:
            ``(C, gathered or None)``.
        """

    @abc.abstractmethod
    def matmul_reduce_scatter(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        out: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``C = ReduceScatter_rows(a @ b) + bias``.

        Args:
            a: ``[m, k]`` contiguous, ``m`` divisible by the group size.
            b: ``[k, n]``, any strides.
            out: optional preallocated ``[m / tp, n]`` output.
            bias: optional ``[n]``, added once after the reduction.
        """

    @abc.abstractmethod
    def all_gather(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Plain row all-gather of a contiguous ``[m_local, ...]`` tensor (weight-gradient
        re-gather when the forward's gathered input was not kept)."""

    def all_gather_start(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: Optional[torch.Tensor] = None
    ) -> PendingGather:
        """:meth:`all_gather`, possibly still running when this returns; ``.wait()`` before
        using the result. The default runs it to completion here.

        The column layer's backward starts the weight-gradient re-gather with this *before*
        queuing its input-gradient GEMM+RS and waits after it, so a backend whose gather needs
        no SMs (or runs asynchronously) hides it behind that GEMM. Without ``out`` the result
        may be a buffer the backend owns, valid until its next ``all_gather_start`` on this
        group and stream."""
        return PendingGather(self.all_gather(x, group, out=out))

    def matmul_reduce_scatter_start(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        bias: Optional[torch.Tensor] = None,
    ) -> PendingGather:
        """:meth:`matmul_reduce_scatter` whose reduction may still be running when this
        returns; ``.wait()`` before using the result. Megatron's column backward overlaps the
        input gradient's reduce-scatter with the weight-gradient GEMM this way. The default
        runs it to completion here (a fused kernel has nothing left to overlap)."""
        return PendingGather(self.matmul_reduce_scatter(a, b, group, bias=bias))

    @abc.abstractmethod
    def reduce_scatter(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Plain row reduce-scatter (sum) of a contiguous ``[m, ...]`` tensor."""
