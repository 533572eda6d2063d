"""How well does ``auto`` choose for shapes its tables lack? Leave-one-shape-family-out on tables.

For every table (default: the shipped ones) and every shape family in it (one op's per-rank
``(n, k)``, all its m-buckets), the family is hidden and each of its entries is decided from
the rest of that table, then scored against the entry's own measured times (the truth: fused
where ``flux_ms <= (1 - margin) * nccl_ms``). Rules:

* ``estimate``: what ``auto`` does for a shape no table lists (:mod:`megatron_flux.tuning.estimate`):
  the K nearest entries' predicted ratio with the allowance the remaining entries measure for
  themselves (so the allowance never sees the hidden family), else the size rule;
* ``size_rule``: the size rule alone (what a machine without any current table gets);
* ``old_1024``: fused from 1024 global rows (the rule before the estimate);
* ``nearest``: the nearest entry's own decision (same distance, no allowance);
* ``ag_rows``: ``estimate``, and on a machine of :data:`~megatron_flux.tuning.estimate.AG_ROWS_FUSED`
  an AG+GEMM fused wherever :func:`~megatron_flux.tuning.estimate.ag_rows_rule` takes it (what
  ``auto`` does there).

Per rule: decisions right, *false fused* (fused chosen where NCCL was faster by the margin: the
error that makes ``auto`` slower than NCCL), false NCCL, fused chosen where the fused kernel
was slower than NCCL at all, and the geometric mean and the maximum over the entries of the
chosen backend's time over NCCL's (NCCL counts 1.0). ``oracle`` is that mean with every choice
right.

``--held-out BENCH...`` also scores models the tables never saw, measured by the op benchmark on
a table's machine: each case is decided from the table without the entries any of these
benchmarks added (:mod:`megatron_flux.tools.tune.extend`), and scored by its measured times.

``python -m megatron_flux.tools.auto_eval [TABLE.json ...] [--margin 0.02] [--held-out BENCH.json ...] [--out JSON]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_flux.tuning import estimate as E

RULES = ("estimate", "size_rule", "old_1024", "nearest", "ag_rows")


def _points(table) -> Dict[str, List[E.Point]]:
    out: Dict[str, List[E.Point]] = {"ag": [], "rs": []}
    for e in table.entries:
        if e.flux_ms and e.nccl_ms:
            out[e.op].append(E.Point(e.m, e.n, e.k, e.flux_ms / e.nccl_ms, e.config, table.path))
    return out


def _ag_rows_listed(table) -> bool:
    return (table.gpu, table.tp, table.dtype) in E.AG_ROWS_FUSED


def _choice_record(op: str, p: E.Point, known: List[E.Point], est: E.Estimator, tp: int,
                   margin: float, ag_rows: bool = False) -> dict:
    """``p`` (measured) and each rule's choice for it from the ``known`` entries alone
    (``ag_rows``: the machine is one of :data:`~megatron_flux.tuning.estimate.AG_ROWS_FUSED`)."""
    got = est.decide(p.m, p.n, p.k, margin)
    near = E.nearest(known, p.m, p.n, p.k, reach=math.inf)
    estimated = got.fused if got is not None else E.size_rule(op, p.m, tp)
    choice = {
        "estimate": estimated,
        "size_rule": E.size_rule(op, p.m, tp),
        "old_1024": p.m >= 1024,
        "nearest": bool(near) and near[0][1].ratio <= 1.0 - margin,
        "ag_rows": estimated or (ag_rows and op == "ag"
                                 and E.ag_rows_rule(known, p.m, p.n, p.k, tp)),
    }
    return {"op": op, "n": p.n, "k": p.k, "m": p.m, "ratio": round(p.ratio, 4), "choice": choice,
            "estimate_from": ("size rule" if got is None else f"{got.ratio:.3f} x {got.allowance:.3f}")}


def leave_out_choices(table, margin: float) -> List[dict]:
    """One record per entry with times: the entry and each rule's choice with its family hidden."""
    records = []
    for op, points in _points(table).items():
        for fam in sorted({p.family for p in points}):
            rest = [p for p in points if p.family != fam]
            est = E.Estimator(rest)
            for p in sorted((p for p in points if p.family == fam), key=lambda p: p.m):
                records.append(_choice_record(op, p, rest, est, table.tp, margin,
                                              _ag_rows_listed(table)))
    return records


