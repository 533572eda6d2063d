"""The fused backend: AG+GEMM and GEMM+RS as single Triton kernels over torch symmetric memory.

Host-side schedule of one AllGather+GEMM call on rank ``r`` (``W`` ranks, epoch ``e``):

1. the GEMM kernel is queued on the current stream first; it computes the local rows from the
   caller's shard at once and spins on chunk signals before each remote tile;
2. on a side stream (after an event marking the shard ready) the copy engine pushes the shard,
   chunk by chunk, into every peer's gathered workspace (peers in the order they consume it),
   each chunk followed by a stream memory write of ``e`` into that peer's signal word;
3. the current stream waits for the side stream, so the shard and the workspace are safe to reuse.

With ``GemmConfig.ag_merge_local`` (the default at small m, with a lead of 0) the kernel reads
its local rows from the gathered workspace after a lead of local tiles, so step 0 also copies
the shard into this rank's own gathered rows, on the current stream before the GEMM (as pulling
does). A copy queued on the side stream behind
the kernel and signalled would overlap the lead, but the kernel would then spin on work queued
behind it on its own device, which this schedule never does.

With ``GemmConfig.ag_pull`` (a tuning knob) step 0 is: copy the shard into this rank's own
symmetric slot and run a one-warp "shards ready" barrier (:mod:`megatron_flux.kernels.ready_barrier`)
on the current stream, before the GEMM; step 2 then *pulls* each peer's shard from its slot into
the local workspace (in the order the GEMM visits them), each chunk followed by a stream memory
write into this rank's own signal word. The barrier finishes before the GEMM is queued behind it,
so it never waits beside the persistent grid.

Because the kernel is queued before the copies and the copies never wait on the kernel, the
kernel never spins on work queued behind it, also with ``CUDA_DEVICE_MAX_CONNECTIONS=1``; and
no wait needs an SM, so a grid that is only partly resident still drains.

GEMM+ReduceScatter needs no side stream: the kernel pushes remote tiles and reduces its own.
With ``GemmConfig.rs_copy_engine`` (a tuning knob) the kernel writes the peers' partials into a
local staging buffer instead and raises this rank's "produced" word; queued behind it, a side
stream waits for that word (``cuStreamWaitValue32``), copies each partial into its owner's slot
by the copy engine and writes the owner's signal word, while the kernel computes its own rows;
the current stream then waits for the side stream (the staging buffer is reused by the next
call). The kernel never waits for its own side stream, only for its peers'; each peer's copies
wait only for that peer's producer phase, which waits for nothing. Peer-to-peer copies queued
this way start while the kernel runs under both ``CUDA_DEVICE_MAX_CONNECTIONS`` settings
(``benchmarks/experiments/stream_wait_overlap.py``, session 16).

The plain all-gather of the column layer's backward (``all_gather_start``: the input, again, for
the weight gradient) also runs on the copy engine, so it needs no SM beside the input
gradient's GEMM+RS grid: ``all_gather_start`` queues the pushes of this rank's rows into every
peer's gather workspace (side stream, after an event marking the rows ready) and the copy of
its own rows (caller's stream); the caller then queues its GEMM+RS; ``wait()`` queues the signal
writes behind the pushes, makes the current stream wait for them, and runs a one-warp bounded
wait for every peer's signal. With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` nothing on the side stream
may wait for an earlier copy before the kernel is queued: a stream operation that waits holds
the single hardware queue, and the kernel behind it. So the signal writes are queued after the
kernel, and the own rows are not copied behind the pushes.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Dict, Optional, Tuple

import torch

from megatron_flux.backends import (
    COLUMN_DGRAD_CHOICES,
    COLUMN_REGATHER_CHOICES,
    ENV_COLUMN_DGRAD,
    ENV_COLUMN_REGATHER,
)
from megatron_flux.backends.base import TPOverlapBackend, output_like

_DEFAULT_MAX_SPINS = 1 << 25


def flux_backend_factory_or_reason():
    """``(factory, None)`` when triton and torch symmetric memory import, else ``(None, reason)``."""
    try:
        import triton  # noqa: F401
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return None, f"import failed: {exc}"
    return FluxBackend, None


ENV_RESERVED_SMS = "MEGATRON_FLUX_RESERVED_SMS"


def reserved_sms(total: int) -> int:
    """SMs the fused grids leave free, from ``$MEGATRON_FLUX_RESERVED_SMS`` (default 0).

    The persistent grids wait on their peers while holding SMs, so every CTA of every rank must
    be resident. A kernel that runs beside them, such as an asynchronous data-parallel NCCL
    collective under ``--overlap-grad-reduce``, takes SMs. Reserving at least as many SMs as
    it uses (NCCL: up to its channel count) keeps the grids fully resident; correctness does
    not depend on the grid size, only the speed does.
    """
    raw = os.environ.get(ENV_RESERVED_SMS, "")
    if raw == "":
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${ENV_RESERVED_SMS}={raw!r}: expected an integer") from None
    if not 0 <= value < total:
        raise ValueError(f"${ENV_RESERVED_SMS}={raw!r}: must be in [0, {total}) on a {total}-SM GPU")
    return value


_DEPS = None


def _deps():
    """The comm and kernel helpers the fused calls use, imported on first use, not with this
    module (which must import without Triton: ``flux_backend_factory_or_reason`` reports why
    the backend is unavailable). An import statement inside a function costs 0.5-0.9 µs a
    call on this repo's CPU machine, more on the GPU boxes' hosts, where the fused path's host
    time decides host-bound training steps; the hot paths made a dozen per layer call.
    Whoever wraps one of these (``benchmarks/experiments/phase_trace_tp.py`` wraps
    ``ag_gemm.launch_ag_gemm``) must do so before the first fused call of the process."""
    global _DEPS
    if _DEPS is None:
        from types import SimpleNamespace

        from megatron_flux.comm.ag_copies import ag_copy_plan, materialize
        from megatron_flux.comm.errors import DeviceErrorWord
        from megatron_flux.comm.rs_copies import rs_copy_plan
        from megatron_flux.comm.signals import wait_signal_on_stream, write_signal
        from megatron_flux.comm.streams import StreamOrder, on_stream
        from megatron_flux.comm.workspace import SymmetricWorkspace
        from megatron_flux.kernels.ag_gemm import launch_ag_gemm
        from megatron_flux.kernels.config import rs_band_words, rs_bands, rs_signal_count
        from megatron_flux.kernels.gemm_rs import launch_gemm_rs, rs_staging_table
        from megatron_flux.kernels.ready_barrier import launch_ready_barrier
        from megatron_flux.kernels.rs_reduce import launch_rs_reduce
        from megatron_flux.kernels.signals import OP_GATHER, OP_GEMM_RS

        _DEPS = SimpleNamespace(**{k: v for k, v in locals().items() if k != "SimpleNamespace"})
    return _DEPS


def _signal_and_wait(backend, ws, err, signals, *, rank, world, parity, epoch, current, side,
                     done: str, op_code: int) -> None:
    """The end of a copy-engine collective: on ``side``, each ``(uint32 flags, index)`` of
    ``signals`` receives ``epoch`` behind the copies queued there; ``current`` waits for
    ``side`` (hand-off ``done``); then a one-warp bounded wait on ``current`` for every peer's
    signal ``[peer]`` of this rank (``op_code`` names the op in a timeout). Queued from the
    handles' ``wait()``, so with one hardware queue the writes sit behind the caller's kernel."""
    d = _deps()
    caller = torch.cuda.current_stream(current.device)
    with d.on_stream(side, caller):
        for flags, index in signals:
            d.write_signal(flags, index, epoch)  # after its copy, on the same stream
    backend._order(current.device, done)(current, side)
    with d.on_stream(current, caller):
        d.launch_ready_barrier(ws.flag_ptrs(parity), err.device_word, rank=rank, world=world,
                             base=0, epoch=epoch, max_spins=backend.max_spins, signal=False,
                             wait=True, op_code=op_code)
    err.after_launch()


class _CopyEngineGather:
    """The handle :meth:`FluxBackend.all_gather_start` returns; :meth:`wait` finishes the call."""

    def __init__(self, backend, ws, err, copies, gathered, out, rank, world, parity, epoch,
                 current, side):
        self._backend, self._ws, self._err, self._copies = backend, ws, err, copies
        self._gathered, self._out = gathered, out
        self._rank, self._world, self._parity, self._epoch = rank, world, parity, epoch
        self._current, self._side = current, side
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        # "done": the pushes finished (the shard is free for reuse), on the stream that started
        # the gather
        _signal_and_wait(self._backend, self._ws, self._err,
                         [(flags, index) for _, _, flags, index in self._copies],
                         rank=self._rank, world=self._world, parity=self._parity,
                         epoch=self._epoch, current=self._current, side=self._side, done="done",
                         op_code=_deps().OP_GATHER)
        self._copies = None
        if self._out is not None:
            self._out.copy_(self._gathered)
            self._result = self._out
        else:
            self._result = self._gathered
        return self._result


class _CopyEngineReduceScatter:
    """The handle of a copy-engine ReduceScatter (``column_dgrad="copy_engine"``). :meth:`wait`
    queues the signal writes behind the copies (after whatever the caller queued meanwhile: with
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a write waiting for its copy holds the one hardware queue),
    makes the current stream wait for the side stream, waits (one warp, bounded) for every
    peer's signal and sums the partials (:mod:`megatron_flux.kernels.rs_reduce`)."""

    def __init__(self, backend, ws, err, copies, partial, bias, rank, world, parity, epoch,
                 m_local, n, current, side):
        self._backend, self._ws, self._err, self._copies = backend, ws, err, copies
        self._partial, self._bias = partial, bias
        self._rank, self._world, self._parity, self._epoch = rank, world, parity, epoch
        self._m_local, self._n, self._current, self._side = m_local, n, current, side
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        d = _deps()
        m_local, n, rank, world = self._m_local, self._n, self._rank, self._world
        _signal_and_wait(self._backend, self._ws, self._err,
                         [(flags, rank) for _, _, flags in self._copies], rank=rank,
                         world=world, parity=self._parity, epoch=self._epoch,
                         current=self._current, side=self._side, done="rs-dgrad-done",
                         op_code=d.OP_GEMM_RS)
        out = torch.empty((m_local, n), dtype=self._partial.dtype, device=self._current.device)
        own = self._partial[rank * m_local:(rank + 1) * m_local]
        slots = self._ws.data(rank, self._parity, world * m_local * n)
        with d.on_stream(self._current, torch.cuda.current_stream(self._current.device)):
            d.launch_rs_reduce(own, slots, out, self._bias, rank=rank, world=world)
        self._copies = self._partial = None
        self._result = out
        return out


