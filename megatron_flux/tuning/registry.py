"""Where tables come from, and lookup by key with the nearest m-bucket.

Tables are searched in this order (an earlier source wins for the same key and m-bucket;
buckets of different sources for the same ``(gpu, sms, tp, dtype, op, n, k)`` are merged):

1. files installed with :func:`use_table_files` (``--flux-config PATH`` calls it from
   :func:`megatron_flux.arguments.validate_flux_args`);
2. ``$MEGATRON_FLUX_CONFIG``: files or directories (every ``*.json`` in them), separated by
   ``os.pathsep``;
3. the user cache, where ``megatron-flux tune`` writes by default:
   ``$XDG_CACHE_HOME/megatron-flux/tables`` (else ``~/.cache/megatron-flux/tables``), one file
   per GPU, SM count, TP, dtype and kernel version (:func:`cache_table_path`). Only files of
   this package's kernel version are read (another version's belong to another install); one
   that is alone for its machine is reported as stale. ``MEGATRON_FLUX_CACHED_TABLES=0``
   turns the cache off;
4. the tables shipped in the package, ``megatron_flux/tuning/tables/*.json`` (package data,
   installed by ``pip install .``). ``MEGATRON_FLUX_SHIPPED_TABLES=0`` turns them off.

A table measured with other kernels than these (:meth:`Table.stale`) still gives configs, but
its times do not decide ``auto``; the first lookup for its machine warns once per such file.

Everything is read once, on the first lookup, and validated then (a malformed file raises
:class:`~megatron_flux.tuning.schema.TuningFileError` naming the file and field). User-given
tables that match no (GPU, SM count, TP) of a lookup raise too, once, naming the files and what
they were measured on: a table for another machine is a mistake, not something to ignore.
Unknown GPUs and shapes without any user table are *not* errors: they get ``None`` (heuristic
defaults).

**Consistency across TP ranks.** Every rank of a TP group reads the same files (the package,
the same flag and environment), runs on the same GPU model, and asks with the same
``(op, m_total, n, k, dtype, tp)``, so every rank gets the same entry and the same ``auto``
decision; no communication is needed. A group mixing GPU models would break that; it is not
supported by the fused backend anyway.
"""

from __future__ import annotations

import glob
import os
import threading
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_flux.tuning.keys import ShapeKey, nearest_bucket
from megatron_flux.tuning.schema import Entry, Table, TuningFileError, load_table

ENV_FILES = "MEGATRON_FLUX_CONFIG"
ENV_SHIPPED = "MEGATRON_FLUX_SHIPPED_TABLES"
ENV_CACHED = "MEGATRON_FLUX_CACHED_TABLES"
_OFF = ("0", "false", "no", "off")
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables")

class StaleTableWarning(UserWarning):
    """A table measured with other kernels than these (see :meth:`Table.stale`)."""


_LOCK = threading.Lock()
_user_files: List[str] = []
_index: Optional["TableIndex"] = None


