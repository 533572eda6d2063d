"""Where a training step's time goes, per profiled step, from a torch-profiler chrome trace.

Megatron writes the trace with ``--profile --use-pytorch-profiler --profile-step-start S
--profile-step-end E`` (``<tensorboard-dir>/../torch_profile/rank-<r>.json.gz``);
``ProfilerStep#N`` spans Megatron's logged iteration ``N``. With ``--log`` of a job run with
``--flux-interleave-backends``, each step is labelled with its backend.

Per step (GPU work is attributed to the step whose host span launched it, via the launch's
correlation id):

* ``host_ms``: the step's span on the host; ``gpu_busy_ms``: the union of its kernels and copies
  over all streams; ``gpu_span_ms``: first GPU start to last GPU end; ``gpu_gaps_ms``: time
  inside the span with nothing running, and how much of it came in gaps over 50 us;
* ``gpu_ms_by_kind``: kernel time summed per kind (``gemm``, ``fused_ag``, ``fused_rs``,
  ``nccl``, ``attention``, ``memcpy``, ``other``; overlapping kernels count twice);
* ``launches`` and ``launch_api_ms``: kernel launches and the host time spent in CUDA runtime
  and driver calls; ``syncs``: blocking calls (``*Synchronize``, non-async ``cudaMemcpy``)
  with their total host time; ``stream_waits``: ``cudaStreamWaitEvent`` calls (not blocking;
  traces summarised before 2026-11-22 counted them among ``syncs``);
* ``linear_host_ms``: host time inside the TP linears' autograd functions (forward and backward
  nodes), with the call count;
* ``comm_alone_ms``: time in which NCCL kernels or copies run and nothing else does (exposed
  communication; a fused kernel counts as computation);
* ``comm_alone_by_op_ms``: ``comm_alone_ms`` split by NCCL kernel or copy (name cut to 60
  characters, and its stream), with the count and total time of each;
* per backend, ``kernels_ms``: the kernels that took the most time, summed per name and step
  (median over the backend's steps), names cut to 90 characters;
* per backend, ``fused_calls_us``: the fused kernels of a step in the order they ran (name cut to
  40 characters, duration in us, median over the backend's steps with the same number of fused
  calls), to set each call beside the op benchmark's time for its shape; ``fused_calls_steps``:
  the steps those medians come from.

``python benchmarks/trace_summary.py rank-0.json.gz [--log job.log] --out summary.json``
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Optional

STEP_RE = re.compile(r"ProfilerStep#(\d+)")
KINDS = [
    ("fused_ag", re.compile(r"ag_gemm", re.I)),
    ("fused_rs", re.compile(r"gemm_rs", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attention", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|sm90_", re.I)),
]
LINEAR_RE = re.compile(r"(ColumnParallelLinear|RowParallelLinear|LinearWithGradAccumulation)")
SYNC_RE = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpyDtoH")
WAIT_RE = re.compile(r"^cudaStreamWaitEvent$")
LAUNCH_RE = re.compile(r"LaunchKernel|cuLaunch")


def kind_of(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    for kind, rx in KINDS:
        if rx.search(name):
            return kind
    return "other"


def _union(intervals: List[tuple]) -> float:
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _merge(intervals: List[tuple]) -> List[list]:
    merged: List[list] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _alone(these: List[tuple], others: List[tuple]) -> float:
    """Time covered by ``these`` and by none of ``others``."""
    a, b = _merge(these), _merge(others)
    total, j = 0.0, 0
    for s, e in a:
        covered = 0.0
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
        total += (e - s) - covered
    return total


def _alone_by_op(ops: List[tuple], compute: List[tuple]) -> Dict[str, dict]:
    """Per op name: calls, total time and time with no computation beside it (ms), largest
    alone time first."""
    out: Dict[str, dict] = defaultdict(lambda: {"calls": 0, "ms": 0.0, "alone_ms": 0.0})
    merged = _merge(compute)
    ends = [e for _, e in merged]
    for name, (s, e) in ops:
        covered, j = 0.0, bisect.bisect_right(ends, s)  # first interval ending after s
        while j < len(merged) and merged[j][0] < e:
            covered += min(e, merged[j][1]) - max(s, merged[j][0])
            j += 1
        row = out[name]
        row["calls"] += 1
        row["ms"] += (e - s) / 1e3
        row["alone_ms"] += (e - s - covered) / 1e3
    return {k: {"calls": v["calls"], "ms": round(v["ms"], 3), "alone_ms": round(v["alone_ms"], 3)}
            for k, v in sorted(out.items(), key=lambda kv: -kv[1]["alone_ms"])}


def _gaps(intervals: List[tuple], big_us: float = 50.0):
    merged = _merge(intervals)
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    return sum(gaps), sum(g for g in gaps if g > big_us), sum(1 for g in gaps if g > big_us)


def load(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def backend_by_iteration(log: Optional[str]) -> Dict[int, str]:
    if not log:
        return {}
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from interleave_report import parse

    switches, steps = parse(log)
    starts = [k for k, _ in switches]
    out = {}
    for it in range(1, max(list(steps) + [0]) + 1):
        i = bisect.bisect_right(starts, it) - 1
        if i >= 0:
            out[it] = switches[i][1]
    return out


def profiler_steps(events: List[dict]):
    """``(steps, step_at)``: the ``ProfilerStep#N`` spans as sorted ``(start, end, N)``, and a
    function giving the index of the span a host timestamp falls in (``None`` outside)."""
    steps = []
    for e in events:
        m = STEP_RE.fullmatch(str(e.get("name", "")))
        if m and e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op", None):
            steps.append((e["ts"], e["ts"] + e["dur"], int(m.group(1))))
    steps.sort()
    if not steps:
        raise SystemExit("no ProfilerStep#N spans in the trace")
    starts = [s for s, _, _ in steps]

    def step_at(ts: float) -> Optional[int]:
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > steps[i][1]:
            return None
        return i

    return steps, step_at


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events_by_step(events: List[dict], step_at) -> Dict[int, List[dict]]:
    """``{step index: [GPU event, ...]}`` (kernels, copies, memsets, in GPU start order), each
    attributed to the step whose host span launched it: the CUDA runtime or driver call with
    the same correlation id ran inside that step's ``ProfilerStep#N`` span."""
    launch_step: Dict[int, int] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            i = step_at(e["ts"]) if corr is not None else None
            if i is not None:
                launch_step[corr] = i
    out: Dict[int, List[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            i = launch_step.get((e.get("args") or {}).get("correlation"))
            if i is not None:
                out[i].append(e)
    for v in out.values():
        v.sort(key=lambda e: e["ts"])
    return out


def summarize(events: List[dict], labels: Dict[int, str], top: int = 30) -> dict:
    steps, step_at = profiler_steps(events)

    per = [defaultdict(float) for _ in steps]
    gpu: List[List[tuple]] = [[] for _ in steps]
    comm: List[List[tuple]] = [[] for _ in steps]
    comm_ops: List[List[tuple]] = [[] for _ in steps]
    compute: List[List[tuple]] = [[] for _ in steps]
    by_name = [defaultdict(float) for _ in steps]
    fused: List[List[tuple]] = [[] for _ in steps]
    linear_calls = [0 for _ in steps]
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), str(e.get("name", ""))
        if cat in ("cuda_runtime", "cuda_driver"):
            i = step_at(e["ts"])
            if i is None:
                continue
            per[i]["launch_api_ms"] += e["dur"] / 1e3
            if LAUNCH_RE.search(name):
                per[i]["launches"] += 1
            if SYNC_RE.search(name):
                per[i]["syncs"] += 1
                per[i]["sync_ms"] += e["dur"] / 1e3
            elif WAIT_RE.search(name):
                per[i]["stream_waits"] += 1
        elif cat == "cpu_op" and LINEAR_RE.search(name):
            i = step_at(e["ts"])
            if i is not None:
                per[i]["linear_host_ms"] += e["dur"] / 1e3
                linear_calls[i] += 1
    for i, step_events in gpu_events_by_step(events, step_at).items():
        for e in step_events:
            span = (e["ts"], e["ts"] + e["dur"])
            gpu[i].append(span)
            kind = kind_of(str(e.get("name", "")), e["cat"])
            per[i]["kind:" + kind] += e["dur"] / 1e3
            if kind in ("nccl", "memcpy"):
                comm[i].append(span)
                comm_ops[i].append((f"{str(e.get('name', ''))[:60]} (stream "
                                    f"{(e.get('args') or {}).get('stream')})", span))
            else:
                compute[i].append(span)
            if e["cat"] == "kernel":
                by_name[i][str(e.get("name", ""))[:90]] += e["dur"] / 1e3
            if kind in ("fused_ag", "fused_rs"):
                fused[i].append((e["ts"], str(e.get("name", ""))[:40], e["dur"]))
    rows = []
    for i, (s, e, n) in enumerate(steps):
        g = gpu[i]
        span = (max(x[1] for x in g) - min(x[0] for x in g)) if g else 0.0
        gap, big, nbig = _gaps(g) if g else (0.0, 0.0, 0)
        d = per[i]
        rows.append({
            "step": n,
            "backend": labels.get(n),
            "host_ms": round((e - s) / 1e3, 3),
            "gpu_busy_ms": round(_union(g) / 1e3, 3),
            "gpu_span_ms": round(span / 1e3, 3),
            "gpu_gaps_ms": round(gap / 1e3, 3),
            "gpu_gaps_over_50us_ms": round(big / 1e3, 3),
            "gpu_gaps_over_50us": nbig,
            "gpu_ms_by_kind": {k[5:]: round(v, 3) for k, v in sorted(d.items()) if k.startswith("kind:")},
            "comm_alone_ms": round(_alone(comm[i], compute[i]) / 1e3, 3),
            "comm_alone_by_op_ms": _alone_by_op(comm_ops[i], compute[i]),
            "launches": int(d["launches"]),
            "launch_api_ms": round(d["launch_api_ms"], 3),
            "syncs": int(d["syncs"]),
            "sync_ms": round(d["sync_ms"], 3),
            "stream_waits": int(d["stream_waits"]),
            "linear_host_ms": round(d["linear_host_ms"], 3),
            "linear_calls": linear_calls[i],
        })
    by_backend: Dict[str, dict] = {}
    for name in sorted({r["backend"] for r in rows if r["backend"]}):
        rs = [r for r in rows if r["backend"] == name]
        agg = {k: round(statistics.median(r[k] for r in rs), 3)
               for k in ("host_ms", "gpu_busy_ms", "gpu_span_ms", "gpu_gaps_ms",
                         "gpu_gaps_over_50us_ms", "launches", "launch_api_ms", "syncs",
                         "linear_host_ms", "comm_alone_ms")}
        kinds = sorted({k for r in rs for k in r["gpu_ms_by_kind"]})
        agg["gpu_ms_by_kind"] = {k: round(statistics.median(r["gpu_ms_by_kind"].get(k, 0.0) for r in rs), 3)
                                 for k in kinds}
        idx = [i for i, r in enumerate(rows) if r["backend"] == name]
        names = {k for i in idx for k in by_name[i]}
        med = {k: statistics.median(by_name[i].get(k, 0.0) for i in idx) for k in names}
        agg["kernels_ms"] = {k: round(v, 3) for k, v in sorted(med.items(), key=lambda kv: -kv[1])[:top]}
        agg["steps"] = [r["step"] for r in rs]
        agg["fused_calls_steps"], agg["fused_calls_us"] = _fused_calls([fused[i] for i in idx],
                                                                       [rows[i]["step"] for i in idx])
        by_backend[name] = agg
    return {"steps": rows, "median_by_backend": by_backend}


def _fused_calls(calls: List[List[tuple]], step_numbers: List[int]):
    """``(steps, [{"name", "us"}, ...])``: per call index, the median duration over the steps
    whose fused-call count is the most common one among these steps (a step cut at the
    profile's edge has fewer); empty when no step ran a fused kernel."""
    counts = [len(c) for c in calls if c]
    if not counts:
        return [], []
    n = statistics.mode(counts)
    keep = [(c, s) for c, s in zip(calls, step_numbers) if len(c) == n]
    out = []
    for j in range(n):
        names = {c[j][1] for c, _ in keep}
        out.append({"name": "|".join(sorted(names)), "us": round(statistics.median(c[j][2] for c, _ in keep), 1)})
    return [s for _, s in keep], out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--log", help="job log with [flux-interleave] lines (labels the steps)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    report = summarize(load(args.trace), backend_by_iteration(args.log))
    report["trace"] = args.trace
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for r in report["steps"]:
        print(f"step {r['step']:>4} {str(r['backend']):>9}: host {r['host_ms']:7.1f}  busy "
              f"{r['gpu_busy_ms']:7.1f}  span {r['gpu_span_ms']:7.1f}  gaps {r['gpu_gaps_ms']:6.1f} "
              f"(>50us {r['gpu_gaps_over_50us_ms']:6.1f}/{r['gpu_gaps_over_50us']})  launches "
              f"{r['launches']:5d}  syncs {r['syncs']:3d} {r['sync_ms']:6.1f}ms  linears "
              f"{r['linear_host_ms']:6.1f}ms/{r['linear_calls']}  {r['gpu_ms_by_kind']}")
    for name, agg in report["median_by_backend"].items():
        print(f"== {name}: top kernels, ms per step (median)")
        for k, v in list(agg["kernels_ms"].items())[:15]:
            print(f"   {v:8.2f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
