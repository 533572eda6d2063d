"""Experiment: are the fused kernels' slow samples slow launches, or slow stretches of launches?

Session 22 found gpt3-175b GEMM+RS m = 64 (merged rows) alternating between two per-trial means
(0.148 and 0.179 ms) while cuBLAS stayed within 0.2 %, and single runs of m = 1024 shapes move
by 3-7 %. A trial there is one CUDA-event pair around 20 launches. Here every launch has its own
event pair (GPU time: a sleep kernel ahead of each block lets the host queue the block first),
so the record says, per method, whether the times are bimodal launch by launch, whether a mode
persists for a whole block (lag-1 correlation of consecutive launches), and whether it follows
the method timed just before (``after``).

One GPU, communication off (``kernel_vs_cublas``'s TP 2 wiring). Per shape the methods are
cuBLAS, the fused kernel with the shipped table's config or the default (``--config``), and
the plain persistent GEMM of the same tile; each trial times every method once, in a shuffled
order, ``--warmup`` untimed launches then ``--block`` timed ones.

    PYTHONPATH=. python benchmarks/experiments/launch_modes.py --case rs:gpt3-175b:64:default \
        --case rs:gpt3-175b:1024:table --json launch-modes.json
"""

import argparse
import dataclasses
import random
import statistics

import torch

from common import named_configs, write_record
from megatron_flux.bench.kernel_vs_cublas import (
    _plain_runner,
    _rs_runner,
    _ag_runner,
    _sleep_cycles_per_ms,
    grid_shape,
)
from megatron_flux.tuning.provider import TableConfigProvider


def timed_block(fn, n, sleep_cycles):
    """Per-launch GPU times (ms) of ``n`` back-to-back launches of ``fn``."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda._sleep(sleep_cycles)
    events[0].record()
    for i in range(n):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(n)]


def summary(times):
    """Quantiles, the share of launches 10 % or more above the fastest decile, and the lag-1
    correlation of consecutive launches inside blocks."""
    flat = sorted(t for block in times for t in block)
    q = lambda p: flat[min(len(flat) - 1, int(p * len(flat)))]  # noqa: E731
    fast = q(0.1)
    slow_share = sum(t > 1.1 * fast for t in flat) / len(flat)
    xs, ys = [], []
    for block in times:
        xs += block[:-1]
        ys += block[1:]
    try:
        lag1 = statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        lag1 = None
    block_medians = [statistics.median(b) for b in times]
    return {"p05": q(0.05), "p25": q(0.25), "median": q(0.5), "p75": q(0.75), "p95": q(0.95),
            "min": flat[0], "max": flat[-1], "slow_share": slow_share, "lag1": lag1,
            "block_medians": block_medians}


def methods_for(case):
    op, model, m, which = case.split(":")
    m = int(m)
    short = "ag" if op == "ag" else "rs"
    n, k = grid_shape(short, model, 2)
    cfg = named_configs(TableConfigProvider(), short, m, n, k, 2)[which]
    runner = _ag_runner if short == "ag" else _rs_runner
    fused, cublas, check, err = runner(m, n, k, 2, cfg, torch.bfloat16)
    plain, _, _, _ = _plain_runner(m, n, k, 2, cfg, torch.bfloat16)
    return (op, model, m, n, k, which, cfg), {"cublas": cublas, "fused": fused, "plain": plain}, check


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", required=True,
                   help="op:model:m:config, op in ag/rs, config in table/default")
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    p.add_argument("--json")
    args = p.parse_args()
    sleep_cycles = int(args.sleep_ms * _sleep_cycles_per_ms())
    rows = []
    for case in args.case:
        (op, model, m, n, k, which, cfg), fns, check = methods_for(case)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        got, ref = check()
        rel = float((got - ref).norm() / ref.norm())
        times = {name: [] for name in fns}
        after = {name: [] for name in fns}
        rng = random.Random(0)
        order = list(fns)
        prev = None
        for _ in range(args.trials):
            rng.shuffle(order)
            for name in order:
                for _ in range(args.warmup):
                    fns[name]()
                times[name].append(timed_block(fns[name], args.block, sleep_cycles))
                after[name].append(prev)
                prev = name
        base = statistics.median(t for b in times["cublas"] for t in b)
        line = [f"{case} rel_err {rel:.2e} cublas {base:.4f} ms"]
        for name, blocks in times.items():
            s = summary(blocks)
            rows.append({"case": case, "op": op, "model": model, "m": m, "n": n, "k": k,
                         "config_label": which, "cfg": dataclasses.asdict(cfg) if name != "cublas" else None,
                         "method": name, "rel_err": rel if name == "fused" else None,
                         "after": after[name], "times_ms": blocks, **s})
            line.append(f"{name}: med {s['median'] / base:.3f} p05 {s['p05'] / base:.3f} "
                        f"p95 {s['p95'] / base:.3f} slow {s['slow_share']:.2f} lag1 "
                        f"{s['lag1'] if s['lag1'] is None else round(s['lag1'], 2)}")
        print("\n  ".join(line), flush=True)
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
