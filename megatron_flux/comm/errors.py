"""The device error word: how a bounded wait that timed out becomes a Python exception.

Each fused op owns an int32[4] device word ``(op, rank, signal index, value seen)`` that a kernel
fills when a wait runs out of spins (see :mod:`megatron_flux.kernels.signals`). After a launch the
word is copied asynchronously into pinned host memory every ``interval`` calls; the next call (or
:meth:`DeviceErrorWord.check`) reads the host copy without synchronising and raises, with what
the word's ``describe`` callback reports (the backend's: this rank's signal words)."""

from __future__ import annotations

import threading
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


def read_without_blocking(tensors: Sequence[torch.Tensor], queue: Callable,
                          seconds: float = REPORT_READ_SECONDS, *,
                          clock: Callable = time.monotonic,
                          sleep: Callable = time.sleep) -> Optional[List[list]]:
    """The values of the device ``tensors`` as lists, or ``None`` where they did not reach the
    host within ``seconds``. ``queue(tensors) -> (host tensors, done())`` queues their copies
    (:meth:`HostReader.queue`); ``done`` is polled, and neither the device nor a stream is
    synchronised, since work queued before a timeout report (an NCCL collective, a kernel behind
    a stream wait) may itself wait on the stalled peer, and waiting for it would keep the report
    from ever being raised."""
    if not tensors:
        return []
    hosts, done = queue(tensors)
    deadline = clock() + seconds
    while not done():
        if clock() >= deadline:
            return None
        sleep(0.001)
    return [h.tolist() for h in hosts]


#: pinned bytes a :class:`HostReader` holds (the signal words a report shows fit many times)
REPORT_BUFFER_BYTES = 1 << 16


class HostReader:
    """Copies small tensors of one CUDA device to the host on a stream of its own, with the
    stream, an event and a pinned buffer made when the reader is, so that a report makes
    nothing. Made at report time, the stream alone waited for the stalled kernel: a process's
    first CUDA stream (torch creates its stream pool then) waited 4.9 s, until the spin bound
    ran out, behind a wait on a peer on an H200, where a pinned allocation, the copy and a
    driver stream (:func:`own_stream`, 0.4 ms) did not wait
    (``benchmarks/experiments/report_read_probe.py``). The stream is not one of torch's pooled
    ones, which ``torch.cuda.Stream()`` deals out in turn (32 per priority), so no other code
    can queue work on it that waits on the stalled peer (:func:`own_stream`). The fused backend
    makes one per device when it first uses the device, before its first launch."""

    def __init__(self, device: torch.device, capacity: int = REPORT_BUFFER_BYTES):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.stream = own_stream(self.device)
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.done = torch.cuda.Event()
        self.done.record(self.stream)  # torch creates the CUDA event at its first record
        self._lock = threading.Lock()

    def queue(self, tensors: Sequence[torch.Tensor]):
        """Host views of ``tensors`` in the buffer and the ``query`` of the event after their
        copies. Each must be contiguous and on the reader's device, and together they must fit
        the buffer (a copy needing a device allocation or a conversion kernel could wait for
        the device too): otherwise ValueError."""
        hosts, at = [], 0
        for t in tensors:
            at = -(-at // 16) * 16
            nbytes = t.numel() * t.element_size()
            if not t.is_contiguous() or t.device != self.device:
                raise ValueError(f"HostReader reads contiguous tensors of {self.device}, "
                                 f"not a {tuple(t.shape)} view of {t.device}")
            if at + nbytes > self.buffer.numel():
                raise ValueError(f"HostReader: {at + nbytes} bytes exceed its "
                                 f"{self.buffer.numel()}-byte buffer")
            hosts.append(self.buffer[at:at + nbytes].view(t.dtype).view(t.shape))
            at += nbytes
        with torch.cuda.stream(self.stream):
            for host, t in zip(hosts, tensors):
                host.copy_(t, non_blocking=True)
            self.done.record(self.stream)
        return hosts, self.done.query

    def read(self, tensors: Sequence[torch.Tensor],
             seconds: float = REPORT_READ_SECONDS) -> Optional[List[list]]:
        """:func:`read_without_blocking` through this reader (one read at a time: the buffer
        and the event are shared)."""
        with self._lock:
            return read_without_blocking(tensors, self.queue, seconds)


#: ``cuStreamCreate`` flag: the stream does not synchronise with the legacy default stream
_CU_STREAM_NON_BLOCKING = 1


def own_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking CUDA stream of ``device`` that only its caller uses: created by the
    driver (``cuStreamCreate``, non-blocking like torch's own streams: the legacy default
    stream, where torch queues work by default, does not order it) and wrapped as a
    ``torch.cuda.ExternalStream``; never destroyed. Where the driver library cannot be loaded,
    a pooled ``torch.cuda.Stream``."""
    import ctypes

    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # the device's primary context, current
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return torch.cuda.Stream(device=device)
        handle = ctypes.c_void_p()
        rc = lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(_CU_STREAM_NON_BLOCKING))
        if rc != 0:
            raise RuntimeError(f"cuStreamCreate failed on {device} (CUresult {rc})")
        return torch.cuda.ExternalStream(handle.value, device=device)


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

    def queue_read(self) -> None:
        """Queue the word's copy to the host on the current stream (read by :meth:`check` once
        that stream has reached it)."""
        self.host_word.copy_(self.device_word, non_blocking=True)

    def check(self, sync: bool = False) -> None:
        """Raise :class:`FusedOpTimeout` if a kernel reported a timed-out wait (with ``sync``,
        after reading the word through the current stream)."""
        if sync:
            self.queue_read()
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
