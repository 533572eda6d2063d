"""Every runtime setting of megatron-flux, in one object.

:class:`FluxOptions` is built once, from Megatron's arguments (:meth:`FluxOptions.from_args`, which
:func:`megatron_flux.arguments.validate_flux_args` installs) or, for code that builds models
itself, from keyword arguments; the environment variables below are only its defaults, read
once by :meth:`FluxOptions.from_env`. The backends take the object they are built with, and
:func:`set_options` hands a new one to the backends already built, so no setting travels through
``os.environ`` at run time.

========================  ====================================  ==========================
field                     environment default                   meaning
========================  ====================================  ==========================
``column_dgrad``          ``MEGATRON_FLUX_COLUMN_DGRAD``         column backward's input
                                                                 gradient: ``nccl`` (cuBLAS,
                                                                 then NCCL's reduce-scatter
                                                                 beside the wgrad), ``fused``,
                                                                 ``copy_engine``
``column_regather``       ``MEGATRON_FLUX_COLUMN_REGATHER``      the column backward's
                                                                 re-gather of its input when
                                                                 it was not kept: ``nccl``
                                                                 (asynchronous all-gather) or
                                                                 ``copy_engine``
``reserved_sms``          ``MEGATRON_FLUX_RESERVED_SMS``         SMs the persistent grids leave
                                                                 free for other kernels
``max_spins``             ``MEGATRON_FLUX_MAX_SPINS``            polls before a wait gives up
``error_check_interval``  ``MEGATRON_FLUX_ERROR_CHECK_INTERVAL``  calls between reads of the
                                                                 device error word
``direct_launch``         ``MEGATRON_FLUX_DIRECT_LAUNCH``        launch compiled kernels past
                                                                 Triton's argument binding
``host_descriptors``      ``MEGATRON_FLUX_HOST_DESCRIPTORS``     encode A's and B's TMA
                                                                 descriptors on the host
``auto_margin``           ``MEGATRON_FLUX_AUTO_MARGIN``          ``auto`` takes a fused kernel
                                                                 only where a table measured it
                                                                 this fraction faster than NCCL
``capture``               ``MEGATRON_FLUX_CAPTURE``              fused calls inside a CUDA graph
                                                                 capture run fused (on
                                                                 workspaces reserved for
                                                                 graphs); 0: they run on NCCL
``allow_several_queues``  ``MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES``  run fused also where
                                                                 ``CUDA_DEVICE_MAX_CONNECTIONS
                                                                 =1`` is not in effect on
                                                                 every rank (a grid spinning on
                                                                 its peers can then deadlock
                                                                 beside another rank-spanning
                                                                 kernel); 0: such a group runs
                                                                 NCCL, with one log line
========================  ====================================  ==========================
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable, List, Mapping, Optional

__all__ = [
    "COLUMN_DGRAD_CHOICES",
    "COLUMN_REGATHER_CHOICES",
    "ENV",
    "FluxOptions",
    "get_options",
    "on_options_change",
    "set_options",
]

#: the column backward's input gradient, the first the default
COLUMN_DGRAD_CHOICES = ("nccl", "fused", "copy_engine")
#: the column backward's re-gather (without a kept gathered input), the first the default: NCCL's
#: asynchronous all-gather needs no spinning wait on the caller's stream
COLUMN_REGATHER_CHOICES = ("nccl", "copy_engine")

#: field -> environment variable holding its default
ENV = {
    "column_dgrad": "MEGATRON_FLUX_COLUMN_DGRAD",
    "column_regather": "MEGATRON_FLUX_COLUMN_REGATHER",
    "reserved_sms": "MEGATRON_FLUX_RESERVED_SMS",
    "max_spins": "MEGATRON_FLUX_MAX_SPINS",
    "error_check_interval": "MEGATRON_FLUX_ERROR_CHECK_INTERVAL",
    "direct_launch": "MEGATRON_FLUX_DIRECT_LAUNCH",
    "host_descriptors": "MEGATRON_FLUX_HOST_DESCRIPTORS",
    "auto_margin": "MEGATRON_FLUX_AUTO_MARGIN",
    "capture": "MEGATRON_FLUX_CAPTURE",
    "allow_several_queues": "MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES",
}


@dataclasses.dataclass(frozen=True)
class FluxOptions:
    """The settings the backends and kernels run with (see the module docstring). Invalid values
    raise ``ValueError`` naming the field (and, when read from the environment, the variable)."""

    column_dgrad: str = COLUMN_DGRAD_CHOICES[0]
    column_regather: str = COLUMN_REGATHER_CHOICES[0]
    reserved_sms: int = 0
    max_spins: int = 1 << 25
    error_check_interval: int = 16
    direct_launch: bool = True
    host_descriptors: bool = True
    auto_margin: float = 0.02
    capture: bool = True
    allow_several_queues: bool = False

    def __post_init__(self) -> None:
        _check_choice("column_dgrad", self.column_dgrad, COLUMN_DGRAD_CHOICES)
        _check_choice("column_regather", self.column_regather, COLUMN_REGATHER_CHOICES)
        for name in ("reserved_sms", "max_spins", "error_check_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"megatron-flux option {name}: expected an int, got {value!r}")
        if self.reserved_sms < 0:
            raise ValueError(f"megatron-flux option reserved_sms: must be >= 0, got {self.reserved_sms}")
        if self.max_spins < 1 or self.error_check_interval < 1:
            raise ValueError("megatron-flux options max_spins and error_check_interval must be >= 1")
        if not 0.0 <= float(self.auto_margin) < 1.0:
            raise ValueError(f"megatron-flux option auto_margin: expected a number in [0, 1), "
                             f"got {self.auto_margin!r}")

    def replace(self, **changes: Any) -> "FluxOptions":
        """A copy with ``changes`` (``None`` values leave a field as it is)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "FluxOptions":
        """The defaults, overridden by the ``MEGATRON_FLUX_*`` variables that are set."""
        environ = os.environ if environ is None else environ
        values = {}
        for name, var in ENV.items():
            raw = environ.get(var, "")
            if raw == "":
                continue
            try:
                values[name] = _PARSE[name](raw)
                cls(**{name: values[name]})
            except ValueError as exc:
                raise ValueError(f"${var}={raw!r}: {exc}") from None
        return cls(**values)

    @classmethod
    def from_args(cls, args: Any, base: Optional["FluxOptions"] = None) -> "FluxOptions":
        """``base`` (default :meth:`from_env`) with the ``--flux-*`` flags that were given."""
        base = cls.from_env() if base is None else base
        return base.replace(column_dgrad=getattr(args, "flux_column_dgrad", None),
                            column_regather=getattr(args, "flux_column_regather", None))