class TableIndex:
    """``ShapeKey -> {m: (Entry, Table)}`` built from tables in priority order, twice: from
    every table (configs) and from the current ones only (times; see :meth:`Table.stale`)."""

    def __init__(self, tables: Sequence[Table], user_tables: Sequence[Table] = (),
                 other_version_cache: Sequence[Table] = ()):
        self.tables = list(tables)
        self.user_tables = list(user_tables)
        #: cached tables of another kernel version (not indexed; reported where they are alone)
        self.other_version_cache = list(other_version_cache)
        self._by_key: Dict[ShapeKey, Dict[int, Tuple[Entry, Table]]] = {}
        self._current: Dict[ShapeKey, Dict[int, Tuple[Entry, Table]]] = {}
        self._machines = set()
        self._checked_machines = set()
        self._warned_stale: set = set()
        for t in self.tables:  # highest priority first: first writer wins
            self._machines.add((t.gpu, t.sms, t.tp))
            for e in t.entries:
                self._by_key.setdefault(t.shape_key(e), {}).setdefault(e.m, (e, t))
                if not t.stale:
                    self._current.setdefault(t.shape_key(e), {}).setdefault(e.m, (e, t))
        self._buckets = {key: sorted(v) for key, v in self._by_key.items()}
        self._current_buckets = {key: sorted(v) for key, v in self._current.items()}

    def lookup(self, key: ShapeKey, m: int, *, current: bool = False) -> Optional[Tuple[Entry, Table]]:
        """The entry for ``key`` at the bucket nearest ``m`` (see :mod:`.keys`), or ``None``;
        ``current``: among current tables' entries only (whose times may decide)."""
        self._check_user_tables(key)
        self._warn_stale(key)
        by_key, all_buckets = (self._current, self._current_buckets) if current else (self._by_key, self._buckets)
        buckets = all_buckets.get(key)
        if not buckets:
            return None
        return by_key[key][nearest_bucket(m, buckets)]

    def buckets(self, key: ShapeKey, *, current: bool = False) -> List[int]:
        return list((self._current_buckets if current else self._buckets).get(key, ()))

    def entries(self, key: ShapeKey, *, current: bool = False) -> List[Tuple[Entry, Table]]:
        """Every entry of ``key``'s machine and op (``key.n``, ``key.k`` ignored), one per
        ``(n, k, m)`` (the highest-priority table's): what :mod:`.estimate` searches."""
        self._check_user_tables(key)
        self._warn_stale(key)
        src = self._current if current else self._by_key
        return [hit for other, per_m in src.items() if other[:5] == key[:5] for hit in per_m.values()]

    def stale_tables(self, key: ShapeKey) -> List[Table]:
        """The stale tables of ``key``'s GPU, SM count, TP and dtype: indexed ones, and cached
        ones of another kernel version where the cache has none of this version."""
        machine = tuple(key[:4])
        out = [t for t in self.tables if t.stale and (t.gpu, t.sms, t.tp, t.dtype) == machine]
        cached = [t for t in self.other_version_cache if (t.gpu, t.sms, t.tp, t.dtype) == machine]
        if cached and not any(t.path.startswith(user_cache_dir() + os.sep)
                              and (t.gpu, t.sms, t.tp, t.dtype) == machine for t in self.tables):
            out += cached
        return out

    def _warn_stale(self, key: ShapeKey) -> None:
        """One warning per stale table of this machine, the first time a lookup touches it."""
        for t in self.stale_tables(key):
            if t.path in self._warned_stale:
                continue
            self._warned_stale.add(t.path)
            from megatron_flux.kernels.version import KERNEL_VERSION

            use = ("It is not used (the cache keeps one file per kernel version)"
                   if t in self.other_version_cache else
                   "Its configs are still used, but its times no longer decide flux_backend='auto' "
                   "(those shapes are estimated from current tables, else the size rule)")
            warnings.warn(
                f"megatron-flux: tuning table {t.path} ({t.describe()}) was measured with kernel "
                f"version {t.kernel_version}; these kernels are version {KERNEL_VERSION}. {use}. "
                f"Tune again on this machine: torchrun --nproc-per-node {t.tp} --no-python "
                "megatron-flux tune (your model's GEMMs: --model-config CONFIG; the benchmark "
                "grid: --m-set all; docs/tuning.md)", StaleTableWarning, stacklevel=3)

    def _check_user_tables(self, key: ShapeKey) -> None:
        machine = (key.gpu, key.sms, key.tp)
        if not self.user_tables or machine in self._checked_machines:
            return
        self._checked_machines.add(machine)
        if any((t.gpu, t.sms, t.tp) == machine for t in self.user_tables):
            return
        t = self.user_tables[0]
        fld = "gpu.name" if t.gpu != key.gpu else ("gpu.sms" if t.sms != key.sms else "tp")
        raise TuningFileError(
            t.path, fld,
            f"the given tuning table(s) ({', '.join(u.path + ': ' + u.describe() for u in self.user_tables)}) "
            f"match no table for this run: GPU {key.gpu!r} with {key.sms} SMs at TP={key.tp}. "
            "Tune on this machine (`megatron-flux tune`) or drop --flux-config / $MEGATRON_FLUX_CONFIG",
        )


