"""The column backward's re-gather of its input on the copy engine (``column_regather=
"copy_engine"``): no SM taken from the input gradient's kernel beside it.

``all_gather_start`` queues the pushes of this rank's rows into every peer's gather workspace
(side stream, after an event marking the rows ready) and the copy of its own rows (caller's
stream); the caller then queues its dgrad; ``wait()`` queues the signal writes behind the pushes,
makes the current stream wait for them, and runs a one-warp bounded wait for every peer's signal
(:mod:`.handles`). The own rows are copied on the caller's stream, not behind the pushes on the
side stream: with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` every stream shares one hardware queue, and a
same-GPU copy waiting for the pushes would hold the dgrad queued behind it (about 110 µs per call
in a 2×H200 training profile). The bounded wait spins on the caller's stream until the peers'
rows are there, so a host-bound peer costs this rank GPU time: NCCL's asynchronous all-gather
(``column_regather="nccl"``, the default) waits on NCCL's own stream instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_flux.backends.base import output_like
from megatron_flux.backends.flux.ag import gathered_views
from megatron_flux.backends.flux.handles import CopyEngineGather
from megatron_flux.backends.flux.resources import deps
from megatron_flux.backends.flux.support import off_current_device_error


def unsupported_reason(x, group) -> Optional[str]:
    """Why the copy-engine re-gather cannot take ``x`` (then NCCL's runs), or ``None``."""
    if not x.is_cuda:
        return "not CUDA"
    current = torch.cuda.current_device()
    if x.device.index != current:  # its wait launches on the current one: raise, not fall back
        raise off_current_device_error("the input to re-gather is", x.device, current)
    if group is None or group.size() < 2:
        return "one rank"
    if torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture"
    if x.dim() < 1 or x.numel() == 0:
        return "empty"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {x.dtype}"
    return None


def all_gather_start(backend, x, group, out):
    """Queue the copy-engine re-gather of ``x`` and return its :class:`CopyEngineGather`."""
    d = deps()
    res = backend.resources
    x = x.contiguous()
    rows = x.view(x.shape[0], -1)
    world, rank = group.size(), group.rank()
    m_local, k = rows.shape
    m = world * m_local
    shape = (m, *x.shape[1:])
    if out is not None:
        output_like(out, shape, x, "megatron-flux all_gather_start")
    device = x.device
    ws = res.workspace("gather", group, device, x.dtype)
    ws.reserve(m * k, world)  # signals: [src] = the epoch once src's rows are here
    err = res.error_word("gather", device)
    epoch = ws.next_epoch()
    parity = epoch & 1
    gathered, own_rows, _, plan = ws.memo(
        ("gather-call", rank, world, parity, m_local, k),
        lambda: gathered_views(ws, rank, world, parity, m_local, k, m_local))
    current = torch.cuda.current_stream(device)
    side = res.side_stream(device)
    res.order(device, "ready")(side, current)  # this rank's rows are ready
    copies = d.materialize(plan, rows)
    with d.on_stream(side, current):
        for dst, src, _, _ in copies:
            dst.copy_(src)
    own_rows.copy_(rows)
    return CopyEngineGather(backend, ws, err, copies, gathered.view(shape), out, rank, world,
                            parity, epoch, current, side)
