"""Confirm a tuned table's fused-vs-NCCL times with an independent benchmark run.

``megatron-flux tune`` times each winner against ``nccl`` in a few short trials; on the 2×H200
box the same NCCL+cuBLAS op has measured up to 8 % apart between two runs, so one short run can
say "fused wins" where it does not. This takes a tuned table and a benchmark JSON made *with that
table* (``MEGATRON_FLUX_CONFIG=table.json megatron-flux bench ...``, method ``flux``) and keeps,
per entry, the pair of times (``flux_ms``, ``nccl_ms``) from whichever run is **less favourable
to the fused kernel** (larger flux/nccl ratio). ``auto`` then takes fused only where it won in
both runs. Configs are not touched; both runs' times are kept in the entry's ``notes``. The
benchmark must have run on the table's machine (TP, GPU model, SM count, dtype), else it is
refused (:func:`~megatron_flux.tools.tune.from_bench.check_same_machine`).

Tables grow by partial retunes (``tune --no-merge`` on some shapes, merged into the shipped
table), each confirmed by a benchmark of the shapes it touched. So:

- an entry the benchmark ran is compared with **its own tuning run's** times (``notes
  ["tune_flux_ms"]`` when an earlier confirmation stored them), never with an earlier
  benchmark's: a kernel change must be able to move an entry both ways;
- an entry the benchmark did not run keeps an earlier confirmation as it stands (its notes name
  that benchmark in ``bench_source``); one never confirmed is marked ``confirmed: False``.

Repeated benchmarks of the same table and kernels are one body of evidence, not a sequence:
:func:`confirm_repeats` compares each entry's tuning run with **every** run that ran its shape
and keeps the least favourable (its source in ``bench_source``, all of them in ``bench_runs``).
On a box whose trials spread 10-25 % (measured on 2×H100), the latest run alone flipped
six of 48 ``auto`` choices against the two runs before it.

``python -m megatron_flux.tools.tune.confirm TABLE.json BENCH.json [BENCH2.json ...] OUT.json``
takes the benchmarks jointly (:func:`confirm_repeats`); for runs of disjoint shapes (the
large- and the small-m grid) that is the same as one confirmation after the other.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, Tuple

from megatron_flux.tools.tune.from_bench import least_favourable, run_table_tool, times_by_shape, with_search
from megatron_flux.tuning.schema import Entry, Table


def confirm_table(table: Table, bench: Dict[str, Any], bench_source: str) -> Table:
    """``table`` with each entry's times taken from the run less favourable to fused."""
    return confirm_repeats(table, [(bench, bench_source)])


def confirm_repeats(table: Table, runs: Sequence[Tuple[Dict[str, Any], str]]) -> Table:
    """``table`` confirmed by several benchmarks at once: each entry's times come from whichever
    of its tuning run and the runs that ran its shape is least favourable to fused."""
    if not runs:
        raise ValueError("confirm_repeats needs at least one benchmark")
    ran = times_by_shape(table, runs)
    sources = [source for _, source in runs]
    entries = []
    confirmed = kept = 0
    for e in table.entries:
        hits = ran.get((e.op, e.n, e.k, e.m), [])
        notes = dict(e.notes or {})
        if e.flux_ms is None or e.nccl_ms is None or not hits:
            if notes.get("confirmed") and notes.get("bench_source"):
                kept += 1  # confirmed by an earlier benchmark that ran this shape
            else:
                notes["confirmed"] = False
            entries.append(Entry(**{**e.__dict__, "notes": notes}))
            continue
        source, b = least_favourable(hits)
        tune_flux = float(notes.get("tune_flux_ms", e.flux_ms))
        tune_nccl = float(notes.get("tune_nccl_ms", e.nccl_ms))
        notes.update(tune_flux_ms=tune_flux, tune_nccl_ms=tune_nccl, bench_flux_ms=b["flux"],
                     bench_nccl_ms=b["nccl"], bench_source=source, confirmed=True)
        notes.pop("bench_runs", None)
        if len(hits) > 1:
            notes["bench_runs"] = [s for s, _ in hits]
        use_bench = b["flux"] / b["nccl"] > tune_flux / tune_nccl
        notes["times_from"] = "bench" if use_bench else "tune"
        flux_ms, nccl_ms = (b["flux"], b["nccl"]) if use_bench else (tune_flux, tune_nccl)
        entries.append(Entry(op=e.op, n=e.n, k=e.k, m=e.m, config=e.config, tuned=e.tuned,
                             flux_ms=flux_ms, nccl_ms=nccl_ms, notes=notes))
        confirmed += 1
    earlier = sorted({e.notes["bench_source"] for e in entries
                      if e.notes.get("confirmed") and e.notes.get("bench_source") not in sources})
    confirmed_by = {"bench": sources[-1], "entries": confirmed, "kept_from_earlier": kept,
                    "earlier_benches": earlier,
                    "rule": "times of the run less favourable to fused (larger flux/nccl) of the "
                            "entry's tuning run and the latest benchmark that ran it"}
    if len(sources) > 1:
        confirmed_by["benches"] = sources
        confirmed_by["rule"] = ("times of the run less favourable to fused (larger flux/nccl) of "
                                "the entry's tuning run and every benchmark of this confirmation "
                                "that ran it")
    return with_search(table, entries, {"confirmed_by": confirmed_by})


def main(argv: Optional[Sequence[str]] = None) -> int:
    def describe(old, t):
        n = sum(1 for e in t.entries if (e.notes or {}).get("confirmed"))
        fused = sum(1 for e in t.entries if e.flux_ms is not None and e.nccl_ms is not None
                    and e.flux_ms <= e.nccl_ms)
        return f"{len(t.entries)} entries, {n} confirmed, fused not slower in {fused}"

    return run_table_tool(argv, __doc__, confirm_repeats, describe,
                          prog="python -m megatron_flux.tools.tune.confirm")


if __name__ == "__main__":
    sys.exit(main())
