"""The end-to-end matrix: training step time of megatron-core's own layers against megatron-flux.

One cell is a model, a TP size, a micro-batch size and a CUDA-graph mode::

    python benchmarks/e2e_matrix.py run CELL [CELL...] --out DIR    # on the GPU machine
    python benchmarks/e2e_matrix.py merge DIR/*.json --out benchmarks/results/e2e-matrix-<gpu>x<n>-<date>.json --png ...

``CELL`` is ``<config>:tp<N>:mbs<M>:<graphs>`` (``configs/<config>.json``; graphs ``eager``,
``local`` or ``full_iteration``), e.g. ``llama3_8b_16l:tp2:mbs1:eager``. Every cell runs two
micro-batches per step (global batch ``2 x M``, data-parallel size 1). ``run`` writes
``DIR/<cell>.json`` per finished cell and skips cells whose file exists, so a matrix resumes
across calls that each fit a time limit; a graph cell's separate jobs are recorded one by one
(``DIR/<cell>/jobs.jsonl``), so a cell cut off between jobs resumes with the jobs it lacks
(``hosts`` in the record, by first GPU UUID: more than one means its jobs did not all run on
one machine). A job still running 30 s after Megatron's end-of-training line is ended there
(exit ``125`` in its record; stock jobs with ``full_iteration`` graphs hang in their exit).

* **eager**: one job whose Flux linears rotate between ``megatron`` (megatron-core's own code
  in the same layers), ``nccl``, ``flux`` and ``auto`` every ``--block`` iterations
  (``--flux-interleave-backends``; ``auto`` is what the default ``--flux-backend auto`` chose
  from the job's first iterations, its step-time selection); step times per backend and the
  *paired* speedup against ``megatron`` from ``interleave_report.py``.
* **local / full_iteration**: graphed and eager steps cannot share one job, so each backend is a
  separate job on the same machine, back to back, each run ``--repeats`` times: megatron-core's
  own layers (the stock job, no flag) and ``--flux-tp-overlap`` with ``auto``, ``flux`` and
  ``nccl`` (``--graph-jobs`` takes the first of auto, stock, flux, nccl); the median step of
  iterations ``--skip + 1 ..``; not paired.

``exposed_tp_comm_ms``: the TP collectives megatron-core leaves exposed per step, timed alone
with NCCL (``e2e_comm.py``): per micro-batch and layer the forward all-gathers and
reduce-scatters and the row layers' backward all-gathers (megatron-core overlaps the column
layers' backward reduce-scatters with their weight gradients), plus the output layer's
all-gather and the embedding's reduce-scatter.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from interleave_report import summarize  # noqa: E402

CELL_RE = re.compile(r"^(?P<model>[\w.-]+):tp(?P<tp>\d+):mbs(?P<mbs>\d+):(?P<graphs>eager|local|full_iteration)$")
STEP_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([0-9.]+)")
AUTO_RE = re.compile(r"\[flux-auto\] flux_backend='(\w+)'")
#: the launcher's table coverage line (``megatron-flux plan``), up to its first ';'
PLAN_RE = re.compile(r"megatron-flux plan: ([^;\n]*)")
BACKENDS = ("megatron", "nccl", "flux", "auto")


def parse_cell(cell: str) -> dict:
    m = CELL_RE.match(cell)
    if not m:
        raise SystemExit(f"cell {cell!r}: expected <config>:tp<N>:mbs<M>:<eager|local|full_iteration>")
    d = m.groupdict()
    return {"model": d["model"], "tp": int(d["tp"]), "micro_batch": int(d["mbs"]),
            "cuda_graphs": "none" if d["graphs"] == "eager" else d["graphs"]}


def _config(model: str) -> dict:
    with open(os.path.join(REPO, "configs", f"{model}.json")) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


#: seconds a training job may take to exit after its last iteration (:func:`run_job`)
EXIT_GRACE_S = 30.0


def _launch(cell: dict, iters: int, env: Dict[str, str], extra: List[str], log: str,
            timeout: int) -> int:
    """One training job through the README's launcher; returns its exit code."""
    mbs = cell["micro_batch"]
    full = dict(os.environ, NPROC=str(cell["tp"]), TRAIN_ITERS=str(iters), LOG_INTERVAL="1",
                MODEL_CONFIG=f"configs/{cell['model']}.json", **env)
    argv = ["bash", "examples/pretrain_llama.sh", "--micro-batch-size", str(mbs),
            "--global-batch-size", str(2 * mbs), *extra]
    with open(log, "w") as f:
        f.write("# " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv) + "\n")
        f.flush()
        return run_job(argv, full, f, timeout, exit_grace_s=EXIT_GRACE_S)


