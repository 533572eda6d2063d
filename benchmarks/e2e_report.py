"""Build the end-to-end result JSON from Megatron training logs (stock, nccl, flux runs).

    python benchmarks/e2e_report.py --log stock=stock.log --log nccl=nccl.log \\
        --log flux=flux.log --comm comm.json --tokens-per-step 8192 --warmup 20 \\
        --command "bash benchmarks/e2e_device.sh" --model llama3-8b-16l --out e2e.json

Each log is what ``examples/pretrain_gpt.py`` printed with ``--log-interval 1``: one line per
iteration with ``elapsed time per iteration (ms)`` and ``lm loss``. Step time is the median over
the iterations after ``--warmup``; spread is max - min over those. Loss parity compares every
iteration's ``lm loss`` of ``flux`` (and of stock) with ``nccl``.

Acceptance bound for |flux - nccl|. The backends compute the same math with different bf16
GEMM kernels (Triton vs cuBLAS tile orders and rounding), so per-step losses are not bitwise
equal, and the difference grows wherever training is sensitive (loss spikes). The noise floor is
measured in the same job: stock megatron-core linears and the plugin's ``nccl`` backend are both
NCCL + cuBLAS, written differently (stock re-gathers the input for the weight gradient, the
plugin keeps it; the plugin's ops also accumulate the fp32 weight gradient into ``main_grad``
directly, where stock without apex adds its bf16 rounding), and differ by that same kind of
rounding. flux passes when

1. while the loss is above 1 nat (before the mock data is memorised and the loss turns spiky),
   max |flux - nccl| <= 0.01 nats (bf16 has 8 mantissa bits: about 0.4 % relative rounding per
   operation; a wrong kernel - a missing or doubled partial, a stale signal - is off by whole
   nats from the first step);
2. over all steps, and over the last 50, mean |flux - nccl| <= 2 x mean |stock - nccl|.

With a second stock run (a log named ``stock2``: the same job again, same seed) the report also
compares every run with ``stock`` (``loss_parity_vs_stock``), the noise floor being the two
stock runs' difference (their attention backward and reductions are not bitwise repeatable), under
the same two rules with ``stock`` as the reference and ``stock2`` as the noise.

A first bound, fixed before any run (mean |diff| <= 1 % of the loss and max |diff| <= 0.1 over
all steps), failed for stock vs nccl as well as for flux vs nccl on 2xH200 (max 1.7 nats, at a
loss spike both runs share), i.e. it was tighter than two NCCL + cuBLAS implementations agree;
it is still reported, under ``loss_parity.first_bound``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from typing import Dict, List, Tuple

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+)")
STAMP_RE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]\s+iteration\s+(\d+)/")
TIME_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS_RE = re.compile(r"lm loss: ([0-9.Ee+-]+)")
TFLOPS_RE = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
MEAN_REL_BOUND = 0.01       # the first bound (see the docstring)
MAX_ABS_BOUND = 0.1
EARLY_LOSS = 1.0            # "early": while the reference loss is above this
EARLY_MAX_ABS = 0.01
NOISE_FACTOR = 2.0          # flux's mean |diff| may be this many times stock's
LAST_STEPS = 50


def parse_log(path: str) -> Dict[int, Tuple[float, float, float]]:
    """``{iteration: (loss, step_ms, tflops)}`` from a Megatron log (NaN where missing)."""
    rows: Dict[int, Tuple[float, float, float]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            it = ITER_RE.search(line)
            if not it:
                continue
            loss, t, tf = LOSS_RE.search(line), TIME_RE.search(line), TFLOPS_RE.search(line)
            nan = float("nan")
            rows[int(it.group(1))] = (
                float(loss.group(1)) if loss else nan,
                float(t.group(1)) if t else nan,
                float(tf.group(1)) if tf else nan,
            )
    return rows


def iteration_times(path: str) -> Dict[int, datetime.datetime]:
    """``{iteration: wall-clock time of its log line}`` (Megatron's ``[YYYY-MM-DD hh:mm:ss.f]``)."""
    out: Dict[int, datetime.datetime] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = STAMP_RE.search(line)
            if m:
                out[int(m.group(2))] = datetime.datetime.fromisoformat(m.group(1))
    return out


def gpu_utilization(util_csv: str, start: datetime.datetime, end: datetime.datetime) -> Dict[str, object]:
    """Median ``utilization.gpu`` per GPU from ``nvidia-smi --query-gpu=timestamp,index,
    utilization.gpu --format=csv,noheader,nounits`` samples taken between ``start`` and ``end``
    (the timed iterations). The percentage is the share of sample periods with a kernel running:
    a step that leaves the GPUs idle while the host catches up shows well below 100."""
    per_gpu: Dict[str, List[float]] = {}
    with open(util_csv, errors="replace") as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 3:
                continue
            try:
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
                value = float(parts[2])
            except ValueError:
                continue
            if start <= t <= end:
                per_gpu.setdefault(parts[1], []).append(value)
    return {"median_pct": {g: statistics.median(v) for g, v in sorted(per_gpu.items())},
            "samples": {g: len(v) for g, v in sorted(per_gpu.items())}}


def _mean_abs(ref: List[float], other: List[float]) -> float:
    return statistics.fmean(abs(a - b) for a, b in zip(ref, other))


def parity(ref: List[float], other: List[float], noise: List[float] = None) -> dict:
    """|other - ref| statistics and the bounds of the module docstring (``noise``: stock)."""
    diffs = [abs(a - b) for a, b in zip(ref, other)]
    mean_loss = statistics.fmean(ref)
    early = next((i for i, x in enumerate(ref) if x <= EARLY_LOSS), len(ref))
    out = {
        "steps_compared": len(diffs),
        "max_abs_diff": max(diffs),
        "max_abs_diff_at_step": diffs.index(max(diffs)) + 1,
        "mean_abs_diff": statistics.fmean(diffs),
        "mean_abs_diff_last": statistics.fmean(diffs[-LAST_STEPS:]),
        "final_abs_diff": diffs[-1],
        "early_steps": early,
        "early_max_abs_diff": max(diffs[:early]) if early else None,
        "first_bound": {
            "mean_abs_diff_rel": statistics.fmean(diffs) / mean_loss,
            "within": max(diffs) <= MAX_ABS_BOUND
            and statistics.fmean(diffs) <= MEAN_REL_BOUND * mean_loss,
        },
    }
    if noise is None:  # the noise floor itself (stock vs nccl): only the early bound applies
        out["within_early_bound"] = bool(early and out["early_max_abs_diff"] <= EARLY_MAX_ABS)
    else:
        floor_all = _mean_abs(ref, noise)
        floor_last = _mean_abs(ref[-LAST_STEPS:], noise[-LAST_STEPS:])
        out["noise_floor_mean_abs_diff"] = floor_all
        out["noise_floor_mean_abs_diff_last"] = floor_last
        out["within_bound"] = bool(
            early and out["early_max_abs_diff"] <= EARLY_MAX_ABS
            and out["mean_abs_diff"] <= NOISE_FACTOR * floor_all
            and out["mean_abs_diff_last"] <= NOISE_FACTOR * floor_last
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", action="append", required=True, help="NAME=PATH (stock, nccl, flux)")
    ap.add_argument("--comm", help="benchmarks/e2e_comm.py output")
    ap.add_argument("--util", action="append", default=[],
                    help="NAME=PATH: nvidia-smi utilization samples taken during run NAME")
    ap.add_argument("--tokens-per-step", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=20, help="iterations left out of step time")
    ap.add_argument("--command", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", action="append", default=[], help="KEY=JSON merged into the output")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    log_paths = dict(item.partition("=")[::2] for item in args.log)
    runs = {name: parse_log(path) for name, path in log_paths.items()}
    missing = [n for n, r in runs.items() if not r]
    out: dict = {"command": args.command, "model": args.model, "failed_runs": missing}
    for item in args.extra:
        key, _, value = item.partition("=")
        out[key] = json.loads(value)
    ok = {n: r for n, r in runs.items() if r}
    steps = min((max(r) for r in ok.values()), default=0)
    out["steps"] = steps
    out["loss"] = {n: [r[i][0] for i in range(1, steps + 1) if i in r] for n, r in ok.items()}
    timed = {n: [r[i][1] for i in range(args.warmup + 1, steps + 1) if i in r] for n, r in ok.items()}
    out["step_time_ms"] = {n: statistics.median(t) for n, t in timed.items() if t}
    out["step_time_spread_ms"] = {n: max(t) - min(t) for n, t in timed.items() if t}
    out["step_time_quartiles_ms"] = {
        n: statistics.quantiles(t, n=4) for n, t in timed.items() if len(t) >= 2
    }
    out["tflops_per_gpu"] = {
        n: statistics.median([r[i][2] for i in range(args.warmup + 1, steps + 1) if i in r])
        for n, r in ok.items() if steps > args.warmup
    }
    out["tokens_per_step"] = args.tokens_per_step
    out["tokens_per_s"] = {n: args.tokens_per_step / (t / 1e3) for n, t in out["step_time_ms"].items()}
    st = out["step_time_ms"]
    if "stock" in st:
        out["speedup_vs_stock"] = {n: st["stock"] / t for n, t in st.items()}
    if "nccl" in out["loss"]:
        ref = out["loss"]["nccl"]
        out["loss_parity"] = {
            "reference": "nccl",
            "noise_floor": "stock vs nccl (two NCCL+cuBLAS implementations)",
            "bound": {
                "early": f"max |diff| <= {EARLY_MAX_ABS} while the nccl loss is > {EARLY_LOSS}",
                "all_steps": f"mean |diff| <= {NOISE_FACTOR} x mean |stock - nccl|",
                "last_steps": f"the same over the last {LAST_STEPS} steps",
                "first_bound": f"mean |diff| <= {MEAN_REL_BOUND:.0%} of the loss and max |diff| "
                               f"<= {MAX_ABS_BOUND} (fixed before the runs; failed for stock too)",
                "why": "see the docstring of benchmarks/e2e_report.py",
            },
        }
        stock = out["loss"].get("stock")
        for n, losses in out["loss"].items():
            if n != "nccl" and losses and len(losses) == len(ref):
                noise = stock if n != "stock" and stock and len(stock) == len(ref) else None
                out["loss_parity"][n] = parity(ref, losses, noise)
    if "stock" in out["loss"] and "stock2" in out["loss"]:
        ref, noise = out["loss"]["stock"], out["loss"]["stock2"]
        block = {
            "reference": "stock",
            "noise_floor": "stock vs stock2 (the same stock job run twice, same seed)",
            "bound": {
                "early": f"max |diff| <= {EARLY_MAX_ABS} while the stock loss is > {EARLY_LOSS}",
                "all_steps": f"mean |diff| <= {NOISE_FACTOR} x mean |stock2 - stock|",
                "last_steps": f"the same over the last {LAST_STEPS} steps",
            },
        }
        if len(noise) == len(ref):
            block["stock2"] = parity(ref, noise)
            for n, losses in out["loss"].items():
                if n not in ("stock", "stock2") and losses and len(losses) == len(ref):
                    block[n] = parity(ref, losses, noise)
        out["loss_parity_vs_stock"] = block
    util = {}
    for item in args.util:
        name, _, path = item.partition("=")
        stamps = iteration_times(log_paths[name])
        timed = [i for i in stamps if args.warmup < i <= steps]
        if timed:
            util[name] = gpu_utilization(path, stamps[min(timed)], stamps[max(timed)])
    if util:
        out["gpu_utilization"] = util
        out["gpu_utilization_definition"] = gpu_utilization.__doc__.split("\n\n")[0]
    if args.comm:
        with open(args.comm) as f:
            comm = json.load(f)
        out["tp_comm"] = comm
        per_step = comm["tp_comm_ms_per_step"]
        hidden = {}
        for n in st:  # every fused variant (flux, flux_keep, ...) against both references
            if n in ("stock", "nccl"):
                continue
            if "nccl" in st:
                hidden[f"{n}_vs_plugin_nccl"] = (st["nccl"] - st[n]) / per_step
            if "stock" in st:
                hidden[f"{n}_vs_stock"] = (st["stock"] - st[n]) / per_step
        out["tp_comm_hidden_fraction"] = hidden
        out["tp_comm_hidden_definition"] = (
            "(step time of the reference - step time of flux) / TP communication per step, "
            "where the latter is layers x microbatches x 4 x (all-gather + reduce-scatter of one "
            "[tokens, hidden] bf16 activation), each timed alone with NCCL (benchmarks/e2e_comm.py)"
        )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    summary = {k: out.get(k) for k in ("failed_runs", "steps", "step_time_ms", "tokens_per_s",
                                        "speedup_vs_stock", "tp_comm_hidden_fraction")}
    print(json.dumps(summary, indent=2))
    for n in out.get("loss_parity", {}):
        if n not in ("reference", "noise_floor", "bound"):
            print(n, "vs nccl:", json.dumps(out["loss_parity"][n]))
    for n in out.get("loss_parity_vs_stock", {}):
        if n not in ("reference", "noise_floor", "bound"):
            print(n, "vs stock:", json.dumps(out["loss_parity_vs_stock"][n]))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
