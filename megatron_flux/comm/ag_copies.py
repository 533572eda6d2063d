"""Which copies and signal writes one AllGather+GEMM call queues on its copy-engine stream.

Rank ``r`` of ``W``, a call with ``chunks`` chunks of ``chunk`` rows per rank segment, in the
call's parity half of the workspace (:mod:`megatron_flux.comm.workspace`): for peers ``r-1,
r-2, ...`` (the order in which they reach this rank's rows), copy chunk ``c`` of the caller's
shard into the peer's gathered rows of segment ``r``, then write the epoch into the peer's
signal ``r * chunks + c``.

Kept free of CUDA so the schedule can be checked on CPU tensors with simulated ranks.

:func:`ag_copy_plan` is the same schedule with the shard's rows left as row ranges, so a backend
can build it once per (workspace, shape, parity) and only slice the caller's shard per call:
the layers issue hundreds of these calls per training step, and the views cost host time.
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch


class ChunkCopy(NamedTuple):
    dst: torch.Tensor    # rows in a peer's gathered workspace
    src: torch.Tensor    # rows of the caller's shard
    flags: torch.Tensor  # uint32 signal words that receive the epoch (a peer's or this rank's)
    index: int           # which word


class PlannedCopy(NamedTuple):
    dst: torch.Tensor
    lo: int              # the copy's source is rows lo:hi of the caller's shard
    hi: int
    flags: torch.Tensor
    index: int


def ag_copy_plan(ws, m_local: int, k: int, *, rank: int, world: int, parity: int,
                 chunk: int) -> List[PlannedCopy]:
    """:func:`ag_chunk_copies` without the shard: each copy names its rows ``lo:hi``."""
    m = world * m_local
    chunks = -(-m_local // chunk)
    bounds = [(c * chunk, min(m_local, (c + 1) * chunk)) for c in range(chunks)]
    out: List[PlannedCopy] = []
    seg = slice(rank * m_local, (rank + 1) * m_local)
    for step in range(1, world):
        peer = (rank - step) % world
        theirs = ws.data(peer, parity, m * k).view(m, k)[seg]
        peer_flags = ws.flags(peer, parity, torch.uint32)
        out.extend(PlannedCopy(theirs[lo:hi], lo, hi, peer_flags, rank * chunks + c)
                   for c, (lo, hi) in enumerate(bounds))
    return out


def materialize(plan: List[PlannedCopy], shard: torch.Tensor) -> List[ChunkCopy]:
    """The plan's copies for this call's ``shard`` (``[m_local, k]`` rows)."""
    m_local = shard.shape[0]
    return [ChunkCopy(p.dst, shard if p.lo == 0 and p.hi == m_local else shard[p.lo:p.hi],
                      p.flags, p.index) for p in plan]


def ag_chunk_copies(ws, a_shard: torch.Tensor, *, rank: int, world: int, parity: int,
                    chunk: int) -> List[ChunkCopy]:
    """The copy-engine work of one call, in issue order (see the module docstring)."""
    m_local, k = a_shard.shape
    plan = ag_copy_plan(ws, m_local, k, rank=rank, world=world, parity=parity, chunk=chunk)
    return materialize(plan, a_shard)
