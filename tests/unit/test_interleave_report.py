"""benchmarks/interleave_report.py and benchmarks/trace_summary.py on synthetic inputs."""

import gzip
import json

import interleave_report as R
import trace_summary as T

LINE = (" [2026-11-22 06:53:30.472809] iteration {it:8d}/{n:8d} | consumed samples: {s:12d} | "
        "elapsed time per iteration (ms): {t:.1f} | lm loss: {loss:.6E} | grad norm: 1.000 |\n")
BASE = {"megatron": 330.0, "nccl": 335.0, "flux": 310.0}


def write_log(path, n=40, steps=4, order=("megatron", "nccl", "flux")):
    with open(path, "w") as f:
        for i in range(n):  # i: 0-based iteration, logged as i + 1
            name = order[(i // steps) % len(order)]
            if i % steps == 0:
                f.write(f"[flux-interleave] iteration {i + 1}: backend {name}\n")
            first = i % steps == 0
            t = BASE[name] + (50.0 if first else 0.0) + (i % 3) * 0.5  # first of a block is slow
            f.write(LINE.format(it=i + 1, n=n, s=2 * (i + 1), t=t, loss=10.0 - 0.01 * i))
    return str(path)


def test_blocks_are_attributed_and_their_first_steps_dropped(tmp_path):
    log = write_log(tmp_path / "job.log")
    rep = R.summarize(log, warmup=0, drop_first=1, tokens_per_step=8192, reference="megatron")
    for name, base in BASE.items():
        row = rep["backends"][name]
        assert base <= row["median_ms"] <= base + 1.0, (name, row)
        assert row["steps"] == 3 * len([b for b in range(10) if ("megatron", "nccl", "flux")[b % 3] == name])
    sp = rep["paired_speedup_vs_reference"]
    assert abs(sp["flux"]["median"] - 330.0 / 310.0) < 0.005
    assert abs(sp["nccl"]["median"] - 330.0 / 335.0) < 0.005
    assert "megatron" not in sp
    kept = R.summarize(log, warmup=0, drop_first=0, tokens_per_step=8192, reference="megatron")
    assert kept["backends"]["flux"]["p10_p90_ms"][1] > 350  # the slow first steps are back
    excl = R.summarize(log, warmup=20, drop_first=1, tokens_per_step=8192, reference="megatron",
                       exclude=(25, 40))
    assert sum(r["steps"] for r in excl["backends"].values()) == 3  # iterations 21..24, block of 21
    assert len(rep["loss"]["interleaved"]) == 40
    assert rep["step_time_ms"]["stock"] == rep["backends"]["megatron"]["median_ms"]
    assert rep["speedup_vs_stock"]["flux"] == sp["flux"]["median"] and "stock" in rep["tokens_per_s"]


def test_report_cli_writes_json(tmp_path):
    log = write_log(tmp_path / "job.log")
    out = tmp_path / "r.json"
    assert R.main(["--log", log, "--tokens-per-step", "8192", "--warmup", "4", "--out", str(out),
                   "--extra", 'command="x"', "--exclude", "30-32", "--comm-ms", "20"]) == 0
    rep = json.loads(out.read_text())
    assert rep["command"] == "x" and rep["excluded_iterations"] == [30, 32]
    hidden = rep["tp_comm_hidden_fraction"]
    assert abs(hidden["flux"] - (rep["backends"]["megatron"]["median_ms"] - rep["backends"]["flux"]["median_ms"]) / 20) < 1e-3


def _trace(path):
    ev = []
    for step, (t0, backend_kernel) in enumerate([(0, "ag_gemm_kernel"), (1000, "nccl_AllGather")], start=5):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": t0, "dur": 900})
        for j, (name, dur) in enumerate([(backend_kernel, 100), ("nvjet_gemm", 200), ("elementwise", 10)]):
            corr = step * 10 + j
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 10 * j,
                       "dur": 5, "args": {"correlation": corr}})
            start = t0 + 100 + 400 * j  # gaps of 300/190 us between kernels
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur,
                       "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": t0 + 50,
                   "dur": 40, "args": {"correlation": step * 10 + 9}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "ts": t0 + 60,
                   "dur": 2, "args": {"correlation": step * 10 + 8}})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "ColumnParallelLinearFunction", "ts": t0 + 1, "dur": 30})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return str(path)


