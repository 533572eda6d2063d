"""Add a later tuning run's entries for the shapes a table lacks.

A shipped table is a tuning run refined by benchmarks (confirmed, adopted, extended). A later
``megatron-flux tune`` of more shapes (a training config's GEMMs at another micro-batch, its
output layer) adds **tuned** entries for every (op, n, k, m) the table does not hold; entries
the table holds keep their config and times, since they were confirmed by longer benchmark runs
than a tune's short trials. The tuning run must come from the table's machine and kernel
version (GPU model, SM count, TP, dtype, ``kernel_version``). Each added entry's notes name the
run (``tuned_by``); the table's ``search.added_by`` lists the runs and how many entries each
added. Confirm the result afterwards with a benchmark of the same shapes
(:mod:`.confirm`), so ``auto`` decides from times at least as long as the benchmark's.

``python -m megatron_flux.tools.tune.add TABLE.json TUNED.json [TUNED2.json ...] OUT.json``
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_flux.tools.tune.from_bench import run_table_tool, with_search
from megatron_flux.tuning.schema import Table, TuningFileError, machine_mismatch, validate_table


def refuse_other_machine(table: Table, run: Table, source: str) -> None:
    """Raise :class:`TuningFileError` naming the field where the tuning run ``run`` (read from
    ``source``) was not made on ``table``'s machine and kernel version."""
    differ = machine_mismatch(table, run)
    if differ is not None:
        fld, a, b = differ
        raise TuningFileError(source, fld, f"the table {table.path} has {a!r}, this tuning run {b!r}")


def add_tuned(table: Table, tuned: Sequence[Tuple[Table, str]]) -> Table:
    """``table`` plus each tuning run's entries for (op, n, k, m) it lacks (an earlier run in
    ``tuned`` wins over a later one for the same key); see the module docstring."""
    have = {(e.op, e.n, e.k, e.m) for e in table.entries}
    entries = list(table.entries)
    added_by: List[Dict[str, Any]] = list(((table.extra or {}).get("search") or {}).get("added_by") or [])
    for run, source in tuned:
        refuse_other_machine(table, run, source)
        new = [e for e in run.entries if (e.op, e.n, e.k, e.m) not in have]
        if not new:
            raise TuningFileError(source, "entries", f"adds nothing: {table.path} holds every entry of it")
        for e in new:
            have.add((e.op, e.n, e.k, e.m))
            entries.append(dataclasses.replace(e, notes=dict(e.notes or {}, tuned_by=source)))
        added_by.append({"tune": source, "source": run.source, "entries": len(new),
                         "kept": len(run.entries) - len(new)})
    return with_search(table, entries, {"added_by": added_by})


def _load_runs(table: Table, runs: Sequence[Tuple[Dict[str, Any], str]]) -> Table:
    return add_tuned(table, [(validate_table(obj, path), path) for obj, path in runs])


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_table_tool(argv, __doc__, _load_runs, lambda old, t: (
        f"{len(t.entries)} entries, {len(t.entries) - len(old.entries)} added"),
                          prog="python -m megatron_flux.tools.tune.add")


if __name__ == "__main__":
    sys.exit(main())
