"""The fused AllGather+GEMM call, host side.

Schedule of one call on rank ``r`` (``W`` ranks, epoch ``e``):

1. the GEMM kernel is queued on the current stream first; it computes the local rows from the
   caller's shard at once and spins on chunk signals before each remote tile;
2. on a side stream (after an event marking the shard ready) the copy engine pushes the shard,
   chunk by chunk, into every peer's gathered workspace (peers in the order they consume it),
   each chunk followed by a stream memory write of ``e`` into that peer's signal word;
3. the current stream waits for the side stream, so the shard and the workspace are safe to
   reuse.

With ``GemmConfig.ag_merge_local`` (the default at small m, with a lead of 0) the kernel reads
its local rows from the gathered workspace after a lead of local tiles, so step 0 also copies
the shard into this rank's own gathered rows, on the current stream before the GEMM. A copy
queued on the side stream behind the kernel would overlap the lead, but the kernel would then
spin on work queued behind it on its own device, which this schedule never does.

Because the kernel is queued before the copies and the copies never wait on the kernel, the
kernel never spins on work queued behind it, also with ``CUDA_DEVICE_MAX_CONNECTIONS=1``; and no
wait needs an SM, so a grid that is only partly resident still drains.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_flux.backends.base import output_like
from megatron_flux.backends.flux.bound import launch_or_bound
from megatron_flux.backends.flux.resources import deps
from megatron_flux.backends.flux.support import aligned


def gathered_views(ws, rank, world, parity, m_local, k, chunk):
    """``(gathered [m, k], own rows, this rank's int32 signals, copy plan)`` of one shape and
    parity, in ``ws``'s gather slot (memoized by the callers)."""
    m = world * m_local
    gathered = ws.data(rank, parity, m * k).view(m, k)
    own_rows = gathered[rank * m_local:(rank + 1) * m_local]
    plan = deps().ag_copy_plan(ws, m_local, k, rank=rank, world=world, parity=parity,
                               chunk=chunk)
    return gathered, own_rows, ws.flags(rank, parity), plan


class AgPlan(NamedTuple):
    """What every AG+GEMM call of one operand signature resolves to, resolved once
    (:func:`ag_plan`): a call does the epoch, the output, the launch and the copies."""

    group: object
    world: int
    rank: int
    m: int
    n: int
    cfg: object
    merge: bool
    ws: object
    generation: int
    err: object
    num_sms: int
    device: torch.device
    side: object
    ready: object
    done: object
    parities: tuple            # per parity: (gathered, own rows, signals, copy plan)
    bound: list = None         # per parity: the eager calls' BoundLaunch, False: not bindable


def ag_plan(backend, a_shard, b, group, graph: bool = False) -> AgPlan:
    """Resolve an AG+GEMM call of the operands' signature (the checks raise here, before
    anything is kept); ``graph``: the plan of the same calls inside a CUDA graph capture, on the
    graph workspace, made outside it (:func:`_build`)."""
    res = backend.resources
    backend.check("AG+GEMM", a_shard, b, group)
    world, rank = group.size(), group.rank()
    m_local, k = a_shard.shape
    n = b.shape[1]
    m = world * m_local
    device = a_shard.device
    cfg = backend.config("ag", m, n, k, dtype=a_shard.dtype, tp=world, device=device)
    if cfg.chunk_rows < m_local:
        chunk = cfg.chunk_rows
    else:
        chunk = m_local
        cfg = backend.config_with_chunk(cfg, chunk)
    chunks = -(-m_local // chunk)
    if graph:  # signals: [src * chunks + c] chunk arrivals
        ws = res.graph_workspace("ag", group, device, a_shard.dtype, m * k, world * chunks)
    else:
        ws = res.workspace("ag", group, device, a_shard.dtype)
        ws.reserve(m * k, world * chunks)
    err = res.error_word("ag", device)
    parities = tuple(
        ws.memo(("ag-call", rank, world, parity, m_local, k, chunk),
                lambda parity=parity: gathered_views(ws, rank, world, parity, m_local, k, chunk))
        for parity in (0, 1))
    return AgPlan(group, world, rank, m, n, cfg, cfg.ag_merge_local and world > 1, ws,
                  ws.generation, err, res.sms(device), device,
                  res.side_stream(device, cfg.comm_priority), res.order(device, "ready"),
                  res.order(device, "done"), parities, [None, None])


def all_gather_matmul(backend, a_shard, b, group, out, return_gathered, gathered_out):
    """``FluxBackend.all_gather_matmul`` (see the module docstring), through the call plan of
    the operands' signature (:meth:`FluxBackend.call_plan`); inside a CUDA graph capture through
    :func:`_captured`."""
    key = ("ag", a_shard.shape, a_shard.stride(), a_shard.dtype, a_shard.get_device(), b.shape,
           b.stride(), b.dtype, b.get_device(), id(group))
    if a_shard.is_cuda and torch.cuda.is_current_stream_capturing():
        return _captured(backend, a_shard, b, group, out, return_gathered, gathered_out, key)
    plan = backend.call_plan("AG+GEMM", key, group,
                             lambda: _build(backend, a_shard, b, group, key))
    plan.err.check_if_due()
    epoch = plan.ws.next_epoch()
    return _run(backend, plan, a_shard, b, out, return_gathered, gathered_out, epoch, epoch & 1,
                True)


def _build(backend, a_shard, b, group, key) -> AgPlan:
    """The eager plan; where a capture is expected (:meth:`FluxBackend.expect_capture`) also
    the captured calls' plan of the same signature, which a capture cannot build (it reserves
    symmetric memory), and one call on it now, behind a fence (what it launches is compiled
    and loaded before any capture needs it)."""
    from megatron_flux.comm.capture import CAPTURED_EPOCH

    plan = ag_plan(backend, a_shard, b, group)
    if backend.reserve_for_capture and not backend.has_capture_plan(key, group):
        graph_plan = ag_plan(backend, a_shard, b, group, graph=True)
        backend.register_capture_plan(key, graph_plan)
        backend.graph_fence(graph_plan, "ag")
        _run(backend, graph_plan, a_shard, b, None, False, None, CAPTURED_EPOCH, 0, False)
    return plan


def _captured(backend, a_shard, b, group, out, return_gathered, gathered_out, key):
    """An AG+GEMM call inside a CUDA graph capture: on the graph workspace, with the constant
    signal value, this rank's signals of the call's parity reset after it
    (:mod:`megatron_flux.comm.capture`); on NCCL where no eager call of its signature made its
    plan."""
    from megatron_flux.comm.capture import CAPTURED_EPOCH

    plan = backend.capture_plan("AG+GEMM", key, group)
    if plan is None:
        return backend._nccl_backend().all_gather_matmul(
            a_shard, b, group, out=out, return_gathered=return_gathered,
            gathered_out=gathered_out)
    parity = backend.capture_parity(plan, "ag")
    result = _run(backend, plan, a_shard, b, out, return_gathered, gathered_out, CAPTURED_EPOCH,
                  parity, False)
    backend.keep_scratch_alive(plan.device)
    return result


def _run(backend, plan, a_shard, b, out, return_gathered, gathered_out, epoch, parity, eager):
    """One AG+GEMM call on ``plan`` with this epoch and parity: the output, the launch, the
    side stream's pushes and the hand-back. Not ``eager`` (a graph plan's call, captured or
    not): this rank's signals of the parity are reset after it
    (:mod:`megatron_flux.comm.capture`)."""
    a_shard, b = aligned(a_shard), aligned(b)
    err = plan.err
    gathered, own_rows, flags, copies = plan.parities[parity]
    out = output_like(out, (plan.m, plan.n), a_shard, "megatron-flux AG+GEMM", contiguous=True)
    d, opts = deps(), backend.options
    current = torch.cuda.current_stream(plan.device)
    side = plan.side
    if plan.merge:  # the merged GEMM reads the own rows there after its lead
        own_rows.copy_(a_shard)
    plan.ready(side, current)  # the shard is ready (before the GEMM)

    def launch():
        d.launch_ag_gemm(
            a_shard, gathered, b, out, flags, err.device_word,
            rank=plan.rank, world=plan.world, epoch=epoch, cfg=plan.cfg, num_sms=plan.num_sms,
            max_spins=opts.max_spins, host_descriptors=opts.host_descriptors,
            direct=opts.direct_launch,
        )

    launch_or_bound(backend, plan, parity, eager, (a_shard, b, out), epoch,
                    (gathered, flags, err.device_word), launch)
    if eager:
        err.after_launch()
    _push(d, side, current, copies, a_shard, own_rows, epoch,
          fill_own=return_gathered and not plan.merge)
    plan.done(current, side)
    if not eager:
        flags.zero_()
    if not return_gathered:
        return out, None
    if gathered_out is not None:
        gathered_out.copy_(gathered)
        return out, gathered_out
    return out, gathered


def _push(d, side, current, copies, a_shard, own_rows, epoch, *, fill_own):
    """The side stream's part of an AG+GEMM call: the shard to every peer, chunk by chunk,
    each chunk followed by its signal; with ``fill_own`` also into this rank's gathered rows."""
    with d.on_stream(side, current):
        for dst, src, peer_flags, index in d.materialize(copies, a_shard):
            dst.copy_(src)
            d.write_signal(peer_flags, index, epoch)
        if fill_own:  # else filled up front
            own_rows.copy_(a_shard)

