"""The fused kernels' phase stamps (``kernels/phase_trace.py``) on one GPU: a traced launch
computes the same result as an untraced one, every program stamps its start and end, and the
stamps of each program follow the kernel's schedule in time."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _assert_schedule(trace, phases, order):
    """Every program stamped start and end, and ``order`` (phase names) is non-decreasing in
    time wherever a program stamped both ends of a pair."""
    trace = trace.cpu()
    stamped = trace[:, 0] >= 0
    assert stamped.any()
    assert bool((trace[stamped, phases.index("end")] >= 0).all()), "a program never stamped end"
    for a, b in zip(order, order[1:]):
        ia, ib = phases.index(a), phases.index(b)
        both = (trace[:, ia] >= 0) & (trace[:, ib] >= 0)
        assert bool((trace[both, ia] <= trace[both, ib]).all()), f"{a} after {b}"


@pytest.mark.parametrize("world", [2, 4])
def test_rs_trace(world):
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import rs_on_one_gpu
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gemm_rs import RS_PHASES
    from megatron_flux.kernels.phase_trace import new_trace

    torch.manual_seed(0)
    a = torch.randn(world * 384, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out, _ = rs_on_one_gpu(a, w, world, err, num_sms=16)
    cfg = GemmConfig(128, 128, 64, 3, 4, 8, epilogue_split=2, flatten_consume=True)
    launch(cfg)
    plain = out.clone()
    trace = new_trace(16, a.device)
    out.fill_(float("nan"))
    launch(cfg, trace=trace)
    torch.cuda.synchronize()
    assert int(err[0]) == 0 and torch.equal(out, plain)
    _assert_schedule(trace, RS_PHASES, ["start", "descriptors", "produced", "arrived", "own_gemm",
                                        "waited", "first_reduced", "end"])


def test_ag_trace():
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import ag_on_one_gpu
    from megatron_flux.kernels.ag_gemm import AG_PHASES
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.phase_trace import new_trace

    torch.manual_seed(0)
    a = torch.randn(2 * 640, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(128, 128, 64, 3, 4, 8, chunk_rows=128, epilogue_split=1, stream_k=1)
    launch, out = ag_on_one_gpu(a, w, 2, cfg, err, num_sms=24)  # 80 tiles: a stream-K tail
    launch()
    plain = out.clone()
    trace = new_trace(24, a.device)
    out.fill_(float("nan"))
    launch(trace=trace)
    torch.cuda.synchronize()
    assert int(err[0]) == 0 and torch.equal(out, plain)
    _assert_schedule(trace, AG_PHASES, ["start", "descriptors", "local_done", "last_wait",
                                        "peers_done", "end"])
