"""Host-side signal writes queued on a stream (no SM needed, ordered after the stream's copies)."""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import _SymmetricMemory


def write_signal(flags_u32: torch.Tensor, index: int, value: int) -> None:
    """Queue ``flags_u32[index] = value`` on the current stream.

    Outside graph capture this is ``cuStreamWriteValue32`` (a stream memory op that is ordered
    after the stream's earlier copies and issues a system-scope fence first); under capture,
    where torch does not allow it, a 4-byte memset node."""
    if torch.cuda.is_current_stream_capturing():
        _SymmetricMemory.memset32(flags_u32, offset=index, val=value, count=1)
    else:
        _SymmetricMemory.stream_write_value32(flags_u32, index, value)
