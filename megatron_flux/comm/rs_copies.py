"""Which copies one copy-engine ReduceScatter queues (``column_dgrad="copy_engine"``).

Rank ``r`` of ``W`` holds a full partial ``[m, n]`` (``m = W * m_local``) computed by cuBLAS.
For peers ``r+1, r+2, ...`` (ring order, so at each step the ranks write distinct owners), copy
the partial's rows of segment ``p`` into peer ``p``'s data slot ``r`` of the call's parity
(``data[p][r]``, ``[m_local, n]``), then write the epoch into ``flags[p][r]``; the owner sums
its own rows and the ``W - 1`` slots in rank order once every signal has arrived
(:mod:`megatron_flux.kernels.rs_reduce`). The slot layout and signal words are the fused
GEMM+RS's (:func:`~megatron_flux.kernels.config.rs_signal_count`), so both share one workspace
and its epochs.

Kept free of CUDA so the schedule can be checked on CPU tensors with simulated ranks.
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch


class SlotCopy(NamedTuple):
    peer: int             # the owner of the rows
    dst: torch.Tensor     # the owner's slot for this rank, [m_local * n] elements
    flags: torch.Tensor   # the owner's uint32 signal words; word ``rank`` receives the epoch


def rs_copy_plan(ws, m_local: int, n: int, *, rank: int, world: int, parity: int) -> List[SlotCopy]:
    """The copies of one call, in issue order (see the module docstring)."""
    seg = m_local * n
    out = []
    for step in range(1, world):
        peer = (rank + step) % world
        dst = ws.data(peer, parity, world * seg)[rank * seg:(rank + 1) * seg]
        out.append(SlotCopy(peer, dst, ws.flags(peer, parity, torch.uint32)))
    return out