#: Megatron's line after the last iteration; a job that logged it has all its step times
DONE_MARKER = "[after training is done]"
#: what :func:`run_job` returns for a job killed because it had not exited ``exit_grace_s``
#: after :data:`DONE_MARKER` (stock jobs with ``full_iteration`` graphs hang there)
HUNG_AFTER_TRAINING = 125


def run_job(argv: List[str], env: Dict[str, str], out, timeout: int,
            exit_grace_s: Optional[float] = None) -> int:
    """Run ``argv`` in a session of its own, its output into the file ``out``; past ``timeout``
    seconds kill the whole session (torchrun's workers too, which would otherwise keep their
    GPU memory while the next job starts) and return 124. With ``exit_grace_s``, a job whose
    output shows :data:`DONE_MARKER` and that has not exited that many seconds later is killed
    the same way and :data:`HUNG_AFTER_TRAINING` returned: its steps are all logged, and
    waiting for the time limit would spend minutes of a time-limited call on nothing."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    started, done_at = time.monotonic(), None
    try:
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - started > timeout:
                _kill(proc)
                return 124
            if exit_grace_s is not None:
                if done_at is None and _logged(out, DONE_MARKER):
                    done_at = now
                if done_at is not None and now - done_at > exit_grace_s:
                    _kill(proc)
                    out.write(f"\n# e2e_matrix: killed {exit_grace_s:.0f} s after "
                              f"{DONE_MARKER!r}: the job had not exited\n")
                    out.flush()
                    return HUNG_AFTER_TRAINING
    finally:  # this process ended early (a signal, ^C): the job does not outlive it
        if proc.poll() is None:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _logged(out, marker: str) -> bool:
    """Whether the job's output file ``out`` holds ``marker`` (read by name, from the start)."""
    try:
        with open(out.name, errors="replace") as f:
            return marker in f.read()
    except (OSError, AttributeError):
        return False


def _graph_args(mode: str) -> List[str]:
    if mode == "local":
        return ["--cuda-graph-impl", "local"]
    return ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]


def _median_step(log: str, skip: int) -> Optional[float]:
    steps = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = STEP_RE.search(line)
            if m:
                steps[int(m.group(1))] = float(m.group(2))
    kept = [ms for it, ms in steps.items() if it > skip]
    return round(statistics.median(kept), 2) if kept else None


def _exposed_comm(cell: dict, out_dir: str, timeout: int) -> Optional[float]:
    """The TP collectives megatron-core leaves exposed per step, timed alone (see the module
    docstring), in ms; ``None`` if the timing job failed."""
    cfg = _config(cell["model"])
    tokens = int(cfg["seq-length"]) * cell["micro_batch"]
    path = os.path.join(out_dir, "comm.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(cell["tp"]), os.path.join(HERE, "e2e_comm.py"), "--tokens", str(tokens),
           "--hidden", str(cfg["hidden-size"]), "--layers", str(cfg["num-layers"]),
           "--microbatches", "2", "--out", path]
    try:
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=timeout)
        with open(path) as f:
            comm = json.load(f)
    except (subprocess.SubprocessError, OSError, ValueError):
        return None
    ag, rs = comm["all_gather_ms"]["median"], comm["reduce_scatter_ms"]["median"]
    layers = int(cfg["num-layers"])
    # per micro-batch: 2 forward AGs + 2 forward RSs + 2 backward AGs per layer; the output
    # layer's AG and the embedding's RS
    return round(2 * (layers * (4 * ag + 2 * rs) + ag + rs), 2)


SWITCH_RE = re.compile(r"\[flux-interleave\] iteration (\d+): backend (\w+)")


def paired_rounds(log: str) -> List[Dict[str, float]]:
    """An interleaved job's rounds after its step-time selection: per round (a ``megatron``
    block and the blocks after it), ``megatron``'s block median over each other backend's,
    each block's first iteration dropped (the switch)."""
    steps, switches = {}, []
    with open(log, errors="replace") as f:
        for line in f:
            m = SWITCH_RE.search(line)
            if m:
                switches.append((int(m.group(1)), m.group(2)))
            m = STEP_RE.search(line)
            if m:
                steps[int(m.group(1))] = float(m.group(2))
    if not steps:
        return []
    blocks = []
    for (start, name), (end, _) in zip(switches, switches[1:] + [(max(steps) + 1, None)]):
        kept = [steps[i] for i in range(start + 1, end) if i in steps]
        if name != "selecting" and kept:
            blocks.append((name, statistics.median(kept)))
    rounds: List[Dict[str, float]] = []
    stock = None
    for name, ms in blocks:
        if name == "megatron":
            stock = ms
            rounds.append({})
        elif stock is not None:
            rounds[-1][name] = round(stock / ms, 4)
    return rounds


