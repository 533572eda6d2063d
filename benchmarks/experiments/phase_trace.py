"""Experiment: where a fused kernel's time goes, phase by phase, against the plain yardstick.

One GPU, communication disabled (``kernel_vs_cublas``'s one-GPU wiring, every peer signal
pre-set). Per grid shape and config, the fused kernel and the plain persistent GEMM of the same
tile run with their phase stamps on (:mod:`megatron_flux.kernels.phase_trace`): every program
records ``%globaltimer`` at the points its kernel names (``AG_PHASES``, ``RS_PHASES``,
``PLAIN_PHASES``). Per launch, stamps are taken relative to the launch's first program start;
per phase the record keeps the earliest, median and latest program (µs), then the median of
those over ``--launches`` launches. It also times each kernel with and without the stamps
(CUDA events), so the cost of tracing itself is on record.

    PYTHONPATH=. python benchmarks/experiments/phase_trace.py --op rs --tp 2 \
        --models llama3-8b --m 1024 2048 --json rs-trace.json

(run as a script, with the repository root on ``PYTHONPATH``: it imports ``common`` beside it)
"""

import argparse
import dataclasses
import json
import statistics

import torch

from common import load_module, named_configs, problem, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import add_model_args, ag_on_one_gpu, mean_ms, model_shapes, \
    rs_on_one_gpu
from megatron_flux.tools.diagnostics.plain_gemm import PLAIN_PHASES, launch_plain_gemm
from megatron_flux.kernels.ag_gemm import AG_PHASES
from megatron_flux.kernels.gemm_rs import RS_PHASES
from megatron_flux.kernels.phase_trace import new_trace
from megatron_flux.tuning.provider import TableConfigProvider


def summarize(traces, phases):
    """Per phase, the median over launches of (earliest, median, latest) program stamp in µs
    after the launch's first start, and how many programs stamped it; plus the smallest
    non-zero step between any two stamps seen (the timer's granularity, at most)."""
    per_phase = {name: {"first": [], "median": [], "last": [], "programs": []} for name in phases}
    steps = []
    for tr in traces:
        tr = tr.cpu()
        t0 = int(tr[:, 0][tr[:, 0] >= 0].min())
        for slot, name in enumerate(phases):
            col = tr[:, slot]
            col = col[col >= 0]
            if col.numel() == 0:
                continue
            us = ((col - t0).double() / 1000.0).tolist()
            per_phase[name]["first"].append(min(us))
            per_phase[name]["median"].append(statistics.median(us))
            per_phase[name]["last"].append(max(us))
            per_phase[name]["programs"].append(col.numel())
        flat = torch.unique(tr[tr >= 0])
        if flat.numel() > 1:
            d = flat[1:] - flat[:-1]
            steps.append(int(d[d > 0].min()))
    out = {name: {k: statistics.median(v) for k, v in stats.items()}
           for name, stats in per_phase.items() if stats["first"]}
    return out, (min(steps) if steps else None)


def run_traced(launch, grid, phases, launches, warmup, iters):
    """``launch(trace)`` ``warmup`` times, then ``launches`` traced launches; returns the
    summary and the untraced / traced event times (ms per launch, ``iters`` back to back)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    scratch = new_trace(grid, dev)
    for _ in range(warmup):
        launch(scratch)
    bufs = [new_trace(grid, dev) for _ in range(launches)]
    for b in bufs:
        launch(b)
    for _ in range(warmup):  # the untraced kernel is another compiled variant
        launch(None)
    torch.cuda.synchronize()
    plain_ms = mean_ms(lambda: launch(None), iters)
    traced_ms = mean_ms(lambda: launch(scratch), iters)
    summary, step = summarize(bufs, phases)
    return {"phases": summary, "timer_step_ns": step, "untraced_ms": plain_ms,
            "traced_ms": traced_ms}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["ag", "rs"], default="rs")
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p, ["llama3-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--configs", nargs="+", default=["table", "default"])
    p.add_argument("--override", type=json.loads, default=None,
                   help="GemmConfig fields (JSON) applied to every config")
    p.add_argument("--module", default=None,
                   help="trace the launcher of this copy of kernels/ag_gemm.py or gemm_rs.py "
                        "(an experiment variant) instead of the package's")
    p.add_argument("--launches", type=int, default=7)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    launcher = None
    if args.module:
        name = "launch_ag_gemm" if args.op == "ag" else "launch_gemm_rs"
        launcher = getattr(load_module(args.module, "kernel_variant"), name)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = TableConfigProvider()
    rows = []
    for model, n, k in model_shapes(args, args.op):
        for m in args.m:
            a, w, _ = problem(m, n, k)
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cfgs = named_configs(table, args.op, m, n, k, args.tp)
            for label in args.configs:
                cfg = cfgs[label]
                if args.override:
                    cfg = dataclasses.replace(cfg, **args.override)
                if args.op == "ag":
                    fused, _ = ag_on_one_gpu(a, w, args.tp, cfg, err, launch_ag_gemm=launcher)
                    phases = AG_PHASES
                else:
                    rs_launch, _, _ = rs_on_one_gpu(a, w, args.tp, err, launch_gemm_rs=launcher)
                    fused = (lambda trace=None, cfg=cfg, rs_launch=rs_launch:
                             rs_launch(cfg, trace=trace))
                    phases = RS_PHASES
                record = {"module": args.module, "op": args.op, "model": model, "m": m, "n": n, "k": k, "tp": args.tp,
                          "label": label, "cfg": cfg.to_dict()}
                rows_cap = sms  # the largest grid a launch can have
                record["fused"] = run_traced(fused, rows_cap, phases, args.launches, args.warmup,
                                             args.iters)
                record["plain"] = run_traced(
                    lambda trace=None, cfg=cfg, a=a, w=w, c=c: launch_plain_gemm(a, w, c, cfg, sms,
                                                                     trace=trace),
                    rows_cap, PLAIN_PHASES, args.launches, args.warmup, args.iters)
                rows.append(record)
                for kind in ("fused", "plain"):
                    r = record[kind]
                    shown = "  ".join(f"{name} {v['first']:.1f}/{v['median']:.1f}/{v['last']:.1f}"
                                      f"({v['programs']:.0f})" for name, v in r["phases"].items())
                    print(f"{args.op} {model} m={m} {label} {kind}: {r['untraced_ms']:.4f} ms "
                          f"(traced {r['traced_ms']:.4f}, step {r['timer_step_ns']} ns)  {shown}",
                          flush=True)
            del a, w, c
            torch.cuda.empty_cache()
    write_record(args.json, rows, what="per-program phase stamps (µs after the launch's first "
                 "start: earliest/median/latest program, median over launches)")


if __name__ == "__main__":
    main()
