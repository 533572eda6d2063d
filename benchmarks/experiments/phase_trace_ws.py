"""Experiment: where the warp-specialized GEMM+RS's time goes, partition by partition.

One GPU, communication off (``kernel_vs_cublas.rs_on_one_gpu``'s wiring as rank 0 of ``--tp``,
every peer signal pre-set). Per shape, the ping-pong GEMM+RS (``estimate.PINGPONG_RS``) with
and without its split tail runs with TRACE on: every program stamps ``%globaltimer`` at the
points ``gemm_rs_ws.WS_RS_PHASES`` and ``WS_RS_SYNC`` name, per MMA partition (the last two:
counted in at the grid barrier, its pushes drained; the peers' signals acquired at its first
own tile), and the load partition at its start and end (``gemm_rs_ws.WS_TRACE_SLOTS`` words per
program). Per launch, stamps are taken
relative to the earliest start of any partition; per phase and partition the record keeps the
earliest, median and latest program (µs), then the median of each over ``--launches``
launches. It also times each form with and without the stamps and cuBLAS beside them (CUDA
events, launches alternating), so the cost of tracing is on record.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/phase_trace_ws.py \
        --shapes 1024x2304x5760 1024x2048x5760 --json ws-trace.json
"""

import argparse
import dataclasses
import json
import statistics

import torch

from common import parse_shape, without_phases
from megatron_flux.kernels import gemm_rs_ws, split_tail
from megatron_flux.kernels.config import GemmConfig
from megatron_flux.tools.diagnostics.kernel_vs_cublas import _time_alternating, rel_err, \
    rs_on_one_gpu
from megatron_flux.tuning.estimate import PINGPONG_RS


def summarize(traces, partitions):
    """Per partition and phase, the median over launches of (earliest, median, latest) program
    stamp in µs after the launch's first start, and how many programs stamped it; the load
    partition's start and end; the launch's span (latest stamp)."""
    out = {}
    names = [(f"mma{c}.{phase}", 6 * c + i) for c in range(partitions)
             for i, phase in enumerate(gemm_rs_ws.WS_RS_PHASES)]
    names += [("load.start", 12), ("load.end", 13), ("split.all_parts_in", 14),
              ("split.share_summed", 15)]
    names += [(f"mma{c}.{phase}", 16 + 2 * c + i) for c in range(partitions)
              for i, phase in enumerate(gemm_rs_ws.WS_RS_SYNC)]
    per = {name: {"first": [], "median": [], "last": [], "programs": []} for name, _ in names}
    spans = []
    for tr in traces:
        valid = tr[tr >= 0]
        t0 = int(valid.min())
        spans.append((int(valid.max()) - t0) / 1e3)
        for name, slot in names:
            col = tr[:, slot]
            col = col[col >= 0]
            if col.numel() == 0:
                continue
            us = sorted((col - t0).double().div(1e3).tolist())
            per[name]["first"].append(us[0])
            per[name]["median"].append(us[len(us) // 2])
            per[name]["last"].append(us[-1])
            per[name]["programs"].append(len(us))
    for name, d in per.items():
        if d["programs"]:
            out[name] = {key: statistics.median(v) for key, v in d.items()}
    out["span_us"] = statistics.median(spans)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", required=True, metavar="MxNxK",
                   help="per-rank GEMM: m rows of all ranks, n the hidden size, k per rank")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--launches", type=int, default=21)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    forms = {"nosplit": GemmConfig(**{**PINGPONG_RS, "stream_k": 0}),
             "split": GemmConfig(**PINGPONG_RS)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for spec in args.shapes:
        m, n, k = parse_shape(spec)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        row = {"m": m, "n": n, "k": k, "tp": args.tp, "forms": {}}
        fns = {"cublas": lambda: torch.matmul(a, w.t())}
        for label, cfg in forms.items():
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            launch, out, data = rs_on_one_gpu(a, w, args.tp, err,
                                              without_phases(gemm_rs_ws.launch_gemm_rs_ws), sms)

            trace = torch.full((sms, gemm_rs_ws.WS_TRACE_SLOTS), -1, dtype=torch.int64,
                               device="cuda")
            traces = []
            for _ in range(args.launches):
                trace.fill_(-1)
                launch(cfg, trace=trace)
                torch.cuda.synchronize()
                traces.append(trace.cpu())
            ref = (a.float() @ w.t().float())[:m // args.tp] + sum(
                data[src].float() for src in range(1, args.tp))
            fns[label] = lambda launch=launch, cfg=cfg: launch(cfg)
            fns[label + "+trace"] = lambda launch=launch, cfg=cfg, trace=trace: launch(cfg, trace=trace)
            plan = split_tail.split_tail_plan(args.tp, m // args.tp, n, k, cfg, sms)
            row["forms"][label] = {"config": dataclasses.asdict(cfg), "plan": plan,
                                   "rel_err": rel_err(out.float(), ref), "err": err.tolist(),
                                   "phases": summarize(traces, 2 if cfg.num_warps == 4 else 1)}
        times, ratios = _time_alternating(fns, args.trials, args.rounds, 10, 0, 5.0)
        row["cublas_ms"] = statistics.median(times["cublas"])
        row["ratio_to_cublas"] = {name: statistics.median(r) for name, r in ratios.items()}
        rows.append(row)
        print(f"{spec} cublas {row['cublas_ms'] * 1e3:.1f} us  "
              + "  ".join(f"{k} x{v:.3f}" for k, v in row["ratio_to_cublas"].items()), flush=True)
        for label, form in row["forms"].items():
            ph = form["phases"]
            print(f"  {label} plan {form['plan']} err {form['rel_err']:.2e} span {ph['span_us']:.1f} us")
            for name, d in ph.items():
                if name != "span_us":
                    print(f"    {name:22s} first {d['first']:7.2f} median {d['median']:7.2f} "
                          f"last {d['last']:7.2f}  ({d['programs']:.0f} programs)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"what": __doc__.splitlines()[0], "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "triton": __import__("triton").__version__,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
