"""What the fused backend keeps per device and TP group, built on first use and reused: the
symmetric workspaces, the device error words, the copy-engine side streams, the reusable
cross-stream orderings, the copy-engine GEMM+RS staging buffers, and the device's SM count and
compute capability."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_flux.options import FluxOptions


def deps():
    """The comm and kernel helpers the fused calls use, imported on first use, not with this
    package (which must import without Triton: ``flux_backend_factory_or_reason`` reports why the
    backend is unavailable). Importing inside a function on every call would cost about a
    microsecond each; the hot paths would make a dozen per layer call."""
    global _DEPS
    if _DEPS is None:
        from types import SimpleNamespace

        from megatron_flux.comm.ag_copies import ag_copy_plan, materialize
        from megatron_flux.comm.errors import DeviceErrorWord, HostReader
        from megatron_flux.comm.rs_copies import rs_copy_plan
        from megatron_flux.comm.signals import (stream_wait_unavailable_reason,
                                                wait_signal_on_stream, write_signal)
        from megatron_flux.comm.streams import StreamOrder, on_stream
        from megatron_flux.comm.workspace import SymmetricWorkspace
        from megatron_flux.kernels.ag_gemm import launch_ag_gemm
        from megatron_flux.kernels.config import rs_signal_count
        from megatron_flux.kernels.gemm_rs import launch_gemm_rs, rs_staging_table
        from megatron_flux.kernels.launch import bind_last_launch, forget_last_launch
        from megatron_flux.kernels.ready_barrier import launch_ready_barrier
        from megatron_flux.kernels.rs_reduce import launch_rs_reduce
        from megatron_flux.kernels.signals import OP_GATHER, OP_GEMM_RS, OP_GRAPH_FENCE

        _DEPS = SimpleNamespace(**{k: v for k, v in locals().items() if k != "SimpleNamespace"})
    return _DEPS


_DEPS = None


#: graph-entry fence words per graph workspace kind: slot ``FENCE_SLOTS[kind]`` holds ``world``
#: words (:meth:`DeviceResources.reserve_fence`)
FENCE_SLOTS = {"ag": 0, "rs": 1}


def reserved_sms(total: int, options: FluxOptions) -> int:
    """SMs the fused grids leave free (``options.reserved_sms``), checked against the device.

    The persistent grids wait on their peers while holding SMs, so every CTA of every rank must
    be resident. A kernel that runs beside them, such as an asynchronous data-parallel NCCL
    collective under ``--overlap-grad-reduce``, takes SMs. Reserving at least as many SMs as
    it uses (NCCL: up to its channel count) keeps the grids fully resident; correctness does
    not depend on the grid size, only the speed does.
    """
    value = options.reserved_sms
    if not 0 <= value < total:
        raise ValueError(f"megatron-flux reserved_sms ($MEGATRON_FLUX_RESERVED_SMS) = {value}: must "
                         f"be in [0, {total}) on a {total}-SM GPU")
    return value


class DeviceResources:
    """Per-device (and per TP group) state of one fused backend; see the module docstring."""

    def __init__(self, options: FluxOptions):
        self.options = options
        self._workspaces: Dict[Tuple, object] = {}
        self._errors: Dict[Tuple, object] = {}
        self._readers: Dict[int, object] = {}
        self._streams: Dict[Tuple, torch.cuda.Stream] = {}
        self._orders: Dict[Tuple, object] = {}
        self._staging: Dict[Tuple, torch.Tensor] = {}
        self._retired_staging: list = []  # captured graphs may still address them
        self._num_sms: Dict[int, int] = {}
        self._caps: Dict[int, Tuple[int, int]] = {}

    def set_options(self, options: FluxOptions) -> None:
        """New options: the SM budget is derived from them, the rest reads them per call."""
        self.options = options
        self._num_sms.clear()
        for word in self._errors.values():
            word.interval = max(1, options.error_check_interval)

    def workspace(self, op: str, group, device, dtype):
        """The symmetric workspace of ``op`` (``"ag"``, ``"rs"``, ``"gather"``) on ``group``."""
        key = (op, group.group_name, device.index, dtype)
        ws = self._workspaces.get(key)
        if ws is None:
            self._ensure_reader(device)  # before this workspace's first rendezvous
            ws = self._workspaces[key] = deps().SymmetricWorkspace(op, group, device, dtype)
        return ws

    def _ensure_reader(self, device) -> None:
        """The device's timeout-report reader (:class:`~megatron_flux.comm.errors.HostReader`),
        made on the device's first use, before any kernel of this backend can wait on a peer
        there; where it cannot be made, the reason, which a report then gives."""
        if device.type != "cuda" or device.index in self._readers:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # nothing may be allocated inside a capture: the next eager call makes it
        try:
            self._readers[device.index] = deps().HostReader(device)
        except Exception as exc:  # noqa: BLE001 (a report without its words, not a failed call)
            self._readers[device.index] = f"{type(exc).__name__}: {exc}"

    def graph_workspace(self, op: str, group, device, dtype, data_elems: int, flag_count: int):
        """The workspace of ``op``'s captured calls on ``group`` (separate from the eager one:
        its signals are constant and reset, :mod:`megatron_flux.comm.capture`), reserved
        (collectively) for ``data_elems`` and ``flag_count``, with the fences. Outside a capture:
        nothing symmetric can be allocated inside one."""
        ws = self.workspace(f"{op}:graph", group, device, dtype)
        ws.reserve(data_elems, flag_count)
        self.reserve_fence(group, device)
        return ws

    def fence(self, group, device):
        """The graph-entry fence words of ``group`` (a small symmetric workspace), or None."""
        ws = self._workspaces.get(("fence", group.group_name, device.index, torch.int32))
        return ws if ws is not None and ws.flag_count else None

    def reserve_fence(self, group, device) -> None:
        """Reserve the fence words (collective on first use): a slot of ``world`` words per
        graph workspace kind (:data:`FENCE_SLOTS`)."""
        self.workspace("fence", group, device, torch.int32).reserve(
            1, len(FENCE_SLOTS) * group.size())

    def poll_errors(self) -> None:
        """Raise what the last queued read of an error word found, then queue the next one."""
        for word in self._errors.values():
            word.poll()

    def error_word(self, op: str, device):
        """The device error word of ``op`` on ``device``; raises a timeout reported earlier."""
        key = (op, device.index)
        word = self._errors.get(key)
        if word is None:
            self._ensure_reader(device)
            word = self._errors[key] = deps().DeviceErrorWord(
                device, self.options.error_check_interval,
                describe=lambda: self.describe_signals(device))
        word.check_if_due()
        return word

    def describe_signals(self, device, read=None) -> str:
        """Every workspace of ``device``: this rank's signal words of both parities and its last
        epoch (:meth:`SymmetricWorkspace.signal_state`). What a timeout report appends. On CUDA
        the words are read without waiting for the device (``read``, default: the device's
        :class:`~megatron_flux.comm.errors.HostReader`, made on its first use, bounded in time);
        where they do not arrive in time the text says so instead."""
        spaces = [ws for _, ws in sorted(self._workspaces.items(), key=lambda kv: str(kv[0]))
                  if ws.device == device]
        if device.type != "cuda":
            return "; ".join(ws.signal_state() for ws in spaces)
        from megatron_flux.comm.errors import REPORT_READ_SECONDS

        if read is None:
            reader = self._readers.get(device.index)
            if reader is None:
                return "not read (no fused kernel has run on this device)"
            if isinstance(reader, str):
                return f"not read (no reader: {reader})"
            read = reader.read
        views = [ws.signal_words() for ws in spaces]
        words = read([t for v in views for t in v])
        if words is None:
            return (f"not read (the copy to the host did not finish within "
                    f"{REPORT_READ_SECONDS:g} s: work queued on the device before this report "
                    f"is still waiting, likely on the same peer)")
        parts, at = [], 0
        for ws, v in zip(spaces, views):
            parts.append(ws.signal_state(words=words[at:at + len(v)]))
            at += len(v)
        return "; ".join(parts)

    def check_errors(self, sync: bool = True) -> None:
        """Raise a timeout that a kernel reported in any error word. With ``sync``, the words'
        copies to the host are queued on the current streams and each device's stream is
        synchronised once, not once per word."""
        words = list(self._errors.values())
        if sync:
            devices = {}
            for word in words:
                word.queue_read()
                devices[word.device_word.device] = True
            for device in devices:
                torch.cuda.current_stream(device).synchronize()
        for word in words:
            word.check()

    def capability(self, device) -> Tuple[int, int]:
        cap = self._caps.get(device.index)
        if cap is None:
            cap = self._caps[device.index] = torch.cuda.get_device_capability(device)
        return cap

    def side_stream(self, device, priority: int = -1, use: str = "ag") -> torch.cuda.Stream:
        """A copy-engine stream of this device at this CUDA priority, one per (use, priority):
        the AllGathers' (``"ag"``), copy-engine GEMM+RS's (``"rs"``) and the copy-engine
        dgrad's (``"rs-dgrad"``)."""
        key = (device.index, priority, use)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(device=device, priority=priority)
        return s

    def order(self, device, which: str):
        """The reusable cross-stream ordering of this device for the ``which`` hand-off."""
        key = (device.index, which)
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = deps().StreamOrder()
        return order

    def sms(self, device) -> int:
        """SMs the persistent grids may fill: the device's, less the reserved ones."""
        n = self._num_sms.get(device.index)
        if n is None:
            total = torch.cuda.get_device_properties(device).multi_processor_count
            n = self._num_sms[device.index] = total - reserved_sms(total, self.options)
        return n

    def staging(self, device, dtype, numel: int, side) -> torch.Tensor:
        """This device's local staging buffer for copy-engine GEMM+RS (grown, never shrunk).
        The side stream reads it, so the allocator reuses a replaced buffer only after that
        stream's work (``record_stream``)."""
        key = (device.index, dtype)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None:  # the old buffer's copy plans hold views of it: drop them
                numel = max(numel, buf.numel() * 3 // 2)
                for ws in self._workspaces.values():
                    ws.forget("rs-ce")
                self._retired_staging.append(buf)  # a captured graph may address it
            buf = self._staging[key] = torch.empty(numel, dtype=dtype, device=device)
            buf.record_stream(side)
        return buf
