"""The backend registry, and ``resolve_backend``: which backend runs one call.

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

from megatron_flux.backends.base import TPOverlapBackend, remember
from megatron_flux.options import on_options_change
from megatron_flux.tuning.provider import on_decisions_change

logger = logging.getLogger("megatron_flux")

BackendOrFactory = Union[TPOverlapBackend, Callable[[], TPOverlapBackend]]

_REGISTRY: Dict[str, BackendOrFactory] = {}
#: resolve_backend's answers per call signature (see there); cleared whenever a backend is
#: registered or the tuning tables or their caches change (clear_resolution_cache)
_RESOLVED: Dict[tuple, TPOverlapBackend] = {}
_INSTANCES: Dict[str, TPOverlapBackend] = {}
_LOCK = threading.Lock()
_LOGGED: set = set()

#: A layer setting, not a backend: the Flux linears run megatron-core's own sequence-parallel
#: code (the parent class's NCCL-then-cuBLAS path, byte for byte), so one model can A/B the
#: plugin against stock Megatron in the same process (``benchmarks/interleave_report.py``).
MEGATRON_PASSTHROUGH = "megatron"

#: names accepted by ``flux_backend=`` / ``--flux-backend``
BACKEND_CHOICES = ("auto", "flux", "nccl", MEGATRON_PASSTHROUGH)

#: per thread: whether this thread has its cuBLAS handle (see :func:`_ensure_blas_handle`)
_TLS = threading.local()


def register_backend(name: str, impl: BackendOrFactory, *, override: bool = False) -> None:
    """Register ``impl`` under ``name``. Re-registering a name needs ``override=True``.

    ``impl`` is a :class:`~megatron_flux.backends.base.TPOverlapBackend` or a zero-argument
    callable returning one (a subclass, say); anything else raises ``TypeError`` here, rather
    than at the first forward that names the backend.
    """
    if not isinstance(name, str):
        raise TypeError(f"register_backend: the name must be a str, got {type(name).__name__}")
    if not (isinstance(impl, TPOverlapBackend) or callable(impl)):
        raise TypeError(
            f"register_backend({name!r}, ...): expected a TPOverlapBackend instance or a "
            f"zero-argument factory returning one, got {type(impl).__name__} {impl!r}"
        )
    if not name or name in ("auto", MEGATRON_PASSTHROUGH):
        raise ValueError(
            f"invalid backend name {name!r}: 'auto' and {MEGATRON_PASSTHROUGH!r} are layer "
            "settings, not backends"
        )
    with _LOCK:
        if name in _REGISTRY and not override:
            raise ValueError(f"backend {name!r} is already registered (pass override=True)")
        _REGISTRY[name] = impl
        _INSTANCES.pop(name, None)
        _RESOLVED.clear()


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


def clear_resolution_cache() -> None:
    """Forget :func:`resolve_backend`'s cached answers (new backends, tables or margins)."""
    _RESOLVED.clear()


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
    dtype and shape (nearest m-bucket), it takes ``nccl`` (:mod:`megatron_flux.backends.auto`;
    ``op`` = ``"ag"``/``"rs"`` when the caller knows which op follows, else both are looked up).
    Every TP rank sees the same tables and shapes, so all ranks choose alike.

    While a CUDA graph is being captured the choice is the same as outside it, except that a
    backend that cannot be replayed (``capturable`` False: the fused one with
    ``options.capture`` off) gives way to ``nccl``, with one log line; every rank of a TP group
    captures the same calls, so they still choose alike. Outside capture, the first
    call on each thread creates that thread's cuBLAS handle, so that a capture never has to
    (``cublasCreate`` fails inside a capture; the fused kernels need no cuBLAS, so a thread that
    ran only them eagerly would otherwise meet cuBLAS for the first time in the capture).

    The answer depends only on the operands' shapes, strides, dtypes and devices, the current
    CUDA device, the group and whether the stream is capturing, so it is cached per those (and dropped when the
    tables, the options or the registry change): a training step asks the same few questions
    hundreds of times, and the layers' host cost per call is what bounds host-heavy steps.
    """
    capturing, current = False, None
    if a.is_cuda:
        capturing = torch.cuda.is_current_stream_capturing()
        current = torch.cuda.current_device()
        if not capturing and not getattr(_TLS, "blas", False):
            _ensure_blas_handle(a.device)
    key = (requested, op, a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype,
           b.device, current, group, capturing)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    backend = _resolve_uncached(requested, a, b, group, op)
    if capturing and not backend.capturable:
        log_once(f"capture:{backend.name}",
                 f"megatron-flux: {backend.name!r} is not captured into CUDA graphs; the calls "
                 "inside a capture run on 'nccl' (NCCL collectives and cuBLAS, which graphs "
                 "replay)")
        backend = get_backend("nccl")
    return remember(_RESOLVED, key, backend)


def expect_cuda_graphs() -> None:
    """CUDA graphs will capture this process's fused calls: from now on the fused backend's
    eager calls also reserve the workspaces their captured twins need
    (:meth:`~megatron_flux.backends.flux.FluxBackend.expect_capture`), so a capture that
    follows them runs fused. A no-op where the fused backend is unavailable. The Flux linears
    call it when their config enables megatron-core's CUDA graphs; call it yourself before the
    eager warm-up of ``torch.cuda.make_graphed_callables`` or ``torch.cuda.graph``."""
    if "flux" in available_backends():
        get_backend("flux").expect_capture()


def poll_fused_errors() -> None:
    """Raise a timed-out fused wait reported since the last poll (the fused backend's
    :meth:`~megatron_flux.backends.flux.FluxBackend.poll_errors`); a no-op before the backend
    is built. Jobs whose fused calls replay inside CUDA graphs call it once per step."""
    with _LOCK:
        fused = _INSTANCES.get("flux")
    if fused is not None and hasattr(fused, "poll_errors"):
        fused.poll_errors()


def check_fused_errors() -> None:
    """Raise a timed-out fused wait that any kernel of this process reported so far: the error
    words are copied to the host and each backend synchronises the current stream once (so it
    waits for the work queued on it; on an idle H200 39 us for a job's three words, 58 us read
    one by one: ``benchmarks/experiments/pre_step_check_cost.py``). A no-op before the fused
    backend is built, and during a CUDA graph capture (nothing may synchronise there). The
    Megatron integration runs it before every optimizer step, so a step never applies gradients
    computed from a timed-out wait."""
    with _LOCK:  # "flux", and the fused variants a job may rotate (--flux-interleave-variants)
        fused = [b for b in _INSTANCES.values() if hasattr(b, "check_errors")]
    if not fused or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    for backend in fused:
        backend.check_errors(sync=True)


def _ensure_blas_handle(device: torch.device) -> None:
    """Create this thread's cuBLAS handle for ``device`` now, outside any capture."""
    with torch.cuda.device(device):
        torch.cuda.current_blas_handle()
    _TLS.blas = True


