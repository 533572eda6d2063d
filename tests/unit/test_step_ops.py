"""benchmarks/step_ops.py on a synthetic trace: each TP GEMM's time inside the step."""

import pytest

import step_ops as S


def _events(plan):
    """``plan``: {step: [(kernel name, us), ...]} launched in order."""
    ev = []
    for step, kernels in plan.items():
        t0 = step * 100000
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": t0, "dur": 90000})
        for j, (name, us) in enumerate(kernels):
            corr = step * 1000 + j
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + j, "dur": 1,
                       "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t0 + 100 + 1000 * j, "dur": us,
                       "args": {"correlation": corr}})
    return ev


def _nccl_mb(scale):
    # forward: AG, QKV, attention, proj, RS, AG, fc1, fc2, RS, output; backward: two GEMMs
    return [("ncclDevKernel_AllGather", 50), ("nvjet_qkv", 10 * scale), ("flash_fprop", 30),
            ("nvjet_proj", 20 * scale), ("ncclDevKernel_ReduceScatter", 40), ("ncclDevKernel_AllGather", 50),
            ("nvjet_fc1", 30 * scale), ("nvjet_fc2", 40 * scale), ("ncclDevKernel_ReduceScatter", 40),
            ("nvjet_output", 90 * scale), ("nvjet_dgrad", 5), ("nvjet_wgrad", 6)]


def _flux_mb(scale):
    return [("ag_gemm_kernel", 11 * scale), ("flash_fprop", 30), ("gemm_rs_kernel", 21 * scale),
            ("ag_gemm_ws_kernel", 31 * scale), ("gemm_rs_kernel", 41 * scale), ("ag_gemm_kernel", 91 * scale),
            ("ag_gemm_kernel", 42 * scale), ("nvjet_wgrad", 6), ("ag_gemm_ws_kernel", 22 * scale)]


def test_each_gemm_is_set_beside_its_cublas_time_and_the_benchmark():
    ev = _events({5: _nccl_mb(1) + _nccl_mb(3), 6: _flux_mb(1) + _flux_mb(3)})
    bench = {"rows": [{"op": "AG+GEMM", "model": "qkv", "m": 8192, "method": "cublas_gemm", "median_ms": 0.012},
                      {"op": "AG+GEMM", "model": "qkv", "m": 8192, "method": "flux", "median_ms": 0.015},
                      {"op": "AG+GEMM", "model": "qkv", "m": 4096, "method": "flux", "median_ms": 9.0}]}
    rep = S.summarize(ev, {5: "nccl", 6: "flux"}, layers=1, micro_batches=2, bench=bench, m=8192)
    assert rep["steps"] == {"nccl": [5], "flux": [6]}
    ops = rep["ops"]
    assert ops["qkv"] == {"step_cublas_us": 20.0, "step_cublas_calls": 2, "step_fused_us": 22.0,
                          "step_fused_calls": 2, "step_fused_over_cublas": 1.1, "bench_cublas_us": 12.0,
                          "bench_fused_us": 15.0, "bench_fused_over_cublas": 1.25}
    assert (ops["proj"]["step_cublas_us"], ops["fc1"]["step_fused_us"], ops["fc2"]["step_cublas_us"]) == (40, 62, 80)
    assert (ops["output"]["step_cublas_us"], ops["output"]["step_fused_us"]) == (180, 182)
    assert ops["fc2.dgrad"] == {"step_fused_us": 84.0, "step_fused_calls": 2}
    assert ops["proj.dgrad"]["step_fused_us"] == 44


def test_a_step_off_the_pattern_is_an_error():
    swapped = _flux_mb(1)
    swapped[2], swapped[3] = swapped[3], swapped[2]  # proj ran an AllGather+GEMM
    with pytest.raises(ValueError, match="step 6: the proj call ran a fused_ag kernel"):
        S.summarize(_events({6: swapped + _flux_mb(1)}), {6: "flux"}, layers=1, micro_batches=2)
    with pytest.raises(ValueError, match="step 6: 7 fused calls, expected 7 per micro-batch x 2"):
        S.summarize(_events({6: _flux_mb(1)}), {6: "flux"}, layers=1, micro_batches=2)
    with pytest.raises(ValueError, match="step 5: 3 cuBLAS GEMMs"):
        S.summarize(_events({5: [("nvjet_a", 1)] * 3}), {5: "nccl"}, layers=1, micro_batches=2)