def window_medians(rounds: List[Dict[str, float]], lengths=(3, 6)) -> Dict[str, List[float]]:
    """Per backend and window length R: ``[min, max]`` over the job of the median of R
    consecutive paired rounds, what a step-time selection of R rounds would have measured."""
    out = {}
    for name in sorted({k for r in rounds for k in r}):
        ratios = [r[name] for r in rounds if name in r]
        for n in lengths:
            meds = [statistics.median(ratios[i:i + n]) for i in range(len(ratios) - n + 1)]
            if meds:
                out[f"{name}_{n}"] = [round(min(meds), 3), round(max(meds), 3)]
    return out


def run_cell(cell_name: str, out: str, args, checkpoint=None) -> dict:
    """Run one cell's jobs, then time its exposed TP communication. ``checkpoint(record)`` is
    called between the two, so a time limit that ends the call during the timing keeps the
    jobs' results (:func:`cmd_run` resumes from them)."""
    record = run_cell_jobs(cell_name, out, args)
    if checkpoint is not None:
        checkpoint(record)
    return finish_cell(record, out)


def finish_cell(record: dict, out: str) -> dict:
    """Time the cell's exposed TP communication and close the record."""
    work = os.path.join(out, record["cell"].replace(":", "_"))
    started = time.time()
    record["exposed_tp_comm_ms"] = _exposed_comm(parse_cell(record["cell"]), work, 300)
    record["wall_s"] = round(record.get("wall_s", 0) + time.time() - started, 1)
    return record


JOBS_FILE = "jobs.jsonl"


@functools.lru_cache(maxsize=None)
def _machine() -> str:
    """This machine as its first GPU's UUID (host names of rented machines repeat)."""
    try:
        uuids = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        uuids = []
    return uuids[0] if uuids else socket.gethostname()


