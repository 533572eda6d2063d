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


@pytest.mark.parametrize("form", ["pingpong", "coop"])
def test_rs_ws_trace(form):
    """The warp-specialized GEMM+RS's own stamps (``gemm_rs_ws.WS_RS_PHASES`` and ``WS_RS_SYNC``,
    read by ``benchmarks/experiments/phase_trace_ws.py`` and ``phase_trace_tp.py``), with its
    split tail, as rank 0 of 2 (peers' signals pre-set): the traced launch computes the right
    sum; every MMA partition of every program stamps its start and end and counts in at the
    grid barrier once, between them; the partitions that ran a whole own tile stamp the peers'
    signals acquired, after their count-in and before their end."""
    from megatron_flux.kernels import gemm_rs_ws as W, split_tail
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import rel_err, rs_on_one_gpu

    if W.gemm_rs_ws_kernel is None:
        pytest.skip(W.GLUON_ERROR)
    world, m, n, k = 2, 2048, 2304, 2048
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fields = (dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4)
              if form == "pingpong" else dict(block_m=128, block_n=256, block_k=64, num_stages=3,
                                              num_warps=8))
    cfg = GemmConfig(**fields, epilogue_split=1, rs_warp_specialized=True, stream_k=1)
    assert split_tail.split_tail_plan(world, m // world, n, k, cfg, sms)[1] > 1 or sms != 132
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")

    def launcher(*args, produce=True, consume=True, **kwargs):
        return W.launch_gemm_rs_ws(*args, **kwargs)

    launch, out, data = rs_on_one_gpu(a, w, world, err, launcher, sms)
    trace = torch.full((sms, W.WS_TRACE_SLOTS), -1, dtype=torch.int64, device="cuda")
    launch(cfg, trace=trace)
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0]
    ref = (a.float() @ w.t().float())[:m // world] + data[1].float()
    assert rel_err(out.float(), ref) < 1e-2
    tr = trace.cpu()
    phases, sync = len(W.WS_RS_PHASES), len(W.WS_RS_SYNC)
    acquired = 0
    for c in range(2 if form == "pingpong" else 1):
        start, end = tr[:, phases * c], tr[:, phases * c + phases - 1]
        counted = tr[:, 16 + sync * c + W.WS_RS_SYNC.index("counted_in")]
        peers = tr[:, 16 + sync * c + W.WS_RS_SYNC.index("peers_acquired")]
        assert bool((start >= 0).all()) and bool((end >= 0).all()), c
        assert bool((counted >= 0).all()), f"partition {c}: a program never counted in"
        assert bool(((start <= counted) & (counted <= end)).all()), c
        ran = peers >= 0
        acquired += int(ran.sum())
        assert bool(((counted[ran] <= peers[ran]) & (peers[ran] <= end[ran])).all()), c
    assert acquired > 0, "no partition stamped the peers' signals"