def held_out_choices(table, bench: dict, drop_sources: Sequence[str], margin: float) -> List[dict]:
    """One record per case of ``bench`` (a benchmark with ``flux`` and ``nccl`` on ``table``'s
    machine): each rule's choice from ``table`` without the entries that ``drop_sources`` added
    (``notes.measured_by``, :mod:`megatron_flux.tools.tune.extend`), i.e. as if those
    benchmarks had never run."""
    from megatron_flux.tools.tune.from_bench import check_same_machine, local_times

    check_same_machine(bench, table, "held-out benchmark")
    kept = [e for e in table.entries if (e.notes or {}).get("measured_by") not in drop_sources]
    known = _points(dataclasses.replace(table, entries=kept))
    estimators = {op: E.Estimator(points) for op, points in known.items()}
    records = []
    for (op, n, k, m), t in sorted(local_times(bench, "held-out benchmark").items()):
        p = E.Point(m, n, k, t["flux"] / t["nccl"], None)
        records.append(_choice_record(op, p, known[op], estimators[op], table.tp, margin,
                                      _ag_rows_listed(table)))
    return records


def evaluate_held_out(table, benches: Sequence[Tuple[dict, str]], margin: float) -> Dict[str, dict]:
    """``{bench path: {op: scores}}`` for each of ``benches`` that ran on ``table``'s machine,
    decided from ``table`` without the entries any of them added."""
    from megatron_flux.tuning.schema import TuningFileError

    drop = [path for _, path in benches]
    out: Dict[str, dict] = {}
    for bench, path in benches:
        try:
            records = held_out_choices(table, bench, drop, margin)
        except TuningFileError:  # another machine's benchmark
            continue
        out[path] = {op: scores([r for r in records if r["op"] == op], margin)
                     for op in ("ag", "rs") if any(r["op"] == op for r in records)}
    return out


def score(records: Sequence[dict], rule: str, margin: float) -> dict:
    limit = 1.0 - margin
    n = len(records)
    fused = [r for r in records if r["choice"][rule]]
    return {
        "right": sum(r["choice"][rule] == (r["ratio"] <= limit) for r in records),
        "false_fused": sum(r["ratio"] > limit for r in fused),
        "false_nccl": sum(r["ratio"] <= limit for r in records if not r["choice"][rule]),
        "fused_slower_than_nccl": sum(r["ratio"] > 1.0 for r in fused),
        "geomean_vs_nccl": round(math.exp(sum(math.log(r["ratio"]) for r in fused) / n), 4) if n else None,
        "worst_vs_nccl": max([1.0] + [r["ratio"] for r in fused]),
    }


def scores(records: Sequence[dict], margin: float) -> dict:
    """The oracle, every rule's :func:`score` and its false fused choices, over ``records``."""
    limit = 1.0 - margin
    return {
        "oracle_geomean_vs_nccl": round(math.exp(sum(math.log(min(r["ratio"], 1.0)) if r["ratio"] <= limit
                                                     else 0.0 for r in records) / len(records)), 4),
        "rules": {rule: score(records, rule, margin) for rule in RULES},
        "false_fused": {rule: [f"{r['op']} n={r['n']} k={r['k']} m={r['m']} ({r['ratio']})"
                               for r in records if r["choice"][rule] and r["ratio"] > limit]
                        for rule in RULES},
    }


def evaluate(table, margin: float) -> dict:
    records = leave_out_choices(table, margin)
    estimators = {op: E.Estimator(points) for op, points in _points(table).items()}

    def rounded(a):
        return round(a, 4) if a is not None else None

    return {
        "gpu": table.gpu_name, "sms": table.sms, "tp": table.tp, "dtype": table.dtype,
        "kernel_version": table.kernel_version, "stale": table.stale, "entries": len(records),
        # below LARGE_M rows, and from it up
        "allowance_from_whole_table": {op: [rounded(est.allowance(margin)), rounded(est.allowance(margin, large=True))]
                                       for op, est in estimators.items()},
        **scores(records, margin),
    }


#: how much slower than NCCL a size-rule bucket may be on any entry: the same NCCL op measured
#: up to 8 % apart between two runs on 2xH200 (docs/tuning.md)
SIZE_RULE_NOISE = 0.08


