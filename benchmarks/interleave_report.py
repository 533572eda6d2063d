"""Step times per backend from one training job that rotated the backend between iterations.

``examples/pretrain_gpt.py --flux-interleave-backends megatron nccl flux auto
--flux-interleave-steps N`` switches every Flux linear's backend each ``N`` iterations and logs
``[flux-interleave] iteration K: backend NAME``; Megatron logs ``iteration K/ T | ... elapsed
time per iteration (ms): X``. Separate jobs on a 2xH200 machine differed by up to 20 ms per
step for the same code; blocks of one job share the process, the GPUs' state and the host's
load, so their differences are the backends'.

Per backend this reports the median step time, its quartiles and p10/p90 over the kept
iterations (after ``--warmup``, without the first ``--drop-first`` iterations of each block,
which may carry the previous backend's queued work or a first-call cost), tokens/s, and a
*paired* speedup: per rotation, the reference block's median over this backend's, then the
median and quartiles of those ratios.

``python benchmarks/interleave_report.py --log job.log --tokens-per-step 8192 --out x.json``
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
from typing import Dict, List, Optional, Tuple

TAG_RE = re.compile(r"\[flux-interleave\] iteration (\d+): backend (\S+)")
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+)")
TIME_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS_RE = re.compile(r"lm loss: ([0-9.Ee+-]+)")


def parse(path: str) -> Tuple[List[Tuple[int, str]], Dict[int, Tuple[float, Optional[float]]]]:
    """``(switches, steps)``: the logged switches ``(first iteration, backend)`` in order, and
    ``{iteration: (ms, loss)}``."""
    switches: Dict[int, str] = {}
    steps: Dict[int, Tuple[float, Optional[float]]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            tag = TAG_RE.search(line)
            if tag:
                switches[int(tag.group(1))] = tag.group(2)
                continue
            it, ms = ITER_RE.search(line), TIME_RE.search(line)
            if it and ms:
                loss = LOSS_RE.search(line)
                steps[int(it.group(1))] = (float(ms.group(1)), float(loss.group(1)) if loss else None)
    return sorted(switches.items()), steps


def blocks(switches: List[Tuple[int, str]], steps: Dict[int, Tuple[float, Optional[float]]]):
    """``[(backend, [(iteration, ms), ...]), ...]``: the iterations of each block, in order."""
    starts = [k for k, _ in switches]
    out: List[Tuple[str, List[Tuple[int, float]]]] = []
    for it in sorted(steps):
        i = bisect.bisect_right(starts, it) - 1
        if i < 0:
            continue  # before the first switch: not attributable
        if not out or out[-1][2] != i:
            out.append((switches[i][1], [], i))
        out[-1][1].append((it, steps[it][0]))
    return [(name, its) for name, its, _ in out]


def _quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(path: str, *, warmup: int, drop_first: int, tokens_per_step: int,
              reference: str, exclude: Tuple[int, int] = (0, -1)) -> dict:
    switches, steps = parse(path)
    if not switches:
        raise SystemExit(f"{path}: no '[flux-interleave]' lines (was --flux-interleave-backends set?)")
    kept: Dict[str, List[float]] = {}
    per_block: List[Tuple[str, float]] = []
    for name, its in blocks(switches, steps):
        its = [(i, ms) for i, ms in its[drop_first:]
               if i > warmup and not exclude[0] <= i <= exclude[1]]
        if not its:
            continue
        kept.setdefault(name, []).extend(ms for _, ms in its)
        per_block.append((name, statistics.median(ms for _, ms in its)))
    backends = {}
    for name, xs in kept.items():
        med = statistics.median(xs)
        backends[name] = {
            "steps": len(xs),
            "median_ms": round(med, 2),
            "quartiles_ms": [round(_quantile(xs, 0.25), 2), round(_quantile(xs, 0.75), 2)],
            "p10_p90_ms": [round(_quantile(xs, 0.1), 2), round(_quantile(xs, 0.9), 2)],
            "tokens_per_s": round(tokens_per_step / (med / 1e3), 1),
        }
    # paired: each block against the nearest preceding block of the reference (same rotation)
    paired: Dict[str, List[float]] = {}
    last_ref: Optional[float] = None
    for name, med in per_block:
        if name == reference:
            last_ref = med
        elif last_ref is not None:
            paired.setdefault(name, []).append(last_ref / med)
    speedup = {}
    for name, ratios in paired.items():
        speedup[name] = {
            "blocks": len(ratios),
            "median": round(statistics.median(ratios), 4),
            "quartiles": [round(_quantile(ratios, 0.25), 4), round(_quantile(ratios, 0.75), 4)],
            "min_max": [round(min(ratios), 4), round(max(ratios), 4)],
        }
    losses = {it: loss for it, (_, loss) in sorted(steps.items()) if loss is not None}
    # the training proof's schema (issue 4): the reference 'megatron' is stock megatron-core
    label = {reference: "stock"} if reference == "megatron" else {}
    schema = {
        "steps": len(steps),
        "step_time_ms": {label.get(n, n): r["median_ms"] for n, r in backends.items()},
        "tokens_per_s": {label.get(n, n): r["tokens_per_s"] for n, r in backends.items()},
        "speedup_vs_stock" if reference == "megatron" else f"speedup_vs_{reference}":
            {n: v["median"] for n, v in speedup.items()},
    }
    return {
        **schema,
        "log": path,
        "schedule": [{"from_iteration": k, "backend": b} for k, b in switches[: 2 * len(backends) + 2]],
        "steps_logged": len(steps),
        "warmup": warmup,
        "excluded_iterations": list(exclude) if exclude[0] <= exclude[1] else None,
        "drop_first_per_block": drop_first,
        "tokens_per_step": tokens_per_step,
        "backends": backends,
        "reference": reference,
        "paired_speedup_vs_reference": speedup,
        "paired_speedup_definition": (
            f"per block: median step time of the preceding '{reference}' block / this block's "
            "median; then the median, quartiles and range over blocks (> 1: faster than the "
            "reference)"),
        "loss": {"interleaved": [losses[k] for k in sorted(losses)]},
        "loss_note": ("one loss curve: the backends alternate every block of iterations; loss "
                      "parity between backends comes from separate runs (benchmarks/e2e_device.sh)"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True)
    p.add_argument("--warmup", type=int, default=10, help="ignore iterations up to this one")
    p.add_argument("--drop-first", type=int, default=1, help="ignore this many iterations of each block")
    p.add_argument("--tokens-per-step", type=int, required=True)
    p.add_argument("--reference", default="megatron")
    p.add_argument("--exclude", default=None, metavar="A-B",
                   help="ignore iterations A..B too (e.g. the profiled ones)")
    p.add_argument("--comm-ms", type=float, default=None,
                   help="TP communication per step (benchmarks/e2e_comm.py): adds the share of it "
                        "each backend hid against the reference, (ref - backend) / comm")
    p.add_argument("--extra", action="append", default=[], metavar="KEY=JSON",
                   help="extra top-level fields (JSON values), e.g. command=...")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    exclude = (0, -1)
    if args.exclude:
        lo, _, hi = args.exclude.partition("-")
        exclude = (int(lo), int(hi or lo))
    report = summarize(args.log, warmup=args.warmup, drop_first=args.drop_first,
                       tokens_per_step=args.tokens_per_step, reference=args.reference,
                       exclude=exclude)
    if args.comm_ms:
        ref = report["backends"].get(args.reference)
        if ref is not None:
            report["tp_comm_ms_per_step"] = args.comm_ms
            report["tp_comm_hidden_fraction"] = {
                n: round((ref["median_ms"] - r["median_ms"]) / args.comm_ms, 3)
                for n, r in report["backends"].items() if n != args.reference}
    for item in args.extra:
        key, _, value = item.partition("=")
        try:
            report[key] = json.loads(value)
        except json.JSONDecodeError:
            report[key] = value
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for name, row in report["backends"].items():
        sp = report["paired_speedup_vs_reference"].get(name)
        print(f"{name:>10}: {row['median_ms']:8.1f} ms  IQR {row['quartiles_ms']}  "
              f"n={row['steps']}" + (f"  paired x{sp['median']} {sp['quartiles']}" if sp else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
