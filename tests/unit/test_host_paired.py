"""The paired reading of host A/B runs (benchmarks/host_overhead.paired_summary and
benchmarks/experiments/host_launch_ab.paired_rows): differences trial by trial, on known data
and on a saved run in host_launch_ab's own format."""

import json

import pytest

from host_overhead import paired_summary


def test_constant_difference():
    got = paired_summary([110.0, 210.0, 310.0], [100.0, 200.0, 300.0])
    assert got == {"median_us": 10.0, "lower_in": 0, "trials": 3, "ci90_us": [10.0, 10.0]}


def test_pairs_not_pools():
    # pooled, the variant looks slower (medians 250 vs 200); paired, it is lower in 3 of 4 trials
    variant = [95.0, 195.0, 295.0, 1000.0]
    reference = [100.0, 200.0, 300.0, 100.0]
    got = paired_summary(variant, reference, seed=1)
    assert got["median_us"] == -5.0 and got["lower_in"] == 3 and got["trials"] == 4
    lo, hi = got["ci90_us"]
    assert lo <= -5.0 <= hi
    assert paired_summary(variant, reference, seed=1) == got  # seeded


def test_unpaired_input_is_refused():
    with pytest.raises(ValueError, match="pair one to one"):
        paired_summary([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_summary([], [])


#: a saved host_launch_ab run: per variant and op, the host time per layer call of each trial (µs);
#: trial i of every variant ran in the same round, so differences pair trial by trial
_NCCL_COL = [700.0, 720.0, 740.0, 760.0, 780.0, 800.0, 820.0]
_NCCL_ROW = [600.0, 610.0, 620.0, 630.0, 640.0, 650.0, 660.0]
_RUN_COL = [n + d for n, d in zip(_NCCL_COL, [186, 150, 200, -10, 186, 300, -5])]  # median +186, 2 lower
_RUN_ROW = [n + d for n, d in zip(_NCCL_ROW, [69, -3, 40, 100, 69, 80, -1])]  # median +69, 2 lower
_TRITON_COL = [r + d for r, d in zip(_RUN_COL, [90, 80, 100, 70, 95, 85, 60])]  # +85 over flux run
_TRITON_ROW = [r + d for r, d in zip(_RUN_ROW, [-10, 5, 20, 74, 74, 80, 90])]  # +74, 1 lower
SAVED_RUN = {"rows": [
    {"variant": v, "op": op, "host_trials_us": trials}
    for v, col, row in (("nccl", _NCCL_COL, _NCCL_ROW), ("flux run", _RUN_COL, _RUN_ROW),
                        ("flux triton", _TRITON_COL, _TRITON_ROW))
    for op, trials in (("column fwd+bwd", col), ("row fwd+bwd", row))
]}


def test_saved_run_read_back_pairs_trial_by_trial(tmp_path):
    """Every variant against ``nccl``, the other fused variants against ``flux run`` (never
    ``nccl`` against ``flux run``), each a median of per-trial differences."""
    pytest.importorskip("triton")  # host_launch_ab imports the kernels' launch module
    from host_launch_ab import paired_from_runs

    path = tmp_path / "host-launch-ab.json"
    path.write_text(json.dumps(SAVED_RUN))
    (run,) = paired_from_runs([str(path)])
    assert run["run"] == str(path)
    got = {(p["variant"], p["reference"], p["op"]): p for p in run["paired"]}
    column = got[("flux run", "nccl", "column fwd+bwd")]
    row = got[("flux run", "nccl", "row fwd+bwd")]
    assert column["median_us"] == 186 and column["lower_in"] == 2 and column["trials"] == 7
    assert row["median_us"] == 69 and row["lower_in"] == 2
    assert got[("flux triton", "flux run", "column fwd+bwd")]["median_us"] == 85
    triton_row = got[("flux triton", "flux run", "row fwd+bwd")]
    assert triton_row["median_us"] == 74 and triton_row["lower_in"] == 1
    assert ("flux triton", "nccl", "row fwd+bwd") in got
    assert ("nccl", "flux run", "row fwd+bwd") not in got
    assert len(got) == 6  # 2 variants x nccl + 1 variant x flux run, per op


def test_megatron_pairs_with_every_variant_and_nccl_with_the_fused_ones():
    pytest.importorskip("triton")
    from host_launch_ab import paired_rows

    variants = ["megatron", "nccl", "flux", "flux triton"]
    samples = {(v, "column fwd+bwd"): [(100.0 + i + 10 * j, None) for j in range(3)]
               for i, v in enumerate(variants)}
    got = {(p["variant"], p["reference"]): p["median_us"] for p in paired_rows(samples, variants)}
    assert got == {("nccl", "megatron"): 1.0, ("flux", "megatron"): 2.0, ("flux triton", "megatron"): 3.0,
                   ("flux", "nccl"): 1.0, ("flux triton", "nccl"): 2.0, ("flux triton", "flux"): 1.0}


def _stock_linears_against_dense(rank, world):
    """megatron-core's linears as the host A/B runs them (host_overhead.megatron_linears), on a
    one-rank gloo group, against float64 matmuls: the row's forward and gradients, the column's
    forward (its backward allocates on the CUDA device). At one rank the collectives are
    identities: this checks the GEMMs and autograd around them; the GPU runs the rest."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers

    from host_overhead import megatron_linears

    class CpuBuffer:  # megatron's gather buffer lives on the current CUDA device; here, the CPU
        def get_tensor(self, shape, dtype, name):
            return torch.empty(shape, dtype=dtype)

    layers.get_global_memory_buffer = CpuBuffer
    torch.manual_seed(0)
    column, row = megatron_linears(dist.group.WORLD)
    x = torch.randn(8, 1, 16, dtype=torch.float32, requires_grad=True)
    w = torch.randn(12, 16, dtype=torch.float32, requires_grad=True)
    g = torch.randn(8, 1, 12, dtype=torch.float32)
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    torch.testing.assert_close(column(x, w).double(), x64 @ w64.t(), rtol=1e-5, atol=1e-5)
    out = row(x, w)
    out.backward(g)
    torch.testing.assert_close(out.double(), x64 @ w64.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), g64 @ w64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), g64.reshape(8, 12).t() @ x64.reshape(8, 16),
                               rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.slow
def test_the_stock_reference_is_megatron_cores_math():
    from helpers.dist_harness import run_distributed

    assert run_distributed(_stock_linears_against_dense, 1, timeout=120) == [True]
