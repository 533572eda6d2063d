"""GEMM-class kernel time per role of a Llama layer, for one profiled training step.

In one step of the Llama-3-8B-16l job
(micro-batch 2, two micro-batches, no pipeline parallelism) the GEMM-class kernels (cuBLAS,
fused AG+GEMM, fused GEMM+RS) run in a fixed order per micro-batch: 16 layers x 4 forward
(qkv, proj, fc1, fc2), 3 of the output layer (forward, dgrad, wgrad), then 16 layers x 8
backward (fc2 dgrad, fc2 wgrad, fc1 dgrad, fc1 wgrad, proj dgrad, proj wgrad, qkv dgrad, qkv
wgrad). This script checks that count and prints each role's total, median, min and max.

``python benchmarks/experiments/trace_gemm_roles.py rank-0.json.gz STEP [STEP ...] [--layers 16]
[--json OUT]``
"""

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trace_summary as T  # noqa: E402

FWD = ["fwd qkv AG", "fwd proj RS", "fwd fc1 AG", "fwd fc2 RS"]
BWD = ["bwd fc2 dgrad AG", "bwd fc2 wgrad", "bwd fc1 dgrad RS", "bwd fc1 wgrad",
       "bwd proj dgrad AG", "bwd proj wgrad", "bwd qkv dgrad RS", "bwd qkv wgrad"]


def gemm_kernels_of_step(events, step):
    steps, step_at = T.profiler_steps(events)
    launched_in = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            i = step_at(e["ts"])
            corr = (e.get("args") or {}).get("correlation")
            if i is not None and corr is not None:
                launched_in[corr] = steps[i][2]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"
               and launched_in.get((e.get("args") or {}).get("correlation")) == step
               and T.kind_of(str(e["name"]), "kernel") in ("gemm", "fused_ag", "fused_rs")]
    return sorted(kernels, key=lambda e: e["ts"])


def by_role(kernels, layers):
    per_mb = 4 * layers + 3 + 8 * layers
    if len(kernels) % per_mb:
        raise SystemExit(f"{len(kernels)} GEMM-class kernels, not a multiple of {per_mb}")
    roles = collections.defaultdict(list)
    for i, e in enumerate(kernels):
        j = i % per_mb
        role = FWD[j % 4] if j < 4 * layers else ("output" if j < 4 * layers + 3
                                                  else BWD[(j - 4 * layers - 3) % 8])
        roles[role].append(e["dur"])
    return roles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("steps", type=int, nargs="+")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--json", help="also write {step: {role: stats}} here")
    args = p.parse_args(argv)
    events = T.load(args.trace)
    report = {"command": "python benchmarks/experiments/trace_gemm_roles.py " + " ".join(
                  sys.argv[1:] if argv is None else argv), "steps": {}}
    for step in args.steps:
        roles = by_role(gemm_kernels_of_step(events, step), args.layers)
        print(f"== step {step}")
        stats = {}
        for role in FWD + BWD + ["output"]:
            d = roles[role]
            stats[role] = {"n": len(d), "sum_ms": round(sum(d) / 1e3, 3),
                           "median_us": round(statistics.median(d), 1), "min_us": round(min(d), 1),
                           "max_us": round(max(d), 1)}
            print(f"{role:18s} n={len(d):3d} sum={sum(d) / 1e3:7.2f} ms  median="
                  f"{statistics.median(d):7.1f} min={min(d):7.1f} max={max(d):7.1f} us")
        report["steps"][str(step)] = stats
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
