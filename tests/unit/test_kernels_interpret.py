"""The fused kernels' tile order, signal indexing, ownership and math on the CPU (Triton
interpreter, simulated ranks at TP 2/4/8). The checks live in ``helpers/interpret_checks.py`` and
run in subprocesses, because ``TRITON_INTERPRET`` must be set before the kernels are imported."""

import json
import os
import subprocess
import sys

import pytest

from helpers.paths import REPO

pytest.importorskip("triton")

# not imported here: importing it would switch this process's kernels to the interpreter
NAMES = ["check_tile_order", "check_row_turn_order", "check_ag_gemm_all_ranks", "check_ag_merged_local", "check_ag_merged_signals",
         "check_ag_stream_k", "check_ag_signal_indexing",
         "check_gemm_rs_all_ranks", "check_gemm_rs_ownership",
         "check_gemm_rs_deterministic_and_timeout", "check_gemm_rs_spread_waits_for_its_own_grid",
         "check_gemm_rs_merged_rows", "check_gemm_rs_stream_k",
         "check_gemm_rs_copy_engine",
         "check_copy_engine_reduce_scatter",
         "check_next_call_cannot_release_a_wait",
         "check_ready_barrier", "check_copy_engine_gather", "check_plain_gemm",
         "check_ws_configs_run_the_triton_kernels",
         "check_host_and_device_descriptors_agree"]


#: rough seconds each check takes in the interpreter (2-core box), only to split the checks
#: evenly over the worker processes; a check missing here counts as 1
COST = {"check_gemm_rs_merged_rows": 32, "check_gemm_rs_all_ranks": 29, "check_gemm_rs_stream_k": 13,
        "check_gemm_rs_copy_engine": 13, "check_ag_stream_k": 6, "check_ag_merged_local": 6,
        "check_tile_order": 5, "check_gemm_rs_ownership": 4, "check_ag_gemm_all_ranks": 3}


def _split(names, workers):
    """``names`` in ``workers`` groups of about equal :data:`COST` (longest first)."""
    groups = [[] for _ in range(workers)]
    load = [0.0] * workers
    for name in sorted(names, key=lambda n: -COST.get(n, 1)):
        i = load.index(min(load))
        groups[i].append(name)
        load[i] += COST.get(name, 1)
    return [g for g in groups if g]


@pytest.fixture(scope="module")
def results():
    """Every check's result. The interpreter runs one thread, so the checks are split over one
    process per CPU (at most 4): on 2 cores the run takes half as long."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "tests")]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    workers = max(1, min(4, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-m", "helpers.interpret_checks", *group], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for group in _split(NAMES, workers)]
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")]
            assert proc.returncode == 0 and lines, f"interpreter run failed:\n{out}\n{err}"
            results.update(json.loads(lines[-1][len("RESULTS "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    if "__skipped__" in results:
        pytest.skip(results["__skipped__"])
    return results


def test_every_check_ran(results):
    assert sorted(results) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_logic_under_interpreter(results, name):
    assert name in results, f"{name} did not run"
    assert results[name] is None, results[name]
