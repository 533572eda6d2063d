"""Re-time a stale table with the current kernels: its configs, the benchmarks' times.

A table measured with other kernels (``kernel_version`` not this package's) still supplies its
configs, but its times no longer decide ``auto`` (:mod:`megatron_flux.tuning.registry`). This
takes such a table and benchmarks made **with it** on the current kernels (``MEGATRON_FLUX_CONFIG
=table.json megatron-flux bench ...``, or the shipped table itself, methods ``flux`` and ``nccl``,
same machine) and writes a current table: every entry a benchmark ran keeps its config and takes
the benchmark's median times (of several runs of one shape, the one least favourable to the fused
kernel, as :mod:`.confirm` does); an entry no benchmark ran is dropped, since its times would be
of other kernels; the table's ``kernel_version`` becomes the benchmarks'. The configs were
searched with the older kernels and are not searched again: each entry's notes say so
(``config_kernel_version``), and ``search.retimed_by`` lists the benchmarks.

``python -m megatron_flux.tools.tune.retime TABLE.json BENCH.json [BENCH2.json ...] OUT.json``
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, Tuple

from megatron_flux.tools.tune.from_bench import least_favourable, run_table_tool, times_by_shape, with_search
from megatron_flux.tuning.schema import Entry, Table, TuningFileError


def retime_table(table: Table, runs: Sequence[Tuple[Dict[str, Any], str]]) -> Table:
    """``table`` with the times of ``runs`` (benchmarks of one newer kernel version)."""
    if not runs:
        raise ValueError("retime_table needs at least one benchmark")
    versions = {int((bench.get("env") or {}).get("kernel_version", -1)) for bench, _ in runs}
    if len(versions) != 1 or versions == {-1}:
        raise TuningFileError(runs[0][1], "env.kernel_version",
                              f"the benchmarks must record one kernel version, got {sorted(versions)}")
    (version,) = versions
    ran = times_by_shape(table, runs, kernel_version=version)  # the machine must match
    entries = []
    for e in table.entries:
        hits = ran.get((e.op, e.n, e.k, e.m))
        if not hits:
            continue
        source, t = least_favourable(hits)
        notes = {k: v for k, v in (e.notes or {}).items()
                 if k in ("model", "candidates", "passed_check", "finalists")}
        notes.update(config_kernel_version=table.kernel_version, bench_source=source,
                     confirmed=True, times_from="bench")
        if len(hits) > 1:
            notes["bench_runs"] = [s for s, _ in hits]
        entries.append(Entry(op=e.op, n=e.n, k=e.k, m=e.m, config=e.config, tuned=e.tuned,
                             flux_ms=t["flux"], nccl_ms=t["nccl"], notes=notes))
    retimed_by = {"benches": [s for _, s in runs], "entries": len(entries),
                  "dropped": len(table.entries) - len(entries),
                  "configs_from_kernel_version": table.kernel_version}
    # (the earlier confirmation timed other kernels)
    return with_search(table, entries, {"retimed_by": retimed_by}, drop=("confirmed_by",),
                       kernel_version=version)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_table_tool(argv, __doc__, retime_table, lambda old, t: (
        f"{len(t.entries)} of {len(old.entries)} entries re-timed with kernel version "
        f"{t.kernel_version}; fused not slower in {sum(1 for e in t.entries if e.flux_ms <= e.nccl_ms)}"),
                          prog="python -m megatron_flux.tools.tune.retime")


if __name__ == "__main__":
    sys.exit(main())
