"""Paired block ratios of several interleaved training jobs, against several references, in one JSON.

``benchmarks/interleave_report.py`` reads one job against one reference backend. A question such
as "does ``flux+keep`` beat ``flux``" needs the same pairing over every job that ran both, and
the jobs' step times drift by several % between runs (different hosts, clocks), so only ratios
within a job are compared. Per job (a ``logs.tgz`` from ``benchmarks/device_interleave.sh`` or a
plain log) and per reference the job ran, this prints and records each backend's paired median
(block median of the preceding reference block / the block's median; > 1: faster) with its
quartiles and block count, then, per (reference, backend), the list of job medians.

``python benchmarks/interleave_runs.py --references megatron flux --out x.json RUN1/logs.tgz ...``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave_report import summarize  # noqa: E402


def _log_path(path: str, tmp: str, index: int) -> str:
    """``path`` itself, or the ``interleave.log`` inside a ``logs.tgz``, extracted to ``tmp``."""
    if not path.endswith((".tgz", ".tar.gz")):
        return path
    with tarfile.open(path) as tar:
        member = tar.extractfile("interleave.log")
        if member is None:
            raise SystemExit(f"{path}: no interleave.log inside")
        out = os.path.join(tmp, f"{index}.log")
        with open(out, "wb") as f:
            f.write(member.read())
    return out


def runs_report(paths, references, *, warmup: int = 20, drop_first: int = 1,
                tokens_per_step: int = 8192) -> dict:
    runs, across = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, path in enumerate(paths):
            log = _log_path(path, tmp, index)
            run = {"log": path, "vs": {}}
            for ref in references:
                report = summarize(log, warmup=warmup, drop_first=drop_first,
                                   tokens_per_step=tokens_per_step, reference=ref)
                if ref not in report["backends"]:
                    continue  # this job did not run the reference
                run.setdefault("step_time_ms", {n: b["median_ms"] for n, b in report["backends"].items()})
                run["vs"][ref] = report["paired_speedup_vs_reference"]
                for name, sp in report["paired_speedup_vs_reference"].items():
                    across.setdefault(ref, {}).setdefault(name, []).append(sp["median"])
            runs.append(run)
    return {
        "definition": ("per job and reference: block median of the preceding reference block / "
                       "the block's median, then median, quartiles and range over blocks (> 1: "
                       "faster than the reference); 'across_runs' lists the job medians"),
        "warmup": warmup, "drop_first_per_block": drop_first,
        "runs": runs, "across_runs": across,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="logs.tgz files (device_interleave.sh) or plain logs")
    p.add_argument("--references", nargs="+", default=["megatron"])
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--drop-first", type=int, default=1)
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    report = runs_report(args.logs, args.references, warmup=args.warmup,
                         drop_first=args.drop_first, tokens_per_step=args.tokens_per_step)
    report["command"] = "python benchmarks/interleave_runs.py " + " ".join(
        (argv if argv is not None else sys.argv[1:]))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for ref, rows in report["across_runs"].items():
        for name, medians in rows.items():
            print(f"{name:>18} vs {ref:<9}: " + " ".join(f"{m:.3f}" for m in medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