def _resolve_uncached(requested, a, b, group, op) -> TPOverlapBackend:
    if requested == MEGATRON_PASSTHROUGH:
        raise ValueError(
            f"flux_backend={MEGATRON_PASSTHROUGH!r} is a layer setting (the Flux linears run "
            "megatron-core's own code); megatron_flux.ops has no megatron path: pass 'auto', "
            "'flux', 'nccl' or a registered backend"
        )
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
                from megatron_flux.backends.auto import choose_auto as _choose_auto
            return _choose_auto(fused, get_backend("nccl"), a, b, group.size(), op, log=group.rank() == 0)
    log_once(f"auto:{reason}", f"megatron-flux: flux_backend='auto' uses 'nccl' because {reason}")
    return get_backend("nccl")


_BUILTIN_DONE = False
_choose_auto = None  # megatron_flux.backends.auto.choose_auto, imported on first "auto" fused call


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


def _forget_resolutions() -> None:
    _RESOLVED.clear()


def _apply_options(options) -> None:
    """New process options: the built backends run with them from their next call, and the
    cached answers (which depend on the ``auto`` margin) are dropped."""
    with _LOCK:
        instances = list(_INSTANCES.values())
    for inst in instances:
        if hasattr(inst, "set_options"):
            inst.set_options(options)
    _forget_resolutions()


on_options_change(_apply_options)
on_decisions_change(_forget_resolutions)
