"""Runtime answers from the tables: the kernel config for a shape, and fused-vs-NCCL.

Both are cached per full key, so after the first call of a shape a lookup is one dict access.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple, Union

from megatron_flux.options import ENV, FluxOptions, get_options, on_options_change
from megatron_flux.tuning.device import device_identity
from megatron_flux.tuning.keys import ShapeKey, dtype_key, normalize_gpu_name, normalize_op
from megatron_flux.tuning.registry import get_index

DeviceLike = Union[object, Tuple[str, int]]

_DECISIONS: Dict[tuple, Optional[bool]] = {}
_LOCK = threading.Lock()

#: ``auto`` takes the fused kernel only where the table measured it at least this fraction
#: faster than NCCL: the same NCCL+cuBLAS op measured up to 8 % apart between two runs on the
#: 2xH200 box, so a smaller measured win is as likely noise as gain, and "never slower than
#: NCCL" comes first. ``FluxOptions.auto_margin`` (``$MEGATRON_FLUX_AUTO_MARGIN``) sets it
#: (0 = any measured win).
DEFAULT_AUTO_MARGIN = FluxOptions.auto_margin
ENV_AUTO_MARGIN = ENV["auto_margin"]

#: ``auto`` without a table entry: fused from this many global rows (``m_total``) up.
UNKNOWN_MIN_FUSED_M = 1024

_listeners: List[Callable[[], None]] = []


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
    """Whether the table says the fused kernel beats NCCL for this call.

    ``m`` is the global row count (``m_total``), ``n``/``k`` the per-rank weight shape (see
    :mod:`.keys`). ``True`` where the nearest bucket's measured ``flux_ms`` is at most
    ``(1 - auto_margin()) * nccl_ms``; ``False`` where it is not; ``None`` when unknown (no entry for this GPU/TP/dtype/
    op/n/k, or the entry lacks either time, or ``dtype`` is not one the tables know).
    Cached per argument tuple.
    """
    margin = auto_margin()
    ck = (op, m, n, k, str(dtype), tp, margin,
          device if isinstance(device, tuple) else _device_cache_key(device))
    try:
        return _DECISIONS[ck]
    except KeyError:
        pass
    try:
        hit = lookup_entry(op, m, n, k, dtype, tp, device)
    except ValueError as exc:
        from megatron_flux.tuning.schema import TuningFileError

        if isinstance(exc, TuningFileError):
            raise
        hit = None  # a dtype the tables have no key for: unknown
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


def decide(op: str, m_total: int, n: int, k: int, dtype, tp: int, device) -> Tuple[bool, bool]:
    """``(fused?, from the table?)`` for one op and global row count: the table entry (with the
    margin) where one exists, else fused from :data:`UNKNOWN_MIN_FUSED_M` rows."""
    d = prefer_fused(op, m_total, n, k, dtype, tp, device)
    if d is None:
        return m_total >= UNKNOWN_MIN_FUSED_M, False
    return d, True


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
        listeners = list(_listeners)
    for listener in listeners:
        listener()


on_options_change(lambda _options: clear_caches())


class TableConfigProvider:
    """``FluxBackend(config_provider=TableConfigProvider())``: the table's GemmConfig at the
    nearest m-bucket, else :func:`~megatron_flux.kernels.config.default_config`.

    ``FluxBackend.config`` caches the answer per shape, and passes ``dtype``, ``tp`` and
    ``device`` because this provider sets ``accepts_context``; a call without them (a caller that
    does not know the device) gets the heuristic default.
    """

    accepts_context = True

    def __call__(self, op: str, m_total: int, n: int, k: int, *, dtype=None, tp=None, device=None):
        from megatron_flux.kernels.config import default_config

        if dtype is not None and tp is not None and device is not None:
            try:
                hit = lookup_entry(op, m_total, n, k, dtype, tp, device)
            except ValueError as exc:
                from megatron_flux.tuning.schema import TuningFileError

                if isinstance(exc, TuningFileError):
                    raise
                hit = None
            if hit is not None:
                return hit[0].config
        return default_config(op, m_total, n, k, tp=tp)
