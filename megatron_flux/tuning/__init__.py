"""Per-shape kernel settings and fused-vs-NCCL choice from measured tuning tables.

* :mod:`.keys`     key fields, GPU-name normalisation, the nearest-m-bucket rule (log2 space)
* :mod:`.schema`   the versioned JSON format, validation (errors name file and field), I/O
* :mod:`.registry` where tables come from (``--flux-config``, ``$MEGATRON_FLUX_CONFIG``, the
                   user cache, the shipped ``megatron_flux/tuning/tables/*.json``), lookup,
                   stale tables (measured with other kernels)
* :mod:`.provider` ``TableConfigProvider`` (``FluxBackend``'s default), ``decide`` (``auto``'s
                   choice and where it came from) and :func:`prefer_fused`
* :mod:`.estimate` shapes no table lists: the nearest entries' config and estimated choice,
                   and the size rule
* :mod:`.device`   a device's table identity (GPU name, SM count)

This package only reads tables; the tools that write them (``megatron-flux tune``, confirm,
adopt, from a benchmark) are :mod:`megatron_flux.tools.tune`. ``auto``'s use of the decisions is
:mod:`megatron_flux.backends.auto`.
"""

from __future__ import annotations

from megatron_flux.tuning.keys import ShapeKey, dtype_key, nearest_bucket, normalize_gpu_name
from megatron_flux.tuning.provider import TableConfigProvider, lookup_entry, prefer_fused
from megatron_flux.tuning.registry import (
    ENV_FILES,
    SHIPPED_DIR,
    get_index,
    shipped_table_files,
    use_table_files,
)
from megatron_flux.tuning.schema import (
    FORMAT,
    VERSION,
    Entry,
    Table,
    TuningFileError,
    load_table,
    validate_table,
    write_table,
)


def reset() -> None:
    """Forget installed tables and every cached lookup and decision (tests, a new config)."""
    from megatron_flux.tuning import registry

    registry.reset()  # also drops the cached decisions


__all__ = [
    "ENV_FILES", "FORMAT", "SHIPPED_DIR", "VERSION", "Entry", "ShapeKey", "Table",
    "TableConfigProvider", "TuningFileError", "dtype_key", "get_index", "load_table",
    "lookup_entry", "nearest_bucket", "normalize_gpu_name", "prefer_fused", "reset",
    "shipped_table_files", "use_table_files", "validate_table", "write_table",
]
