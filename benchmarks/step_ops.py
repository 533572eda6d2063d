"""Each TP GEMM's time inside a profiled training step, set beside the op benchmark's.

The op benchmark times one op in a loop; a training step runs the same GEMMs between other
kernels, and there a GEMM can run at other clocks. This reads a torch-profiler trace of an
interleaved job (``benchmarks/device_interleave.sh``, ``--log`` its log so steps are labelled
with their backend) and, per backend, the forward's TP GEMMs of every micro-batch in the order
they ran:

* ``nccl`` steps: the cuBLAS GEMMs (kernel kind ``gemm`` of :mod:`trace_summary`) of each
  micro-batch's forward, ``4 x layers`` of them (QKV, proj, fc1, fc2 per layer) and then the
  output layer's;
* ``flux`` steps: the fused kernels (AllGather+GEMM for QKV, fc1 and the output layer,
  GEMM+ReduceScatter for proj and fc2) of each micro-batch's forward, then the row layers' data
  gradients in backward (fc2, proj per layer, last layer first), which fuse an AllGather too.

A step whose kernels do not follow that pattern (another model, TP or column-dgrad setting) is
an error naming the step. Per op: the median over layers, micro-batches and steps of the call's
GPU time (us), and with ``--bench`` (an op benchmark JSON of the same shapes, e.g.
``bench-h200x2-2026-11-28-train-shapes.json`` whose "models" qkv / proj / mlp / mlpd / out name
the GEMMs) the benchmark's ``cublas_gemm`` and ``flux`` medians beside them.

``python benchmarks/step_ops.py rank-0.json.gz --log interleave.log --layers 16 [--bench B.json --m 8192] --out ops.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Optional

import trace_summary as T

FORWARD = ("qkv", "proj", "fc1", "fc2")
FUSED_KIND = {"qkv": "fused_ag", "proj": "fused_rs", "fc1": "fused_ag", "fc2": "fused_rs", "output": "fused_ag",
              "fc2.dgrad": "fused_ag", "proj.dgrad": "fused_ag"}
#: the op benchmark's (op, "model") for each GEMM (the ten shapes as five models, --rs-k ffn)
BENCH_CASE = {"qkv": ("AG+GEMM", "qkv"), "proj": ("GEMM+RS", "proj"), "fc1": ("AG+GEMM", "mlp"),
              "fc2": ("GEMM+RS", "mlp"), "output": ("AG+GEMM", "out"), "fc2.dgrad": ("AG+GEMM", "mlpd"),
              "proj.dgrad": ("AG+GEMM", "proj")}


def step_kernels(events: List[dict]):
    """``{step number: [(gpu start, name, kind, us), ...]}``: each step's kernels in GPU order
    (:func:`trace_summary.gpu_events_by_step`)."""
    steps, step_at = T.profiler_steps(events)
    return {steps[i][2]: [(e["ts"], str(e.get("name", "")), T.kind_of(str(e.get("name", "")), "kernel"), e["dur"])
                          for e in evs if e["cat"] == "kernel"]
            for i, evs in T.gpu_events_by_step(events, step_at).items()}


def nccl_forward(kernels, layers: int, micro_batches: int, step: int) -> Dict[str, List[float]]:
    """The cuBLAS time of each forward TP GEMM of a ``nccl`` step: per micro-batch, the first
    ``4 * layers + 1`` GEMMs after the previous micro-batch's backward (the forward's GEMMs come
    first; the output layer's is the last of them)."""
    gemms = [us for _, _, kind, us in kernels if kind == "gemm"]
    per_mb = len(gemms) // micro_batches
    if per_mb * micro_batches != len(gemms) or per_mb < 4 * layers + 1:
        raise ValueError(f"step {step}: {len(gemms)} cuBLAS GEMMs do not split into {micro_batches} "
                         f"micro-batches of at least {4 * layers + 1}")
    out: Dict[str, List[float]] = defaultdict(list)
    for mb in range(micro_batches):
        fwd = gemms[mb * per_mb: mb * per_mb + 4 * layers + 1]
        for j, us in enumerate(fwd[:-1]):
            out[FORWARD[j % 4]].append(us)
        out["output"].append(fwd[-1])
    return out