def _choice(name: str, value: Optional[str], env: str, choices: Tuple[str, ...]) -> str:
    """``value``, else ``$env``, else ``choices[0]``; anything outside ``choices`` raises."""
    if value is None:
        value = os.environ.get(env, "") or choices[0]
    if value not in choices:
        raise ValueError(f"megatron-flux: {name} (${env}) must be one of {choices}, got {value!r}")
    return value


class FluxBackend(TPOverlapBackend):
    """Fused Triton kernels; see the module docstring for the schedule."""

    name = "flux"
    waits_across_ranks_on_sms = True  # persistent grids spin on peers' signals

    def __init__(self, config_provider=None, column_dgrad: Optional[str] = None,
                 column_regather: Optional[str] = None):
        """``config_provider(op, m_total, n, k) -> GemmConfig``; default: the tuning tables
        (:class:`~megatron_flux.tuning.provider.TableConfigProvider`: table hit at the nearest
        m-bucket, else ``default_config``). A provider with ``accepts_context = True`` is also
        given ``dtype=``, ``tp=`` and ``device=``.

        ``column_dgrad`` (default ``$MEGATRON_FLUX_COLUMN_DGRAD``, else ``"nccl"``): how
        :meth:`matmul_reduce_scatter_start`, the column backward's input gradient, runs:
        ``"nccl"``, cuBLAS then NCCL's reduce-scatter left running beside the weight-gradient
        GEMM, megatron-core's order (the weight-gradient re-gather stays on the copy engine);
        ``"fused"``, the GEMM+RS kernel; ``"copy_engine"``, cuBLAS, then the copy engine moves
        the peers' rows beside the weight-gradient GEMM (no SM taken from it, unlike NCCL's
        kernel) and a reduction kernel sums them after it (checked against NCCL on GPUs, its
        speed not yet measured). There stock already hides the collective, so the fused kernel
        can only lose its margin to cuBLAS: on the Llama-3-8B-16l job (TP 2, micro-batch 2)
        ``"nccl"`` ran 1.041× stock against 1.027× for ``"fused"`` (benchmarks/NOTES.md,
        session 17).

        ``column_regather`` (default ``$MEGATRON_FLUX_COLUMN_REGATHER``, else
        ``"copy_engine"``): how :meth:`all_gather_start`, the column backward's re-gather of
        the input for the weight gradient, runs: ``"copy_engine"``, pushes into the peers'
        symmetric buffers (no SM taken from the dgrad GEMM beside it); ``"nccl"``, NCCL's
        asynchronous all-gather, as megatron-core does, which costs less host time per call
        (130 against about 290 µs on the 2×H100 box, benchmarks/NOTES.md, session 30)."""
        if config_provider is None:
            from megatron_flux.tuning.provider import TableConfigProvider

            config_provider = TableConfigProvider()
        self._config_provider = config_provider
        self._provider_context = bool(getattr(config_provider, "accepts_context", False))
        self._workspaces: Dict[Tuple, object] = {}
        self._errors: Dict[Tuple, object] = {}
        self._streams: Dict[Tuple[int, int], torch.cuda.Stream] = {}
        self._num_sms: Dict[int, int] = {}
        self._caps: Dict[int, Tuple[int, int]] = {}
        self._plans: Dict[Tuple, object] = {}
        self._reasons: Dict[Tuple, Optional[str]] = {}
        self._orders: Dict[Tuple, object] = {}
        self._staging: Dict[Tuple, torch.Tensor] = {}
        self._stream_wait: Optional[bool] = None
        self.max_spins = int(os.environ.get("MEGATRON_FLUX_MAX_SPINS", _DEFAULT_MAX_SPINS))
        self._nccl = None
        self.column_dgrad = _choice("column_dgrad", column_dgrad, ENV_COLUMN_DGRAD,
                                    COLUMN_DGRAD_CHOICES)
        self.column_regather = _choice("column_regather", column_regather, ENV_COLUMN_REGATHER,
                                       COLUMN_REGATHER_CHOICES)

    # ---------------------------------------------------------------- support
    def unsupported_reason(self, a, b, group) -> Optional[str]:
        if not a.is_cuda:
            return f"input is on {a.device.type}, not CUDA"
        if torch.cuda.is_current_stream_capturing():
            # a captured call would freeze its epoch into the graph: on every replay after the
            # first, the signals already hold that epoch and no wait would wait for its data
            return "CUDA graph capture (the fused kernels' epoch signals cannot be replayed)"
        # the rest depends on the operands' signature only: asked on every call, answered once
        key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
               group.size() if group is not None else 1)
        try:
            return self._reasons[key]
        except KeyError:
            reason = self._reasons[key] = self._signature_reason(a, b, group)
            return reason

    def _signature_reason(self, a, b, group) -> Optional[str]:
        world = group.size() if group is not None else 1
        if world < 2:
            return "tensor-parallel group has one rank"
        if a.dtype not in (torch.bfloat16, torch.float16):
            return f"dtype {a.dtype} (fused kernels take bfloat16/float16)"
        if b.dtype != a.dtype:
            return f"operand dtypes differ ({a.dtype} vs {b.dtype})"
        if a.dim() != 2 or b.dim() != 2:
            return "operands must be 2-D"
        if not a.is_contiguous():
            return "input is not contiguous"
        if not (b.stride(1) == 1 or b.stride(0) == 1):
            return f"weight strides {tuple(b.stride())} are neither row- nor column-major"
        k, n = b.shape
        if a.shape[1] != k:
            return f"shapes {tuple(a.shape)} x {tuple(b.shape)} do not chain"
        if k % 8 or n % 8:
            return f"k={k} and n={n} must be multiples of 8 (16-byte TMA strides)"
        lead = b.stride(0) if b.stride(1) == 1 else b.stride(1)
        if lead % 8:
            return f"weight leading stride {lead} is not a multiple of 8 (16-byte TMA strides)"
        if self._capability(a.device)[0] < 9:
            return "fused kernels need compute capability >= 9.0 (TMA)"
        if a.shape[0] == 0:
            return "empty input"
        return None

    # ---------------------------------------------------------------- helpers
    def _check(self, op: str, a, b, group) -> None:
        reason = self.unsupported_reason(a, b, group)
        if reason is not None:
            raise ValueError(f"megatron-flux {op}: {reason}")

    @staticmethod
    def _aligned(t):
        """``t``, or a copy when its address is not 16-byte aligned (TMA needs 16).

        Alignment is not a reason to fall back: ``auto`` decides on each rank alone, and every
        other input to that decision (shapes, dtypes, strides, device) is the same on all ranks
        of an SPMD program, while addresses need not be; ranks choosing differently would pair
        a fused kernel with an NCCL collective."""
        if t.data_ptr() % 16 == 0:
            return t
        if t.stride(1) == 1:
            return t.clone(memory_format=torch.contiguous_format)
        return t.t().clone(memory_format=torch.contiguous_format).t()

    def _nccl_backend(self):
        if self._nccl is None:
            from megatron_flux.backends import get_backend

            self._nccl = get_backend("nccl")
        return self._nccl

    def _workspace(self, op: str, group, device, dtype):
        key = (op, group.group_name, device.index, dtype)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = _deps().SymmetricWorkspace(op, group, device, dtype)
        return ws

    def _error_word(self, op: str, device):
        key = (op, device.index)
        word = self._errors.get(key)
        if word is None:
            interval = int(os.environ.get("MEGATRON_FLUX_ERROR_CHECK_INTERVAL", 16))
            word = self._errors[key] = _deps().DeviceErrorWord(device, interval)
        word.check_if_due()
        return word

    def check_errors(self, sync: bool = True) -> None:
        """Raise if any fused kernel on this process reported a timed-out wait."""
        for word in self._errors.values():
            word.check(sync=sync)

    def _capability(self, device) -> Tuple[int, int]:
        cap = self._caps.get(device.index)
        if cap is None:
            cap = self._caps[device.index] = torch.cuda.get_device_capability(device)
        return cap

    def _side_stream(self, device, priority: int = -1, use: str = "ag") -> torch.cuda.Stream:
        """A copy-engine stream of this device at this CUDA priority: one per (use, priority),
        the AllGathers' (``"ag"``) and copy-engine GEMM+RS's (``"rs"``)."""
        key = (device.index, priority, use)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(device=device, priority=priority)
        return s

    def _sms(self, device) -> int:
        """SMs the persistent grids may fill: the device's, less ``$MEGATRON_FLUX_RESERVED_SMS``."""
        n = self._num_sms.get(device.index)
        if n is None:
            total = torch.cuda.get_device_properties(device).multi_processor_count
            n = self._num_sms[device.index] = total - reserved_sms(total)
        return n

    def config(self, op: str, m_total: int, n: int, k: int, *, dtype=None, tp=None, device=None):
        """Kernel configuration for one op and global shape (cached: the provider may be a
        tuning-table lookup). ``dtype``/``tp``/``device`` key the table; without them a
        context-aware provider answers with the heuristic default."""
        key = (op, m_total, n, k, dtype, tp, device)
        cfg = self._plans.get(key)
        if cfg is None:
            if self._provider_context:
                cfg = self._config_provider(op, m_total, n, k, dtype=dtype, tp=tp, device=device)
            else:
                cfg = self._config_provider(op, m_total, n, k)
            self._plans[key] = cfg
        return cfg

    def clear_config_cache(self) -> None:
        """Forget cached configs (the tuner swaps the provider's answer between candidates)."""
        self._plans.clear()

    def config_with_chunk(self, cfg, chunk: int):
        key = ("chunk", cfg, chunk)
        out = self._plans.get(key)
        if out is None:
            out = self._plans[key] = dataclasses.replace(cfg, chunk_rows=chunk)
        return out

    # ---------------------------------------------------------------- AG + GEMM
    def all_gather_matmul(self, a_shard, b, group, *, out=None, return_gathered=False, gathered_out=None):
        d = _deps()
        self._check("AG+GEMM", a_shard, b, group)
        a_shard, b = self._aligned(a_shard), self._aligned(b)
        world, rank = group.size(), group.rank()
        m_local, k = a_shard.shape
        n = b.shape[1]
        m = world * m_local
        device = a_shard.device
        out = output_like(out, (m, n), a_shard, "megatron-flux AG+GEMM", contiguous=True)
        cfg = self.config("ag", m, n, k, dtype=a_shard.dtype, tp=world, device=device)
        if cfg.chunk_rows < m_local:
            chunk = cfg.chunk_rows
        else:
            chunk = m_local
            cfg = self.config_with_chunk(cfg, chunk)
        chunks = -(-m_local // chunk)
        ws = self._workspace("ag", group, device, a_shard.dtype)
        # signals: [src * chunks + c] chunk arrivals, then (pull) [world * chunks + p] shard ready
        ready_base = world * chunks
        ws.reserve(m * k, ready_base + world)
        err = self._error_word("ag", device)
        epoch = ws.next_epoch()
        parity = epoch & 1
        pull = cfg.ag_pull
        merge = cfg.ag_merge_local and world > 1  # the kernel reads its own rows from `gathered`
        gathered, own_rows, flags, plan = ws.memo(
            ("ag-call", rank, world, parity, m_local, k, chunk, pull),
            lambda: self._ag_views(ws, rank, world, parity, m_local, k, chunk, pull))

        current = torch.cuda.current_stream(device)
        side = self._side_stream(device, cfg.comm_priority)
        if pull or merge:  # peers pull from there / the merged GEMM reads it after its lead
            own_rows.copy_(a_shard)
        if pull:
            # the barrier runs before the GEMM on this stream, so it never waits beside a
            # persistent grid holding the SMs
            d.launch_ready_barrier(ws.flag_ptrs(parity), err.device_word, rank=rank, world=world,
                                 base=ready_base, epoch=epoch, max_spins=self.max_spins)
        self._order(device, "ready")(side, current)  # the shard is ready (before the GEMM)
        d.launch_ag_gemm(
            a_shard, gathered, b, out, flags, err.device_word,
            rank=rank, world=world, epoch=epoch, cfg=cfg, num_sms=self._sms(device),
            max_spins=self.max_spins,
        )
        err.after_launch()
        with d.on_stream(side, current):
            for dst, src, peer_flags, index in d.materialize(plan, a_shard):
                dst.copy_(src)
                d.write_signal(peer_flags, index, epoch)
            if return_gathered and not pull and not merge:  # else filled up front
                own_rows.copy_(a_shard)
        self._order(device, "done")(current, side)
        if not return_gathered:
            return out, None
        if gathered_out is not None:
            gathered_out.copy_(gathered)
            return out, gathered_out
        return out, gathered

    @staticmethod
    def _ag_views(ws, rank, world, parity, m_local, k, chunk, pull):
        """``(gathered [m, k], own rows, this rank's int32 signals, copy plan)`` of one shape."""
        m = world * m_local
        gathered = ws.data(rank, parity, m * k).view(m, k)
        own_rows = gathered[rank * m_local:(rank + 1) * m_local]
        plan = _deps().ag_copy_plan(ws, m_local, k, rank=rank, world=world, parity=parity, chunk=chunk,
                            pull=pull)
        return gathered, own_rows, ws.flags(rank, parity), plan

    def _order(self, device, which: str):
        """The reusable cross-stream ordering of this device for ``which`` hand-off."""
        key = (device.index, which)
        order = self._orders.get(key)
        if order is None:
            order = self._orders[key] = _deps().StreamOrder()
        return order

    # ---------------------------------------------------------------- GEMM + RS
    @staticmethod
    def _rs_rows(m: int, n: int, world: int, bias) -> int:
        """This rank's output rows of a GEMM+RS of ``m`` rows (checked, as the bias is)."""
        if m % world:
            raise ValueError(f"megatron-flux GEMM+RS: {m} rows are not divisible by TP={world}")
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"megatron-flux GEMM+RS: bias must be contiguous ({n},)")
        return m // world

    def _rs_call(self, group, device, dtype, m_local: int, n: int):
        """``(workspace, error word, epoch, parity)`` of one GEMM+RS call, in either form (the
        fused kernel or the copy-engine dgrad share slots, signals and epochs)."""
        world = group.size()
        ws = self._workspace("rs", group, device, dtype)
        ws.reserve(world * m_local * n, _deps().rs_signal_count(world))
        err = self._error_word("rs", device)
        epoch = ws.next_epoch()
        return ws, err, epoch, epoch & 1

    def matmul_reduce_scatter(self, a, b, group, *, out=None, bias=None):
        self._check("GEMM+RS", a, b, group)
        a, b = self._aligned(a), self._aligned(b)
        world, rank = group.size(), group.rank()
        m, k = a.shape
        n = b.shape[1]
        m_local = self._rs_rows(m, n, world, bias)
        device = a.device
        out = output_like(out, (m_local, n), a, "megatron-flux GEMM+RS", contiguous=True)
        cfg = self.config("rs", m, n, k, dtype=a.dtype, tp=world, device=device)
        ws, err, epoch, parity = self._rs_call(group, device, a.dtype, m_local, n)
        data = ws.data(rank, parity, world * m_local * n)
        if cfg.rs_copy_engine and self._stream_wait_ok():
            return self._rs_copy_engine(a, b, out, bias, ws, err, data, cfg, rank=rank,
                                        world=world, m_local=m_local, n=n, epoch=epoch,
                                        parity=parity)
        _deps().launch_gemm_rs(
            a, b, out, data, ws.data_ptrs(parity), ws.flag_ptrs(parity), bias, err.device_word,
            rank=rank, world=world, epoch=epoch, cfg=cfg, num_sms=self._sms(device),
            max_spins=self.max_spins,
        )
        err.after_launch()
        return out

    def matmul_reduce_scatter_start(self, a, b, group, *, bias=None):
        """The column backward's input gradient: the fused GEMM+RS (complete when this
        returns), or with ``column_dgrad="nccl"`` the NCCL backend's cuBLAS GEMM and a
        reduce-scatter left running beside the caller's next GEMM."""
        if self.column_dgrad == "nccl":
            return self._nccl_backend().matmul_reduce_scatter_start(a, b, group, bias=bias)
        if self.column_dgrad == "copy_engine":
            self._check("GEMM+RS", a, b, group)
            return self._reduce_scatter_copy_engine_start(a, b, group, bias)
        return super().matmul_reduce_scatter_start(a, b, group, bias=bias)

    def _reduce_scatter_copy_engine_start(self, a, b, group, bias):
        """cuBLAS's partial, its peers' rows moved by the copy engine (side stream, queued after
        the GEMM); :meth:`_CopyEngineReduceScatter.wait` finishes the call."""
        d = _deps()
        world, rank = group.size(), group.rank()
        n, device = b.shape[1], a.device
        m_local = self._rs_rows(a.shape[0], n, world, bias)
        ws, err, epoch, parity = self._rs_call(group, device, a.dtype, m_local, n)
        partial = torch.matmul(a, b).contiguous()
        copies = ws.memo(("rs-ce-dgrad", rank, world, parity, m_local, n),
                         lambda: d.rs_copy_plan(ws, m_local, n, rank=rank, world=world, parity=parity))
        current = torch.cuda.current_stream(device)
        side = self._side_stream(device, -1, "rs-dgrad")
        self._order(device, "rs-dgrad-ready")(side, current)  # the partial is computed
        with d.on_stream(side, current):
            for peer, dst, _ in copies:
                dst.copy_(partial[peer * m_local:(peer + 1) * m_local].view(-1))
        partial.record_stream(side)
        return _CopyEngineReduceScatter(self, ws, err, copies, partial, bias, rank, world, parity,
                                        epoch, m_local, n, current, side)

    def _rs_copy_engine(self, a, b, out, bias, ws, err, data, cfg, *, rank, world, m_local, n,
                        epoch, parity):
        """GEMM+RS with the copy engine delivering the partials (see the module docstring)."""
        d = _deps()
        device = a.device
        seg_elems = m_local * n
        side = self._side_stream(device, -1, "rs")
        staging = self._rs_staging(device, a.dtype, (world - 1) * seg_elems, side)
        bands = d.rs_bands(m_local, cfg.block_m, cfg.group_m) if cfg.rs_ce_bands else None
        table, copies, my_flags = ws.memo(
            ("rs-ce", rank, world, parity, m_local, n, staging.data_ptr(), bands,
             cfg.block_m if bands else 0),
            lambda: self._rs_ce_plan(ws, staging, data, rank, world, parity, m_local, n, bands,
                                     cfg.block_m))
        current = torch.cuda.current_stream(device)
        d.launch_gemm_rs(
            a, b, out, data, table, ws.flag_ptrs(parity), bias, err.device_word,
            rank=rank, world=world, epoch=epoch, cfg=cfg, num_sms=self._sms(device),
            max_spins=self.max_spins,
        )
        err.after_launch()
        with d.on_stream(side, current):
            if bands is None:
                d.wait_signal_on_stream(my_flags, world + 1, epoch, side)  # this rank's grid produced
            for dst, src, owner_flags, produced, last in copies:
                if produced is not None:  # this band's tiles are all staged
                    d.wait_signal_on_stream(my_flags, produced, epoch, side)
                dst.copy_(src)
                if last:
                    d.write_signal(owner_flags, rank, epoch)
        self._order(device, "rs-done")(current, side)  # the next call may refill the staging
        return out

    def _stream_wait_ok(self) -> bool:
        """Whether the driver offers the stream wait copy-engine GEMM+RS needs; else (once) a
        warning, and such configs push from the SMs."""
        if self._stream_wait is None:
            from megatron_flux.comm.signals import stream_wait_unavailable_reason

            reason = stream_wait_unavailable_reason()
            if reason is not None:
                warnings.warn(f"megatron-flux GEMM+RS: rs_copy_engine configs push from the SMs "
                              f"instead ({reason})", stacklevel=3)
            self._stream_wait = reason is None
        return self._stream_wait

    def _rs_staging(self, device, dtype, numel: int, side) -> torch.Tensor:
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
            buf = self._staging[key] = torch.empty(numel, dtype=dtype, device=device)
            buf.record_stream(side)
        return buf

    @staticmethod
    def _rs_ce_plan(ws, staging, data, rank, world, parity, m_local, n, bands=None, block_m=0):
        """``(data_ptrs table, copies, this rank's uint32 signals)`` of one copy-engine GEMM+RS
        shape. ``copies``: ``(owner's slot rows, staged rows, owner's uint32 signals, "produced"
        word to wait for first or None, whether the owner's signal follows)`` in queue order:
        per producer step its whole partial, or with ``bands`` (:func:`rs_bands`) band by band
        in the order the step's tiles run (odd steps backwards)."""
        d = _deps()
        seg_elems = m_local * n
        addrs = d.rs_staging_table(staging.data_ptr(), data.data_ptr(), rank=rank, world=world,
                                 m_local=m_local, n=n, elt=staging.element_size())
        table = torch.tensor(addrs, dtype=torch.int64, device=staging.device)
        band_rows, count = (m_local, 1) if bands is None else (bands[0] * block_m, bands[1])
        copies = []
        for step in range(world - 1):
            owner = (rank + 1 + step) % world
            slot = ws.data(owner, parity, world * seg_elems)[rank * seg_elems:(rank + 1) * seg_elems]
            part = staging[step * seg_elems:(step + 1) * seg_elems]
            order = list(range(count)) if step % 2 == 0 else list(reversed(range(count)))
            for j, band in enumerate(order):
                lo, hi = band * band_rows * n, min(m_local, (band + 1) * band_rows) * n
                produced = None if bands is None else d.rs_band_words(world, step, band)[1]
                copies.append((slot[lo:hi], part[lo:hi], ws.flags(owner, parity, torch.uint32),
                               produced, j == count - 1))
        return table, copies, ws.flags(rank, parity, torch.uint32)

    # ---------------------------------------------------------------- plain collectives
    def all_gather(self, x, group, *, out=None):
        return self._nccl_backend().all_gather(x, group, out=out)

    def all_gather_start(self, x, group, *, out=None):
        """The row all-gather on the copy engine (see the module docstring); NCCL's
        asynchronous all-gather with ``column_regather="nccl"`` and where the fused path cannot
        run (CPU, one rank, CUDA graph capture, other dtypes). Without ``out`` the result is this backend's gather
        workspace, valid until its next ``all_gather_start`` on this group."""
        reason = self._gather_unsupported_reason(x, group)
        if reason is not None or self.column_regather == "nccl":
            return self._nccl_backend().all_gather_start(x, group, out=out)
        d = _deps()
        x = x.contiguous()
        rows = x.view(x.shape[0], -1)
        world, rank = group.size(), group.rank()
        m_local, k = rows.shape
        m = world * m_local
        shape = (m, *x.shape[1:])
        if out is not None:
            output_like(out, shape, x, "megatron-flux all_gather_start")
        device = x.device
        ws = self._workspace("gather", group, device, x.dtype)
        ws.reserve(m * k, world)  # signals: [src] = the epoch once src's rows are here
        err = self._error_word("gather", device)
        epoch = ws.next_epoch()
        parity = epoch & 1
        gathered, own_rows, _, plan = ws.memo(
            ("gather-call", rank, world, parity, m_local, k),
            lambda: self._ag_views(ws, rank, world, parity, m_local, k, m_local, False))
        current = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        self._order(device, "ready")(side, current)  # this rank's rows are ready
        copies = d.materialize(plan, rows)
        with d.on_stream(side, current):
            for dst, src, _, _ in copies:
                dst.copy_(src)
        # The own rows go on the caller's stream: behind the pushes on the side stream, this
        # same-GPU copy would wait for them, and with one hardware queue
        # (CUDA_DEVICE_MAX_CONNECTIONS=1) so would the GEMM+RS the caller queues next (session
        # 17's training profile: ~110 us exposed per call).
        own_rows.copy_(rows)
        return _CopyEngineGather(self, ws, err, copies, gathered.view(shape), out, rank, world,
                                 parity, epoch, current, side)

    def _gather_unsupported_reason(self, x, group) -> Optional[str]:
        if not x.is_cuda:
            return "not CUDA"
        if group is None or group.size() < 2:
            return "one rank"
        if torch.cuda.is_current_stream_capturing():
            return "CUDA graph capture"
        if x.dim() < 1 or x.numel() == 0:
            return "empty"
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"dtype {x.dtype}"
        return None

    def reduce_scatter(self, x, group, *, out=None):
        return self._nccl_backend().reduce_scatter(x, group, out=out)
