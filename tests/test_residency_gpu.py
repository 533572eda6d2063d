"""Two persistent programs per SM on one GPU: CUDA's occupancy answer for the fused kernels and
the fallback to one per SM, with the fused kernels' output checked against fp32 matmul."""

import dataclasses
import warnings

import pytest
import torch

from megatron_flux.tools.diagnostics.kernel_vs_cublas import ag_on_one_gpu, rel_err, rs_on_one_gpu
from megatron_flux.kernels import ag_gemm, gemm_rs, residency
from megatron_flux.kernels.config import GemmConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: fits twice on an H100/H200 SM (64-112 KB of shared memory); the 128x256 one does not
TWO = GemmConfig(128, 128, 64, 3, 4, 8, epilogue_split=2, programs_per_sm=2)
BIG = GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, programs_per_sm=2)


def _problem(m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return a, w, a.float() @ w.t().float()


def _occupancy(launcher):
    assert launcher._occupancy, "the launcher never asked for the occupancy"
    return set(launcher._occupancy.values())


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="sized for Hopper's 228 KB of shared memory per SM")
@pytest.mark.parametrize("cfg,expect", [(TWO, 2), (BIG, 1)])
def test_gemm_rs_runs_two_per_sm_only_where_they_fit(cfg, expect):
    residency._WARNED.clear()
    # 2 x 16 x 16 tiles of 128x256 (2 x 16 x 32 of 128x128): more than the SMs, so a grid of
    # two per SM needs both slots of every SM
    a, w, full = _problem(4096, 4096, 1024)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out, data = rs_on_one_gpu(a, w, 2, err)
    gemm_rs._LAUNCH._occupancy.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch(cfg)
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0]
    fits = _occupancy(gemm_rs._LAUNCH)
    assert (min(fits) >= 2) == (expect == 2), fits
    assert any("programs_per_sm=2" in str(c.message) for c in caught) == (expect == 1)
    ref = full[:2048] + data[1].float()
    assert rel_err(out.float(), ref) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="sized for Hopper's 228 KB of shared memory per SM")
@pytest.mark.parametrize("stream_k", [0, 1])
def test_ag_gemm_two_per_sm(stream_k):
    a, w, full = _problem(4096 + 256, 1024, 1024)  # a partial last wave for stream-K
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    cfg = dataclasses.replace(TWO, stream_k=stream_k)
    ag_gemm._LAUNCH._occupancy.clear()
    launch, out = ag_on_one_gpu(a, w, 2, cfg, err)
    launch()
    torch.cuda.synchronize()
    assert err.tolist() == [0, 0, 0, 0]
    assert min(_occupancy(ag_gemm._LAUNCH)) >= 2
    assert rel_err(out.float(), full) < 1e-2
