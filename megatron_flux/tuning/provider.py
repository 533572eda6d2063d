"""Runtime answers from the tables: the kernel config for a shape, and fused-vs-NCCL.

Both are cached per full key, so after the first call of a shape a lookup is one dict access.
Shapes no table lists get both from :mod:`.estimate` (the nearest measured entries), else the
heuristic default config and the size rule.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from megatron_flux.options import ENV, FluxOptions, get_options, on_options_change
from megatron_flux.tuning import estimate
from megatron_flux.tuning.device import device_identity
from megatron_flux.tuning.keys import ShapeKey, dtype_key, normalize_gpu_name, normalize_op
from megatron_flux.tuning.registry import get_index

DeviceLike = Union[object, Tuple[str, int]]

_DECISIONS: Dict[tuple, object] = {}
_ESTIMATORS: Dict[tuple, Tuple[estimate.Estimator, List[estimate.Point]]] = {}
_LOCK = threading.Lock()

#: ``auto`` takes the fused kernel only where the table measured it at least this fraction
#: faster than NCCL: the same NCCL+cuBLAS op measured up to 8 % apart between two runs on the
#: 2xH200 box, so a smaller measured win is as likely noise as gain, and "never slower than
#: NCCL" comes first. ``FluxOptions.auto_margin`` (``$MEGATRON_FLUX_AUTO_MARGIN``) sets it
#: (0 = any measured win).
DEFAULT_AUTO_MARGIN = FluxOptions.auto_margin
ENV_AUTO_MARGIN = ENV["auto_margin"]

#: A table entry decides a call whose m is at most this many octaves from the entry's bucket;
#: farther (a table tuned at one m, a call at another), the estimate, which weighs that entry
#: by its distance among the others, decides.
TABLE_REACH_OCTAVES = 1.0

_listeners: List[Callable[[], None]] = []


class Decision(NamedTuple):
    """``auto``'s choice for one call shape: ``fused``, where it came from (``source``: ``"table"``,
    ``"rule"``, ``"estimate"`` or ``"size rule"``) and why, in words."""

    fused: bool
    source: str
    why: str


def auto_margin() -> float:
    """The margin in effect (the installed :class:`~megatron_flux.options.FluxOptions`)."""
    return get_options().auto_margin


def _identity(device: DeviceLike) -> Tuple[str, int]:
    """``(normalised GPU name, SMs)``; ``device`` is a CUDA device or an explicit ``(name, sms)``."""
    if isinstance(device, tuple) and len(device) == 2 and isinstance(device[0], str):
        return normalize_gpu_name(device[0]), int(device[1])
    gpu, sms, _ = device_identity(device)
    return gpu, sms


def shape_key(op: str, n: int, k: int, dtype, tp: int, device: DeviceLike) -> ShapeKey:
    gpu, sms = _identity(device)
    return ShapeKey(gpu, sms, int(tp), dtype_key(dtype), normalize_op(op), int(n), int(k))


def lookup_entry(op: str, m: int, n: int, k: int, dtype, tp: int, device: DeviceLike):
    """``(Entry, Table)`` at the nearest m-bucket for this key, or ``None`` (unknown GPU/shape)."""
    return get_index().lookup(shape_key(op, n, k, dtype, tp, device), int(m))


def prefer_fused(op: str, m: int, n: int, k: int, dtype, tp: int, device: DeviceLike) -> Optional[bool]:
    """Whether a current table says the fused kernel beats NCCL for this call.

    ``m`` is the global row count (``m_total``), ``n``/``k`` the per-rank weight shape (see
    :mod:`.keys`). ``True`` where the nearest bucket's measured ``flux_ms`` is at most
    ``(1 - auto_margin()) * nccl_ms``; ``False`` where it is not; ``None`` when unknown (no
    entry of a current table for this GPU/TP/dtype/op/n/k, or the entry lacks either time, or
    ``dtype`` is not one the tables know). Stale tables' times are never used. Cached per
    argument tuple.
    """
    margin = auto_margin()
    ck = (op, m, n, k, str(dtype), tp, margin,
          device if isinstance(device, tuple) else _device_cache_key(device))
    try:
        return _DECISIONS[ck]
    except KeyError:
        pass
    hit = _current_entry(op, m, n, k, dtype, tp, device)
    decision = None
    if hit is not None:
        e = hit[0]
        if e.flux_ms is not None and e.nccl_ms is not None:
            decision = e.flux_ms <= (1.0 - margin) * e.nccl_ms
    with _LOCK:
        _DECISIONS[ck] = decision
    return decision


def _device_cache_key(device) -> tuple:
    t = getattr(device, "type", None)
    return (t, getattr(device, "index", None)) if t is not None else (str(device),)


def _keyed_dtype(dtype) -> bool:
    """Whether the tables have a key for ``dtype`` (else every lookup for it misses: the
    callers fall back instead of raising; a broken table file still raises)."""
    try:
        dtype_key(dtype)
    except ValueError:
        return False
    return True


def _current_entry(op, m, n, k, dtype, tp, device):
    """``(Entry, Table)`` of a current table at the nearest bucket, or None (also for a dtype
    the tables have no key for)."""
    if not _keyed_dtype(dtype):
        return None
    return get_index().lookup(shape_key(op, n, k, dtype, tp, device), int(m), current=True)


def _points(key: ShapeKey, current: bool) -> List[estimate.Point]:
    return [estimate.Point(e.m, e.n, e.k,
                           e.flux_ms / e.nccl_ms if e.flux_ms and e.nccl_ms else None,
                           e.config, t.path)
            for e, t in get_index().entries(key, current=current)]


def estimator(op: str, dtype, tp: int, device: DeviceLike) -> Tuple[estimate.Estimator, List[estimate.Point]]:
    """``(Estimator of the current entries, every entry as a point)`` of this machine and op
    (cached until the tables change)."""
    key = shape_key(op, 1, 1, dtype, tp, device)
    ck = tuple(key[:5])
    hit = _ESTIMATORS.get(ck)
    if hit is None:
        hit = (estimate.Estimator(_points(key, current=True)), _points(key, current=False))
        with _LOCK:
            _ESTIMATORS[ck] = hit
    return hit


def _listed(machines, dtype, tp: int, device) -> bool:
    """Whether ``(GPU, TP, dtype)`` is one of ``machines`` (:data:`.estimate.PINGPONG_FUSED`:
    the ping-pong GEMM+RS rule's config ran faster than NCCL wherever it ran there;
    :data:`.estimate.AG_ROWS_FUSED`: so did every AG+GEMM from 1024 rows per rank)."""
    if not _keyed_dtype(dtype):
        return False
    return (_identity(device)[0], int(tp), dtype_key(dtype)) in machines


def decide(op: str, m_total: int, n: int, k: int, dtype, tp: int, device) -> Decision:
    """``auto``'s :class:`Decision` for one op and global row count: a current table's entry
    (with the margin) where one lies within :data:`TABLE_REACH_OCTAVES` of ``m_total``; else
    fused for a GEMM+RS on a (GPU, TP, dtype) of :data:`.estimate.PINGPONG_FUSED` whose config
    is the ping-pong rule's, or an AG+GEMM on one of :data:`.estimate.AG_ROWS_FUSED` that
    :func:`.estimate.ag_rows_rule` takes (source ``"rule"``); else the estimate from the nearest
    current entries (:mod:`.estimate`), else the size rule. Cached."""
    margin = auto_margin()
    op = normalize_op(op)
    ck = ("decide", op, m_total, n, k, str(dtype), tp, margin,
          device if isinstance(device, tuple) else _device_cache_key(device))
    hit = _DECISIONS.get(ck)
    if hit is not None:
        return hit
    out = None
    entry = _current_entry(op, m_total, n, k, dtype, tp, device)
    if entry is not None:
        e = entry[0]
        near = abs(math.log2(max(m_total, 1) / e.m)) <= TABLE_REACH_OCTAVES + 1e-9
        if near and e.flux_ms is not None and e.nccl_ms is not None:
            fused = e.flux_ms <= (1.0 - margin) * e.nccl_ms
            out = Decision(fused, "table", f"table ({e.flux_ms / e.nccl_ms:.3f} at m={e.m}, "
                                           f"margin {margin:.0%})")
    if out is None and op == "rs" and _listed(estimate.PINGPONG_FUSED, dtype, tp, device):
        where = kernel_config(op, m_total, n, k, dtype, tp, device)[1]
        if where.startswith(estimate.PINGPONG_SOURCE):
            out = Decision(True, "rule", f"the {estimate.PINGPONG_SOURCE} rule's config, faster "
                                         f"than NCCL wherever it ran on this GPU at TP {tp}")
    if out is None and op == "ag" and _listed(estimate.AG_ROWS_FUSED, dtype, tp, device):
        if estimate.ag_rows_rule(estimator(op, dtype, tp, device)[0].points, m_total, n, k, tp):
            out = Decision(True, "rule", f"AG+GEMM from {estimate.AG_RULE_ROWS_PER_RANK} rows per "
                                         f"rank, within the measured entries' sizes: faster "
                                         f"than NCCL wherever it ran on this GPU at TP {tp}")
    if out is None and _keyed_dtype(dtype):
        est = estimator(op, dtype, tp, device)[0].decide(m_total, n, k, margin)
        if est is not None:
            out = Decision(est.fused, "estimate", est.why(1.0 - margin))
    if out is None:
        out = Decision(estimate.size_rule(op, m_total, tp), "size rule", estimate.size_rule_why(op, tp))
    with _LOCK:
        _DECISIONS[ck] = out
    return out


def kernel_config(op: str, m_total: int, n: int, k: int, dtype, tp: int, device,
                  wave_aware: bool = True):
    """``(GemmConfig, where it came from)`` for one call: the table entry of this exact shape
    (nearest bucket, stale tables included), else the nearest entry's that can run it, its
    stream-K tail on, or another current entry's whose tiles fill the SMs' waves better
    (:func:`.estimate.wave_aware_config`), or for GEMM+RS the ping-pong Gluon kernel
    (:func:`.estimate.pingpong_rs_config`); ``wave_aware=False``: the nearest entry's always,
    as before those rules, for A/B runs; else ``default_config``."""
    from megatron_flux.kernels.config import default_config

    op = normalize_op(op)
    if not _keyed_dtype(dtype):
        return default_config(op, m_total, n, k, tp=tp), "default"
    hit = lookup_entry(op, m_total, n, k, dtype, tp, device)
    if hit is not None:
        return hit[0].config, f"table (m={hit[0].m})"
    current, every = estimator(op, dtype, tp, device)
    return estimate.unlisted_config(op, every, m_total, n, k, tp, _identity(device)[1],
                                    candidates=current.points if wave_aware else (),
                                    pingpong=wave_aware)


def on_decisions_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever the cached decisions are dropped (new tables or margin), so
    caches built on them (the backend registry's) are dropped too. The tables know nothing of
    their users: this is how the dependency points from the backends to the tables."""
    with _LOCK:
        _listeners.append(listener)


def clear_caches() -> None:
    """Drop the cached decisions and tell :func:`on_decisions_change`'s listeners."""
    with _LOCK:
        _DECISIONS.clear()
        _ESTIMATORS.clear()
        listeners = list(_listeners)
    for listener in listeners:
        listener()


on_options_change(lambda _options: clear_caches())


class TableConfigProvider:
    """``FluxBackend(config_provider=TableConfigProvider())``: :func:`kernel_config`'s config (the
    table's at the nearest m-bucket, else the nearest measured entry's that can run the shape,
    else :func:`~megatron_flux.kernels.config.default_config`).

    ``FluxBackend.config`` caches the answer per shape, and passes ``dtype``, ``tp`` and
    ``device`` because this provider sets ``accepts_context``; a call without them (a caller that
    does not know the device) gets the heuristic default.
    """

    accepts_context = True

    def __call__(self, op: str, m_total: int, n: int, k: int, *, dtype=None, tp=None, device=None):
        from megatron_flux.kernels.config import default_config

        if dtype is not None and tp is not None and device is not None:
            return kernel_config(op, m_total, n, k, dtype, tp, device)[0]
        return default_config(op, m_total, n, k, tp=tp)
