"""Where tables come from, and lookup by key with the nearest m-bucket.

Tables are searched in this order (an earlier source wins for the same key and m-bucket;
buckets of different sources for the same ``(gpu, sms, tp, dtype, op, n, k)`` are merged):

1. files installed with :func:`use_table_files` (``--flux-config PATH`` calls it from
   :func:`megatron_flux.arguments.validate_flux_args`);
2. ``$MEGATRON_FLUX_CONFIG``: files or directories (every ``*.json`` in them), separated by
   ``os.pathsep``;
3. the tables shipped in the package, ``megatron_flux/tuning/tables/*.json`` (package data,
   installed by ``pip install .``). ``MEGATRON_FLUX_SHIPPED_TABLES=0`` turns them off.

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
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tables")

class StaleTableWarning(UserWarning):
    """A table measured with other kernels than these (see :meth:`Table.stale`)."""


_LOCK = threading.Lock()
_user_files: List[str] = []
_index: Optional["TableIndex"] = None


class TableIndex:
    """``ShapeKey -> {m: (Entry, Table)}`` built from tables in priority order, twice: from
    every table (configs) and from the current ones only (times; see :meth:`Table.stale`)."""

    def __init__(self, tables: Sequence[Table], user_tables: Sequence[Table] = ()):
        self.tables = list(tables)
        self.user_tables = list(user_tables)
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
        """The stale tables of ``key``'s GPU, SM count, TP and dtype."""
        return [t for t in self.tables if t.stale and (t.gpu, t.sms, t.tp, t.dtype) == tuple(key[:4])]

    def _warn_stale(self, key: ShapeKey) -> None:
        """One warning per stale table of this machine, the first time a lookup touches it."""
        for t in self.stale_tables(key):
            if t.path in self._warned_stale:
                continue
            self._warned_stale.add(t.path)
            from megatron_flux.kernels.version import KERNEL_VERSION

            warnings.warn(
                f"megatron-flux: tuning table {t.path} ({t.describe()}) was measured with kernel "
                f"version {t.kernel_version}; these kernels are version {KERNEL_VERSION}. Its "
                "configs are still used, but its times no longer decide flux_backend='auto' "
                "(those shapes are estimated from current tables, else the size rule). Refresh "
                f"it on this machine: torchrun --nproc-per-node {t.tp} --no-python megatron-flux "
                "tune --m-set all (docs/tuning.md)", StaleTableWarning, stacklevel=3)

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
    shipped: List[Table] = []
    if os.environ.get(ENV_SHIPPED, "1") not in ("0", "false", "no", "off"):
        shipped = [load_table(p) for p in shipped_table_files()]
    return TableIndex(user + shipped, user)


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
