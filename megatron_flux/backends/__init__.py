"""Backend registry.

``register_backend(name, impl)`` adds a backend (an instance of
:class:`~megatron_flux.backends.base.TPOverlapBackend`, or a zero-argument factory returning
one, so heavy imports stay lazy); ``get_backend(name)`` returns it. ``"auto"`` is not a
backend but a policy, resolved per call by :func:`resolve_backend`.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_flux.backends.base import TPOverlapBackend

logger = logging.getLogger("megatron_flux")

BackendOrFactory = Union[TPOverlapBackend, Callable[[], TPOverlapBackend]]

_REGISTRY: Dict[str, BackendOrFactory] = {}
_INSTANCES: Dict[str, TPOverlapBackend] = {}
_LOCK = threading.Lock()
_LOGGED: set = set()

#: names accepted by ``flux_backend=`` / ``--flux-backend``
BACKEND_CHOICES = ("auto", "flux", "nccl")


def register_backend(name: str, impl: BackendOrFactory, *, override: bool = False) -> None:
    """Register ``impl`` under ``name``. Re-registering a name needs ``override=True``."""
    if not name or name == "auto":
        raise ValueError(f"invalid backend name {name!r}: 'auto' is a policy, not a backend")
    with _LOCK:
        if name in _REGISTRY and not override:
            raise ValueError(f"backend {name!r} is already registered (pass override=True)")
        _REGISTRY[name] = impl
        _INSTANCES.pop(name, None)


def available_backends() -> Tuple[str, ...]:
    """Names of the registered backends (``"auto"`` excluded)."""
    _ensure_builtin()
    return tuple(sorted(_REGISTRY))


def get_backend(name: str) -> TPOverlapBackend:
    """The backend registered as ``name`` (instantiated on first use)."""
    _ensure_builtin()
    with _LOCK:
        if name in _INSTANCES:
            return _INSTANCES[name]
        if name not in _REGISTRY:
            raise KeyError(
                f"unknown megatron-flux backend {name!r}; registered: {sorted(_REGISTRY)}"
                + (" ('auto' is resolved with resolve_backend)" if name == "auto" else "")
            )
        impl = _REGISTRY[name]
        inst = impl if isinstance(impl, TPOverlapBackend) else impl()
        if not isinstance(inst, TPOverlapBackend):
            raise TypeError(f"backend {name!r} factory returned {type(inst).__name__}")
        _INSTANCES[name] = inst
        return inst


def validate_backend_name(name) -> str:
    """``name`` if it is ``"auto"`` or a backend (built-in or registered), else a clear error."""
    if not isinstance(name, str):
        raise TypeError(f"flux_backend must be a str, got {type(name).__name__}")
    if name in BACKEND_CHOICES or name in available_backends():
        return name
    raise ValueError(
        f"unknown megatron-flux backend {name!r}; choose one of "
        f"{sorted(set(BACKEND_CHOICES) | set(available_backends()))}"
    )


def log_once(key: str, msg: str, level: int = logging.WARNING) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.log(level, msg)


def fused_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the fused backend cannot run on ``device`` at all, or ``None``."""
    if device.type != "cuda":
        return f"tensors are on {device.type}, the fused kernels need CUDA"
    if "flux" not in available_backends():
        return "the fused backend is not registered (triton or torch symmetric memory missing)"
    return None


def resolve_backend(
    requested: str,
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup,
    op: Optional[str] = None,
) -> TPOverlapBackend:
    """Pick the backend for one call.

    ``"nccl"`` and any explicitly named backend are returned as they are; a backend that cannot
    run these operands raises. ``"auto"`` takes the fused backend when it is available and
    supports the operands, else the ``nccl`` reference, logging the reason once per reason; and
    where a tuning table measured the fused kernel slower than ``nccl`` for this GPU, TP size,
    dtype and shape (nearest m-bucket), it takes ``nccl`` (:mod:`megatron_flux.tuning.auto`;
    ``op`` = ``"ag"``/``"rs"`` when the caller knows which op follows, else both are looked up).
    Every TP rank sees the same tables and shapes, so all ranks choose alike.
    """
    if requested != "auto":
        backend = get_backend(requested)
        reason = backend.unsupported_reason(a, b, group)
        if reason is not None:
            raise RuntimeError(f"megatron-flux backend {requested!r} cannot run this op: {reason}")
        return backend
    reason = fused_unavailable_reason(a.device)
    if reason is None:
        fused = get_backend("flux")
        reason = fused.unsupported_reason(a, b, group)
        if reason is None:
            global _choose_auto
            if _choose_auto is None:
                from megatron_flux.tuning.auto import choose_auto as _choose_auto
            return _choose_auto(fused, get_backend("nccl"), a, b, group.size(), op)
    log_once(f"auto:{reason}", f"megatron-flux: flux_backend='auto' uses 'nccl' because {reason}")
    return get_backend("nccl")


_BUILTIN_DONE = False
_choose_auto = None  # megatron_flux.tuning.auto.choose_auto, imported on first "auto" fused call


def _ensure_builtin() -> None:
    """Register the built-in backends lazily (avoids import cycles and CUDA probing at import)."""
    global _BUILTIN_DONE
    if _BUILTIN_DONE:
        return
    _BUILTIN_DONE = True
    from megatron_flux.backends.nccl import NcclBackend

    _REGISTRY.setdefault("nccl", NcclBackend)
    try:
        from megatron_flux.backends.flux import flux_backend_factory_or_reason
    except ImportError as exc:  # triton missing, or torch without symmetric memory
        log_once("flux-import", f"megatron-flux: fused backend unavailable ({exc})", logging.INFO)
        return
    factory, reason = flux_backend_factory_or_reason()
    if factory is not None:
        _REGISTRY.setdefault("flux", factory)
    else:
        log_once("flux-unavailable", f"megatron-flux: fused backend unavailable ({reason})", logging.INFO)


__all__ = [
    "BACKEND_CHOICES",
    "TPOverlapBackend",
    "available_backends",
    "get_backend",
    "log_once",
    "register_backend",
    "resolve_backend",
    "validate_backend_name",
]