def _check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"megatron-flux option {name}: must be one of {choices}, got {value!r}")


def _parse_bool(raw: str) -> bool:
    if raw in ("1", "0"):
        return raw == "1"
    raise ValueError(f"must be 0 or 1, got {raw!r}")


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def _parse_float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None


_PARSE: dict = {
    "column_dgrad": str,
    "column_regather": str,
    "reserved_sms": _parse_int,
    "max_spins": _parse_int,
    "error_check_interval": _parse_int,
    "direct_launch": _parse_bool,
    "host_descriptors": _parse_bool,
    "auto_margin": _parse_float,
    "capture": _parse_bool,
    "allow_several_queues": _parse_bool,
}

_LOCK = threading.Lock()
_current: Optional[FluxOptions] = None
_listeners: List[Callable[[FluxOptions], None]] = []


def get_options() -> FluxOptions:
    """The options in effect: the last :func:`set_options`, else :meth:`FluxOptions.from_env`
    (read once)."""
    global _current
    if _current is None:
        with _LOCK:
            if _current is None:
                _current = FluxOptions.from_env()
    return _current


def set_options(options: Optional[FluxOptions]) -> None:
    """Install ``options`` for this process (``None``: back to the environment's defaults, read
    again on next use) and tell the listeners (the backends already built, cached decisions)."""
    global _current
    if options is not None and not isinstance(options, FluxOptions):
        raise TypeError(f"set_options: expected FluxOptions, got {type(options).__name__}")
    with _LOCK:
        _current = options
        listeners = list(_listeners)
    current = get_options()
    for listener in listeners:
        listener(current)


def on_options_change(listener: Callable[[FluxOptions], None]) -> None:
    """Call ``listener(new_options)`` after every :func:`set_options`."""
    with _LOCK:
        _listeners.append(listener)
