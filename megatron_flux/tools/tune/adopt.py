"""Adopt a knob into a table where interleaved A/B benchmarks timed it faster.

A benchmark run with methods ``flux`` and ``flux_variant`` (``--flux-variant '{"knob": value}'``)
times each case's table config and the same config with the variant's fields changed, in the
same interleaved trials. Given one or more such runs, each entry whose case ran in at least one
of them gets the variant's fields **where every run that ran the case timed the variant faster**
(medians); its times (``flux_ms``, ``nccl_ms``) become the variant's and NCCL's from the run
less favourable to fused (larger variant/nccl), the A/B is kept in ``notes["adopted"]``. Entries
no run covered, or where a run timed the variant no faster, are left as they are. Every run must
carry the same ``flux_variant`` fields and have run on the table's machine (TP, GPU model, SM
count, dtype: :func:`~megatron_flux.tools.tune.from_bench.check_same_machine`).

``flux_variant`` runs in a second backend object (its own workspaces and streams). On 2×H100,
``flux`` and ``flux_default`` with *identical* configs measured up to 9 % apart with the same
sign run after run, and a same-config control 0.88-1.02× ``flux`` in one run. A run that also timed ``flux_control`` (a second backend
with the table's own configs) sizes that floor per case: there the variant must beat the table
config by more than ``|flux_control / flux - 1|``, and the control's times go into the notes.
Runs without it keep the plain rule (variant faster at all).

``python -m megatron_flux.tools.tune.adopt TABLE.json AB_BENCH.json [AB_BENCH2.json ...] OUT.json``
(applied after ``megatron_flux.tools.tune.confirm``; an adopted entry's ``tune_*`` times in its notes
become the A/B's, so a later confirmation compares against its new config's times).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_flux.tools.tune.from_bench import check_same_machine, local_times, run_table_tool, with_search
from megatron_flux.tuning.schema import Entry, Table, TuningFileError


def _variant_wins(t: Dict[str, float], control: Optional[Dict[str, float]]) -> bool:
    """One run's verdict: the variant beat the table config, by more than the same-config
    control's distance from it where the run timed one."""
    floor = abs(control["flux_control"] / control["flux"] - 1.0) if control else 0.0
    return t["flux_variant"] < t["flux"] * (1.0 - floor)


def adopt_variant(table: Table, runs: Sequence[Tuple[Dict[str, Any], str]]) -> Table:
    """``table`` with the runs' ``flux_variant`` fields adopted where every run that ran an
    entry's case timed them faster (see the module docstring)."""
    if not runs:
        raise ValueError("adopt_variant needs at least one A/B benchmark")
    fields = None
    timed: List[Tuple[str, Dict[tuple, Dict[str, float]]]] = []
    for bench, source in runs:
        check_same_machine(bench, table, source)
        variant = bench.get("flux_variant")
        if not isinstance(variant, dict) or not variant:
            raise TuningFileError(source, "flux_variant", "not an A/B run (no flux_variant fields)")
        if fields is not None and variant != fields:
            raise TuningFileError(source, "flux_variant", f"{variant} != the first run's {fields}")
        fields = variant
        timed.append((source, local_times(bench, source, ("flux", "flux_variant", "nccl")),
                      local_times(bench, source, ("flux", "flux_control"))))
    entries, adopted = [], 0
    for e in table.entries:
        key = (e.op, e.n, e.k, e.m)
        hits = [(src, t[key], control.get(key)) for src, t, control in timed if key in t]
        if not hits or not all(_variant_wins(t, c) for _, t, c in hits):
            entries.append(e)
            continue
        src, worst, _ = max(hits, key=lambda h: h[1]["flux_variant"] / h[1]["nccl"])
        notes = dict(e.notes or {})
        # a later confirmation compares a benchmark with these times, not the former config's
        notes.update(tune_flux_ms=worst["flux_variant"], tune_nccl_ms=worst["nccl"],
                     times_from="adopted")
        notes["adopted"] = {
            "fields": dict(fields), "sources": [s for s, _, _ in hits],
            "table_config_ms": [t["flux"] for _, t, _ in hits],
            "variant_ms": [t["flux_variant"] for _, t, _ in hits],
            "nccl_ms": [t["nccl"] for _, t, _ in hits], "times_from": src,
            "rule": "variant faster than the table config in every A/B run that ran the case "
                    "(same interleaved trials); times of the run less favourable to fused"}
        if any(c is not None for _, _, c in hits):
            notes["adopted"]["control_ms"] = [c["flux_control"] if c else None for _, _, c in hits]
            notes["adopted"]["rule"] += ("; where a run timed flux_control (the table config in a "
                                         "second backend), faster by more than |control/flux - 1|")
        # (from_dict: an A/B run's fields may name a removed knob at the value it always had)
        config = type(e.config).from_dict({**e.config.to_dict(), **fields})
        entries.append(Entry(op=e.op, n=e.n, k=e.k, m=e.m, config=config, tuned=e.tuned,
                             flux_ms=worst["flux_variant"], nccl_ms=worst["nccl"], notes=notes))
        adopted += 1
    earlier = list(dict((table.extra or {}).get("search") or {}).get("adopted") or [])
    return with_search(table, entries, {"adopted": earlier + [
        {"fields": dict(fields), "benches": [s for _, s in runs], "entries": adopted}]})


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_table_tool(argv, __doc__, adopt_variant, lambda old, t: (
        f"{len(t.entries)} entries, variant adopted in "
        f"{sum(1 for e in t.entries if 'adopted' in (e.notes or {}))}"),
                          prog="python -m megatron_flux.tools.tune.adopt")


if __name__ == "__main__":
    sys.exit(main())