def flux_calls(kernels, layers: int, micro_batches: int, step: int) -> Dict[str, List[float]]:
    """The fused kernels of a ``flux`` step, per micro-batch ``4 * layers`` forward calls, the
    output layer's, then ``2 * layers`` backward (fc2 and proj data gradients per layer)."""
    fused = [(kind, us) for _, _, kind, us in kernels if kind in ("fused_ag", "fused_rs")]
    per_mb = 6 * layers + 1
    if len(fused) != per_mb * micro_batches:
        raise ValueError(f"step {step}: {len(fused)} fused calls, expected {per_mb} per micro-batch "
                         f"x {micro_batches}")
    names = [FORWARD[j % 4] for j in range(4 * layers)] + ["output"] + \
            [("fc2.dgrad", "proj.dgrad")[j % 2] for j in range(2 * layers)]
    out: Dict[str, List[float]] = defaultdict(list)
    for mb in range(micro_batches):
        for name, (kind, us) in zip(names, fused[mb * per_mb:(mb + 1) * per_mb]):
            if kind != FUSED_KIND[name]:
                raise ValueError(f"step {step}: the {name} call ran a {kind} kernel")
            out[name].append(us)
    return out


def summarize(events, labels: Dict[int, str], layers: int, micro_batches: int,
              bench: Optional[dict] = None, m: Optional[int] = None) -> dict:
    per_step = step_kernels(events)
    times: Dict[str, Dict[str, List[float]]] = {"nccl": defaultdict(list), "flux": defaultdict(list)}
    steps: Dict[str, List[int]] = {"nccl": [], "flux": []}
    for n, kernels in sorted(per_step.items()):
        backend = labels.get(n)
        if backend not in times:
            continue
        got = (nccl_forward if backend == "nccl" else flux_calls)(kernels, layers, micro_batches, n)
        for op, v in got.items():
            times[backend][op].extend(v)
        steps[backend].append(n)
    bench_ms = {}
    if bench is not None:
        for r in bench["rows"]:
            if r["m"] == m and r.get("median_ms") is not None:
                bench_ms[(r["op"], r["model"], r["method"])] = r["median_ms"]
    ops = {}
    for op in FUSED_KIND:
        row = {}
        for backend, key in (("nccl", "step_cublas_us"), ("flux", "step_fused_us")):
            v = times[backend].get(op)
            if v:
                row[key] = round(statistics.median(v), 1)
                row[key.replace("_us", "_calls")] = len(v)
        if "step_cublas_us" in row and "step_fused_us" in row:
            row["step_fused_over_cublas"] = round(row["step_fused_us"] / row["step_cublas_us"], 3)
        case = BENCH_CASE[op]
        for method, key in (("cublas_gemm", "bench_cublas_us"), ("flux", "bench_fused_us")):
            if (case[0], case[1], method) in bench_ms:
                row[key] = round(1e3 * bench_ms[(case[0], case[1], method)], 1)
        if "bench_cublas_us" in row and "bench_fused_us" in row:
            row["bench_fused_over_cublas"] = round(row["bench_fused_us"] / row["bench_cublas_us"], 3)
        ops[op] = row
    return {"steps": steps, "layers": layers, "micro_batches": micro_batches, "m": m, "ops": ops}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--log", required=True, help="the interleaved job's log (labels the steps)")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--bench", help="op benchmark JSON of the same GEMMs")
    p.add_argument("--m", type=int, help="the benchmark's m for these GEMMs (seq x micro-batch size)")
    p.add_argument("--command", default="", help="how the trace was made, recorded in the JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.bench and args.m is None:
        p.error("--bench needs --m")
    bench = json.load(open(args.bench)) if args.bench else None
    rep = summarize(T.load(args.trace), T.backend_by_iteration(args.log), args.layers, args.micro_batches,
                    bench, args.m)
    rep.update(trace=args.trace, bench=args.bench, command=args.command)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"{'op':11s} {'step cuBLAS':>11s} {'step fused':>10s} {'ratio':>6s} {'bench cuBLAS':>12s} "
          f"{'bench fused':>11s} {'ratio':>6s}")
    for op, r in rep["ops"].items():
        cells = [r.get(k) for k in ("step_cublas_us", "step_fused_us", "step_fused_over_cublas", "bench_cublas_us",
                                    "bench_fused_us", "bench_fused_over_cublas")]
        print(f"{op:11s} " + " ".join(f"{'-' if c is None else c:>{w}}" for c, w in zip(cells, (11, 10, 6, 12, 11, 6))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
