"""The tuner's whole run on two CPU ranks: everything but the fused kernels.

``megatron-flux tune`` needs GPUs for what it measures, but most of what it does is
orchestration: the plan, the broadcast of what the table already holds, each entry's check,
screen and final timing with collectives between ranks, rank 0's table write after every entry,
and the agreement that stops every rank when one fails. Here that runs for real on a gloo group
of two processes, with the fused backend replaced by the NCCL one (candidate configs then time
alike) and the GPU's identity given, so a fault on that path fails on the CPU instead of on the
device (a name error in rank 0's table writer once left the other ranks waiting there).
"""

import json
import os

import pytest
import torch

from megatron_flux.tuning import schema

from helpers.dist_harness import run_distributed

SHAPES = ["ag:128:64", "rs:64:128"]
ARGV = ["--shapes", *SHAPES, "--ms", "64", "--max-candidates", "2", "--top", "1", "--screen-iters", "1",
        "--trials", "1", "--iters", "1", "--warmup", "1", "--sample-warmup", "0", "--no-progress"]


def _tune_on_cpu(rank, world, out, fail_write_on_rank=None, extra=()):
    import torch.distributed as dist

    import megatron_flux.backends as backends
    import megatron_flux.backends.flux as flux_pkg
    import megatron_flux.tuning.device as device_mod
    import megatron_flux.tuning.schema as schema_mod
    from megatron_flux.backends.nccl import NcclBackend
    from megatron_flux.tools.tune import search

    class CpuFlux(NcclBackend):
        """The tuner's fused backend, as the NCCL one: every candidate config computes alike."""

        def __init__(self, config_provider=None):
            super().__init__()
            self.config_provider = config_provider

        def clear_config_cache(self):
            pass

    backends.available_backends = lambda: ["nccl", "flux", "auto"]
    flux_pkg.FluxBackend = CpuFlux
    device_mod.device_identity = lambda device: ("h200", 132, "NVIDIA H200")
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    if fail_write_on_rank == rank:
        def broken_write(table, path):
            raise OSError(f"disk full writing {path}")
        schema_mod.write_table = broken_write
    argv = [*ARGV, *extra, "--out", out]
    args = search.parse_args(argv)
    try:
        code = search._run(args, argv, dist.group.WORLD, rank, world, torch.device("cpu"))
    except search.TuneFailed as exc:
        return f"TuneFailed: {exc}"
    return code


@pytest.mark.slow
def test_a_tune_runs_on_two_ranks_and_writes_a_valid_table(tmp_path):
    out = str(tmp_path / "table.json")
    assert run_distributed(_tune_on_cpu, 2, out, timeout=180) == [0, 0]
    with open(out) as f:
        obj = json.load(f)
    table = schema.validate_table(obj, out)
    assert table.tp == 2 and table.gpu_name == "NVIDIA H200" and table.sms == 132
    assert sorted((e.op, e.n, e.k, e.m) for e in table.entries) == [("ag", 128, 64, 64), ("rs", 64, 128, 64)]
    assert all(e.tuned and e.flux_ms > 0 and e.nccl_ms > 0 for e in table.entries)
    assert table.source == "megatron-flux tune " + " ".join([*ARGV, "--out", out])
    # a second run with --skip-tuned finds both entries and tunes nothing: the file stays as it was
    before = open(out).read()
    assert run_distributed(_tune_on_cpu, 2, out, extra=("--skip-tuned",), timeout=180) == [0, 0]
    assert open(out).read() == before


@pytest.mark.slow
def test_a_failure_on_rank_0_alone_stops_both_ranks_after_that_entry(tmp_path):
    out = str(tmp_path / "table.json")
    results = run_distributed(_tune_on_cpu, 2, out, fail_write_on_rank=0, timeout=180)
    assert results[0].startswith("TuneFailed: ag n=128 k=64 m=64: OSError: disk full")
    assert results[1] == "TuneFailed: ag n=128 k=64 m=64: failed on another rank (its error is in that rank's output)"
    assert not os.path.exists(out)
