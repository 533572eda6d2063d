"""Experiment: the first compiled run of ``ag_merge_local`` (one GPU, communication off), sized
for the last two minutes of a session's device time.

At one shape (default llama3-8b m = 1024, TP 2, the table's config) the per-segment kernel and
the merged one with leads of 1 and 0 waves run in ``kernel_vs_cublas``'s one-GPU wiring: each
output is checked against fp32 math and the merged ones against the per-segment one bitwise,
then all run interleaved with cuBLAS (``--trials`` x ``--iters``), printing as they go.

    PYTHONPATH=. python benchmarks/experiments/ag_merge_quick.py --json merge-quick.json
"""

import argparse
import dataclasses
import statistics

import torch

from common import named_configs, problem, write_record
from megatron_flux.bench.kernel_vs_cublas import ag_on_one_gpu, grid_shape, mean_ms
from megatron_flux.tuning.provider import TableConfigProvider


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    n, k = grid_shape("ag", args.model, args.tp)
    a, w, full = problem(args.m, n, k)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    cfg = named_configs(TableConfigProvider(), "ag", args.m, n, k, args.tp)["table"]
    variants = {"per_segment": cfg,
                "merged_lead1": dataclasses.replace(cfg, ag_merge_local=True, ag_merge_lead=1),
                "merged_lead0": dataclasses.replace(cfg, ag_merge_local=True, ag_merge_lead=0)}
    fns = {"cublas": lambda: torch.matmul(a, w.t())}
    checks = {}
    for name, c in variants.items():
        launch, out = ag_on_one_gpu(a, w, args.tp, c, err)
        launch()
        torch.cuda.synchronize()
        rel = float((out.float() - full).norm() / full.norm())
        same = None if name == "per_segment" else bool(torch.equal(out, checks["per_segment"]["out"]))
        checks[name] = {"out": out.clone(), "rel_err": rel, "bitwise_equal_per_segment": same,
                        "err_word": err.tolist()}
        print(f"{name}: rel err {rel:.2e}, bitwise equal to per-segment: {same}, err {err.tolist()}",
              flush=True)
        fns[name] = launch
    times = {name: [] for name in fns}
    for t in range(args.trials):
        order = list(fns)[t % len(fns):] + list(fns)[:t % len(fns)]
        for name in order:
            for _ in range(5):  # warm the sample
                fns[name]()
            times[name].append(mean_ms(fns[name], args.iters))
        print(f"trial {t}: " + "  ".join(f"{n_} {times[n_][-1]:.4f}" for n_ in fns), flush=True)
    base = statistics.median(times["cublas"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = None
        if name.startswith("merged"):
            paired = statistics.median(x / y for x, y in zip(ts, times["per_segment"]))
        print(f"{name}: median {med:.4f} ms = {med / base:.3f}x cuBLAS, paired vs per-segment "
              f"{paired}", flush=True)
        info = {k_: v for k_, v in checks.get(name, {}).items() if k_ != "out"}
        rows.append({"method": name, "median_ms": med, "times_ms": ts, "vs_cublas": med / base,
                     "paired_vs_per_segment": paired, **info,
                     "config": variants[name].to_dict() if name in variants else None})
    write_record(args.json, rows, model=args.model, m=args.m, n=n, k=k, tp=args.tp)


if __name__ == "__main__":
    main()
