"""The fused GEMM+ReduceScatter call, host side, and the column backward's copy-engine
ReduceScatter (``column_dgrad="copy_engine"``), which shares its slots, signals and epochs.

GEMM+ReduceScatter needs no side stream: the kernel pushes remote tiles and reduces its own.
With ``GemmConfig.rs_copy_engine`` the kernel writes the peers' partials into a local staging
buffer instead and raises this rank's "produced" word; queued behind it, a side stream waits for
that word (``cuStreamWaitValue32``), copies each partial into its owner's slot by the copy engine
and writes the owner's signal word, while the kernel computes its own rows; the current stream
then waits for the side stream (the staging buffer is reused by the next call). The kernel never
waits for its own side stream, only for its peers'; each peer's copies wait only for that peer's
producer phase, which waits for nothing. Peer-to-peer copies queued this way start while the
kernel runs under both ``CUDA_DEVICE_MAX_CONNECTIONS`` settings
(``benchmarks/experiments/stream_wait_overlap.py``).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from megatron_flux.backends.base import output_like
from megatron_flux.backends.flux.bound import launch_or_bound
from megatron_flux.backends.flux.handles import CopyEngineReduceScatter
from megatron_flux.backends.flux.resources import deps
from megatron_flux.backends.flux.support import aligned


def rs_rows(a, n: int, world: int, bias) -> int:
    """This rank's output rows of a GEMM+RS of ``a``'s rows (checked, as the bias is: a
    contiguous ``(n,)`` tensor on ``a``'s device, which the kernel reads)."""
    m = a.shape[0]
    if m % world:
        raise ValueError(f"megatron-flux GEMM+RS: {m} rows are not divisible by TP={world}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()
                             or bias.device != a.device):
        raise ValueError(f"megatron-flux GEMM+RS: bias must be contiguous ({n},) on {a.device}, "
                         f"got {tuple(bias.shape)} on {bias.device}")
    return m // world


def rs_workspace(res, group, device, dtype, m_local: int, n: int, *, graph: bool = False,
                 row_turns: bool = False):
    """``(workspace, error word)`` of GEMM+RS calls of ``m_local`` rows per rank and ``n``
    columns, reserved for them, in either form (the fused kernel or the copy-engine dgrad share
    slots, signals and epochs). ``graph``: the captured calls' workspace
    (:meth:`DeviceResources.graph_workspace`). ``row_turns``: with the row-group counters of
    ``rs_row_turns`` (:func:`~megatron_flux.kernels.config.rs_signal_count`)."""
    world = group.size()
    elems, flags = world * m_local * n, deps().rs_signal_count(world, row_turns)
    if graph:
        ws = res.graph_workspace("rs", group, device, dtype, elems, flags)
    else:
        ws = res.workspace("rs", group, device, dtype)
        ws.reserve(elems, flags)
    return ws, res.error_word("rs", device)


def rs_call(res, group, device, dtype, m_local: int, n: int):
    """``(workspace, error word, epoch, parity)`` of one GEMM+RS call (:func:`rs_workspace`)."""
    ws, err = rs_workspace(res, group, device, dtype, m_local, n)
    epoch = ws.next_epoch()
    return ws, err, epoch, epoch & 1


class RsPlan(NamedTuple):
    """What every GEMM+RS call of one operand signature resolves to, resolved once
    (:func:`rs_plan`): a call does the epoch, the output, the launch and the copies."""

    group: object
    world: int
    rank: int
    m_local: int
    n: int
    cfg: object
    ws: object
    generation: int
    err: object
    num_sms: int
    device: torch.device
    side: object               # copy-engine delivery: the side stream, else None
    done: object               # ... and its "rs-done" ordering
    parities: tuple            # per parity: (data, data_ptrs table, flag_ptrs, copies, my_flags)
    own_flags: tuple = ()      # per parity: this rank's int32 signals (a captured call resets them)
    bound: list = None         # per parity: the eager calls' BoundLaunch, False: not bindable


def rs_plan(backend, a, b, group, bias, graph: bool = False) -> RsPlan:
    """Resolve a GEMM+RS call of ``a``'s and ``b``'s signature (the checks raise here, before
    anything is kept); ``graph``: the plan of the same calls inside a CUDA graph capture, on the
    graph workspace, made outside it (:func:`_build`)."""
    res = backend.resources
    backend.check("GEMM+RS", a, b, group)
    world, rank = group.size(), group.rank()
    m, k = a.shape
    n = b.shape[1]
    m_local = rs_rows(a, n, world, bias)
    device = a.device
    cfg = backend.config("rs", m, n, k, dtype=a.dtype, tp=world, device=device)
    # captured calls push from the SMs (see _build), and so do all calls where the driver lacks
    # the stream wait: a kernel compiled for copy-engine delivery with none queued never
    # raises its peers' signals
    if cfg.rs_copy_engine and (graph or not _stream_wait_ok(backend)):
        cfg = backend.config_without_copy_engine(cfg)
    ws, err = rs_workspace(res, group, device, a.dtype, m_local, n, graph=graph,
                           row_turns=cfg.rs_row_turns)
    side = done = None
    parities = []
    if cfg.rs_copy_engine:
        side = res.side_stream(device, -1, "rs")
        done = res.order(device, "rs-done")
        staging = res.staging(device, a.dtype, (world - 1) * m_local * n, side)
    for parity in (0, 1):
        data = ws.data(rank, parity, world * m_local * n)
        if side is None:
            parities.append((data, ws.data_ptrs(parity), ws.flag_ptrs(parity), None, None))
        else:
            table, copies, my_flags = ws.memo(
                ("rs-ce", rank, world, parity, m_local, n, staging.data_ptr()),
                lambda: copy_plan(ws, staging, data, rank, world, parity, m_local, n))
            parities.append((data, table, ws.flag_ptrs(parity), copies, my_flags))
    return RsPlan(group, world, rank, m_local, n, cfg, ws, ws.generation, err, res.sms(device),
                  device, side, done, tuple(parities), (ws.flags(rank, 0), ws.flags(rank, 1)),
                  [None, None])


def matmul_reduce_scatter(backend, a, b, group, out, bias):
    """``FluxBackend.matmul_reduce_scatter`` (see the module docstring), through the call plan
    of the operands' signature (:meth:`FluxBackend.call_plan`); inside a CUDA graph capture
    through :func:`_captured`."""
    key = ("rs", a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype,
           b.get_device(), id(group), bias is None)
    if a.is_cuda and torch.cuda.is_current_stream_capturing():
        return _captured(backend, a, b, group, out, bias, key)
    plan = backend.call_plan("GEMM+RS", key, group, lambda: _build(backend, a, b, group, bias, key))
    plan.err.check_if_due()
    epoch = plan.ws.next_epoch()
    return _run(backend, plan, a, b, out, bias, epoch, epoch & 1, True)


def _build(backend, a, b, group, bias, key) -> RsPlan:
    """The eager plan; where a capture is expected (:meth:`FluxBackend.expect_capture`) also
    the captured calls' plan of the same signature, which a capture cannot build (it reserves
    symmetric memory and copies address tables to the device), and one call on it now, behind
    a fence (its kernel is compiled and loaded before any capture needs it).

    Captured calls push from the SMs: copy-engine delivery's side stream waits for a word its
    own kernel raises, and in a graph that wait and the kernel are siblings, which a replay may
    run in either order (the captured copy-engine form hung after its capture on 2xH200)."""
    from megatron_flux.comm.capture import CAPTURED_EPOCH

    plan = rs_plan(backend, a, b, group, bias)
    if backend.reserve_for_capture and not backend.has_capture_plan(key, group):
        graph_plan = rs_plan(backend, a, b, group, bias, graph=True)
        backend.register_capture_plan(key, graph_plan)
        backend.graph_fence(graph_plan, "rs")
        _run(backend, graph_plan, a, b, None, bias, CAPTURED_EPOCH, 0, False)
    return plan


def _captured(backend, a, b, group, out, bias, key):
    """A GEMM+RS call inside a CUDA graph capture: on the graph workspace, with the constant
    signal value, this rank's signals of the call's parity reset after it
    (:mod:`megatron_flux.comm.capture`); on NCCL where no eager call of its signature made
    its plan."""
    from megatron_flux.comm.capture import CAPTURED_EPOCH

    plan = backend.capture_plan("GEMM+RS", key, group)
    if plan is None:
        return backend._nccl_backend().matmul_reduce_scatter(a, b, group, out=out, bias=bias)
    parity = backend.capture_parity(plan, "rs")
    out = _run(backend, plan, a, b, out, bias, CAPTURED_EPOCH, parity, False)
    backend.keep_scratch_alive(plan.device)
    return out


def _run(backend, plan, a, b, out, bias, epoch, parity, eager):
    """One GEMM+RS call on ``plan`` with this epoch and parity: the output, the launch and, for
    copy-engine delivery, the side stream's copies. Not ``eager`` (a graph plan's call, captured
    or not): this rank's signals of the parity are reset after it
    (:mod:`megatron_flux.comm.capture`)."""
    if bias is not None:  # its shape and layout, which the key does not hold
        rs_rows(a, plan.n, plan.world, bias)
    a, b = aligned(a), aligned(b)
    err = plan.err
    data, table, flag_ptrs, copies, my_flags = plan.parities[parity]
    out = output_like(out, (plan.m_local, plan.n), a, "megatron-flux GEMM+RS", contiguous=True)
    d, opts = deps(), backend.options
    side = plan.side
    current = torch.cuda.current_stream(plan.device) if side is not None else None

    def launch():
        d.launch_gemm_rs(
            a, b, out, data, table, flag_ptrs, bias, err.device_word,
            rank=plan.rank, world=plan.world, epoch=epoch, cfg=plan.cfg, num_sms=plan.num_sms,
            max_spins=opts.max_spins, host_descriptors=opts.host_descriptors,
            direct=opts.direct_launch,
        )

    launch_or_bound(backend, plan, parity, eager, (a, b, out, bias), epoch,
                    (data, table, flag_ptrs, err.device_word), launch)
    if eager:
        err.after_launch()
    if side is not None:
        _deliver(d, side, current, my_flags, copies, plan.rank, plan.world, epoch)
        plan.done(current, side)  # the next call may refill the staging
    if not eager:
        plan.own_flags[parity].zero_()
    return out


def _deliver(d, side, current, my_flags, copies, rank, world, epoch):
    """The side stream's part of a copy-engine GEMM+RS call: wait for this rank's producer
    phase, then each partial to its owner's slot and the owner's signal."""
    with d.on_stream(side, current):
        d.wait_signal_on_stream(my_flags, world + 1, epoch, side)  # this rank's grid produced
        for dst, src, owner_flags in copies:
            dst.copy_(src)
            d.write_signal(owner_flags, rank, epoch)


def _stream_wait_ok(backend) -> bool:
    """Whether the driver offers the stream wait copy-engine GEMM+RS needs; else (once) a
    warning, and such configs push from the SMs."""
    if backend._stream_wait is None:
        reason = deps().stream_wait_unavailable_reason()
        if reason is not None:
            warnings.warn(f"megatron-flux GEMM+RS: rs_copy_engine configs push from the SMs "
                          f"instead ({reason})", stacklevel=4)
        backend._stream_wait = reason is None
    return backend._stream_wait


def copy_plan(ws, staging, data, rank, world, parity, m_local, n):
    """``(data_ptrs table, copies, this rank's uint32 signals)`` of one copy-engine GEMM+RS
    shape. ``copies``: per producer step, in queue order, ``(owner's slot rows, the step's
    staged partial, owner's uint32 signals)``."""
    d = deps()
    seg_elems = m_local * n
    addrs = d.rs_staging_table(staging.data_ptr(), data.data_ptr(), rank=rank, world=world,
                               m_local=m_local, n=n, elt=staging.element_size())
    table = torch.tensor(addrs, dtype=torch.int64, device=staging.device)
    copies = []
    for step in range(world - 1):
        owner = (rank + 1 + step) % world
        slot = ws.data(owner, parity, world * seg_elems)[rank * seg_elems:(rank + 1) * seg_elems]
        part = staging[step * seg_elems:(step + 1) * seg_elems]
        copies.append((slot, part, ws.flags(owner, parity, torch.uint32)))
    return table, copies, ws.flags(rank, parity, torch.uint32)


def reduce_scatter_copy_engine_start(backend, a, b, group, bias):
    """The column backward's dgrad with ``column_dgrad="copy_engine"``: cuBLAS's partial, its
    peers' rows moved by the copy engine (side stream, queued after the GEMM);
    :meth:`CopyEngineReduceScatter.wait` finishes the call."""
    if a.is_cuda and torch.cuda.is_current_stream_capturing():
        from megatron_flux.backends.registry import log_once

        log_once("capture:rs-copy-engine-dgrad",
                 "megatron-flux: column_dgrad='copy_engine' is not captured into CUDA graphs; "
                 "the column backward's dgrad inside a capture runs on 'nccl'")
        return backend._nccl_backend().matmul_reduce_scatter_start(a, b, group, bias=bias)
    d = deps()
    res = backend.resources
    backend.check("GEMM+RS", a, b, group)
    world, rank = group.size(), group.rank()
    n, device = b.shape[1], a.device
    m_local = rs_rows(a, n, world, bias)
    ws, err, epoch, parity = rs_call(res, group, device, a.dtype, m_local, n)
    partial = torch.matmul(a, b).contiguous()
    copies = ws.memo(("rs-ce-dgrad", rank, world, parity, m_local, n),
                     lambda: d.rs_copy_plan(ws, m_local, n, rank=rank, world=world, parity=parity))
    current = torch.cuda.current_stream(device)
    side = res.side_stream(device, -1, "rs-dgrad")
    res.order(device, "rs-dgrad-ready")(side, current)  # the partial is computed
    with d.on_stream(side, current):
        for peer, dst, _ in copies:
            dst.copy_(partial[peer * m_local:(peer + 1) * m_local].view(-1))
    partial.record_stream(side)
    return CopyEngineReduceScatter(backend, ws, err, copies, partial, bias, rank, world, parity,
                                   epoch, m_local, n, current, side)
