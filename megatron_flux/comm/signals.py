"""Host-side signal writes queued on a stream (no SM needed, ordered after the stream's copies)."""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import _SymmetricMemory


def write_signal(flags_u32: torch.Tensor, index: int, value: int) -> None:
    """Queue ``flags_u32[index] = value`` on the current stream: ``cuStreamWriteValue32``, a
    stream memory op ordered after the stream's earlier copies (with a system-scope fence first).

    Never under CUDA graph capture: the fused backend refuses capture (a replayed graph would
    write the same epoch again, see ``FluxBackend.unsupported_reason``)."""
    _SymmetricMemory.stream_write_value32(flags_u32, index, value)
