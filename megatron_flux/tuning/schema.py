"""The tuning-table file format (version 1), its validation, and JSON reading/writing.

One file holds the measurements of one ``(GPU, SM count, TP, dtype)``::

    {
      "format": "megatron-flux-tuning",
      "version": 1,
      "gpu": {"name": "NVIDIA H200", "sms": 132},
      "tp": 2,
      "dtype": "bf16",
      "source": "what produced the numbers (a command, or the file they were read from)",
      "kernel_version": 1,                              # optional; absent = 0 (see below)
      "created": "2026-11-22T05:22:18+00:00",          # optional
      "environment": {"torch": "...", "triton": "..."}, # optional, free-form
      "search": {...},                                  # optional, free-form (tuner settings)
      "entries": [
        {"op": "ag", "n": 24576, "k": 12288, "m": 4096,
         "config": {"block_m": 128, ...},   # GemmConfig fields; missing ones: default_config's
         "tuned": true,                     # false: the config was not searched (heuristic)
         "flux_ms": 3.75, "nccl_ms": 3.88,  # medians, communication on; optional (null/absent)
         "notes": {...}}                    # optional, free-form
      ]
    }

Keys are described in :mod:`megatron_flux.tuning.keys`. Validation is strict: every problem is
a :class:`TuningFileError` whose message starts with the file and the field path
(``h200.json: entries[3].config.block_m: ...``), and unknown fields are errors (a typo must
not silently fall back to defaults). A newer ``version`` than this code reads is an error that
says so.

``kernel_version`` is the :data:`~megatron_flux.kernels.version.KERNEL_VERSION` of the kernels
the times were measured with (absent: 0, before versions were recorded). A table of another
version is *stale* (:meth:`Table.stale`): :mod:`.registry` still uses its configs but not its
times.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from megatron_flux.tuning.keys import DTYPES, OPS, ShapeKey, normalize_gpu_name

FORMAT = "megatron-flux-tuning"
VERSION = 1
_TOP_REQUIRED = ("format", "version", "gpu", "tp", "dtype", "source", "entries")
_TOP_OPTIONAL = ("kernel_version", "created", "environment", "search")
_ENTRY_REQUIRED = ("op", "n", "k", "m", "config", "tuned")
_ENTRY_OPTIONAL = ("flux_ms", "nccl_ms", "notes")


class TuningFileError(ValueError):
    """A malformed or mismatched tuning file; the message names the file and the field."""

    def __init__(self, path: str, field_path: str, problem: str):
        self.path, self.field, self.problem = path, field_path, problem
        super().__init__(f"tuning file {path}: field {field_path!r}: {problem}")


@dataclass(frozen=True)
class Entry:
    """One validated table row."""

    op: str
    n: int
    k: int
    m: int
    config: Any  # GemmConfig
    tuned: bool
    flux_ms: Optional[float] = None
    nccl_ms: Optional[float] = None
    notes: Optional[dict] = None


@dataclass
class Table:
    """One validated file."""

    path: str
    gpu_name: str
    gpu: str  # normalised
    sms: int
    tp: int
    dtype: str
    source: str
    entries: List[Entry]
    extra: Dict[str, Any] = field(default_factory=dict)  # kernel_version / created / environment / search

    def shape_key(self, e: Entry) -> ShapeKey:
        return ShapeKey(self.gpu, self.sms, self.tp, self.dtype, e.op, e.n, e.k)

    def describe(self) -> str:
        return f"{self.gpu_name} ({self.sms} SMs), TP={self.tp}, {self.dtype}"

    @property
    def kernel_version(self) -> int:
        """The kernel version its times were measured with (0: not recorded)."""
        return int(self.extra.get("kernel_version", 0))

    @property
    def stale(self) -> bool:
        """Measured with other kernels than this package's (its times no longer decide)."""
        from megatron_flux.kernels.version import KERNEL_VERSION

        return self.kernel_version != KERNEL_VERSION


