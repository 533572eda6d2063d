"""A fused backend whose kernel settings are the tables' with some fields changed.

For A/B measurements of a config change: the op benchmark's ``flux_variant`` method, and
training jobs that rotate the fused backend against such a variant
(``examples/pretrain_support.py``, ``--flux-interleave-variants``), where the step, not an op
in a loop, decides. The variant is another :class:`~.backend.FluxBackend` object, with its
own workspaces and streams.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

from megatron_flux.tuning.keys import normalize_op


def check_variant_fields(fields: Dict[str, Any]) -> Dict[str, Any]:
    """``fields`` if every name is a ``GemmConfig`` field (a removed knob only at the value it
    always had) and the default config with them changed is valid; else ``ValueError``."""
    from megatron_flux.kernels.config import GemmConfig

    if not isinstance(fields, dict):
        raise ValueError(f"config changes must be a JSON object of GemmConfig fields, got {fields!r}")
    GemmConfig.from_dict({**GemmConfig().to_dict(), **fields})
    return dict(fields)


def variant_backend(fields: Dict[str, Any], ops: Optional[Iterable[str]] = None, backend_cls=None):
    """A fused backend whose config for each call is the tables' (``TableConfigProvider``) with
    ``fields`` changed, for the ops in ``ops`` (``"ag"`` / ``"rs"``, or any spelling
    :func:`~megatron_flux.tuning.keys.normalize_op` takes; default both); other ops keep the
    tables' config."""
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.tuning.provider import TableConfigProvider

    fields = check_variant_fields(fields)
    changed = {normalize_op(op) for op in (ops if ops is not None else ("ag", "rs"))}
    table = TableConfigProvider()

    def provider(op, m, n, k, **context):
        cfg = table(op, m, n, k, **context)
        if normalize_op(op) not in changed:
            return cfg
        # (from_dict: the fields may name a removed knob at the value it always had)
        return GemmConfig.from_dict({**cfg.to_dict(), **fields})

    provider.accepts_context = True
    if backend_cls is None:
        from megatron_flux.backends.flux.backend import FluxBackend as backend_cls
    return backend_cls(config_provider=provider)
