"""Symmetric workspaces of simulated ranks in one process, on CPU tensors.

``fake_workspaces(world, ...)`` builds one :class:`SymmetricWorkspace` per rank whose "symmetric"
buffers are plain CPU tensors: ``get_buffer(peer, ...)`` is a view of the peer's buffer and
``buffer_ptrs`` their addresses, so host code and interpreted kernels see the same memory layout
as on GPUs. Allocation is SPMD as on GPUs: every rank asks for the same sizes, in the same order.
"""

from __future__ import annotations

import contextlib
from typing import List

import torch

from megatron_flux.comm.workspace import SymmetricWorkspace


class _Group:
    def __init__(self, rank: int, world: int):
        self._rank, self._world, self.group_name = rank, world, "fake-tp"

    def rank(self):
        return self._rank

    def size(self):
        return self._world


class _Handle:
    def __init__(self, buffers: List[torch.Tensor]):
        self._buffers = buffers
        self.buffer_ptrs = [b.data_ptr() for b in buffers]
        self.barrier_timeouts: List[int] = []

    def barrier(self, channel: int = 0, timeout_ms: int = 0):
        self.barrier_timeouts.append(timeout_ms)

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        flat = self._buffers[rank].view(dtype)
        numel = 1
        for s in sizes:
            numel *= s
        return flat[storage_offset:storage_offset + numel].view(sizes)


class _FakeSymmMem:
    """Stands in for ``torch.distributed._symmetric_memory`` while ranks allocate in turn."""

    def __init__(self, world: int):
        self.world = world
        self.rounds: List[List[torch.Tensor]] = []  # allocation round -> every rank's buffer
        self.next = [0] * world

    def empty(self, nbytes, dtype, device, rank):
        r = self.next[rank]
        self.next[rank] += 1
        if r == len(self.rounds):
            self.rounds.append([torch.full((nbytes,), 0xAB, dtype=torch.uint8) for _ in range(self.world)])
        return self.rounds[r][rank]

    def rendezvous(self, buf):
        for bufs in self.rounds:
            if any(b is buf for b in bufs):
                return _Handle(bufs)
        raise AssertionError("rendezvous of an unknown buffer")


@contextlib.contextmanager
def _patched(fake: _FakeSymmMem, rank: int):
    from torch.distributed import _symmetric_memory as symm_mem

    saved = symm_mem.empty, symm_mem.rendezvous
    symm_mem.empty = lambda n, dtype, device: fake.empty(n, dtype, device, rank)
    symm_mem.rendezvous = lambda buf, group_name: fake.rendezvous(buf)
    try:
        yield
    finally:
        symm_mem.empty, symm_mem.rendezvous = saved


class FakeWorld:
    """``world`` workspaces of one op; :meth:`reserve` grows them all, as SPMD ranks would."""

    def __init__(self, world: int, op: str = "ag", dtype=torch.float16):
        self.fake = _FakeSymmMem(world)
        self.ws = [SymmetricWorkspace(op, _Group(r, world), torch.device("cpu"), dtype) for r in range(world)]

    def reserve(self, data_elems: int, flag_count: int) -> None:
        for r, ws in enumerate(self.ws):
            with _patched(self.fake, r):
                ws.reserve(data_elems, flag_count)
