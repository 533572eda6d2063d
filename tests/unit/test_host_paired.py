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
