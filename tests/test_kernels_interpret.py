"""The fused kernels' tile order, signal indexing, ownership and math on the CPU (Triton
interpreter, simulated ranks at TP 2/4/8). The checks live in ``interpret_checks.py`` and run in
one subprocess, because ``TRITON_INTERPRET`` must be set before the kernels are imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
# not imported here: importing it would switch this process's kernels to the interpreter
NAMES = ["check_tile_order", "check_ag_gemm_all_ranks", "check_ag_peer_groups",
         "check_ag_merged_local", "check_ag_merged_signals",
         "check_ag_stream_k", "check_ag_signal_indexing",
         "check_gemm_rs_all_ranks", "check_gemm_rs_ownership",
         "check_gemm_rs_deterministic_and_timeout", "check_gemm_rs_spread_waits_for_its_own_grid",
         "check_gemm_rs_merged_rows", "check_gemm_rs_stream_k",
         "check_gemm_rs_copy_engine", "check_gemm_rs_copy_engine_bands",
         "check_copy_engine_reduce_scatter",
         "check_next_call_cannot_release_a_wait",
         "check_ready_barrier", "check_copy_engine_gather", "check_plain_gemm",
         "check_programs_per_sm", "check_ws_configs_run_the_triton_kernels",
         "check_host_and_device_descriptors_agree"]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, str(HERE / "interpret_checks.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    results = json.loads(lines[-1][len("RESULTS "):])
    if "__skipped__" in results:
        pytest.skip(results["__skipped__"])
    return results


def test_every_check_ran(results):
    assert sorted(results) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_logic_under_interpreter(results, name):
    assert name in results, f"{name} did not run"
    assert results[name] is None, results[name]
