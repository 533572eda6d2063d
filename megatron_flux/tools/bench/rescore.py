"""Recompute a benchmark JSON's metrics and summary from its stored trial times.

    python -m megatron_flux.tools.bench.rescore benchmarks/results/bench-*.json [--min-m 1024]

Results written before a metric existed (the paired speedup, :func:`~.report.paired_speedup`)
hold everything it needs: every row keeps its per-trial times (``trials_ms``), and trial ``i``
of each method ran back to back in one interleaved round. This prints, per file, the summary
that :func:`~.report.summarize` gives today and the cases where ``auto`` or ``flux`` ran slower
than NCCL by either statistic. It reads only; the files stay as they were measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from megatron_flux.tools.bench import report as R

SHOWN = ("auto", "flux")


def rescore(doc: dict) -> dict:
    """``doc``'s rows with today's metrics and their summary (``doc`` is not changed)."""
    rows = [dict(r) for r in doc["rows"]]
    R.add_metrics(rows)
    return {"rows": rows, "summary": R.summarize(rows)}


def slower_cases(rows: Sequence[dict], min_m: int = 0) -> List[str]:
    """One line per ``auto``/``flux`` row below 1.00x NCCL by the ratio of medians or paired."""
    out = []
    for r in rows:
        if r["method"] not in SHOWN or r["status"] != "ok" or r["m"] < min_m:
            continue
        sp, pp = r.get("speedup_vs_nccl"), r.get("paired_speedup_vs_nccl")
        if (sp is not None and sp < 1.0) or (pp is not None and pp < 1.0):
            ran = f" -> {r['resolved_backend']}" if r.get("resolved_backend") else ""
            out.append(f"  {r['method']:5s} {r['op']:8s} {r['model']:16s} m={r['m']:<5d} "
                       f"medians {_ratio(sp)}  paired {_ratio(pp)}{ran}")
    return out


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}x"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--min-m", type=int, default=0, help="list slower cases from this m up")
    args = p.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            doc = json.load(f)
        res = rescore(doc)
        print(f"{path} (TP {doc.get('tp')}, {doc.get('gpu')}, {doc.get('trials')} trials)")
        print(R.format_summary(res["summary"]))
        print("\n".join(slower_cases(res["rows"], args.min_m)) or "  no auto/flux case slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
