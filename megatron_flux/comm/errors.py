"""The device error word: how a bounded wait that timed out becomes a Python exception.

Each fused op owns an int32[4] device word ``(op, rank, signal index, value seen)`` that a kernel
fills when a wait runs out of spins (see :mod:`megatron_flux.kernels.signals`). After a launch the
word is copied asynchronously into pinned host memory every ``interval`` calls; the next call (or
:meth:`DeviceErrorWord.check`) reads the host copy without synchronising and raises, with what
the word's ``describe`` callback reports (the backend's: this rank's signal words)."""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import torch

from megatron_flux.kernels.signals import (OP_AG_GEMM, OP_AG_READY, OP_GATHER, OP_GEMM_RS,
                                           OP_GRAPH_FENCE, OP_SPLIT_TAIL)

_OPS = {OP_AG_GEMM: "AG+GEMM", OP_GEMM_RS: "GEMM+RS", OP_AG_READY: "ready barrier",
        OP_GATHER: "all-gather (copy engine)", OP_GRAPH_FENCE: "CUDA graph fence",
        OP_SPLIT_TAIL: "GEMM+RS split tail"}


#: how long a timeout report waits for this rank's signal words to reach the host
REPORT_READ_SECONDS = 2.0


class FusedOpTimeout(RuntimeError):
    """A fused kernel gave up waiting for a peer's signal."""


def read_without_blocking(tensors: Sequence[torch.Tensor], seconds: float = REPORT_READ_SECONDS,
                          *, queue: Optional[Callable] = None, clock: Callable = time.monotonic,
                          sleep: Callable = time.sleep) -> Optional[List[list]]:
    """The values of the CUDA ``tensors`` (of one device) as lists, or ``None`` where they did
    not reach the host within ``seconds``. They are copied on a stream of their own into pinned
    memory, and the copy's event is polled: neither the device nor a stream is synchronised,
    since work queued before a timeout report (an NCCL collective, a kernel behind a stream
    wait) may itself wait on the stalled peer, and waiting for it would keep the report from
    ever being raised. ``queue(tensors) -> (host tensors, done())`` queues the copies."""
    if not tensors:
        return []
    hosts, done = (queue or _queue_host_copies)(tensors)
    deadline = clock() + seconds
    while not done():
        if clock() >= deadline:
            return None
        sleep(0.001)
    return [h.tolist() for h in hosts]


def _queue_host_copies(tensors):
    """Copies of ``tensors`` into pinned memory on a new stream, and their event's ``query``."""
    stream = torch.cuda.Stream(device=tensors[0].device)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    with torch.cuda.stream(stream):
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return hosts, done.query


class DeviceErrorWord:
    #: called when a timeout is raised; its text is appended to the message (never raises)
    describe: Optional[Callable[[], str]] = None

    def __init__(self, device: torch.device, interval: int = 16,
                 describe: Optional[Callable[[], str]] = None):
        self.device_word = torch.zeros(4, dtype=torch.int32, device=device)
        self.host_word = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self.interval = max(1, interval)
        self.describe = describe
        self._calls = 0

    def after_launch(self) -> None:
        self._calls += 1
        if self._calls % self.interval == 0:
            self.host_word.copy_(self.device_word, non_blocking=True)

    def poll(self) -> None:
        """Raise what the last queued read found (:meth:`check`), then queue the next read on
        the current stream: a check per training step that never synchronises, for calls that
        replay inside CUDA graphs and so never reach :meth:`after_launch`."""
        self.check()
        self.host_word.copy_(self.device_word, non_blocking=True)

    def check_if_due(self) -> None:
        """Cheap per-call check: read the host copy only right after a copy was queued."""
        if self._calls % self.interval == 0 and self._calls:
            self.check()

    def check(self, sync: bool = False) -> None:
        """Raise :class:`FusedOpTimeout` if a kernel reported a timed-out wait."""
        if sync:
            self.host_word.copy_(self.device_word, non_blocking=True)
            torch.cuda.current_stream(self.device_word.device).synchronize()
        op, rank, index, seen = (int(v) for v in self.host_word.tolist())
        if op:
            raise FusedOpTimeout(_message(op, rank, index, seen) + self._state())

    def _state(self) -> str:
        if self.describe is None:
            return ""
        try:
            text = self.describe()
        except Exception as exc:  # the timeout is the error to report, not this
            text = f"(could not read them: {exc!r})"
        return f" This rank's signal words: {text}" if text else ""


def _message(op: int, rank: int, index: int, seen: int) -> str:
    if op == OP_AG_READY:
        return (f"megatron-flux ready barrier: rank {rank} timed out waiting for rank {index}'s "
                f"signal (last value seen {seen}); that rank died, diverged (different shapes, "
                f"configs or call order across the TP group) or is stalled. Outputs since then "
                f"are invalid.")
    if op == OP_GATHER:
        return (f"megatron-flux all-gather (copy engine): rank {rank} timed out waiting for rank "
                f"{index}'s rows (last value seen {seen}); that rank died, diverged (different "
                f"shapes or call order across the TP group) or is stalled. Outputs since then "
                f"are invalid.")
    if op == OP_GRAPH_FENCE:
        return (f"megatron-flux CUDA graph fence: rank {rank} timed out waiting for rank {index} "
                f"at a captured graph's first fused call (last value seen {seen}); that rank "
                f"died, replays other graphs or is stalled. Outputs since then are invalid.")
    if op == OP_SPLIT_TAIL:
        return (f"megatron-flux GEMM+RS split tail: rank {rank} timed out waiting for the K-parts "
                f"of its tail tile {index} (count seen {seen}): a program of its grid never "
                f"published its part, because it was itself waiting for a peer that died or is "
                f"stalled, or by a kernel bug. Outputs since then are invalid.")
    return (f"megatron-flux {_OPS.get(op, op)}: rank {rank} timed out waiting for signal "
            f"{index} (last value seen {seen}); a peer died, diverged (different shapes or "
            f"call order across the TP group) or is stalled. Outputs since then are invalid.")
