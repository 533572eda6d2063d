"""``auto``: the fused backend or the NCCL reference, per call shape, from the tuning tables.

``resolve_backend`` first checks that the fused backend can run the operands at all; then it
asks :func:`choose_auto` which of ``fused`` and ``nccl`` to use. The call sites in
``megatron_flux.ops`` name the op that follows (``op="ag"``/``"rs"``); without it both readings
of ``(a, b)`` are looked up:

* AG+GEMM: ``m_total = rows(a) * tp`` (``a`` is this rank's shard);
* GEMM+RS: ``m_total = rows(a)``.

Each reading is :func:`megatron_flux.tuning.provider.decide`: the table entry at the nearest
m-bucket with the ``auto`` margin, else the estimate from the nearest measured entries, else a
size rule; one log line per shape, on the TP group's first rank, names which (except a
table's fused choice). Where both readings give the same backend it is returned as is;
otherwise an :class:`AutoDispatch` picks per method (``all_gather_matmul`` is the AG reading,
``matmul_reduce_scatter`` the RS one); its ``name`` says what it picked, e.g.
``auto(ag:nccl,rs:flux)``. Cached per ``(op, rows, k, n, dtype, tp, device)``: after the first
call of a shape, one dict lookup.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

from megatron_flux.backends.base import TPOverlapBackend, remember
from megatron_flux.tuning.provider import decide, on_decisions_change

_CACHE: Dict[tuple, object] = {}


def _decide(op, rows, k, n, dtype, tp, device, log: bool) -> bool:
    m_total = rows * tp if op == "ag" else rows
    d = decide(op, m_total, n, k, dtype, tp, device)
    # a table's "fused" is the expected case: quiet; the rest is said by one rank of the group
    # (every rank reads the same tables, so every rank decides alike)
    if log and (not d.fused or d.source != "table"):
        from megatron_flux.backends.registry import log_once

        log_once(
            f"auto:{op}:{m_total}:{n}:{k}:{dtype}:{tp}",
            f"megatron-flux: flux_backend='auto' uses '{'flux' if d.fused else 'nccl'}' for {op} "
            f"m={m_total} n={n} k={k}: {d.why}",
            logging.INFO,
        )
    return d.fused


class AutoDispatch(TPOverlapBackend):
    """Fused or NCCL chosen per method call from the table (the op is known per method)."""

    name = "auto"

    def __init__(self, fused: TPOverlapBackend, nccl: TPOverlapBackend, use_fused_ag: bool, use_fused_rs: bool):
        self.fused, self.nccl = fused, nccl
        self.ag = fused if use_fused_ag else nccl
        self.rs = fused if use_fused_rs else nccl
        self.name = f"auto(ag:{self.ag.name},rs:{self.rs.name})"
        self.waits_across_ranks_on_sms = bool(
            self.ag.waits_across_ranks_on_sms or self.rs.waits_across_ranks_on_sms)
        self.capturable = bool(getattr(self.ag, "capturable", True)
                               and getattr(self.rs, "capturable", True))

    def backend_for(self, op: str) -> TPOverlapBackend:
        return self.ag if op == "ag" else self.rs

    def unsupported_reason(self, a, b, group):
        return self.fused.unsupported_reason(a, b, group)

    def all_gather_matmul(self, a_shard, b, group, **kw):
        return self.ag.all_gather_matmul(a_shard, b, group, **kw)

    def matmul_reduce_scatter(self, a, b, group, **kw):
        return self.rs.matmul_reduce_scatter(a, b, group, **kw)

    def matmul_reduce_scatter_start(self, a, b, group, **kw):
        return self.rs.matmul_reduce_scatter_start(a, b, group, **kw)

    def all_gather(self, x, group, *, out=None):
        return self.nccl.all_gather(x, group, out=out)

    def all_gather_start(self, x, group, *, out=None):
        return self.nccl.all_gather_start(x, group, out=out)

    def reduce_scatter(self, x, group, *, out=None):
        return self.nccl.reduce_scatter(x, group, out=out)


def choose_auto(fused: TPOverlapBackend, nccl: TPOverlapBackend, a, b, tp: int, op: Optional[str] = None,
                *, log: bool = True):
    """``fused``, ``nccl`` or an :class:`AutoDispatch` for ``a @ b`` at TP size ``tp``; ``log``:
    whether this rank says why where the choice is not a table's fused one (the group's first
    rank does)."""
    rows, k = a.shape[0], b.shape[0]
    n = b.shape[1]
    key = (op, rows, k, n, a.dtype, tp, a.device, id(fused), id(nccl))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if op is not None:
        from megatron_flux.tuning.keys import normalize_op

        out = fused if _decide(normalize_op(op), rows, k, n, a.dtype, tp, a.device, log) else nccl
    else:
        ag = _decide("ag", rows, k, n, a.dtype, tp, a.device, log)
        rs = _decide("rs", rows, k, n, a.dtype, tp, a.device, log)
        out = (fused if ag else nccl) if ag == rs else AutoDispatch(fused, nccl, ag, rs)
    return remember(_CACHE, key, out)  # variable shapes: started over, not grown


def clear_cache() -> None:
    """Forget :func:`choose_auto`'s answers (called when the tables' decisions change)."""
    _CACHE.clear()


on_decisions_change(clear_cache)
