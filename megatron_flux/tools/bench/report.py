"""Turning timed rows into FLUX's metrics, a terminal table, a JSON document and a PNG.

Metrics (FLUX paper §2.3), per (op, model, m), from median times:

* ``ECT = T(method) − T(cublas_gemm)`` — effective communication time: what the method costs
  beyond the best non-split GEMM. Perfect overlap gives 0.
* ``overlap efficiency = 1 − ECT(method) / ECT(nccl)`` — 0 for the non-overlapped baseline,
  1 for perfect overlap, negative when the method is slower than the baseline.
* ``speedup = T(nccl) / T(method)``.
* ``paired speedup`` = the median over trials of ``T_i(nccl) / T_i(method)``. Every trial times
  each method once, back to back (:mod:`~.timing`), so trial ``i``'s two times share that
  moment's clocks and NVLink traffic; the ratio of two medians does not pair them, and on
  2×H200 two timings of the very same NCCL callable (``auto`` where it resolved to ``nccl``)
  came 0.92–0.94× apart that way and 0.99–1.00× paired. Both are reported.

Edge cases are defined rather than left to a ``ZeroDivisionError``: when ``ECT(nccl) <= 0``
(the baseline exposed no measurable communication, e.g. tiny collectives within timing noise)
the efficiency is undefined and reported as ``None`` (JSON ``null``, ``-`` in the table); a
missing or non-positive time gives ``None`` for every metric that needs it.

Only methods that compute the op (:data:`~.methods.COMPUTES_OP`) get metrics; ``cublas_gemm``
and ``comm`` are the yardsticks.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_flux.kernels.version import KERNEL_VERSION

from megatron_flux.tools.bench.grid import OPS
from megatron_flux.tools.bench.methods import COMPUTES_OP, METHODS, OVERLAPPING
from megatron_flux.tools.check import PLUGIN_ENV_VARS

STATUSES = ("ok", "skipped", "error")
#: m at or above which a case belongs to the main grid of the summary (FLUX's Fig. 11–13 range)
LARGE_M_MIN = 1024
#: environment variables that change how NCCL / symmetric memory behave, recorded with results
ENV_VARS = (
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "CUDA_VISIBLE_DEVICES",
) + PLUGIN_ENV_VARS  # which tables and launch paths the flux methods ran with


# ---------------------------------------------------------------------------------- metrics


def ect(method_ms: Optional[float], gemm_ms: Optional[float]) -> Optional[float]:
    """Effective communication time ``method − gemm`` (ms), or ``None`` if a time is missing."""
    if method_ms is None or gemm_ms is None:
        return None
    return method_ms - gemm_ms


def overlap_efficiency(ect_method: Optional[float], ect_nccl: Optional[float]) -> Optional[float]:
    """``1 − ECT(method)/ECT(nccl)``; ``None`` when either is missing or ``ECT(nccl) <= 0``."""
    if ect_method is None or ect_nccl is None or not ect_nccl > 0:
        return None
    return 1.0 - ect_method / ect_nccl


def speedup(method_ms: Optional[float], nccl_ms: Optional[float]) -> Optional[float]:
    """``T(nccl) / T(method)``; ``None`` when either is missing or ``T(method) <= 0``."""
    if method_ms is None or nccl_ms is None or not method_ms > 0:
        return None
    return nccl_ms / method_ms


def paired_speedup(method_trials: Sequence[float], nccl_trials: Sequence[float]) -> Optional[float]:
    """Median over trials of ``T_i(nccl) / T_i(method)``; ``None`` unless both have the same
    (non-zero) number of positive trial times (a method dropped mid-run has fewer)."""
    if not method_trials or len(method_trials) != len(nccl_trials):
        return None
    if not all(t > 0 for t in method_trials) or not all(t > 0 for t in nccl_trials):
        return None
    return statistics.median(n / m for m, n in zip(method_trials, nccl_trials))


def case_key(row: dict) -> Tuple[str, str, int]:
    return (row["op"], row["model"], row["m"])


def add_metrics(rows: List[dict]) -> None:
    """Fill ``ect_ms``, ``overlap_eff``, ``speedup_vs_nccl`` and ``paired_speedup_vs_nccl``
    into every row, in place."""
    ok = {(case_key(r), r["method"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        r["ect_ms"] = r["overlap_eff"] = r["speedup_vs_nccl"] = r["paired_speedup_vs_nccl"] = None
        if r["status"] != "ok" or r["method"] not in COMPUTES_OP:
            continue
        key = case_key(r)
        gemm_row, nccl_row = ok.get((key, "cublas_gemm")), ok.get((key, "nccl"))
        gemm = gemm_row["median_ms"] if gemm_row else None
        nccl = nccl_row["median_ms"] if nccl_row else None
        r["ect_ms"] = ect(r["median_ms"], gemm)
        r["overlap_eff"] = overlap_efficiency(r["ect_ms"], ect(nccl, gemm))
        r["speedup_vs_nccl"] = speedup(r["median_ms"], nccl)
        if nccl_row:
            r["paired_speedup_vs_nccl"] = paired_speedup(r.get("trials_ms") or [],
                                                         nccl_row.get("trials_ms") or [])


def _stats(values: Sequence[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _geomean(values: Sequence[float]) -> Optional[float]:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summarize(rows: Sequence[dict]) -> Dict[str, dict]:
    """Per op and m-range (``m>=1024`` / ``m<1024``), per overlapping method present:

    ``cases`` (timed), ``overlap_eff`` (median/min/max over cases with a defined efficiency),
    ``geomean_speedup_vs_nccl``, ``slower_than_nccl`` (cases with speedup < 1), the same two
    from the paired speedups (``geomean_paired_speedup_vs_nccl``, ``slower_than_nccl_paired``),
    ``check_failed`` (max_rel_err above threshold), ``skipped`` and ``errors`` counts. For
    ``auto``, also ``slower_on_nccl``: how many of its slower cases resolved to the ``nccl``
    backend itself, the very code the ``nccl`` method times, so that their distance from it is
    the benchmark's noise, not a choice.
    Expects :func:`add_metrics` to have run.
    """
    out: Dict[str, dict] = {}
    methods = [m for m in OVERLAPPING if any(r["method"] == m for r in rows)]
    for op in OPS:
        op_rows = [r for r in rows if r["op"] == op]
        if not op_rows:
            continue
        out[op] = {}
        for label, pick in ((f"m>={LARGE_M_MIN}", lambda m: m >= LARGE_M_MIN), (f"m<{LARGE_M_MIN}", lambda m: m < LARGE_M_MIN)):
            sel = [r for r in op_rows if pick(r["m"])]
            if not sel:
                continue
            block = {}
            for meth in methods:
                mr = [r for r in sel if r["method"] == meth]
                ok = [r for r in mr if r["status"] == "ok"]
                effs = [r["overlap_eff"] for r in ok if r.get("overlap_eff") is not None]
                sps = [r["speedup_vs_nccl"] for r in ok if r.get("speedup_vs_nccl") is not None]
                pps = [r["paired_speedup_vs_nccl"] for r in ok
                       if r.get("paired_speedup_vs_nccl") is not None]
                block[meth] = {
                    "cases": len(ok),
                    "overlap_eff": _stats(effs),
                    "geomean_speedup_vs_nccl": _geomean(sps),
                    "slower_than_nccl": sum(1 for s in sps if s < 1.0),
                    "geomean_paired_speedup_vs_nccl": _geomean(pps),
                    "slower_than_nccl_paired": sum(1 for s in pps if s < 1.0),
                    "min_paired_speedup_vs_nccl": min(pps) if pps else None,
                    "check_failed": sum(1 for r in ok if r.get("check") == "FAIL"),
                    "skipped": sum(1 for r in mr if r["status"] == "skipped"),
                    "errors": sum(1 for r in mr if r["status"] == "error"),
                }
                if meth == "auto":
                    block[meth]["slower_on_nccl"] = sum(
                        1 for r in ok if r.get("speedup_vs_nccl") is not None
                        and r["speedup_vs_nccl"] < 1.0 and r.get("resolved_backend") == "nccl")
            out[op][label] = block
    return out


# ---------------------------------------------------------------------------------- table


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _note(r: dict, footnotes: Dict[str, int]) -> str:
    """The row's note; skip and error reasons become numbered footnotes (they are long and
    usually repeat across cases)."""
    notes = []
    if r["status"] in ("skipped", "error"):
        text = f"{r['status']}: {r.get('reason') or ''}"
        notes.append(f"{'ERROR' if r['status'] == 'error' else 'skipped'} [{footnotes.setdefault(text, len(footnotes) + 1)}]")
    if r.get("check") == "FAIL":
        notes.append(f"CHECK FAILED (> {r.get('max_rel_err_threshold', float('nan')):.0e})")
    if r.get("resolved_backend"):
        notes.append(f"-> {r['resolved_backend']}")
    return " ".join(notes)


def format_table(rows: Sequence[dict]) -> str:
    """A fixed-width table: one line per (case, method), a rule between cases, then the
    footnotes with the full skip / error reasons."""
    head = ("op", "model", "m", "n", "k", "method", "median_ms", "spread_ms", "ECT_ms", "eff", "speedup", "paired",
            "rel_err", "note")
    lines: List[Optional[Tuple[str, ...]]] = []
    footnotes: Dict[str, int] = {}
    last = None
    for r in rows:
        key = case_key(r)
        if last is not None and key != last:
            lines.append(None)
        last = key
        eff, sp = r.get("overlap_eff"), r.get("speedup_vs_nccl")
        lines.append((
            r["op"], r["model"], str(r["m"]), str(r["n"]), str(r["k"]), r.get("label", r["method"]),
            _fmt(r.get("median_ms"), ".4f"), _fmt(r.get("spread_ms"), ".4f"), _fmt(r.get("ect_ms"), "+.4f"),
            "-" if eff is None else f"{eff * 100:+.1f}%", "-" if sp is None else f"{sp:.3f}x",
            "-" if r.get("paired_speedup_vs_nccl") is None else f"{r['paired_speedup_vs_nccl']:.3f}x",
            _fmt(r.get("max_rel_err"), ".1e"), _note(r, footnotes),
        ))
    widths = [max([len(head[i])] + [len(l[i]) for l in lines if l]) for i in range(len(head))]
    right = {2, 3, 4, 6, 7, 8, 9, 10, 11, 12}

    def render(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "-" * len(render(head))
    out = [render(head), rule] + [rule if l is None else render(l) for l in lines]
    out += [f"[{i}] {text}" for text, i in footnotes.items()]
    return "\n".join(out)


def _paired_text(s: dict) -> str:
    if s.get("min_paired_speedup_vs_nccl") is None:
        return ""
    return (f" (paired: {s['slower_than_nccl_paired']}, worst "
            f"{s['min_paired_speedup_vs_nccl']:.3f}x)")


def format_summary(summary: Dict[str, dict]) -> str:
    """A few lines per op: median overlap efficiency and slower-than-nccl counts."""
    lines = []
    for op, ranges in summary.items():
        for label, block in ranges.items():
            for meth, s in block.items():
                eff = s["overlap_eff"]["median"]
                gm = s["geomean_speedup_vs_nccl"]
                lines.append(
                    f"{op:8s} {label:8s} {meth:15s} cases={s['cases']:2d}  median eff="
                    + ("   -   " if eff is None else f"{eff * 100:+6.1f}%")
                    + "  geomean speedup=" + ("  -  " if gm is None else f"{gm:.3f}x")
                    + f"  slower than nccl={s['slower_than_nccl']}"
                    + (f" ({s['slower_on_nccl']} ran nccl itself)" if s.get("slower_on_nccl") else "")
                    + _paired_text(s)
                    + f"  check failed={s['check_failed']}"
                    + f"  skipped={s['skipped']}  errors={s['errors']}"
                )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- JSON


def validate_result(doc: dict) -> None:
    """Raise ``ValueError`` listing every way ``doc`` departs from the result schema."""
    problems = []
    for key, typ in (("command", str), ("gpu", str), ("tp", int), ("torch", str), ("triton", str), ("rows", list)):
        if not isinstance(doc.get(key), typ) or (typ is int and isinstance(doc.get(key), bool)):
            problems.append(f"{key}: expected {typ.__name__}, got {type(doc.get(key)).__name__}")
    for i, r in enumerate(doc.get("rows") or []):
        where = f"rows[{i}]"
        if not isinstance(r, dict):
            problems.append(f"{where}: not an object")
            continue
        if r.get("op") not in OPS:
            problems.append(f"{where}.op: {r.get('op')!r} not in {OPS}")
        if r.get("method") not in METHODS:
            problems.append(f"{where}.method: {r.get('method')!r} not in {METHODS}")
        if not isinstance(r.get("model"), str):
            problems.append(f"{where}.model: expected str")
        for key in ("m", "n", "k"):
            v = r.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                problems.append(f"{where}.{key}: expected positive int, got {v!r}")
        status = r.get("status")
        if status not in STATUSES:
            problems.append(f"{where}.status: {status!r} not in {STATUSES}")
        timed = status == "ok"
        for key in ("median_ms", "spread_ms"):
            v = r.get(key)
            good = isinstance(v, float) and math.isfinite(v) and v >= 0 if timed else v is None
            if not good:
                problems.append(f"{where}.{key}: {v!r} (status {status!r})")
        trials = r.get("trials_ms")
        if not isinstance(trials, list) or (timed and not trials) or not all(isinstance(t, float) for t in trials):
            problems.append(f"{where}.trials_ms: expected a list of floats (non-empty when ok)")
        if not timed and not r.get("reason"):
            problems.append(f"{where}.reason: a {status!r} row must say why")
        err = r.get("max_rel_err")
        if err is not None and not (isinstance(err, float) and err >= 0):
            problems.append(f"{where}.max_rel_err: {err!r}")
    if problems:
        raise ValueError("benchmark result does not match the schema:\n  " + "\n  ".join(problems))


def write_json(path: str, doc: dict) -> None:
    """Validate and write ``doc`` as strict JSON (no NaN/Infinity), creating parent dirs."""
    validate_result(doc)
    text = json.dumps(doc, indent=1, allow_nan=False)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def collect_env(device: torch.device, group: Optional[dist.ProcessGroup]) -> dict:
    """Versions, devices and communication-relevant env vars (collective: every rank calls)."""
    mine = {"host": platform.node(), "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        mine.update(name=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    everyone: List[Optional[dict]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    nccl = None
    if device.type == "cuda":
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "nccl": nccl,
        "kernel_version": KERNEL_VERSION,
        "dist_backend": dist.get_backend(group),
        "ranks": everyone,
        "gpus": [r.get("name") for r in everyone if r.get("name")],
        "sms": everyone[0].get("sms"),
        "env_vars": {k: os.environ.get(k) for k in ENV_VARS},
    }


# ---------------------------------------------------------------------------------- PNG


#: overlap-efficiency panels clip below this (%), labelling the clipped bars with their value
EFF_FLOOR_PCT = -200.0


def _label_cases(ax, cases: Sequence[Tuple[str, int]]) -> None:
    """m values as tick labels, model names centred under their block, dashed model borders."""
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([str(m) for _, m in cases], fontsize=7, rotation=90)
    ax.set_xlim(-0.6, len(cases) - 0.4)
    start = 0
    for x in range(1, len(cases) + 1):
        if x == len(cases) or cases[x][0] != cases[start][0]:
            ax.text((start + x - 1) / 2, -0.2, cases[start][0], transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=8)
            if x < len(cases):
                ax.axvline(x - 0.5, color="#bbbbbb", linestyle="--", linewidth=0.8)
            start = x


def plot_png(path: str, rows: Sequence[dict], summary: Dict[str, dict], title: str) -> Optional[str]:
    """Write the figure; return ``None`` on success or the reason it was not drawn.

    Layout: one row of panels per op — left, ECT (ms) per case for every method that computes
    the op (nccl included: its bar is the communication left exposed); right, overlap efficiency
    per case for the overlapping methods — and a bottom panel with each overlapping method's
    median efficiency per op and m-range. matplotlib is optional (``pip install
    megatron-flux[bench]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not importable ({exc})"
    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    if not ops:
        return "no rows to plot"
    colors = {"nccl": "#7f7f7f", "torch_async_tp": "#1f77b4", "flux": "#d62728", "flux_default": "#e377c2", "flux_variant": "#2ca02c", "flux_control": "#8c564b", "auto": "#ff7f0e"}
    fig = plt.figure(figsize=(16, 4.8 * len(ops) + 3.5))
    grid = fig.add_gridspec(len(ops) + 1, 2, height_ratios=[4.8] * len(ops) + [3.0])
    for i, op in enumerate(ops):
        op_rows = [r for r in rows if r["op"] == op]
        cases = list(dict.fromkeys((r["model"], r["m"]) for r in op_rows))
        for j, (metric, meths, ylabel, scale) in enumerate((
            ("ect_ms", [m for m in COMPUTES_OP], "ECT (ms)", 1.0),
            ("overlap_eff", list(OVERLAPPING), "overlap efficiency (%)", 100.0),
        )):
            ax = fig.add_subplot(grid[i, j])
            present = [m for m in meths if any(r["method"] == m and r.get(metric) is not None for r in op_rows)]
            width = 0.8 / max(1, len(present))
            shown = []
            for b, meth in enumerate(present):
                val = {(r["model"], r["m"]): r.get(metric) for r in op_rows if r["method"] == meth}
                ys = [scale * val[c] if val.get(c) is not None else math.nan for c in cases]
                xs = [x + (b - (len(present) - 1) / 2) * width for x in range(len(cases))]
                ax.bar(xs, ys, width, label=meth, color=colors.get(meth))
                shown += [(x, y) for x, y in zip(xs, ys) if not math.isnan(y)]
            if metric == "overlap_eff" and shown and min(y for _, y in shown) < EFF_FLOOR_PCT:
                # a few very negative efficiencies would flatten every other bar: clip, label them
                ax.set_ylim(EFF_FLOOR_PCT, max(110.0, max(y for _, y in shown) + 10))
                for x, y in shown:
                    if y < EFF_FLOOR_PCT:
                        ax.text(x, EFF_FLOOR_PCT * 0.97, f"{y:.0f}%", rotation=90, fontsize=6, ha="center", va="bottom")
            _label_cases(ax, cases)
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op}: {ylabel.split(' (')[0]}")
            if present:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no method timed", transform=ax.transAxes, ha="center")
    ax = fig.add_subplot(grid[len(ops), :])
    groups = [(op, label) for op in summary for label in summary[op]]
    meths = [m for m in OVERLAPPING if any(m in summary[op][label] for op, label in groups)]
    width = 0.8 / max(1, len(meths))
    for b, meth in enumerate(meths):
        ys = []
        for op, label in groups:
            med = summary[op][label].get(meth, {}).get("overlap_eff", {}).get("median")
            ys.append(math.nan if med is None else 100.0 * med)
        xs = [x + (b - (len(meths) - 1) / 2) * width for x in range(len(groups))]
        ax.bar(xs, ys, width, label=meth, color=colors.get(meth))
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{op} {label}" for op, label in groups], fontsize=8)
    ax.set_ylabel("median overlap eff. (%)")
    ax.set_title("summary: median overlap efficiency per op and m-range (0 = nccl, 100 = perfect)")
    if meths:
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
