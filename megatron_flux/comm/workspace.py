"""Symmetric workspaces for the fused kernels.

One :class:`SymmetricWorkspace` per (op, process group, device, dtype). Its single symmetric
allocation (torch symmetric memory, mapped on every rank of the group) holds

``[ signals, parity 0 | signals, parity 1 | data slot, parity 0 | data slot, parity 1 ]``

Calls alternate the two halves (``parity = epoch & 1``). A peer can be at most one call ahead of
this rank: its call ``e + 2`` needs data that this rank sends only after its own call ``e`` has
finished. So with two halves nobody writes into a slot or signal word that a call still uses.

The signals need the split as much as the data: the AllGather's index layout depends on the
call's shape and config (``src * chunks + c``), and at TP >= 3 a peer that finished call
``e`` may already signal call ``e + 1``, under another layout, while this rank still waits for
a third rank's call-``e`` signal. In one shared region that write could land on the awaited
word with a value ``>= e`` and release the wait before the data came. (GEMM+RS's layout, one
word per peer then this rank's own arrival counter, does not depend on the config; it gets the
same split.) Signals hold epochs (see :mod:`megatron_flux.kernels.signals`), so they are never
reset.

The allocation grows (collectively: every rank asks for the same sizes, as SPMD training does)
and is reused; it never shrinks. Growing zeroes the new signals and runs a barrier before first use,
bounded by :data:`BARRIER_TIMEOUT_MS`.

Before a new allocation is shared (the rendezvous), this rank's device finishes what is queued
on it (:func:`_drain_before_sharing`). torch's allocator zeroes the whole block, its barrier's
signal pad included, with a memset that runs in stream order on the legacy default stream and
asynchronously to the host. A peer that is through the rendezvous may store its barrier signal
into this rank's pad before a busy device runs that memset, which then erases it: this rank's
barrier waits for a signal that never comes, the peer's barrier passes and its fused kernel
waits for pushes that this rank, stuck behind its barrier, never issues (a TP 4 tune whose
rank 0 timed out waiting for its peers' signals with value 0 while ranks 1-3 idled; reproduced
by benchmarks/experiments/growth_race.py).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

_ALIGN = 256

#: how long the barrier after a growth waits for every peer before it gives up: torch's barrier
#: then prints which rank it waited for and traps, ending the process (a peer that never grows
#: its workspace with this rank would otherwise leave it spinning forever). NCCL's default
#: collective timeout.
BARRIER_TIMEOUT_MS = 10 * 60 * 1000


def _drain_before_sharing(buf: torch.Tensor) -> None:
    """Wait until ``buf``'s device has run everything queued on it (the allocator's memset on the
    legacy default stream, this module's zeroing on the current one): a new allocation is shared
    only once its signals are zero on this rank (module docstring). Growth is rare, so the wait
    costs a few per job."""
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)


def _align(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class SymmetricWorkspace:
    """Symmetric signals + two parity data slots for one op on one TP group."""

    def __init__(self, op: str, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype):
        self.op = op
        self.group = group
        self.rank = group.rank()
        self.world = group.size()
        self.device = device
        self.dtype = dtype
        self.elt = torch.empty((), dtype=dtype).element_size()
        self.epoch = 0
        self.generation = 0  # bumped whenever memoized views may have died (growth, forget)
        self.flag_count = 0
        self.data_elems = 0
        self._buffer = None
        self._handle = None
        self._retired: List[torch.Tensor] = []
        self._views: Dict[Tuple[int, str, int], torch.Tensor] = {}
        self._data_ptrs: List[torch.Tensor] = []
        self._flag_ptrs: List[torch.Tensor] = []

    # ---------------------------------------------------------------- allocation
    def reserve(self, data_elems: int, flag_count: int) -> None:
        """Make room for ``data_elems`` per slot and ``flag_count`` signals per parity (collective
        on growth)."""
        if data_elems <= self.data_elems and flag_count <= self.flag_count:
            return
        from torch.distributed import _symmetric_memory as symm_mem

        data_elems = max(data_elems, self.data_elems, 1)
        flag_count = max(flag_count, self.flag_count, 1)
        # grow with headroom so a slowly rising shape does not reallocate every call
        if self._buffer is not None:
            data_elems = max(data_elems, self.data_elems * 3 // 2)
            flag_count = max(flag_count, self.flag_count * 3 // 2)
        flag_bytes = _align(flag_count * 4)
        slot_bytes = _align(data_elems * self.elt)
        buf = symm_mem.empty(2 * flag_bytes + 2 * slot_bytes, dtype=torch.uint8, device=self.device)
        buf[:2 * flag_bytes].zero_()
        _drain_before_sharing(buf)  # both zeroings land before any peer can address the block
        handle = symm_mem.rendezvous(buf, self.group.group_name)
        # every rank's signals are zero before anyone signals (bounded: BARRIER_TIMEOUT_MS)
        try:
            handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        except TypeError:  # a torch whose barrier has no timeout
            handle.barrier(channel=0)
        if self._buffer is not None:
            # peers finished with the old buffer before the barrier above (stream order); keep it
            # referenced anyway so a peer's late mapping never points at freed memory, and with
            # its address tables, which a captured CUDA graph may still read
            self._retired.extend([self._buffer, *self._flag_ptrs, *self._data_ptrs])
        self._buffer, self._handle = buf, handle
        self.flag_count = flag_bytes // 4
        self.data_elems = slot_bytes // self.elt
        self._flag_bytes, self._slot_bytes = flag_bytes, slot_bytes
        self._views.clear()
        self.generation += 1
        ptrs = list(handle.buffer_ptrs)
        self._flag_ptrs = [
            torch.tensor([p + parity * flag_bytes for p in ptrs], dtype=torch.int64, device=self.device)
            for parity in (0, 1)
        ]
        self._data_ptrs = [
            torch.tensor([p + 2 * flag_bytes + parity * slot_bytes for p in ptrs], dtype=torch.int64,
                         device=self.device)
            for parity in (0, 1)
        ]

    def fits(self, data_elems: int, flag_count: int) -> bool:
        """Whether :meth:`reserve` of these sizes would allocate nothing."""
        return (self._buffer is not None and data_elems <= self.data_elems
                and flag_count <= self.flag_count)

    def memo(self, key, make):
        """``make()``, cached until the workspace grows (its views die with the old buffer).

        The fused ops keep their per-shape views and copy plans here, so a steady-state call
        builds none of them."""
        value = self._views.get(key)
        if value is None:
            value = self._views[key] = make()
        return value

    def forget(self, tag: str) -> None:
        """Drop the memoized values whose key starts with ``tag`` (their tensors outlived their
        use, e.g. views of a staging buffer that was replaced)."""
        for key in [k for k in self._views if isinstance(k, tuple) and k and k[0] == tag]:
            del self._views[key]
        self.generation += 1

    def signal_words(self) -> Tuple[torch.Tensor, ...]:
        """This rank's signal words of parity 0 and 1 (device views; none before allocation)."""
        if self._buffer is None:
            return ()
        return self.flags(self.rank, 0), self.flags(self.rank, 1)

    def signal_state(self, max_words: int = 16, words=None) -> str:
        """This rank's signal words of both parities and the last epoch, as one line (what a
        timeout report appends: a peer's word still at an old epoch, or an arrival counter left
        non-zero, tells why a wait ran out). ``words``: the values of :meth:`signal_words`, read
        by the caller; without them they are read here, which waits for the current stream."""
        name = f"{self.op} {str(self.dtype).replace('torch.', '')}"
        if self._buffer is None:
            return f"{name}: not allocated"
        if words is None:
            words = [t.tolist() for t in self.signal_words()]
        parts = []
        for parity, flags in enumerate(words):
            more = f" +{len(flags) - max_words} more" if len(flags) > max_words else ""
            parts.append(f"parity {parity} {flags[:max_words]}{more}")
        return f"{name} epoch {self.epoch}: " + ", ".join(parts)

    def next_epoch(self) -> int:
        """Epoch of the next call (1, 2, ...; int32 signals allow 2**31 - 1 calls per op)."""
        self.epoch += 1
        if self.epoch >= 2**31 - 1:
            raise RuntimeError(f"megatron-flux {self.op}: signal epoch overflow")
        return self.epoch

    # ---------------------------------------------------------------- views
    def data(self, rank: int, parity: int, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of ``rank``'s data slot ``parity`` (a peer's is mapped)."""
        key = (rank, "data", parity)
        view = self._views.get(key)
        if view is None:
            offset = (2 * self._flag_bytes + parity * self._slot_bytes) // self.elt
            view = self._handle.get_buffer(rank, (self.data_elems,), self.dtype, storage_offset=offset)
            self._views[key] = view
        return view[:numel]

    def flags(self, rank: int, parity: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``rank``'s signal words of ``parity`` (int32 for kernels, uint32 for stream memory ops)."""
        key = (rank, "flags", parity, 0 if dtype == torch.int32 else 1)
        view = self._views.get(key)
        if view is None:
            view = self._handle.get_buffer(rank, (self.flag_count,), dtype,
                                           storage_offset=parity * self.flag_count)
            self._views[key] = view
        return view

    def data_ptrs(self, parity: int) -> torch.Tensor:
        """int64 device table: every rank's data slot ``parity`` address."""
        return self._data_ptrs[parity]

    def flag_ptrs(self, parity: int) -> torch.Tensor:
        """int64 device table: every rank's signal region ``parity`` address."""
        return self._flag_ptrs[parity]
