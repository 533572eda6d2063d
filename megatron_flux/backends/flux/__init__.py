"""The fused backend (see :mod:`.backend`)."""

from megatron_flux.backends.flux.backend import FluxBackend, flux_backend_factory_or_reason
from megatron_flux.backends.flux.resources import reserved_sms

__all__ = ["FluxBackend", "flux_backend_factory_or_reason", "reserved_sms"]