def _finished_jobs(work: str) -> Dict[str, dict]:
    """The graph cell's jobs that ran to their end in an earlier call, by log name (a call's
    time limit may end a cell between its separate jobs; the next call runs only the rest)."""
    path = os.path.join(work, JOBS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {job["log"]: job for job in map(json.loads, filter(str.strip, f))}


def _job_finished(work: str, job: dict) -> None:
    with open(os.path.join(work, JOBS_FILE), "a") as f:
        f.write(json.dumps(job) + "\n")


def run_cell_jobs(cell_name: str, out: str, args) -> dict:
    """One cell's training jobs and their step times (no exposed-communication timing)."""
    cell = parse_cell(cell_name)
    work = os.path.join(out, cell_name.replace(":", "_"))
    os.makedirs(work, exist_ok=True)
    # which tuning tables the jobs read: the files named in $MEGATRON_FLUX_CONFIG, else the
    # shipped ones (and the user cache), as the launcher finds them
    record = {**cell, "cell": cell_name, "jobs": [],
              "tables": os.environ.get("MEGATRON_FLUX_CONFIG") or "shipped"}
    started = time.time()
    if cell["cuda_graphs"] == "none":
        log = os.path.join(work, "interleave.log")
        rc = _launch(cell, args.iters, {"FLUX_BACKEND": "auto"},
                     ["--flux-interleave-backends", *BACKENDS, "--flux-interleave-steps",
                      str(args.block)], log, args.job_timeout)
        record["jobs"].append({"kind": "interleaved", "log": os.path.basename(log), "exit": rc})
        tokens = int(_config(cell["model"])["seq-length"]) * 2 * cell["micro_batch"]
        rep = summarize(log, warmup=args.skip, drop_first=1, tokens_per_step=tokens,
                        reference="megatron")
        rows = rep["backends"]
        record["step_ms"] = {b: rows[b]["median_ms"] for b in BACKENDS if b in rows}
        record["speedup_vs_megatron"] = {
            b: rep["paired_speedup_vs_reference"][b]["median"]
            for b in BACKENDS[1:] if b in rep["paired_speedup_vs_reference"]}
        record["paired"] = True
        record["steps"] = {b: rows[b]["steps"] for b in rows if b in BACKENDS}
        record["interleave_report"] = rep
        with open(log, errors="replace") as f:
            chosen = AUTO_RE.findall(f.read())
        record["auto_choice"] = chosen[-1] if chosen else None
        record["paired_rounds"] = paired_rounds(log)
        record["window_medians"] = window_medians(record["paired_rounds"])
    else:
        jobs = [("auto", {"FLUX_BACKEND": "auto"}), ("megatron", {"FLUX_TP_OVERLAP": "0"}),
                ("flux", {"FLUX_BACKEND": "flux"}), ("nccl", {"FLUX_BACKEND": "nccl"})
                ][: args.graph_jobs]
        times: Dict[str, List[Optional[float]]] = {}
        finished = _finished_jobs(work)
        for rep_i in range(args.repeats):
            for name, env in jobs:
                log = os.path.join(work, f"{name}-{rep_i}.log")
                job = finished.get(os.path.basename(log))
                if job is None:
                    rc = _launch(cell, args.graph_iters, env, _graph_args(cell["cuda_graphs"]),
                                 log, args.job_timeout)
                    job = {"kind": name, "run": rep_i, "log": os.path.basename(log), "exit": rc,
                           "median_step_ms": _median_step(log, args.skip),
                           "host": _machine()}
                    _job_finished(work, job)
                record["jobs"].append(job)
                times.setdefault(name, []).append(job["median_step_ms"])
        record["runs_step_ms"] = times
        record["hosts"] = sorted({j.get("host", "?") for j in record["jobs"]})
        record["step_ms"] = {n: statistics.median(v) for n, v in times.items()
                             if all(x is not None for x in v)}
        base = record["step_ms"].get("megatron")
        record["speedup_vs_megatron"] = ({n: round(base / v, 4) for n, v in record["step_ms"].items()
                                          if n != "megatron"} if base else {})
        record["paired"] = False
        record["steps"] = args.graph_iters - args.skip
    record["table_coverage"] = table_coverage([os.path.join(work, j["log"]) for j in record["jobs"]])
    record["wall_s"] = round(time.time() - started, 1)
    return record


def table_coverage(logs: List[str]) -> Optional[str]:
    """The first job log's ``megatron-flux plan`` line (how many of the config's TP GEMMs
    the tables hold at its rows), without the tune command it offers; None if no log has one."""
    for log in logs:
        try:
            with open(log, errors="replace") as f:
                m = PLAN_RE.search(f.read())
        except OSError:
            continue
        if m:
            return m.group(1).strip()
    return None


def cmd_run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/e2e_matrix.py run " + " ".join(sys.argv[2:])
    for cell in args.cells:
        path = os.path.join(args.out, cell.replace(":", "_") + ".json")
        partial = path[:-len(".json")] + ".partial.json"
        if os.path.exists(path):
            print(f"{cell}: done already ({path})")
            continue
        if os.path.exists(partial):  # its jobs ran; the exposed-communication timing did not
            print(f"{cell}: jobs done already ({partial}); timing the exposed communication")
            with open(partial) as f:
                rec = finish_cell(json.load(f), args.out)
        else:
            def checkpoint(record, partial=partial):
                with open(partial, "w") as f:
                    json.dump(dict(record, command=command), f, indent=1)

            rec = run_cell(cell, args.out, args, checkpoint)
            rec["command"] = command
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
        if os.path.exists(partial):
            os.remove(partial)
        print(f"{cell}: step_ms {rec.get('step_ms')} speedup {rec.get('speedup_vs_megatron')} "
              f"auto={rec.get('auto_choice')} exposed={rec.get('exposed_tp_comm_ms')} "
              f"({rec['wall_s']} s)", flush=True)
    return 0


def cmd_merge(args) -> int:
    cells = []
    for path in args.cells:
        with open(path) as f:
            cells.append(json.load(f))
    meta = {}
    if args.meta:
        with open(args.meta) as f:
            meta = json.load(f)
    keep = ("model", "tp", "micro_batch", "cuda_graphs", "steps", "step_ms",
            "speedup_vs_megatron", "paired", "exposed_tp_comm_ms", "auto_choice", "runs_step_ms",
            "run", "machine", "hosts", "code", "note", "paired_rounds", "window_medians",
            "tables", "table_coverage")
    out = {
        "command": args.command or " ; ".join(sorted({c.get("command", "") for c in cells})),
        "gpu": meta.get("gpu", args.gpu),
        "versions": meta.get("versions", {}),
        "date": args.date or datetime.date.today().isoformat(),
        "definitions": {
            "step_ms": "median step time (ms) per backend; eager cells: one interleaved job, "
                       "backends rotated in blocks, each block's first iteration dropped; "
                       "graph cells: separate jobs, median over their runs",
            "speedup_vs_megatron": "eager: paired (each block against the preceding megatron "
                                   "block, median over blocks); graphs: ratio of job medians",
            "auto": "what --flux-backend auto (the default) runs: the backend its step-time "
                    "selection chose in that job (auto_choice); under CUDA graphs the per-op "
                    "choice, its fused calls captured (cells whose code predates the captured "
                    "fused path ran their captured calls on NCCL)",
            "exposed_tp_comm_ms": "TP collectives megatron-core does not overlap, per step, "
                                  "timed alone with NCCL",
            "tables": "the tuning tables the jobs read: $MEGATRON_FLUX_CONFIG, or 'shipped' "
                      "(the package's, and the user cache)",
            "table_coverage": "the launcher's megatron-flux plan line: how many of the config's "
                              "TP GEMMs those tables hold at the job's rows",
        },
        "cells": [{k: c[k] for k in keep if k in c} for c in cells],
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.png:
        _plot(out, args.png)
    for c in out["cells"]:
        print(f"{c['model']} tp{c['tp']} mbs{c['micro_batch']} {c['cuda_graphs']}: "
              f"{c['speedup_vs_megatron']} auto={c.get('auto_choice')}")
    return 0


def _plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = {"none": 0, "local": 1, "full_iteration": 2}
    cells = sorted(out["cells"], key=lambda c: (c["model"], c["tp"], c["micro_batch"],
                                                modes.get(c["cuda_graphs"], 3), c.get("run") or 0))
    names = [f"{c['model'].split('_')[0]}\ntp{c['tp']} mbs{c['micro_batch']}\n{c['cuda_graphs']}"
             + (f"\nrun {c['run']}" if c.get("run") else "") for c in cells]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    width = 0.25
    for i, b in enumerate(("nccl", "flux", "auto")):
        ys = [c["speedup_vs_megatron"].get(b, float("nan")) for c in cells]
        ax.bar([x + (i - 1) * width for x in range(len(cells))], ys, width, label=b)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(cells)), names, fontsize=8)
    ax.set_ylabel("step speedup vs megatron-core")
    ax.set_ylim(0.8, 1.15)
    ax.legend()
    ax.set_title(f"megatron-flux end to end, {out['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run cells on this machine (TP = the cell's)")
    r.add_argument("cells", nargs="+")
    r.add_argument("--out", required=True)
    r.add_argument("--iters", type=int, default=190,
                   help="iterations of an eager cell's job (the step-time selection takes ~83)")
    r.add_argument("--block", type=int, default=4, help="iterations per interleaved block")
    r.add_argument("--skip", type=int, default=20, help="iterations not counted at the start")
    r.add_argument("--graph-iters", type=int, default=60)
    r.add_argument("--graph-jobs", type=int, default=4,
                   help="graph cells: megatron and auto (2), also flux (3), also nccl (4)")
    r.add_argument("--repeats", type=int, default=1, help="runs of each graph-cell job")
    r.add_argument("--job-timeout", type=int, default=300)
    r.set_defaults(fn=cmd_run)
    m = sub.add_parser("merge", help="one matrix JSON (and plot) from cell files")
    m.add_argument("cells", nargs="+")
    m.add_argument("--out", required=True)
    m.add_argument("--png")
    m.add_argument("--meta", help="JSON with gpu and versions (the device run writes one)")
    m.add_argument("--gpu", default="unknown")
    m.add_argument("--command")
    m.add_argument("--date")
    m.set_defaults(fn=cmd_merge)
    w = sub.add_parser("rounds", help="an interleaved job's paired rounds and window medians")
    w.add_argument("log")
    w.set_defaults(fn=cmd_rounds)
    args = p.parse_args(argv)
    return args.fn(args)


def cmd_rounds(args) -> int:
    rounds = paired_rounds(args.log)
    print(json.dumps({"paired_rounds": rounds, "window_medians": window_medians(rounds)},
                     indent=1))
    return 0


def _exit_on_term(signum, frame):  # `timeout` ends a call with SIGTERM: unwind, killing the job
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_term)
    sys.exit(main())