def _pos_int(path, fld, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise TuningFileError(path, fld, f"must be a positive integer, got {v!r}")
    return v


def _time(path, fld, v) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise TuningFileError(path, fld, f"must be a positive number of milliseconds or null, got {v!r}")
    return float(v)


def _check_keys(path, where, d, required, optional) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise TuningFileError(path, f"{where}{missing[0]}", "missing")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise TuningFileError(path, f"{where}{unknown[0]}", f"unknown field (known: {sorted(set(required) | set(optional))})")


def _config(path, fld, d, op, m, n, k, tp):
    from megatron_flux.kernels.config import (REMOVED_FIELDS, GemmConfig, default_config,
                                              removed_field_problem)

    if not isinstance(d, dict):
        raise TuningFileError(path, fld, f"must be an object of GemmConfig fields, got {type(d).__name__}")
    import dataclasses

    types = {f.name: f.type for f in dataclasses.fields(GemmConfig)}
    d = dict(d)
    for name in [x for x in d if x in REMOVED_FIELDS]:  # older tables: at the value it had
        problem = removed_field_problem(name, d.pop(name))
        if problem is not None:
            raise TuningFileError(path, f"{fld}.{name}", problem)
    for name, v in d.items():
        if name not in types:
            raise TuningFileError(path, f"{fld}.{name}", f"unknown GemmConfig field (known: {sorted(types)})")
        want_bool = isinstance(getattr(GemmConfig(), name), bool)
        if want_bool and not isinstance(v, bool):
            raise TuningFileError(path, f"{fld}.{name}", f"must be true or false, got {v!r}")
        if not want_bool and (isinstance(v, bool) or not isinstance(v, int)):
            raise TuningFileError(path, f"{fld}.{name}", f"must be an integer, got {v!r}")
    # fields an entry does not name keep what it was measured with: entries written before
    # the small-m AG default gathered first ran the per-segment schedule
    base = default_config(op, m, n, k, tp=tp, gather_small_m=False).to_dict()
    if op == "rs":  # entries written before GEMM+RS took stream_k ran without it
        base["stream_k"] = 0
    base.update(d)
    try:
        return GemmConfig.from_dict(base)
    except (ValueError, TypeError) as exc:
        raise TuningFileError(path, fld, f"not a valid GemmConfig: {exc}") from None


def validate_table(obj: Any, path: str = "<table>") -> Table:
    """Validate a parsed JSON object; return the :class:`Table` or raise :class:`TuningFileError`."""
    if not isinstance(obj, dict):
        raise TuningFileError(path, "<root>", f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise TuningFileError(path, "format", f"must be {FORMAT!r}, got {obj.get('format')!r} "
                              "(is this a megatron-flux tuning table, written by `megatron-flux tune`?)")
    ver = obj.get("version")
    if isinstance(ver, bool) or not isinstance(ver, int):
        raise TuningFileError(path, "version", f"must be an integer, got {ver!r}")
    if ver > VERSION:
        raise TuningFileError(path, "version", f"{ver} is newer than this megatron-flux reads ({VERSION}); upgrade megatron-flux")
    if ver < 1:
        raise TuningFileError(path, "version", f"must be >= 1, got {ver}")
    _check_keys(path, "", obj, _TOP_REQUIRED, _TOP_OPTIONAL)
    gpu = obj["gpu"]
    if not isinstance(gpu, dict):
        raise TuningFileError(path, "gpu", f"must be an object {{name, sms}}, got {type(gpu).__name__}")
    _check_keys(path, "gpu.", gpu, ("name", "sms"), ())
    if not isinstance(gpu["name"], str) or not gpu["name"].strip():
        raise TuningFileError(path, "gpu.name", f"must be a non-empty string, got {gpu['name']!r}")
    sms = _pos_int(path, "gpu.sms", gpu["sms"])
    tp = _pos_int(path, "tp", obj["tp"])
    if tp < 2:
        raise TuningFileError(path, "tp", f"must be >= 2 (nothing to overlap at TP=1), got {tp}")
    if obj["dtype"] not in DTYPES:
        raise TuningFileError(path, "dtype", f"must be one of {list(DTYPES)}, got {obj['dtype']!r}")
    if not isinstance(obj["source"], str) or not obj["source"].strip():
        raise TuningFileError(path, "source", "must say where the numbers come from (non-empty string)")
    for name in ("environment", "search"):
        if name in obj and not isinstance(obj[name], dict):
            raise TuningFileError(path, name, f"must be an object, got {type(obj[name]).__name__}")
    kv = obj.get("kernel_version", 0)
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 0:
        raise TuningFileError(path, "kernel_version", f"must be a non-negative integer, got {kv!r}")
    if "created" in obj and not isinstance(obj["created"], str):
        raise TuningFileError(path, "created", f"must be a string, got {obj['created']!r}")
    raw = obj["entries"]
    if not isinstance(raw, list):
        raise TuningFileError(path, "entries", f"must be a list, got {type(raw).__name__}")
    entries: List[Entry] = []
    seen: Dict[Tuple[str, int, int, int], int] = {}
    for i, e in enumerate(raw):
        w = f"entries[{i}]"
        if not isinstance(e, dict):
            raise TuningFileError(path, w, f"must be an object, got {type(e).__name__}")
        _check_keys(path, w + ".", e, _ENTRY_REQUIRED, _ENTRY_OPTIONAL)
        if e["op"] not in OPS:
            raise TuningFileError(path, f"{w}.op", f"must be one of {list(OPS)}, got {e['op']!r}")
        n = _pos_int(path, f"{w}.n", e["n"])
        k = _pos_int(path, f"{w}.k", e["k"])
        m = _pos_int(path, f"{w}.m", e["m"])
        if m % tp:
            raise TuningFileError(path, f"{w}.m", f"{m} rows are not divisible by tp={tp}")
        if not isinstance(e["tuned"], bool):
            raise TuningFileError(path, f"{w}.tuned", f"must be true or false, got {e['tuned']!r}")
        if "notes" in e and e["notes"] is not None and not isinstance(e["notes"], dict):
            raise TuningFileError(path, f"{w}.notes", "must be an object")
        key = (e["op"], n, k, m)
        if key in seen:
            raise TuningFileError(path, w, f"duplicate of entries[{seen[key]}] (op={key[0]} n={n} k={k} m={m})")
        seen[key] = i
        entries.append(Entry(
            op=e["op"], n=n, k=k, m=m,
            config=_config(path, f"{w}.config", e["config"], e["op"], m, n, k, tp),
            tuned=e["tuned"],
            flux_ms=_time(path, f"{w}.flux_ms", e.get("flux_ms")),
            nccl_ms=_time(path, f"{w}.nccl_ms", e.get("nccl_ms")),
            notes=e.get("notes"),
        ))
    return Table(
        path=path, gpu_name=gpu["name"], gpu=normalize_gpu_name(gpu["name"]), sms=sms, tp=tp,
        dtype=obj["dtype"], source=obj["source"], entries=entries,
        extra={k: obj[k] for k in _TOP_OPTIONAL if k in obj},
    )


def load_table(path: str) -> Table:
    """Read and validate the tuning file at ``path``."""
    if not os.path.isfile(path):
        raise TuningFileError(path, "<file>", "no such file")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningFileError(path, "<file>", f"not valid JSON ({exc})") from None
    return validate_table(obj, path)


def entry_to_dict(e: Entry) -> Dict[str, Any]:
    d: Dict[str, Any] = {"op": e.op, "n": e.n, "k": e.k, "m": e.m, "config": e.config.to_dict(),
                         "tuned": e.tuned, "flux_ms": e.flux_ms, "nccl_ms": e.nccl_ms}
    if e.notes:
        d["notes"] = e.notes
    return d


def table_to_dict(t: Table) -> Dict[str, Any]:
    """The JSON object of ``t`` (entries sorted by op, n, k, m so diffs stay readable)."""
    d: Dict[str, Any] = {"format": FORMAT, "version": VERSION,
                         "gpu": {"name": t.gpu_name, "sms": t.sms}, "tp": t.tp, "dtype": t.dtype,
                         "source": t.source}
    d.update(t.extra)
    d["entries"] = [entry_to_dict(e) for e in sorted(t.entries, key=lambda e: (e.op, e.n, e.k, e.m))]
    return d


def write_table(t: Table, path: str) -> None:
    """Write ``t`` to ``path`` atomically (validated first: never writes a file we cannot read)."""
    d = table_to_dict(t)
    validate_table(json.loads(json.dumps(d)), path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def machine_mismatch(a: Table, b: Table) -> Optional[Tuple[str, Any, Any]]:
    """The first of GPU, SM count, TP, dtype and kernel version in which two tables differ, as
    ``(field, a's, b's)``, or None: tables that may be combined (one file holds times of one
    machine and one kernel version)."""
    for fld, x, y in (("gpu.name", a.gpu, b.gpu), ("gpu.sms", a.sms, b.sms), ("tp", a.tp, b.tp),
                      ("dtype", a.dtype, b.dtype), ("kernel_version", a.kernel_version, b.kernel_version)):
        if x != y:
            return fld, x, y
    return None


def merge_tables(old: Table, new: Table) -> Table:
    """``new``'s entries over ``old``'s for the same (op, n, k, m); both must be for the same
    GPU, SM count, TP, dtype and kernel version (else :class:`TuningFileError` naming the
    differing field: one file holds times of one kernel version)."""
    differ = machine_mismatch(old, new)
    if differ is not None:
        fld, a, b = differ
        raise TuningFileError(old.path, fld, f"cannot merge: existing file has {a!r}, new results have {b!r}")
    merged = {(e.op, e.n, e.k, e.m): e for e in old.entries}
    merged.update({(e.op, e.n, e.k, e.m): e for e in new.entries})
    sources = old.source if new.source in old.source else f"{old.source}; {new.source}"
    extra = dict(old.extra)
    extra.update(new.extra)
    return Table(path=new.path, gpu_name=new.gpu_name, gpu=new.gpu, sms=new.sms, tp=new.tp,
                 dtype=new.dtype, source=sources, entries=list(merged.values()), extra=extra)


def default_filename(gpu_name: str, sms: int, tp: int, dtype: str) -> str:
    """``h200-sm132-tp2-bf16.json``: the name the tuner writes and the shipped tables use."""
    return f"{normalize_gpu_name(gpu_name)}-sm{sms}-tp{tp}-{dtype}.json"