def _expand(paths: Iterable[str]) -> List[str]:
    out: List[str] = []
    for p in paths:
        if not p:
            continue
        if os.path.isdir(p):
            out.extend(sorted(glob.glob(os.path.join(p, "*.json"))))
        else:
            out.append(p)
    return out


def user_cache_dir() -> str:
    """Where ``megatron-flux tune`` writes tables by default and the registry looks after the
    given ones: ``$XDG_CACHE_HOME/megatron-flux/tables``, else ``~/.cache/megatron-flux/tables``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "megatron-flux", "tables")


def cache_table_path(gpu_name: str, sms: int, tp: int, dtype: str, kernel_version: Optional[int] = None) -> str:
    """``<user_cache_dir>/<gpu>-sm<sms>-tp<tp>-<dtype>-kv<kernel version>.json`` (default: this
    package's kernel version)."""
    from megatron_flux.kernels.version import KERNEL_VERSION
    from megatron_flux.tuning.schema import default_filename

    kv = KERNEL_VERSION if kernel_version is None else kernel_version
    stem = default_filename(gpu_name, sms, tp, dtype)[:-len(".json")]
    return os.path.join(user_cache_dir(), f"{stem}-kv{kv}.json")


def cached_table_files() -> List[str]:
    """The tables in the user cache (none with ``MEGATRON_FLUX_CACHED_TABLES=0``)."""
    if os.environ.get(ENV_CACHED, "1").lower() in _OFF:
        return []
    return sorted(glob.glob(os.path.join(user_cache_dir(), "*.json")))


def shipped_table_files() -> List[str]:
    """The tables installed with the package."""
    return sorted(glob.glob(os.path.join(SHIPPED_DIR, "*.json")))


def user_table_files() -> List[str]:
    """Files from :func:`use_table_files`, then ``$MEGATRON_FLUX_CONFIG``."""
    env = os.environ.get(ENV_FILES, "")
    return _expand(list(_user_files) + env.split(os.pathsep))


def use_table_files(paths: Sequence[str], *, validate: bool = True) -> List[Table]:
    """Install ``paths`` (files or directories) as the highest-priority tables of this process.

    Validates them now (so a bad ``--flux-config`` fails at startup) and drops the cached index.
    Returns the validated tables.
    """
    global _index
    files = _expand(paths)
    tables = [load_table(p) for p in files] if validate else []
    with _LOCK:
        _user_files[:] = files
        _index = None
    _forget_decisions()
    return tables


def reset() -> None:
    """Forget installed files and the cached index (tests; a new ``--flux-config``)."""
    global _index
    with _LOCK:
        _user_files.clear()
        _index = None
    _forget_decisions()


def _forget_decisions() -> None:
    """Drop the fused-vs-NCCL decisions made from the previous tables."""
    from megatron_flux.tuning import provider

    provider.clear_caches()


def build_index() -> TableIndex:
    user = [load_table(p) for p in user_table_files()]
    cached: List[Table] = []
    for p in cached_table_files():
        try:
            cached.append(load_table(p))
        except TuningFileError as exc:  # a cache must never stop a job: say so and go on
            warnings.warn(f"megatron-flux: ignoring the cached tuning table {p}: {exc}", stacklevel=2)
    shipped: List[Table] = []
    if os.environ.get(ENV_SHIPPED, "1").lower() not in _OFF:
        shipped = [load_table(p) for p in shipped_table_files()]
    current_cache = [t for t in cached if not t.stale]
    return TableIndex(user + current_cache + shipped, user, [t for t in cached if t.stale])


def get_index() -> TableIndex:
    """The process's table index (built on first use)."""
    global _index
    idx = _index
    if idx is None:
        with _LOCK:
            if _index is None:
                _index = build_index()
            idx = _index
    return idx
