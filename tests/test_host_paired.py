"""The paired reading of host A/B runs (benchmarks/host_overhead.paired_summary and
benchmarks/experiments/host_launch_ab.paired_rows): differences trial by trial, on known data
and on a committed run whose paired medians the session-30 notes quote."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "experiments"))

from host_overhead import paired_summary  # noqa: E402


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


def test_session30_run1_as_quoted():
    """NOTES, session 30: flux run - nccl, +186 us per column call (lower in 3 of 21) and +69 us
    per row call (8 of 21), from this file."""
    pytest.importorskip("triton")  # host_launch_ab imports the kernels' launch module
    from host_launch_ab import paired_from_runs

    path = os.path.join(ROOT, "benchmarks", "results", "host-launch-ab-h100x2-2026-11-26-s30-run1.json")
    (run,) = paired_from_runs([path])
    got = {(p["variant"], p["reference"], p["op"]): p for p in run["paired"]}
    column = got[("flux run", "nccl", "column fwd+bwd")]
    row = got[("flux run", "nccl", "row fwd+bwd")]
    assert round(column["median_us"]) == 186 and column["lower_in"] == 3
    assert round(row["median_us"]) == 69 and row["lower_in"] == 8
    assert ("flux triton", "flux run", "row fwd+bwd") in got  # fused variants against flux run
    assert ("nccl", "flux run", "row fwd+bwd") not in got
