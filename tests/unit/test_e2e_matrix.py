"""benchmarks/e2e_matrix.py: cells, resumption, the JSON schema, on fake training logs."""

import json

import pytest

import e2e_matrix as M

STEP = {"megatron": 350.0, "nccl": 345.0, "flux": 340.0, "auto": 338.0, "selecting": 400.0}


def _interleaved_log(path, iters, block):
    """Megatron's per-iteration lines and the interleaver's switches, as a job would log them."""
    lines = []
    order = ["megatron", "nccl", "flux", "auto"]
    select = 24
    for it in range(1, iters + 1):
        if it == 1:
            lines.append("[flux-interleave] iteration 1: backend selecting")
        if it == select + 1:
            lines.append("[flux-auto] flux_backend='nccl' for this job, from its measured steps")
        if it > select and (it - select - 1) % block == 0:
            name = order[((it - select - 1) // block) % 4]
            lines.append(f"[flux-interleave] iteration {it}: backend {name}")
        name = "selecting" if it <= select else order[((it - select - 1) // block) % 4]
        lines.append(f" [2026-11-27] iteration {it:>8}/ {iters} | consumed samples: {2 * it} | "
                     f"elapsed time per iteration (ms): {STEP[name] + (0.5 if it % 2 else 0):.1f} |"
                     f" lm loss: 9.0E+00 |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def test_cells_parse_and_bad_ones_are_refused():
    assert M.parse_cell("llama3_8b_16l:tp2:mbs1:eager") == {
        "model": "llama3_8b_16l", "tp": 2, "micro_batch": 1, "cuda_graphs": "none"}
    assert M.parse_cell("gpt3_175b_4l:tp4:mbs2:local")["cuda_graphs"] == "local"
    with pytest.raises(SystemExit, match="expected"):
        M.parse_cell("llama3_8b_16l:tp2:mbs1")


def _graph_job_log(log, iters, env, scale=1.0):
    """A separate job's per-iteration lines at the step time of the backend ``env`` runs."""
    name = "megatron" if env.get("FLUX_TP_OVERLAP") == "0" else env["FLUX_BACKEND"]
    with open(log, "w") as f:
        if name != "megatron":
            f.write("> megatron-flux plan: 2 of 10 TP GEMMs have a current table entry at m=4096; "
                    "to tune the rest on this machine: torchrun ... megatron-flux tune ...\n")
        for it in range(1, iters + 1):
            f.write(f" iteration {it:>4}/ {iters} | elapsed time per iteration (ms): "
                    f"{STEP[name] * scale:.1f} |\n")


def test_a_matrix_from_fake_jobs_has_the_issues_schema_and_resumes(tmp_path, monkeypatch):
    launches = []

    def fake_launch(cell, iters, env, extra, log, timeout):
        launches.append((cell["cuda_graphs"], env, extra))
        if "--flux-interleave-backends" in extra:
            _interleaved_log(log, iters, 4)
        else:
            _graph_job_log(log, iters, env, 0.9 if "--cuda-graph-impl" in extra else 1.0)
        return 0

    monkeypatch.setattr(M, "_launch", fake_launch)
    monkeypatch.setattr(M, "_exposed_comm", lambda cell, work, timeout: 12.5)
    monkeypatch.setenv("MEGATRON_FLUX_CONFIG", "/tmp/confirmed.json")
    out = tmp_path / "cells"
    cells = ["llama3_8b_16l:tp2:mbs1:eager", "llama3_8b_16l:tp2:mbs1:local"]
    assert M.main(["run", *cells, "--out", str(out), "--iters", "120", "--graph-iters", "40"]) == 0
    assert len(launches) == 5  # one interleaved job, four graph jobs (auto, megatron, flux, nccl)
    assert M.main(["run", *cells, "--out", str(out)]) == 0
    assert len(launches) == 5, "finished cells are not run again"
    eager = json.loads((out / "llama3_8b_16l_tp2_mbs1_eager.json").read_text())
    assert eager["step_ms"] == pytest.approx({b: STEP[b] + 0.25 for b in M.BACKENDS}, abs=0.3)
    assert eager["speedup_vs_megatron"]["auto"] == pytest.approx(350.0 / 338.0, rel=2e-3)
    assert eager["auto_choice"] == "nccl" and eager["paired"] is True
    merged = tmp_path / "matrix.json"
    assert M.main(["merge", *sorted(str(p) for p in out.glob("*.json")), "--out", str(merged),
                   "--gpu", "NVIDIA H200", "--date", "2026-11-27"]) == 0
    doc = json.loads(merged.read_text())
    assert {"command", "gpu", "versions", "cells"} <= set(doc)
    for cell in doc["cells"]:
        assert {"model", "tp", "micro_batch", "cuda_graphs", "steps", "step_ms",
                "speedup_vs_megatron", "paired", "exposed_tp_comm_ms"} <= set(cell)
        assert cell["cuda_graphs"] in ("none", "local", "full_iteration")
    graphed = next(c for c in doc["cells"] if c["cuda_graphs"] == "local")
    assert graphed["paired"] is False
    # which tables the jobs read, and how much of the config they held
    assert all(c["tables"] == "/tmp/confirmed.json" for c in doc["cells"])
    assert graphed["table_coverage"] == "2 of 10 TP GEMMs have a current table entry at m=4096"
    assert eager["table_coverage"] is None  # the fake interleaved log has no plan line
    assert graphed["speedup_vs_megatron"]["auto"] == pytest.approx(350.0 / 338.0, rel=1e-3)


def test_a_cell_cut_off_while_timing_its_communication_resumes_without_its_jobs(tmp_path,
                                                                               monkeypatch):
    """The call's time limit may end a cell after its jobs, during the exposed-communication
    timing: the jobs' step times are kept in a partial record, and the next run only times the
    communication."""
    launches = []

    def fake_launch(cell, iters, env, extra, log, timeout):
        launches.append(env)
        _graph_job_log(log, iters, env)
        return 0

    def cut_off(cell, work, timeout):
        raise KeyboardInterrupt  # the call's limit, as a signal would end it

    monkeypatch.setattr(M, "_launch", fake_launch)
    monkeypatch.setattr(M, "_exposed_comm", cut_off)
    out = tmp_path / "cells"
    cell = "llama3_8b_16l:tp2:mbs1:full_iteration"
    with pytest.raises(KeyboardInterrupt):
        M.main(["run", cell, "--out", str(out), "--graph-iters", "40"])
    partial = out / "llama3_8b_16l_tp2_mbs1_full_iteration.partial.json"
    assert json.loads(partial.read_text())["step_ms"] == {b: STEP[b] for b in M.BACKENDS}
    assert not (out / "llama3_8b_16l_tp2_mbs1_full_iteration.json").exists()
    monkeypatch.setattr(M, "_exposed_comm", lambda cell, work, timeout: 19.0)
    assert M.main(["run", cell, "--out", str(out)]) == 0
    assert len(launches) == 4, "the jobs are not run again"
    done = json.loads((out / "llama3_8b_16l_tp2_mbs1_full_iteration.json").read_text())
    assert done["exposed_tp_comm_ms"] == 19.0 and done["step_ms"]["megatron"] == 350.0
    assert done["command"].startswith("python benchmarks/e2e_matrix.py run") and not partial.exists()


def test_paired_rounds_and_window_medians_from_an_interleaved_log(tmp_path):
    """Each round pairs a megatron block with the blocks after it (first iteration of each
    dropped); window medians are what selections of 3 and 6 rounds would have measured."""
    log = tmp_path / "interleave.log"
    _interleaved_log(log, 24 + 4 * 4 * 8, 4)  # after the selection: 8 rounds of 4 blocks
    rounds = M.paired_rounds(str(log))
    assert len(rounds) == 8 and all(set(r) == {"nccl", "flux", "auto"} for r in rounds)
    for r in rounds:
        assert r["nccl"] == pytest.approx(350.0 / 345.0, abs=3e-3)
        assert r["auto"] == pytest.approx(350.0 / 338.0, abs=3e-3)
    win = M.window_medians([{"nccl": x} for x in (1.0, 1.1, 0.9, 1.2, 1.0, 1.0, 0.8)])
    assert win == {"nccl_3": [1.0, 1.1], "nccl_6": [1.0, 1.0]}
    assert M.main(["rounds", str(log)]) == 0


def test_a_timed_out_job_takes_its_children_with_it(tmp_path):
    """A job past its time limit is killed with everything it started (torchrun's workers would
    otherwise hold their GPU memory while the next job of the cell starts)."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    argv = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    with open(tmp_path / "job.log", "w") as out:
        t0 = time.time()
        assert M.run_job(argv, dict(os.environ), out, timeout=1) == 124
    assert time.time() - t0 < 30
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the job's child outlived the time limit")
    with open(tmp_path / "ok.log", "w") as out:
        assert M.run_job(["bash", "-c", "exit 3"], dict(os.environ), out, timeout=10) == 3


def test_a_graph_cell_cut_off_between_jobs_runs_only_the_jobs_it_lacks(tmp_path, monkeypatch):
    """A graph cell's separate jobs may not all fit one call: the jobs that finished are kept,
    and the next run launches only the rest, then reports all four."""
    launches = []

    def fake_launch(cell, iters, env, extra, log, timeout):
        name = "megatron" if env.get("FLUX_TP_OVERLAP") == "0" else env["FLUX_BACKEND"]
        if name == "nccl" and len(launches) < 4:
            launches.append(name)
            raise KeyboardInterrupt  # the call's limit ends the cell during its last job
        launches.append(name)
        _graph_job_log(log, iters, env)
        return 0

    monkeypatch.setattr(M, "_launch", fake_launch)
    monkeypatch.setattr(M, "_exposed_comm", lambda cell, work, timeout: 19.0)
    out = tmp_path / "cells"
    cell = "llama3_8b_16l:tp2:mbs1:full_iteration"
    with pytest.raises(KeyboardInterrupt):
        M.main(["run", cell, "--out", str(out), "--graph-iters", "40"])
    assert launches == ["auto", "megatron", "flux", "nccl"]
    assert M.main(["run", cell, "--out", str(out), "--graph-iters", "40"]) == 0
    assert launches[4:] == ["nccl"], "only the job that did not finish runs again"
    done = json.loads((out / "llama3_8b_16l_tp2_mbs1_full_iteration.json").read_text())
    assert done["step_ms"] == {b: STEP[b] for b in M.BACKENDS}
    assert [j["kind"] for j in done["jobs"]] == ["auto", "megatron", "flux", "nccl"]


def test_a_job_that_hangs_after_its_last_iteration_is_ended_after_the_grace(tmp_path):
    """Stock jobs with full_iteration graphs log every step, then do not exit: the matrix ends
    them a grace period after Megatron's end-of-training line instead of at the time limit, and
    says so in the log; a job that exits by itself keeps its exit status."""
    import os
    import time

    hang = f"echo ' iteration 1/ 1 |'; echo '{M.DONE_MARKER} datetime'; sleep 60"
    log = tmp_path / "hang.log"
    with open(log, "w") as out:
        t0 = time.time()
        rc = M.run_job(["bash", "-c", hang], dict(os.environ), out, timeout=50, exit_grace_s=1)
    assert rc == M.HUNG_AFTER_TRAINING and time.time() - t0 < 20
    assert "had not exited" in log.read_text() and "iteration 1/ 1" in log.read_text()
    with open(tmp_path / "ok.log", "w") as out:
        assert M.run_job(["bash", "-c", f"echo '{M.DONE_MARKER}'; sleep 1; exit 0"],
                         dict(os.environ), out, timeout=50, exit_grace_s=5) == 0
    with open(tmp_path / "quiet.log", "w") as out:  # no marker: only the time limit ends it
        assert M.run_job(["bash", "-c", "sleep 60"], dict(os.environ), out, timeout=2,
                         exit_grace_s=0.5) == 124
