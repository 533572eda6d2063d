"""Replace a table's entries with a later re-search of the same shapes.

:mod:`.add` keeps what a table holds. When the kernels change, the configs searched with the
earlier kernels are worth searching again (re-timing them, :mod:`.retime`, only re-measures
them): a ``megatron-flux tune`` of the shapes the table holds, started from what each runs now
(its untuned config is the table's, and a winner must beat it), **replaces** each of those
entries, config and times; entries the run lacks stay as they are. The tuning run must come
from the table's machine and kernel version. Each replaced entry's notes name the run
(``tuned_by``); the table's ``search.retuned_by`` lists the runs, with how many entries each
replaced and added. Confirm the result afterwards with a benchmark of the re-searched shapes
(:mod:`.confirm`): until then the entries hold only the tune's short trials.

``python -m megatron_flux.tools.tune.retune TABLE.json TUNED.json OUT.json``
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_flux.tools.tune.add import refuse_other_machine
from megatron_flux.tools.tune.from_bench import run_table_tool, with_search
from megatron_flux.tuning.schema import Table, TuningFileError, validate_table


def retune_table(table: Table, run: Table, source: str) -> Table:
    """``table`` with every entry of ``run`` in place of its own for the same (op, n, k, m), and
    ``run``'s other entries added (module docstring)."""
    refuse_other_machine(table, run, source)
    if not run.entries:
        raise TuningFileError(source, "entries", "the tuning run holds no entries")
    tuned = {(e.op, e.n, e.k, e.m): dataclasses.replace(e, notes=dict(e.notes or {}, tuned_by=source))
             for e in run.entries}
    entries = []
    for e in table.entries:
        entries.append(tuned.pop((e.op, e.n, e.k, e.m), e))
    replaced = len(run.entries) - len(tuned)
    entries.extend(tuned.values())
    retuned_by: List[Dict[str, Any]] = list(((table.extra or {}).get("search") or {}).get("retuned_by") or [])
    retuned_by.append({"tune": source, "source": run.source, "replaced": replaced, "added": len(tuned)})
    return with_search(table, entries, {"retuned_by": retuned_by})


def _load_run(table: Table, runs: Sequence[Tuple[Dict[str, Any], str]]) -> Table:
    if len(runs) != 1:
        raise SystemExit("retune takes one tuning run (merge several with megatron-flux tune's --out)")
    obj, path = runs[0]
    return retune_table(table, validate_table(obj, path), path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_table_tool(argv, __doc__, _load_run, lambda old, t: (
        f"{len(t.entries)} entries, {t.extra['search']['retuned_by'][-1]['replaced']} re-searched, "
        f"{len(t.entries) - len(old.entries)} added"),
                          prog="python -m megatron_flux.tools.tune.retune")


if __name__ == "__main__":
    sys.exit(main())