def derive_size_rule(tables, margin: float = 0.02, noise: float = SIZE_RULE_NOISE) -> Dict[str, Optional[int]]:
    """``{op: rows per rank}`` (None: no bucket qualifies): per op, the smallest rows-per-rank
    bucket from which, on every table that has entries there, the geometric mean of flux/nccl
    is at most ``1 - margin`` and no ratio exceeds ``1 + noise``
    (:data:`megatron_flux.tuning.estimate.SIZE_RULE_ROWS_PER_RANK` is this of the shipped
    tables)."""
    out: Dict[str, Optional[int]] = {}
    for op in ("ag", "rs"):
        per_table = [[(e.m // t.tp, e.flux_ms / e.nccl_ms) for e in t.entries
                      if e.op == op and e.flux_ms and e.nccl_ms] for t in tables]
        out[op] = None
        for rows in sorted({r for entries in per_table for r, _ in entries}):
            ok = True
            for entries in per_table:
                above = [x for r, x in entries if r >= rows]
                if above and (math.exp(sum(map(math.log, above)) / len(above)) > 1.0 - margin
                              or max(above) > 1.0 + noise):
                    ok = False
                    break
            if ok:
                out[op] = rows
                break
    return out


def format_result(name: str, res: dict) -> str:
    lines = [f"{name} ({res['entries']} entries{', stale' if res['stale'] else ''}; allowance from "
             f"the whole table: " + ", ".join(f"{op} {a}" for op, a in res["allowance_from_whole_table"].items())
             + f"; oracle {res['oracle_geomean_vs_nccl']:.3f}x)"]
    for rule, s in res["rules"].items():
        lines.append(f"  {rule:10s} right {s['right']:2d}/{res['entries']}  false fused {s['false_fused']:2d}  "
                     f"false nccl {s['false_nccl']:2d}  slower than nccl {s['fused_slower_than_nccl']:2d}  "
                     f"geomean {s['geomean_vs_nccl']:.3f}x  worst {s['worst_vs_nccl']:.3f}x")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_flux.tools.tune.from_bench import read_json
    from megatron_flux.tuning.registry import shipped_table_files
    from megatron_flux.tuning.schema import TuningFileError, load_table

    p = argparse.ArgumentParser(prog="python -m megatron_flux.tools.auto_eval",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="*", help="tuning tables (default: the shipped ones)")
    p.add_argument("--margin", type=float, default=0.02, help="auto's margin (default 0.02)")
    p.add_argument("--held-out", nargs="+", default=[], metavar="BENCH",
                   help="benchmarks of shapes (models) to decide as if unseen: from each table of "
                        "their machine without the entries any of them added (tools.tune.extend)")
    p.add_argument("--out", help="also write the results as JSON")
    args = p.parse_args(argv)
    if not 0.0 <= args.margin < 1.0:
        p.error("--margin must be in [0, 1)")
    files = args.tables or shipped_table_files()
    try:  # a missing or malformed file: one line naming it, exit 2
        tables = [load_table(path) for path in files]
        held_out = [(read_json(path), path) for path in args.held_out]
    except TuningFileError as exc:
        p.exit(2, f"{p.prog}: {exc}\n")
    derived = derive_size_rule(tables, args.margin)
    print(f"size rule derived from these tables (rows per rank from which fused): {derived}; "
          f"in use: {E.SIZE_RULE_ROWS_PER_RANK}")
    record = {
        "command": "python -m megatron_flux.tools.auto_eval" + "".join(f" {t}" for t in args.tables)
                   + (f" --margin {args.margin}" if args.margin != 0.02 else "")
                   + (" --held-out" + "".join(f" {b}" for b in args.held_out) if args.held_out else "")
                   + (f" --out {args.out}" if args.out else ""),
        "date": datetime.date.today().isoformat(), "margin": args.margin,
        "constants": {"m_weight": E.M_WEIGHT, "reach": E.REACH, "k_nearest": E.K_NEAREST,
                      "row_shift": E.ROW_SHIFT, "monotone_from_m": E.MONOTONE_FROM_M, "large_m": E.LARGE_M,
                      "size_rule_rows_per_rank": dict(E.SIZE_RULE_ROWS_PER_RANK),
                      "ag_rows_fused": [list(x) for x in E.AG_ROWS_FUSED],
                      "ag_rule_rows_per_rank": E.AG_RULE_ROWS_PER_RANK},
        "size_rule_derived": derived,
        "tables": {},
    }
    for path, table in zip(files, tables):
        res = evaluate(table, args.margin)
        name = os.path.basename(path)
        print(format_result(name, res))
        record["tables"][name] = res
    if held_out:
        record["held_out_benches"] = list(args.held_out)
        record["held_out"] = {}
        for path, table in zip(files, tables):
            res = evaluate_held_out(table, held_out, args.margin)
            if res:
                record["held_out"][os.path.basename(path)] = res
            for bench, ops in res.items():
                for op, s in ops.items():
                    est = s["rules"]["estimate"]
                    print(f"held out {os.path.basename(bench)} on {os.path.basename(path)}, {op}: "
                          f"estimate {est['geomean_vs_nccl']:.3f}x NCCL (oracle "
                          f"{s['oracle_geomean_vs_nccl']:.3f}x), slower than nccl "
                          f"{est['fused_slower_than_nccl']}, worst {est['worst_vs_nccl']:.3f}x")
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
                f.write("\n")
        except OSError as exc:
            p.exit(2, f"{p.prog}: --out {args.out}: {exc.strerror}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