def test_trace_summary_attributes_gpu_work_to_the_launching_step(tmp_path):
    tr = _trace(tmp_path / "rank-0.json.gz")
    rep = T.summarize(T.load(tr), {5: "flux", 6: "nccl"})
    s5, s6 = rep["steps"]
    assert (s5["step"], s5["backend"], s6["backend"]) == (5, "flux", "nccl")
    assert s5["gpu_ms_by_kind"] == {"fused_ag": 0.1, "gemm": 0.2, "other": 0.01}
    assert s6["gpu_ms_by_kind"]["nccl"] == 0.1
    assert s5["gpu_busy_ms"] == 0.31 and s5["gpu_span_ms"] == 0.81
    assert s5["gpu_gaps_over_50us"] == 2 and abs(s5["gpu_gaps_ms"] - 0.5) < 1e-9
    assert (s5["launches"], s5["syncs"], s5["stream_waits"], s5["linear_calls"]) == (3, 1, 1, 1)
    assert rep["median_by_backend"]["flux"]["steps"] == [5]
    assert (s5["comm_alone_ms"], s6["comm_alone_ms"]) == (0.0, 0.1)  # nccl ran beside nothing
    assert rep["median_by_backend"]["nccl"]["kernels_ms"] == {"nvjet_gemm": 0.2, "nccl_AllGather": 0.1,
                                                             "elementwise": 0.01}


def test_comm_alone_subtracts_only_the_overlapped_part():
    comm = [(0, 10), (5, 20), (30, 40)]          # union [0, 20] + [30, 40]
    compute = [(2, 4), (15, 35), (38, 39)]       # covers 2 + 5 + 5 + 1 of it
    assert T._alone(comm, compute) == 30 - 13
    assert T._alone(comm, []) == 30 and T._alone([], compute) == 0


def test_comm_alone_is_split_by_op(tmp_path):
    tr = _trace(tmp_path / "rank-0.json.gz")
    rep = T.summarize(T.load(tr), {5: "flux", 6: "nccl"})
    s5, s6 = rep["steps"]
    assert s5["comm_alone_by_op_ms"] == {}
    assert s6["comm_alone_by_op_ms"] == {"nccl_AllGather (stream None)": {"calls": 1, "ms": 0.1,
                                                                         "alone_ms": 0.1}}
    ops = [("x", (0, 10)), ("y", (5, 8)), ("x", (20, 30))]
    by_op = T._alone_by_op(ops, [(2, 4), (25, 40), (3, 6)])  # compute [2, 6] + [25, 40]
    assert by_op == {"x": {"calls": 2, "ms": 0.02, "alone_ms": 0.011},
                     "y": {"calls": 1, "ms": 0.003, "alone_ms": 0.002}}
    assert list(by_op) == ["x", "y"], "largest alone time first"


def test_runs_report_pairs_every_job_against_each_reference_it_ran(tmp_path):
    """benchmarks/interleave_runs.py: a tgz'd job and a plain one; a reference a job did not run
    is skipped for that job; the across-runs lists hold one median per job, in order."""
    import tarfile

    import interleave_runs as IR

    one = write_log(tmp_path / "interleave.log")
    tgz = tmp_path / "logs.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(one, arcname="interleave.log")
    two = write_log(tmp_path / "two.log", order=("nccl", "flux"))
    out = tmp_path / "runs.json"
    assert IR.main([str(tgz), two, "--references", "megatron", "nccl", "--warmup", "0",
                    "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [sorted(r["vs"]) for r in rep["runs"]] == [["megatron", "nccl"], ["nccl"]]
    flux_vs_nccl = rep["across_runs"]["nccl"]["flux"]
    assert len(flux_vs_nccl) == 2 and all(abs(m - 335.0 / 310.0) < 0.005 for m in flux_vs_nccl)
    assert rep["across_runs"]["megatron"]["flux"] == [rep["runs"][0]["vs"]["megatron"]["flux"]["median"]]
    assert rep["runs"][1]["step_time_ms"].keys() == {"nccl", "flux"}


def test_trace_summary_lists_fused_calls_in_order_with_median_durations(tmp_path):
    """Per backend, each fused call of a step in GPU order, median over steps with the usual
    call count (a step cut at the profile's edge is left out)."""
    ev = []
    plan = {5: [("ag_gemm_kernel", 100), ("gemm_rs_kernel", 50)], 6: [("ag_gemm_kernel", 300), ("gemm_rs_kernel", 70)],
            7: [("ag_gemm_kernel", 200), ("gemm_rs_kernel", 60)], 8: [("ag_gemm_kernel", 999)]}
    for step, kernels in plan.items():
        t0 = step * 10000
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": t0, "dur": 9000})
        # launched in order, listed out of order: the GPU start decides
        for j, (name, dur) in reversed(list(enumerate(kernels + [("nvjet_gemm", 5)]))):
            corr = step * 10 + j
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 10 * j, "dur": 5,
                       "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t0 + 100 + 1000 * j, "dur": dur,
                       "args": {"correlation": corr}})
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    rep = T.summarize(T.load(str(path)), {5: "flux", 6: "flux", 7: "flux", 8: "flux"})
    agg = rep["median_by_backend"]["flux"]
    assert agg["fused_calls_steps"] == [5, 6, 7]
    assert agg["fused_calls_us"] == [{"name": "ag_gemm_kernel", "us": 200}, {"name": "gemm_rs_kernel", "us": 60}]
